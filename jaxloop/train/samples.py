"""Samples to read: what the model was asked and answered at each evaluation.

Every evaluation during training writes `<run_dir>/samples/<update>.jsonl` (`update`: the updates
the evaluated policy has had, as in metrics.jsonl's `eval_reward` of that update's row; the final
evaluation's file is `<total_updates>.jsonl`), one JSON object per held-out prompt: `prompt_text`
(the text the model saw, prompt_template and chat template applied), `response`, `label` and
`reward` (null where it is not finite, as metrics.jsonl writes them). `jaxloop.evaluate
--samples-out FILE` writes the same rows. Each file is written whole or not at all (a temporary
file renamed over it).

A resumed run is the run from its checkpoint on: `SamplesWriter(run_dir, start_update)` first
removes the files of evaluations after the resumed step (a run that died past its last checkpoint
wrote them from policies the resumed run no longer has), as MetricsWriter drops their rows.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxloop.io.orbax import write_text_atomic

__all__ = ["SAMPLES_DIR", "SamplesWriter", "sample_steps", "samples_text", "write_samples"]

SAMPLES_DIR = "samples"
FIELDS = ("prompt_text", "response", "label", "reward")


def samples_text(rows: Iterable[Mapping[str, Any]]) -> str:
    """The rows as JSONL (a non-finite reward as null, so every line is valid JSON)."""
    lines = []
    for row in rows:
        out = {key: row[key] for key in FIELDS}
        reward = out["reward"]
        out["reward"] = None if reward is None or not math.isfinite(reward) else float(reward)
        lines.append(json.dumps(out, ensure_ascii=False) + "\n")
    return "".join(lines)


def write_samples(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> None:
    write_text_atomic(path, samples_text(rows))


def sample_steps(run_dir: str | os.PathLike) -> list[int]:
    """The updates of the samples files in `run_dir`, sorted."""
    folder = Path(run_dir) / SAMPLES_DIR
    if not folder.is_dir():
        return []
    names = (p.name.removesuffix(".jsonl") for p in folder.glob("*.jsonl"))
    return sorted(int(name) for name in names if name.isdigit())


class SamplesWriter:
    """`write(update, rows)`: `<run_dir>/samples/<update>.jsonl`; files past `start_update` of a
    resumed run are removed first."""

    def __init__(self, run_dir: str | os.PathLike, start_update: int = 0):
        self.folder = Path(run_dir) / SAMPLES_DIR
        for step in sample_steps(run_dir):
            if step > start_update:
                (self.folder / f"{step}.jsonl").unlink(missing_ok=True)

    def write(self, update: int, rows: Iterable[Mapping[str, Any]]) -> None:
        path = self.folder / f"{int(update)}.jsonl"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_samples(path, rows)
        except OSError as err:  # a write's EFBIG / ENOSPC names no file: say which one
            if err.filename is not None:
                raise
            raise OSError(err.errno, err.strerror, str(path)) from err
