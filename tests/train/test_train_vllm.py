"""`python -m jaxloop.train --config.rollout.engine=vllm`: the four algorithms through Ray + vLLM.

One Ray cluster for the module (started here; the training processes join it through
`rollout.ray_address`), one vLLM engine actor per training run, a tiny fp32 model with head_dim 32
(the smallest the vLLM CPU attention supports). Each run: 2 updates; metrics have the embedded
path's keys plus `engine_restarts` and `manager_restarts`, the engine-vs-trainer log-prob
difference is within the vLLM bound, checkpoints are written. Resume: stop after 1 update, rerun,
and the result equals the straight run's (same tokens, losses and rewards).

Each engine run costs tens of seconds (a Ray worker importing vLLM and building an engine), so
runs are shared where one run can serve two tests without weakening either: DPPO trains one
update ahead (rollout.max_staleness=1), and its straight run is also the resume test's reference;
GRPO's verbose one-update run is also the first half of the GRPO resume; PPO's run is an Ouro
model with threshold exits and a 2-then-3 loop budget, the early-exit test's run.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from jaxloop.config import default_logprob_diff
from tests.train.helpers import UNIT, interrupt_at_checkpoint, read_rows, stable, train_process

pytestmark = pytest.mark.slow
# its own Ray cluster (the `cluster` fixture): a group of its own, beside the other real-engine
# modules (the longest chain of the suite when they ran one after another)
ENGINE_GROUP = "train-vllm"

ALGORITHMS = ["ppo", "grpo", "dppo", "flow_dppo"]
TINY = [
    *UNIT,
    "--config.model.hidden_size=64",
    "--config.model.intermediate_size=64",
    "--config.model.num_layers=1",
    "--config.model.head_dim=32",
    "--config.prompts_per_update=4",
    "--config.n_samples_per_prompt=2",
    "--config.micro_batch_size=8",
    "--config.rollout.max_new_tokens=3",
    "--config.eval_every=1",
    "--config.eval_prompts=4",
    "--config.checkpoint_every=1",
    "--config.keep_checkpoints=3",
    "--config.total_updates=2",
    "--config.progress=false",
    "--config.data.reward=tests.train.rewards:char_code_reward",
]
TIMINGS: dict[str, float] = {}
# rollout.max_staleness per algorithm (0 when absent): DPPO's off-policy correction at work
STALENESS = {"dppo": 1}
# Ouro with threshold exits and a 2-then-3 loop budget: the engines exit tokens and run K loops
EARLY_EXIT = (
    "--config.model.family=ouro",
    "--config.model.num_loops=3",
    "--config.model.loop_budget=2@0,3@1",
    "--config.rollout.early_exit=threshold",
    "--config.rollout.exit_threshold=0.4",
)
# what each algorithm's run adds to TINY: PPO's is also the early-exit test's run
EXTRA = {"ppo": EARLY_EXIT}


@pytest.fixture(scope="module")
def cluster():
    start = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # private, never a running one
    TIMINGS["cluster_start_s"] = time.perf_counter() - start
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    print("\ntrain-through-vLLM timings:", {k: float(f"{v:.3g}") for k, v in TIMINGS.items()})


@pytest.fixture(scope="module")
def straight_runs():
    return {}


def _train(run_dir, algorithm, *extra, env, address=None):
    engine = (
        ()
        if address is None
        else ("--config.rollout.engine=vllm", f"--config.rollout.ray_address={address}")
    )
    return train_process(run_dir, f"{algorithm}.py", *TINY, *extra, *engine, env=env, timeout=900)


def _keys(rows):
    return set().union(*(r.keys() for r in rows))


def _ahead(algorithm):
    return (f"--config.rollout.max_staleness={STALENESS.get(algorithm, 0)}",)


def _own(algorithm):
    """The algorithm's own settings: its staleness and EXTRA."""
    return (*_ahead(algorithm), *EXTRA.get(algorithm, ()))


def _vllm_run(tmp_path, algorithm, cluster, env, straight_runs):
    if algorithm not in straight_runs:
        run_dir = tmp_path / f"{algorithm}_vllm"
        proc, seconds = _train(run_dir, algorithm, *_own(algorithm), env=env, address=cluster)
        TIMINGS[f"{algorithm}_vllm_run_s"] = seconds
        ready = re.search(r"ready in ([\d.]+)s \(engine start ([\d.]+)s", proc.stderr)
        assert ready, proc.stderr[-2000:]
        TIMINGS[f"{algorithm}_engine_start_s"] = float(ready.group(2))
        straight_runs[algorithm] = (run_dir, proc.stdout + proc.stderr)  # both: all it printed
    return straight_runs[algorithm]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_train_through_ray_vllm(tmp_path, algorithm, cluster, env, straight_runs):
    run_dir, output = _vllm_run(tmp_path, algorithm, cluster, env, straight_runs)
    assert "vllm engine(s) ready" in output
    # quiet engines by default (rollout.engine_log_level=WARNING): no INFO line from vLLM, Ray
    # or the actors on stdout or stderr, and the run ends with its summary
    info = [line for line in output.splitlines() if re.search(r"\bINFO\b", line)]
    assert not info, info[:5]
    assert "run summary: update 2 of 2" in output and (run_dir / "curves.png").is_file()
    rows = read_rows(run_dir)
    assert [r["update"] for r in rows] == [0, 1]
    assert [r["policy_version"] for r in rows] == [0.0, 1.0]
    assert [r["staleness_max"] for r in rows] == [0.0, float(STALENESS.get(algorithm, 0))]
    # engine vs trainer log-probs: checked on every batch the current policy sampled; a batch
    # of an older version (DPPO's update 1) cannot be compared and carries no such metric
    checked = [r for r in rows if r["staleness_max"] == 0]
    assert len(checked) == len(rows) - STALENESS.get(algorithm, 0)
    assert all("logprob_diff_max" not in r for r in rows if r["staleness_max"] > 0)
    for r in checked:
        assert r["logprob_diff_max"] <= default_logprob_diff("vllm", "float32"), r[
            "logprob_diff_max"
        ]
    for r in rows:
        assert r["engine_restarts"] == 0.0 and r["manager_restarts"] == 0.0
        assert r["num_samples"] == 8.0 and r["response_length"] > 0
        assert r["publish_gb_per_s"] > 0
    TIMINGS[f"{algorithm}_logprob_diff_max"] = max(r["logprob_diff_max"] for r in checked)
    assert "final_eval_reward" in rows[-1]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]

    # the embedded engine's metrics, the same run's keys (PPO's 2-then-3 loop budget: both K)
    embedded = tmp_path / f"{algorithm}_embedded"
    _train(embedded, algorithm, *_own(algorithm), env=env)
    assert _keys(rows) == _keys(read_rows(embedded)) | {"engine_restarts", "manager_restarts"}


def test_early_exit_and_loop_budget_through_ray_vllm(tmp_path, cluster, env, straight_runs):
    """Ouro with threshold exits and a 2-then-3 loop budget (PPO's run, EARLY_EXIT): the engines
    exit tokens and run K loops, the trainer replays their depths, and the log-probs agree within
    the vLLM bound."""
    run_dir, _ = _vllm_run(tmp_path, "ppo", cluster, env, straight_runs)
    rows = read_rows(run_dir)
    assert [r["loop_budget"] for r in rows] == [2.0, 3.0]
    for r in rows:
        assert r["logprob_diff_max"] <= default_logprob_diff("vllm", "float32")
        assert r["depth_hist_1"] > 0 and r["depth_mean"] < r["loop_budget"]
    TIMINGS["depth_logprob_diff_max"] = max(r["logprob_diff_max"] for r in rows)


@pytest.fixture(scope="module")
def grpo_stopped_verbose(tmp_path_factory, cluster, env):
    """GRPO through the engines for one update with --config.verbose=True, stopped after it
    (rollout.max_staleness=0): (run_dir, everything it printed). verbose and stop_after change
    no math (resume-free keys), so the run is also the first half of the GRPO resume test."""
    run_dir = tmp_path_factory.mktemp("grpo_verbose") / "run"
    proc, _ = _train(
        run_dir,
        "grpo",
        *_ahead("grpo"),
        "--config.stop_after=1",
        "--config.verbose=True",
        env=env,
        address=cluster,
    )
    return run_dir, proc.stdout + proc.stderr  # vLLM logs to stdout, Ray forwards it as it is


def test_verbose_shows_the_engines_info_lines(grpo_stopped_verbose):
    """--config.verbose=True: vLLM's INFO lines come through, prefixed by the engine index."""
    _, output = grpo_stopped_verbose
    info = [line for line in output.splitlines() if re.search(r"\bINFO\b", line)]
    assert len(info) > 5, output[-2000:]
    from_vllm = [line for line in info if "[" in line and "pid=" in line]
    assert from_vllm and all("(engine 0 pid=" in line for line in from_vllm), from_vllm[:5]


@pytest.mark.parametrize("algorithm", ["grpo", "dppo"])
def test_resume_through_ray_vllm(tmp_path, cluster, env, straight_runs, algorithm, request):
    """Stop after update 1, resume in a fresh process: equal to the straight run. DPPO runs one
    update ahead (k=1): the batch of update 1 was generated by the engines (policy 0) while
    update 0 trained; it travels in checkpoint 1, so the resumed process trains on the same
    tokens. GRPO (k=0) resumes its verbose first half without --config.verbose."""
    staleness = STALENESS.get(algorithm, 0)
    straight, _ = _vllm_run(tmp_path, algorithm, cluster, env, straight_runs)
    resumed = tmp_path / "resumed"
    if algorithm == "grpo":
        shutil.copytree(request.getfixturevalue("grpo_stopped_verbose")[0], resumed)
    else:
        _train(
            resumed,
            algorithm,
            *_ahead(algorithm),
            "--config.stop_after=1",
            env=env,
            address=cluster,
        )
    assert len(read_rows(resumed)) == 1
    assert sorted(os.listdir(resumed / "checkpoints")) == ["1"]
    _, seconds = _train(resumed, algorithm, *_ahead(algorithm), env=env, address=cluster)
    TIMINGS[f"resume_run_k{staleness}_s"] = seconds
    assert sorted(os.listdir(resumed / "checkpoints")) == ["1", "2"]
    a, b = stable(read_rows(straight)), stable(read_rows(resumed))
    assert len(a) == len(b) == 2
    assert [r["staleness_max"] for r in a] == [0.0, float(staleness)]
    # same data cursor, seeds and policy after the restart: same tokens, rewards, losses
    assert a == b


def _launch_two_cmd(run_dir, cluster, *engine: str) -> list[str]:
    """2 GRPO trainer processes x 4 fake CPU devices (jaxloop.launch, jax.distributed over gloo);
    process 0 alone starts and talks to the engines (rollout/replicated.py): one vLLM engine
    unless `engine` says otherwise."""
    cmd = [sys.executable, "-m", "jaxloop.launch", "--num-processes", "2"]
    cmd += ["--devices-per-process", "4", "--", "--config", "grpo.py", *TINY, *_ahead("grpo")]
    cmd += [f"--config.run_dir={run_dir}", *(engine or ["--config.rollout.engine=vllm"])]
    return [*cmd, f"--config.rollout.ray_address={cluster}", "--config.curves=false"]


def _launch_two(run_dir, cluster, env, *engine: str) -> tuple[str, float]:
    start = time.perf_counter()
    cmd = _launch_two_cmd(run_dir, cluster, *engine)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr, time.perf_counter() - start


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes `pid` started."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            except FileNotFoundError:
                continue
            out.append((int(child), cmdline.decode()))
    return out


def _kill_process_1_after_checkpoint_1(run_dir, cluster, env, log) -> tuple[int, float]:
    """The 2-process launch with trainer process 1 SIGKILLed once checkpoint 1 is committed:
    (the launch's exit code, seconds from the kill until the launch ended)."""
    launched = {}

    def kill_process_1():
        (launch,) = [pid for pid, cmd in _children(os.getpid()) if "jaxloop.launch" in cmd]
        launched["trainers"] = _children(launch)
        (victim,) = [p for p, cmd in launched["trainers"] if "--config.dist.process_id=1" in cmd]
        os.kill(victim, signal.SIGKILL)

    code, stopped_s = interrupt_at_checkpoint(
        _launch_two_cmd(run_dir, cluster), env, run_dir, log, kill_process_1
    )
    assert all(not Path(f"/proc/{pid}").exists() for pid, _ in launched["trainers"])
    return code, stopped_s


def test_two_trainer_processes_through_ray_vllm(tmp_path, cluster, env, straight_runs):
    """Two trainer processes with one vLLM engine: the same tokens and rewards as the 1-process
    8-device run with the same engine, its parameters to 1e-5 (relative per tensor, as the
    embedded sampler's 2-process test), one engine for both processes (process 1 starts none).
    Process 1 killed after checkpoint 1: the launch stops process 0 too, in bounded time; the
    relaunch resumes from checkpoint 1 and ends bitwise as the straight 2-process run."""
    from tests.train.test_mesh import _assert_close, _export

    one, _ = _vllm_run(tmp_path, "grpo", cluster, env, straight_runs)
    two = tmp_path / "two"
    output, seconds = _launch_two(two, cluster, env)
    TIMINGS["two_process_vllm_run_s"] = seconds
    assert output.count("vllm engine(s) ready") == 1 and "[process 1]" in output
    rows, want = read_rows(two), read_rows(one)
    assert [r["update"] for r in rows] == [0, 1]  # process 0 alone writes metrics
    for key in ("tokens_checksum", "reward_mean", "num_samples", "policy_version"):
        assert [r[key] for r in rows] == [r[key] for r in want], key
    for r in rows:
        assert r["logprob_diff_max"] <= default_logprob_diff("vllm", "float32")
        assert r["engine_restarts"] == 0.0 and r["publish_bytes"] > 0
    assert abs(rows[-1]["final_eval_reward"] - want[-1]["final_eval_reward"]) <= 1e-6
    TIMINGS["two_process_param_rel_diff"] = _assert_close(
        _export(two, tmp_path / "two-hf"), _export(one, tmp_path / "one-hf"), "2 processes"
    )

    resumed = tmp_path / "resumed"
    code, stopped_s = _kill_process_1_after_checkpoint_1(
        resumed, cluster, env, tmp_path / "killed.log"
    )
    TIMINGS["two_process_kill_to_stop_s"] = stopped_s
    assert code != 0 and stopped_s < 60, (code, stopped_s)
    _, seconds = _launch_two(resumed, cluster, env)
    TIMINGS["two_process_resume_s"] = seconds
    assert stable(read_rows(resumed)) == stable(rows)
    got, straight = _export(resumed, tmp_path / "resumed-hf"), _export(two, tmp_path / "two-hf2")
    assert got.keys() == straight.keys()
    assert all(got[name].tobytes() == straight[name].tobytes() for name in got)


RAY_JAX = ("--config.rollout.engine=ray_jax", "--config.rollout.num_engines=2")


def test_two_trainer_processes_with_ray_jax_engines(tmp_path, cluster, env):
    """Two trainer processes with two Ray JAX engine actors (rollout.engine=ray_jax: the embedded
    sampler in its own processes): the tokens, rewards and evaluations of one process x 8 devices
    with the same engines, its parameters to 1e-5, and the embedded sampler's log-prob bound."""
    from tests.train.test_mesh import _assert_close, _export

    one = tmp_path / "one"
    proc, _ = train_process(
        one, "grpo.py", *TINY, *RAY_JAX, f"--config.rollout.ray_address={cluster}", env=env
    )
    assert "rollout: 2 jax engine(s) ready" in proc.stderr
    two = tmp_path / "two"
    output, seconds = _launch_two(two, cluster, env, *RAY_JAX)
    TIMINGS["two_process_ray_jax_run_s"] = seconds
    assert output.count("jax engine(s) ready") == 1 and "[process 1]" in output
    rows, want = read_rows(two), read_rows(one)
    assert [r["update"] for r in rows] == [0, 1]
    for key in ("tokens_checksum", "reward_mean", "eval_reward", "policy_version"):
        assert [r.get(key) for r in rows] == [r.get(key) for r in want], key
    for r in rows + want:
        assert r["logprob_diff_max"] <= default_logprob_diff("ray_jax", "float32") == 1e-3
        assert r["engine_restarts"] == 0.0
    TIMINGS["two_process_ray_jax_param_rel_diff"] = _assert_close(
        _export(two, tmp_path / "two-hf"), _export(one, tmp_path / "one-hf"), "2 processes"
    )
