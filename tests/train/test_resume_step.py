"""`--config.resume_step=N` (issue 39 item 3): resume from an older checkpoint after verifying it;
the newer steps are moved into <run_dir>/checkpoints.discarded/ (never deleted, never
overwritten), said in one line, and the run ends bit for bit where an uninterrupted one does. A
step that is not there or does not verify: one line, exit 2, nothing moved."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.helpers import TINY, read_rows, stable
from tests.train.test_resume import _checkpoint_arrays

ARGS = (
    *TINY,
    "--config.total_updates=3",
    "--config.checkpoint_every=1",
    "--config.keep_checkpoints=5",
)


def _run(run_dir, *extra, env):
    cmd = [sys.executable, "-m", "jaxloop.train", "--config", "ppo.py"]
    cmd += [f"--config.run_dir={run_dir}", *ARGS, *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _files(root: Path) -> dict[str, str]:
    """Every file under `root` by its relative path: the SHA-256 of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def _same_final_checkpoint(a: Path, b: Path, step: int = 3) -> None:
    ca, cb = _checkpoint_arrays(a, step), _checkpoint_arrays(b, step)
    assert ca.keys() == cb.keys() and any(k.startswith("actor_opt") for k in ca)
    for key in ca:
        assert ca[key].dtype == cb[key].dtype and ca[key].tobytes() == cb[key].tobytes(), key
    state = Path("checkpoints", str(step), "train_state", "metadata")  # counters, RNG, cursor
    assert json.loads((a / state).read_text()) == json.loads((b / state).read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory, one_device_env):
    """An uninterrupted run of 3 updates: checkpoints 1, 2 and 3."""
    run_dir = tmp_path_factory.mktemp("resume_step") / "reference"
    proc = _run(run_dir, env=one_device_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _steps(run_dir) == ["1", "2", "3"]
    return run_dir


def test_resume_step_moves_newer_steps_aside_and_ends_bitwise(tmp_path, reference, one_device_env):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    discarded = run_dir / "checkpoints.discarded"

    # back to checkpoint 1 for one update: 2 and 3 move aside whole, metrics rows past 1 go
    proc = _run(run_dir, "--config.resume_step=1", "--config.stop_after=1", env=one_device_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("resume_step=")]
    assert said == [
        f"resume_step=1: moved checkpoints newer than it aside into {discarded}/ (2, 3; "
        "nothing deleted); resuming from checkpoint 1"
    ], proc.stderr
    for step in ("2", "3"):
        assert _files(discarded / step) == _files(reference / "checkpoints" / step)
    assert _steps(run_dir) == ["1", "2"]
    assert stable(read_rows(run_dir)) == stable(read_rows(reference))[:2]

    # an ordinary resume finishes the run: the final checkpoint is the uninterrupted run's
    proc = _run(run_dir, env=one_device_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "moved checkpoints" not in proc.stderr
    _same_final_checkpoint(reference, run_dir)
    assert stable(read_rows(run_dir)) == stable(read_rows(reference))

    # once more from 2 on the finished run: 3 is taken in checkpoints.discarded/, so it is 3.1
    proc = _run(run_dir, "--config.resume_step=2", env=one_device_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(3 as 3.1; nothing deleted)" in proc.stderr, proc.stderr
    assert sorted(p.name for p in discarded.iterdir()) == ["2", "3", "3.1"]
    assert _files(discarded / "3") == _files(reference / "checkpoints" / "3")  # not overwritten
    _same_final_checkpoint(reference, run_dir)
    assert stable(read_rows(run_dir)) == stable(read_rows(reference))


def _damage(run_dir: Path, step: int) -> Path:
    """Flip a byte (same size) in the largest data file of the step's actor_params; its path
    within the item."""
    params = run_dir / "checkpoints" / str(step) / "actor_params"
    path = max((p for p in params.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path.relative_to(params)


def _refused(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_a_missing_step_is_refused_and_nothing_moves(tmp_path, reference, one_device_env):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = _files(run_dir)
    for extra in ((), ("--dry-run",)):
        line = _refused(_run(run_dir, "--config.resume_step=7", *extra, env=one_device_env))
        assert line == (
            f"error: resume_step=7: run dir {run_dir} has no checkpoint 7 (its checkpoints: "
            "1, 2, 3)"
        )
        assert _files(run_dir) == before and not (run_dir / "checkpoints.discarded").exists()


def test_a_step_that_does_not_verify_is_refused_and_nothing_moves(
    tmp_path, reference, one_device_env
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    damaged = _damage(run_dir, 2)
    before = _files(run_dir)
    line = _refused(_run(run_dir, "--config.resume_step=2", env=one_device_env))
    assert f"checkpoint 2 is corrupt: actor_params/{damaged}" in line, line
    assert line.endswith("(checkpoint 1 verifies: pass --config.resume_step=1 to resume from it)")
    assert _files(run_dir) == before and not (run_dir / "checkpoints.discarded").exists()


def _empty(run_dir: Path, step: int) -> None:
    step_dir = run_dir / "checkpoints" / str(step)
    shutil.rmtree(step_dir)
    step_dir.mkdir()


@pytest.mark.parametrize(
    ("damage", "said"), [(_damage, "is corrupt"), (_empty, "is incomplete")], ids=["flip", "empty"]
)
def test_a_damaged_newest_step_offers_resume_step(
    tmp_path, reference, one_device_env, damage, said
):
    """Without the key, a damaged newest step (a flipped byte; emptied) is one line (stderr of a
    real process) naming the key that resumes from the older one."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    damage(run_dir, 3)
    before = _files(run_dir)
    line = _refused(_run(run_dir, "--config.total_updates=4", env=one_device_env))
    assert f"checkpoint 3 {said}" in line, line
    assert line.endswith(
        f"(checkpoint 2 verifies: move {run_dir / 'checkpoints' / '3'} out of checkpoints/ or "
        "pass --config.resume_step=2 to resume from it)"
    )
    assert _files(run_dir) == before
