"""The launch path on a simulated multi-node Ray cluster (conftest.py: head + two `trainer_slot`
nodes + one `engine_slot` node): STRICT_SPREAD places one trainer process per node and the run
equals the one-process run; a placement the cluster cannot satisfy is refused in bounded time; a
trainer node lost mid-run stops every process, and relaunching resumes bitwise."""

import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.train.helpers import read_rows, run_train, stable
from tests.train.test_mesh import BASE, _assert_close, _export
from tests.train.test_resume import _flatten

pytestmark = pytest.mark.slow  # a 4-raylet Ray cluster and jax.distributed trainer processes
# the simulated cluster is its own Ray cluster: beside the real-engines group (tests/conftest.py)
ENGINE_GROUP = "ray-cluster"

# 3 GRPO updates of the tiny model, a checkpoint after each; the reward can hold (rewards.py)
OVERRIDES = (
    *BASE,
    "--config.total_updates=3",
    "--config.data.reward=tests.cluster.rewards:held_char_code_reward",
    "--config.mesh.fsdp=8",
)
PLACED = re.compile(r"trainer process (\d+) on node ([0-9a-f]+) \(([\d.]+)\), resources (\{.*\})")


def _launch_cmd(cluster, run_dir, n=2, timeout_s=None):
    cmd = [sys.executable, "-m", "jaxloop.launch", "--ray", "--ray-address", cluster.address]
    cmd += ["--ray-strategy", "STRICT_SPREAD", "--ray-resources", "trainer_slot=1"]
    cmd += ["--num-processes", str(n), "--devices-per-process", "4"]
    if timeout_s is not None:
        cmd += ["--ray-placement-timeout-s", str(timeout_s)]
    return [*cmd, "--", "--config", "grpo.py", *OVERRIDES, f"--config.run_dir={run_dir}"]


def _launch(cluster, run_dir, env, n=2, timeout_s=None, timeout=900):
    start = time.perf_counter()
    proc = subprocess.run(
        _launch_cmd(cluster, run_dir, n, timeout_s),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.perf_counter() - start


def _placements(stdout: str) -> dict[int, str]:
    """rank -> node id, from the launch's placement lines."""
    return {int(m[1]): m[2] for m in PLACED.finditer(stdout)}


@pytest.fixture(scope="module")
def straight(ray_cluster, tmp_path_factory, env):
    """The 2-process STRICT_SPREAD run that never stops: (run_dir, launch stdout)."""
    run_dir = tmp_path_factory.mktemp("two-nodes")
    proc, seconds = _launch(ray_cluster, run_dir, env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"\n2 processes on 2 nodes, 3 updates: {seconds:.1f} s")
    return run_dir, proc.stdout


def test_strict_spread_places_one_process_per_node(ray_cluster, straight, tmp_path, env):
    run_dir, stdout = straight
    placed = _placements(stdout)
    trainer_ids = {node.node_id for node in ray_cluster.trainer_nodes}
    assert sorted(placed) == [0, 1]
    assert placed[0] != placed[1] and set(placed.values()) == trainer_ids
    assert "trainer_slot: 1" in PLACED.search(stdout)[4]
    one = tmp_path / "one-process"
    rows = run_train(one, "grpo.py", *OVERRIDES, env=env)
    two_rows = read_rows(run_dir)
    assert [r["update"] for r in two_rows] == [0, 1, 2]
    assert [r["tokens_checksum"] for r in two_rows] == [r["tokens_checksum"] for r in rows]
    _assert_close(
        _export(run_dir, tmp_path / "two-hf"), _export(one, tmp_path / "one-hf"), "2 nodes"
    )


def test_unsatisfiable_placement_is_refused(ray_cluster, tmp_path, env):
    """STRICT_SPREAD of 3 processes over the 2 nodes that have a trainer_slot: one line, exit 2,
    within the placement timeout (plus Ray's start-up), nothing written."""
    run_dir = tmp_path / "refused"
    proc, seconds = _launch(ray_cluster, run_dir, env, n=3, timeout_s=5, timeout=120)
    print(f"\nrefused in {seconds:.1f} s (placement timeout 5 s)")
    assert proc.returncode == 2, proc.stderr[-4000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: cannot place 3 trainer processes (STRICT_SPREAD")
    assert "within 5 s" in lines[0] and "2 live node(s) of 4" in lines[0]
    assert seconds < 60 and not run_dir.exists()


def _checkpoint_arrays(run_dir, step) -> dict[str, np.ndarray]:
    """Every array item of a checkpoint, restored onto this process's first device (the one in
    tests/train/test_resume.py restores onto the saving devices, which were two processes')."""
    path = os.path.join(run_dir, "checkpoints", str(step))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    checkpointer = ocp.StandardCheckpointer()
    out = {}
    for item in sorted(os.listdir(path)):
        if item == "train_state" or not os.path.isdir(os.path.join(path, item)):
            continue
        meta = checkpointer.metadata(os.path.join(path, item))
        meta = getattr(meta, "item_metadata", meta)
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta
        )
        tree = checkpointer.restore(os.path.join(path, item), target)
        out.update((key, np.asarray(leaf)) for key, leaf in _flatten(tree, item))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_lost_trainer_node_stops_all_and_resumes_bitwise(ray_cluster, straight, tmp_path, env):
    held = tmp_path / "held"
    held.mkdir()
    run_dir = tmp_path / "lost-node"
    hold_env = dict(env)
    hold_env["JAXLOOP_TEST_HOLD_AFTER"] = str(run_dir / "checkpoints" / "1")
    hold_env["JAXLOOP_TEST_HOLD_MARKERS"] = str(held)
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        launch = subprocess.Popen(
            _launch_cmd(ray_cluster, run_dir), env=hold_env, stdout=stdout, stderr=stderr
        )
    try:
        # both processes are held in a reward call after checkpoint 1 was committed
        deadline = time.monotonic() + 600
        while len(os.listdir(held)) < 2:
            assert launch.poll() is None, err.read_text()[-4000:]
            assert time.monotonic() < deadline, "the trainer processes never reached the hold"
            time.sleep(0.5)
        pids = [int(name) for name in os.listdir(held)]
        lost = _placements(out.read_text())[1]
        start = time.perf_counter()
        ray_cluster.remove_node(ray_cluster.node(lost))
        code = launch.wait(timeout=120)
        stopped_s = time.perf_counter() - start
    finally:
        if launch.poll() is None:
            launch.kill()
    print(f"\nnode of process 1 removed: the launch exited {stopped_s:.1f} s later")
    assert code == 1
    errors = [line for line in err.read_text().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err.read_text()[-4000:]
    assert (
        f"trainer process 1 on node {lost}" in errors[0]
        and "was lost: its node is dead" in errors[0]
    )
    deadline = time.monotonic() + 30  # the survivor's actor was killed: its process dies with it
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "a trainer process outlived the launch"
    assert (run_dir / "checkpoints" / "1").is_dir()
    before = read_rows(run_dir)  # update 0 at least (checkpoint 1 was committed)

    ray_cluster.add_trainer_node()  # a replacement machine joins
    proc, seconds = _launch(ray_cluster, run_dir, env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"relaunch on the replacement node resumed and finished in {seconds:.1f} s")
    straight_dir, _ = straight
    # update 0's row, timings included, is the one written before the loss: the relaunch resumed
    assert read_rows(run_dir)[0] == before[0]
    assert stable(read_rows(run_dir)) == stable(read_rows(straight_dir))
    a, b = _checkpoint_arrays(straight_dir, 3), _checkpoint_arrays(run_dir, 3)
    assert a.keys() == b.keys() and any(k.startswith("actor_opt") for k in a)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes(), key
