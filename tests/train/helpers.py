"""Running `python -m jaxloop.train` in a fresh process, as a user would."""

import json
import subprocess
import sys
import time
from pathlib import Path

from jaxloop.config import unit_overrides
from jaxloop.metrics import TIMING_METRICS

# the one-token unit setting: the algorithm configs carry the multi-token learning recipe
UNIT = unit_overrides()
# A small model and batch for tests that only need the loop to run.
TINY = (
    *UNIT,
    "--config.model.hidden_size=32",
    "--config.model.intermediate_size=64",
    "--config.model.num_layers=1",
    "--config.model.head_dim=16",
    "--config.prompts_per_update=4",
    "--config.n_samples_per_prompt=2",
    "--config.micro_batch_size=8",
    "--config.eval_prompts=8",
    "--config.progress=false",
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
