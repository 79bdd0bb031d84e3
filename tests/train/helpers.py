"""Running `python -m jaxloop.train` in a fresh process, as a user would."""

import json
import subprocess
import sys
import time
from pathlib import Path

from jaxloop.config import TINY_MODEL_OVERRIDES, unit_overrides
from jaxloop.metrics import TIMING_METRICS

# the one-token unit setting: the algorithm configs carry the multi-token learning recipe
UNIT = unit_overrides()
# A small model and batch for tests that only need the loop to run.
TINY = (
    *UNIT,
    *TINY_MODEL_OVERRIDES,
    "--config.progress=false",
    # matplotlib costs ~2 CPU-s per run; the tests that check curves.png turn it back on
    "--config.curves=false",
)
# Metrics that measure time, not the computation: excluded from bitwise comparisons.
VOLATILE = TIMING_METRICS


def train_process(run_dir, config: str, *overrides: str, env=None, timeout: int = 600):
    """Train in a subprocess; asserts exit code 0; returns (CompletedProcess, seconds)."""
    cmd = [
        sys.executable,
        "-m",
        "jaxloop.train",
        "--config",
        config,
        f"--config.run_dir={run_dir}",
        *overrides,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, time.perf_counter() - start


def run_train(run_dir, config: str, *overrides: str, env=None, timeout: int = 600):
    """Train in a subprocess and return the metrics rows."""
    train_process(run_dir, config, *overrides, env=env, timeout=timeout)
    return read_rows(run_dir)


def read_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def interrupt_at_checkpoint(cmd, env, run_dir, log, action, step: int = 1, timeout: int = 600):
    """Run `cmd` (output to the file `log`) until checkpoint `step` of `run_dir` is committed, then
    call `action()` (lose a node, kill a process); returns (exit code, seconds from the action
    until the command ended)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not (Path(run_dir) / "checkpoints" / str(step)).is_dir():
            assert proc.poll() is None, Path(log).read_text()[-4000:]
            assert time.monotonic() < deadline, f"checkpoint {step} never appeared"
            time.sleep(0.1)
        acted_at = time.perf_counter()
        action()
        code = proc.wait(timeout=timeout)
        return code, time.perf_counter() - acted_at
    finally:
        if proc.poll() is None:
            proc.kill()
