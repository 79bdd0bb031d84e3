"""`python -m jaxloop.train --config.rollout.engine=vllm`: the four algorithms through Ray + vLLM.

One Ray cluster for the module (started here; the training processes join it through
`rollout.ray_address`), one vLLM engine actor per training run, a tiny fp32 model with head_dim 32
(the smallest the vLLM CPU attention supports). Each run: 2 updates; metrics have the embedded
path's keys plus `engine_restarts` and `manager_restarts`, the engine-vs-trainer log-prob
difference is within the vLLM bound, checkpoints are written. Resume: stop after 1 update, rerun,
and the result equals the straight run's (same tokens, losses and rewards).
"""

import os
import re
import time

import pytest
import ray

from jaxloop.config import default_logprob_diff
from tests.train.helpers import UNIT, read_rows, stable, train_process

pytestmark = pytest.mark.slow

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


@pytest.fixture(scope="module")
def cluster():
    start = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False)
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


def _vllm_run(tmp_path, algorithm, cluster, env, straight_runs):
    if algorithm not in straight_runs:
        run_dir = tmp_path / f"{algorithm}_vllm"
        proc, seconds = _train(run_dir, algorithm, env=env, address=cluster)
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
    for r in rows:
        assert r["logprob_diff_max"] <= default_logprob_diff("vllm", "float32"), r[
            "logprob_diff_max"
        ]
        assert r["engine_restarts"] == 0.0 and r["manager_restarts"] == 0.0
        assert r["num_samples"] == 8.0 and r["response_length"] > 0
        assert r["publish_gb_per_s"] > 0
    TIMINGS[f"{algorithm}_logprob_diff_max"] = max(r["logprob_diff_max"] for r in rows)
    assert "final_eval_reward" in rows[-1]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]

    # the embedded engine's metrics (1 update: eval and final eval in one row) for the keys
    embedded = tmp_path / f"{algorithm}_embedded"
    _train(embedded, algorithm, "--config.total_updates=1", env=env)
    assert _keys(rows) == _keys(read_rows(embedded)) | {"engine_restarts", "manager_restarts"}


def test_early_exit_and_loop_budget_through_ray_vllm(tmp_path, cluster, env):
    """Ouro with threshold exits and a 2-then-3 loop budget: the engines exit tokens and run K
    loops, the trainer replays their depths, and the log-probs agree within the vLLM bound."""
    run_dir = tmp_path / "depth_vllm"
    _train(
        run_dir,
        "dppo",
        "--config.model.family=ouro",
        "--config.model.num_loops=3",
        "--config.model.loop_budget=2@0,3@1",
        "--config.rollout.early_exit=threshold",
        "--config.rollout.exit_threshold=0.4",
        env=env,
        address=cluster,
    )
    rows = read_rows(run_dir)
    assert [r["loop_budget"] for r in rows] == [2.0, 3.0]
    for r in rows:
        assert r["logprob_diff_max"] <= default_logprob_diff("vllm", "float32")
        assert r["depth_hist_1"] > 0 and r["depth_mean"] < r["loop_budget"]
    TIMINGS["depth_logprob_diff_max"] = max(r["logprob_diff_max"] for r in rows)


def test_verbose_shows_the_engines_info_lines(tmp_path, cluster, env):
    """--config.verbose=True: vLLM's INFO lines come through, prefixed by the engine index."""
    proc, _ = _train(
        tmp_path / "verbose",
        "grpo",
        "--config.total_updates=1",
        "--config.verbose=True",
        env=env,
        address=cluster,
    )
    output = proc.stdout + proc.stderr  # vLLM logs to stdout, Ray forwards it as it is
    info = [line for line in output.splitlines() if re.search(r"\bINFO\b", line)]
    assert len(info) > 5, output[-2000:]
    from_vllm = [line for line in info if "[" in line and "pid=" in line]
    assert from_vllm and all("(engine 0 pid=" in line for line in from_vllm), from_vllm[:5]


@pytest.mark.parametrize("algorithm,staleness", [("grpo", 0), ("dppo", 1)])
def test_resume_through_ray_vllm(tmp_path, cluster, env, straight_runs, algorithm, staleness):
    """k=1: the batch of update 1 was generated by the engines (policy 0) while update 0 trained;
    it travels in checkpoint 1, so the resumed process trains on the same tokens."""
    ahead = (f"--config.rollout.max_staleness={staleness}",)
    if staleness == 0:
        straight, _ = _vllm_run(tmp_path, algorithm, cluster, env, straight_runs)
    else:
        straight = tmp_path / "straight"
        _train(straight, algorithm, *ahead, env=env, address=cluster)
    resumed = tmp_path / "resumed"
    _train(resumed, algorithm, *ahead, "--config.stop_after=1", env=env, address=cluster)
    assert len(read_rows(resumed)) == 1
    assert sorted(os.listdir(resumed / "checkpoints")) == ["1"]
    _, seconds = _train(resumed, algorithm, *ahead, env=env, address=cluster)
    TIMINGS[f"resume_run_k{staleness}_s"] = seconds
    assert sorted(os.listdir(resumed / "checkpoints")) == ["1", "2"]
    a, b = stable(read_rows(straight)), stable(read_rows(resumed))
    assert len(a) == len(b) == 2
    assert [r["staleness_max"] for r in a] == [0.0, float(staleness)]
    # same data cursor, seeds and policy after the restart: same tokens, rewards, losses
    assert a == b
