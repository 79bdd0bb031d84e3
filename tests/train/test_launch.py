"""2 processes x 4 fake CPU devices (jax.distributed over gloo), started by jaxloop.launch, run
2 GRPO updates and match the 1-process 8-device run (fp32, <= 1e-5 relative)."""

import subprocess
import sys

import pytest

from tests.train.helpers import TINY, read_rows, run_train
from tests.train.test_mesh import BASE, _assert_close, _export

pytestmark = pytest.mark.slow  # two trainer processes joined by JAX's distributed runtime


def _launch(env, run_dir, *launch_args, train_args=()):
    """2 GRPO trainer processes x 4 fake devices through jaxloop.launch; asserts exit 0."""
    cmd = [sys.executable, "-m", "jaxloop.launch", *launch_args, "--num-processes", "2"]
    cmd += ["--devices-per-process", "4", "--", "--config", "grpo.py"]
    cmd += [f"--config.run_dir={run_dir}", *BASE, *train_args, "--config.mesh.fsdp=8"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_two_processes_match_one(tmp_path, env):
    one = tmp_path / "one-process"
    rows = run_train(one, "grpo.py", *BASE, "--config.mesh.fsdp=8", env=env)
    two = tmp_path / "two-processes"
    proc = _launch(env, two)
    # process 0 alone writes metrics: one row per update, none from process 1
    two_rows = read_rows(two)
    assert [r["update"] for r in two_rows] == [0, 1]
    assert two_rows[0]["tokens_checksum"] == rows[0]["tokens_checksum"]
    assert "[process 1]" in proc.stderr  # the second process really ran
    _assert_close(
        _export(two, tmp_path / "two-hf"), _export(one, tmp_path / "one-hf"), "2 processes"
    )


def test_ray_launch_places_processes(tmp_path, env):
    """--ray: the processes are Ray actors in a placement group (PACK here: this cluster is one
    node; STRICT_SPREAD puts one per node), joined by JAX's runtime; 1 GRPO update."""
    run_dir = tmp_path / "ray"
    _launch(
        env, run_dir, "--ray", "--ray-strategy", "PACK", train_args=("--config.total_updates=1",)
    )
    assert [r["update"] for r in read_rows(run_dir)] == [0]


def test_launch_refuses_bad_arguments():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxloop.launch", "--num-processes", "0", "--", *TINY],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--num-processes must be >= 1" in proc.stderr


@pytest.mark.parametrize(
    "option,message",
    [
        (("--ray-resources", "trainer_slot"), "expected NAME=AMOUNT with AMOUNT > 0"),
        (("--ray-resources", "trainer_slot=-1"), "expected NAME=AMOUNT with AMOUNT > 0"),
        (("--ray-placement-timeout-s", "0"), "--ray-placement-timeout-s must be > 0"),
    ],
)
def test_launch_refuses_bad_ray_options(option, message):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxloop.launch", "--ray", *option, "--num-processes", "2"]
        + ["--", *TINY],
        capture_output=True,
        text=True,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("--config.rollout.engine_resources=engine_slot",), "expected NAME=AMOUNT"),
        (("--config.rollout.engine_resources=engine_slot=0",), "expected NAME=AMOUNT"),
        (
            ("--config.rollout.engine=vllm", "--config.rollout.engine_resources=engine_slot=1"),
            "rollout.engine_resources needs rollout.ray_address",
        ),
    ],
)
def test_train_refuses_bad_engine_resources(tmp_path, overrides, message, env):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxloop.train", "--config", "grpo.py", *TINY, *overrides]
        + [f"--config.run_dir={tmp_path / 'run'}"],
        env=env,
        capture_output=True,
        text=True,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()
