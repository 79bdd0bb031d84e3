"""One run dir, one writer (issue 39 item 1): a second trainer on a run dir in use exits 2 in
one line naming the holder, and a holder killed with SIGKILL leaves no lock that blocks."""

import os
import signal
import subprocess
import sys

from jaxloop.io.run_dir import completed_update
from tests.train.helpers import TINY, interrupt_at_checkpoint, read_rows


def _cmd(run_dir, *extra):
    return [
        sys.executable,
        "-m",
        "jaxloop.train",
        "--config",
        "ppo.py",
        f"--config.run_dir={run_dir}",
        *TINY,
        "--config.checkpoint_every=1",
        *extra,
    ]


def test_second_trainer_is_refused_and_a_killed_holder_does_not_block(tmp_path, one_device_env):
    run_dir = tmp_path / "run"
    log = tmp_path / "first.log"
    second = {}

    def start_second_then_kill_first():
        second["proc"] = subprocess.run(
            _cmd(run_dir, "--config.total_updates=400"),
            env=one_device_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        # the first (the lock's holder) dies without any cleanup
        for pid_line in (run_dir / ".lock").read_text().split(","):
            if pid_line.strip().startswith("pid "):
                os.kill(int(pid_line.split()[1]), signal.SIGKILL)

    code, _ = interrupt_at_checkpoint(
        _cmd(run_dir, "--config.total_updates=400"),
        one_device_env,
        run_dir,
        log,
        start_second_then_kill_first,
    )
    refused = second["proc"]
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "in use by another run" in lines[0] and "pid " in lines[0] and "since " in lines[0]
    assert code == -signal.SIGKILL
    # the killed holder's lock file is still there but does not block: the rerun resumes
    assert (run_dir / ".lock").exists()
    done = completed_update(run_dir)
    proc = subprocess.run(
        _cmd(run_dir, "--config.total_updates=400", f"--config.stop_after={done + 1}"),
        env=one_device_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert completed_update(run_dir) > done  # resumed past the killed run's last checkpoint
    assert read_rows(run_dir)
    assert not (run_dir / ".lock").exists()  # a clean release leaves no lock file
