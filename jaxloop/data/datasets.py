"""Prompt sources: a deterministic, resumable stream of (prompt, label) examples.

A `PromptSource` hands out batches with `next_batch(n)` and advances a cursor (epoch, position).
`state()` is a JSON-serialisable dict; `restore(state)` puts the cursor back so the continuation is
identical. Finite sources visit their rows in a permutation seeded by (seed, epoch), and a batch
may span two epochs.

- `BuiltinSource(task, seed)`: infinite, example i = `task.prompt('train', i, seed=seed)`;
  `len()` is the task's prompt-space size, used as a nominal epoch length for `state()`.
- `FileSource(path, seed)`: JSONL (`.jsonl`, `.json` with one object per line) or Parquet
  (`.parquet`, `.pq`) rows with string `prompt` and `label` fields (numeric labels become strings).
- `make_source(cfg)`; `make_eval_examples(cfg, n)` for the held-out prompts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxloop.data.tasks import DEFAULT_TASK, BuiltinTask
from jaxloop.data.types import DataError, Example, PromptSource
from jaxloop.textfile import utf8_lines

__all__ = [
    "BuiltinSource",
    "DataError",
    "Example",
    "FileSource",
    "PromptSource",
    "load_examples",
    "make_eval_examples",
    "make_source",
]


class BuiltinSource(PromptSource):
    """Infinite stream of training prompts of a `BuiltinTask`; cursor i -> task example i."""

    kind = "builtin"

    def __init__(self, task, seed: int = 0):
        super().__init__(seed)
        self.task = task

    def __len__(self) -> int:
        return self.task.num_prompts

    def _example(self, epoch: int, position: int) -> Example:
        return self.task.prompt("train", epoch * len(self) + position, seed=self.seed)

    def _extra_state(self) -> dict[str, Any]:
        return {"task": self.task.name, "num_digits": self.task.num_digits}

    def eval_examples(self, n: int) -> list[Example]:
        return self.task.eval_examples(n)


class FileSource(PromptSource):
    """All rows of a JSONL or Parquet file, reshuffled every epoch."""

    kind = "file"

    def __init__(self, path: str | os.PathLike, seed: int = 0):
        super().__init__(seed)
        self.path = Path(path)
        self.examples = load_examples(self.path)
        h = hashlib.sha256()
        for ex in self.examples:
            h.update(json.dumps([ex.prompt, ex.label]).encode("utf-8"))
            h.update(b"\n")
        self.digest = h.hexdigest()
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def _example(self, epoch: int, position: int) -> Example:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, epoch])
            self._perm = rng.permutation(len(self.examples))
            self._perm_epoch = epoch
        return self.examples[int(self._perm[position])]

    def _extra_state(self) -> dict[str, Any]:
        return {"digest": self.digest}

    def restore(self, state: Mapping[str, Any]) -> None:
        super().restore(state)
        self._perm_epoch = -1


def load_examples(path: str | os.PathLike) -> list[Example]:
    """Rows {prompt, label} of a JSONL or Parquet file; DataError naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = _read_jsonl(path)
    elif suffix in (".parquet", ".pq"):
        rows = _read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported data file type {suffix!r} (use .jsonl or .parquet)")
    if not rows:
        raise DataError(f"{path}: no rows (expected {{prompt, label}} records)")
    return [_to_example(path, where, row) for where, row in rows]


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    for lineno, line in utf8_lines(path, DataError):
        try:
            rows.append((f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from None
    return rows


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types
        raise DataError(f"{path}: cannot read Parquet ({type(e).__name__}: {e})") from None
    missing = [c for c in ("prompt", "label") if c not in table.column_names]
    if missing and table.num_rows:
        raise DataError(
            f"{path}: missing column(s) {missing}; found {table.column_names} "
            "(expected prompt, label)"
        )
    if not table.num_rows:
        return []
    prompts = table.column("prompt").to_pylist()
    labels = table.column("label").to_pylist()
    pairs = zip(prompts, labels, strict=True)
    return [(f"row {i}", {"prompt": p, "label": lab}) for i, (p, lab) in enumerate(pairs)]


def _to_example(path: Path, where: str, row: Any) -> Example:
    if not isinstance(row, dict):
        raise DataError(f"{path}: {where} is a {type(row).__name__}, expected an object")
    prompt, label = row.get("prompt"), row.get("label")
    missing = [k for k, v in (("prompt", prompt), ("label", label)) if v is None]
    if missing:
        raise DataError(f"{path}: {where} is missing field(s) {missing} (expected prompt, label)")
    if not isinstance(prompt, str) or not prompt:
        raise DataError(f"{path}: {where} has a non-string or empty prompt")
    if isinstance(label, bool) or not isinstance(label, str | int | float):
        raise DataError(f"{path}: {where} has a label of type {type(label).__name__}")
    label = label if isinstance(label, str) else str(label)
    if not label.strip():
        raise DataError(f"{path}: {where} has an empty label")
    return Example(prompt, label)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    try:
        value = cfg[key]
    except (KeyError, AttributeError, TypeError):
        value = getattr(cfg, key, default)
    return default if value is None else value


def make_source(cfg: Any) -> PromptSource:
    """`cfg` (dict-like): source ('builtin' or a file path), task, num_digits, seed."""
    source = str(_get(cfg, "source", "builtin"))
    seed = int(_get(cfg, "seed", 0))
    if source == "builtin":
        task = BuiltinTask(
            name=str(_get(cfg, "task", DEFAULT_TASK)),
            num_digits=int(_get(cfg, "num_digits", 4)),
            seed=seed,
        )
        return BuiltinSource(task, seed=seed)
    return FileSource(source, seed=seed)


def make_eval_examples(cfg: Any, n: int) -> list[Example]:
    """Held-out examples: the builtin task's eval split, or the first `n` rows of
    `cfg['eval_source']` for file sources (an empty list when there is none)."""
    eval_source = _get(cfg, "eval_source", None)
    if eval_source:
        return load_examples(eval_source)[:n]
    if str(_get(cfg, "source", "builtin")) == "builtin":
        task = BuiltinTask(
            name=str(_get(cfg, "task", DEFAULT_TASK)),
            num_digits=int(_get(cfg, "num_digits", 4)),
            seed=int(_get(cfg, "seed", 0)),
        )
        return task.eval_examples(n)
    return []
