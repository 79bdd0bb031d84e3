"""Writes the kernel refuses, end to end (issue 39 item 2): a trainer whose checkpoint write fails
for a file-size limit (a real RLIMIT_FSIZE, lowered on the running trainer once its first
checkpoint is committed) or a full file system (a size-limited tmpfs, where this machine lets a
test mount one) exits 2 in one line; the previous checkpoint still verifies, nothing
half-written is listed as a step, and a rerun with room resumes and ends with the final
checkpoint of an uninterrupted run, bit for bit."""

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxloop.io.orbax import check_step
from tests.train.helpers import TINY, read_rows, stable
from tests.train.test_resume import _checkpoint_arrays

ARGS = (*TINY, "--config.total_updates=4", "--config.checkpoint_every=1")
# above every metrics, TensorBoard and config file of the run, below a checkpoint's parameter
# data (about 46 and 54 KB at this size)
FILE_SIZE_LIMIT = 32 * 1024


def _cmd(run_dir, *extra):
    cmd = [sys.executable, "-m", "jaxloop.train", "--config", "ppo.py"]
    return [*cmd, f"--config.run_dir={run_dir}", *ARGS, *extra]


def _steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory, one_device_env):
    run_dir = tmp_path_factory.mktemp("write_refusals") / "reference"
    proc = subprocess.run(_cmd(run_dir), env=one_device_env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _refused_then_resumed(
    run_dir: Path, stderr: str, code: int, said: str, reference, env, extra=()
):
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, stderr[-6000:]
    assert lines[0].startswith(f"error: cannot write: {said}"), lines
    steps = _steps(run_dir)
    assert steps and check_step(run_dir, int(steps[-1])) is True  # the newest one verifies
    # a rerun with room resumes there and ends where the uninterrupted run did
    proc = subprocess.run(
        _cmd(run_dir, *extra), env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ca, cb = _checkpoint_arrays(reference, 4), _checkpoint_arrays(run_dir, 4)
    assert ca.keys() == cb.keys() and any(k.startswith("critic_opt") for k in ca)
    for key in ca:
        assert ca[key].tobytes() == cb[key].tobytes(), key
    assert stable(read_rows(run_dir)) == stable(read_rows(reference))


def _wait_for_checkpoint_1(proc, run_dir: Path, log: Path) -> None:
    """Until the running trainer has committed checkpoint 1 (its digests are written last)."""
    digests = run_dir / "checkpoints" / "1" / "jaxloop_digests.json"
    deadline = time.monotonic() + 300
    while not digests.exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "checkpoint 1 never appeared"
        time.sleep(0.002)


def test_a_file_size_limit_on_a_later_checkpoint_is_one_line(tmp_path, reference, one_device_env):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_cmd(run_dir), env=one_device_env, stdout=out, stderr=out)
    try:
        _wait_for_checkpoint_1(proc, run_dir, log)
        # the kernel's limit on the running trainer: checkpoint 2's data files exceed it
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = (
        "[Errno 27] File too large: checkpoint 2 was not written (checkpoint 1 is intact; a "
        f"rerun resumes from it): '{run_dir / 'checkpoints'}'"
    )
    assert _steps(run_dir) == ["1"]
    _refused_then_resumed(run_dir, log.read_text(), code, said, reference, one_device_env)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1200 KiB tmpfs (about two checkpoints and the run's other files), where this machine
    lets the test mount one (root or CAP_SYS_ADMIN); skipped, saying so, where it does not."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_file_system_on_a_later_checkpoint_is_one_line(
    tmp_path, small_tmpfs, reference, one_device_env
):
    run_dir = small_tmpfs / "run"
    extra = ("--config.keep_checkpoints=5",)
    proc = subprocess.run(_cmd(run_dir, *extra), env=one_device_env, capture_output=True, text=True)
    assert len(_steps(run_dir)) >= 1
    moved = tmp_path / "run"  # a rerun with room: the run dir copied off the full file system
    shutil.copytree(run_dir, moved, symlinks=True)
    said = "[Errno 28] No space left on device"
    _refused_then_resumed(moved, proc.stderr, proc.returncode, said, reference, one_device_env)


def test_a_file_size_limit_on_the_metrics_rows_is_one_line(tmp_path, reference, one_device_env):
    """The same limit, below the next metrics row (and TensorBoard event) instead of a checkpoint:
    the update's row is refused before its checkpoint is written; whatever part of the row reached
    the file is dropped by the resumed run (it rewrites metrics.jsonl up to its checkpoint)."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_cmd(run_dir), env=one_device_env, stdout=out, stderr=out)
    try:
        _wait_for_checkpoint_1(proc, run_dir, log)
        # stopped while the limit is set: update 2's row (written before its checkpoint) is then
        # the next write (an update takes far longer than this poll)
        os.kill(proc.pid, signal.SIGSTOP)
        appended = [run_dir / "metrics.jsonl", *run_dir.rglob("events.out.tfevents.*")]
        limit = max(p.stat().st_size for p in appended) + 1
        assert limit < FILE_SIZE_LIMIT  # below a checkpoint file too: the first refusal is a row
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
        os.kill(proc.pid, signal.SIGCONT)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _steps(run_dir) == ["1"]
    stderr = log.read_text()
    assert "checkpoint 2 was not written" not in stderr, stderr[-3000:]  # a row was refused first
    said = "[Errno 27] File too large"
    _refused_then_resumed(run_dir, stderr, code, said, reference, one_device_env)


SAMPLES_ARGS = ("--config.eval_every=1", "--config.eval_prompts=256")


@pytest.fixture(scope="module")
def samples_reference(tmp_path_factory, one_device_env):
    """An uninterrupted run that evaluates (and writes a samples file) at every update."""
    run_dir = tmp_path_factory.mktemp("write_refusals") / "samples_reference"
    proc = subprocess.run(
        _cmd(run_dir, *SAMPLES_ARGS), env=one_device_env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_a_file_size_limit_on_a_samples_file_is_one_line(
    tmp_path, samples_reference, one_device_env
):
    """A run stopped after checkpoint 1 is resumed under a file-size limit above every file it
    rewrites on resuming but below a samples file: the evaluation that starts update 1 cannot
    write samples/1.jsonl. Exit 2, one line naming the file, no temporary file left beside it,
    checkpoint 1 verifies; a rerun with room ends as the uninterrupted run did."""
    run_dir = tmp_path / "run"
    first = subprocess.run(
        _cmd(run_dir, *SAMPLES_ARGS, "--config.stop_after=1"),
        env=one_device_env,
        capture_output=True,
        text=True,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert _steps(run_dir) == ["1"]
    samples = run_dir / "samples"
    sample_size = (samples / "0.jsonl").stat().st_size
    others = [
        p.stat().st_size
        for p in run_dir.rglob("*")
        if p.is_file() and "checkpoints" not in p.parts and p.parent != samples
    ]
    # room for a resumed run's rewritten metrics, configs and a few metrics rows, not a sample
    limit = max(others) + 4096
    assert limit < sample_size, (limit, sample_size)

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(
        _cmd(run_dir, *SAMPLES_ARGS),
        env=one_device_env,
        capture_output=True,
        text=True,
        preexec_fn=limited,
        timeout=600,
    )
    said = f"[Errno 27] File too large: '{samples / '1.jsonl'}'"
    assert sorted(p.name for p in samples.iterdir()) == ["0.jsonl"]  # nothing half-written
    _refused_then_resumed(
        run_dir, proc.stderr, proc.returncode, said, samples_reference, one_device_env, SAMPLES_ARGS
    )
    reference = samples_reference / "samples"
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in samples.iterdir()) == names
    for name in names:  # the rewritten samples files are the uninterrupted run's
        assert (samples / name).read_bytes() == (reference / name).read_bytes(), name
