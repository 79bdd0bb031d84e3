"""Run metrics: one JSON line per update in <run_dir>/metrics.jsonl, TensorBoard scalars in
<run_dir>/tb/, and a tqdm progress bar.

`MetricsWriter(run_dir, start_update)` first drops every line with update >= start_update from an
existing metrics.jsonl (atomically), so a resumed run never has duplicate lines; TensorBoard gets
`purge_step=start_update` for the same reason. NaN / inf values are written as null.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from jaxloop.errors import UsageError
from jaxloop.textfile import utf8_lines

__all__ = [
    "METRICS_FILE",
    "MetricsFileError",
    "PROGRESS_KEYS",
    "MetricsProgress",
    "MetricsWriter",
    "progress",
    "read_metrics",
]

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
PROGRESS_KEYS = ("reward_mean", "eval_reward")
# Prefixes of metrics that measure time, not the computation: two runs of the same config and
# seed agree on every other metric bit for bit (resume and chaos checks leave these out).
TIMING_METRICS = (
    "time_",
    "tokens_per_s",
    "publish_gb_per_s",
    "engine_idle_",
    "learner_idle_",
    "warm_start_seconds",
)


def _to_float(key: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        x = float(value)  # python / numpy / 0-d jax scalars
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r} is not a number: {value!r}") from None
    return x if math.isfinite(x) else None


class MetricsFileError(UsageError):
    """A metrics.jsonl that is damaged beyond a line cut short (bytes that are not UTF-8)."""


def _read_lines(path: Path) -> list[dict]:
    out = []
    hint = ": the file is damaged; repair or delete that line"
    for _, line in utf8_lines(path, MetricsFileError, hint):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(row, dict) and isinstance(row.get("update"), int):
            out.append(row)
    return out


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of <run_dir>/metrics.jsonl (null metrics as None); FileNotFoundError if absent.

    Blank or truncated lines are skipped; a line of bytes that are not UTF-8 is a
    MetricsFileError (a UsageError: one line, exit 2) naming it.
    """
    return _read_lines(Path(run_dir) / METRICS_FILE)


def _summary_writer_class():
    """tensorboardX's SummaryWriter. tensorboardX's import imports torch (seconds, at every trainer
    start) only to name torch.Tensor in type hints; its conversions import torch lazily, and
    jaxloop logs Python floats. So unless torch is loaded already (or another thread could be
    importing it), tensorboardX is imported with `import torch` refused; afterwards torch
    imports as usual."""
    import threading

    if "tensorboardX.writer" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
    elif threading.active_count() > 1:
        from tensorboardX import SummaryWriter
    else:
        sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
        try:
            from tensorboardX import SummaryWriter
        finally:
            del sys.modules["torch"]
    return SummaryWriter


# tensorboardX writes events in a thread of its own: a write the file system refuses there (a
# full disk) ends that thread, after which its bounded queue fills and the next add_scalar
# blocks for ever. The thread's exception is kept here (not printed) and raised by the next
# write, in the trainer's thread (one line, exit 2, at the entry point's boundary).
_TB_FAILURES: dict[int, BaseException] = {}
_THREAD_HOOK = threading.excepthook


def _keep_tb_failures(args) -> None:
    if type(args.thread).__module__.startswith("tensorboardX") and args.exc_value is not None:
        _TB_FAILURES[id(args.thread)] = args.exc_value
    else:
        _THREAD_HOOK(args)


threading.excepthook = _keep_tb_failures


def _raise_tb_failure(tb) -> None:
    for writer in (tb.all_writers or {}).values():
        worker = getattr(writer.event_writer, "_worker", None)
        if worker is not None and id(worker) in _TB_FAILURES:
            raise _TB_FAILURES.pop(id(worker))


def _close_tb(tb) -> None:
    """Close a SummaryWriter; where the file system refused its events (a full disk, a size
    limit), stop its writer threads and mark its files closed, so that tensorboardX's own exit
    hook does not retry the flush and print a traceback after the run's one-line error."""
    try:
        _raise_tb_failure(tb)  # its writer thread ended: closing would wait for it for ever
        tb.close()
    except OSError:
        for writer in (tb.all_writers or {}).values():
            events = writer.event_writer
            worker = getattr(events, "_worker", None)
            if worker is not None and worker.is_alive():
                worker.stop()
            events._closed = True  # tensorboardX's atexit cleanup: close() if not _closed
        raise


class MetricsWriter:
    """`write(update, metrics)` appends {"update": update, **metrics} and logs TB scalars."""

    def __init__(self, run_dir: str | os.PathLike, start_update: int = 0, *, tensorboard=True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.start_update = int(start_update)
        if self.path.exists():
            self._truncate(self.start_update)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            self._tb = _summary_writer_class()(
                logdir=str(self.run_dir / TB_DIR),
                purge_step=self.start_update if self.start_update > 0 else None,
                flush_secs=30,
                # tensorboardX names files by the second; a resume within the same second would
                # otherwise overwrite the previous event file.
                filename_suffix=f".{os.getpid()}.{time.time_ns()}",
            )

    def _truncate(self, start_update: int) -> None:
        rows = [r for r in _read_lines(self.path) if r["update"] < start_update]
        tmp = self.path.with_name(f".{METRICS_FILE}.tmp.{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def write(self, update: int, metrics: Mapping[str, Any]) -> dict:
        """Log one update; returns the row written."""
        if self._file is None:
            raise RuntimeError("MetricsWriter is closed")
        row: dict[str, Any] = {"update": int(update)}
        for key, value in metrics.items():
            if key == "update":
                continue
            row[str(key)] = _to_float(key, value)
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key != "update" and value is not None:
                    _raise_tb_failure(self._tb)
                    self._tb.add_scalar(key, value, global_step=row["update"])
        return row

    log = write

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        try:
            if self._file is not None:
                file, self._file = self._file, None
                file.close()  # a refused flush raises, the file is closed all the same
        finally:
            if self._tb is not None:
                tb, self._tb = self._tb, None
                _close_tb(tb)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MetricsProgress(tqdm):
    """A tqdm bar with `step(metrics)`; when the bar is disabled (not a TTY) `close()` still
    prints one summary line, so CI logs show where the run ended."""

    def __init__(self, *args, keys: Iterable[str] = PROGRESS_KEYS, **kwargs):
        self._keys = tuple(keys)
        self._last: dict[str, float] = {}
        self._count = int(kwargs.get("initial", 0) or 0)
        self._t0 = time.perf_counter()
        self._summary_file = kwargs.get("file") or sys.stderr
        self._summary_done = False
        self._desc = kwargs.get("desc") or "progress"
        super().__init__(*args, **kwargs)

    def step(self, metrics: Mapping[str, Any] | None = None, n: int = 1) -> None:
        """Advance by `n` updates and show the latest values of the tracked metrics."""
        if metrics:
            for k in self._keys:
                if k in metrics:
                    v = _to_float(k, metrics[k])
                    if v is not None:
                        self._last[k] = v
            if self._last:
                self.set_postfix({k: f"{v:.4g}" for k, v in self._last.items()}, refresh=False)
        self.update(n)

    def update(self, n=1):
        self._count += n
        return super().update(n)

    def summary(self) -> str:
        total = "?" if self.total is None else self.total
        parts = [f"{self._desc}: {self._count}/{total}"]
        parts += [f"{k}={v:.4g}" for k, v in self._last.items()]
        parts.append(f"{time.perf_counter() - self._t0:.1f}s")
        return " ".join(parts)

    def close(self, summary: bool = True):
        """Closes the bar; `summary=False` (a run that failed: its error is the one line on
        stderr) prints no summary line, now or later."""
        if not summary:
            self._summary_done = True
        if self.disable and not self._summary_done and hasattr(self, "_count"):
            self._summary_done = True
            try:
                print(self.summary(), file=self._summary_file, flush=True)
            except (OSError, ValueError):  # stream closed (interpreter shutdown)
                pass
        return super().close()


def progress(
    total: int | None,
    initial: int = 0,
    desc: str = "train",
    *,
    keys: Iterable[str] = PROGRESS_KEYS,
    file=None,
    disable: bool | None = None,
) -> MetricsProgress:
    """A progress bar over updates; `bar.step(metrics)` per update, `bar.close()` at the end.

    `disable=None` hides the bar when `file` (stderr) is not a TTY; a summary line is then
    printed on close.
    """
    return MetricsProgress(
        total=total,
        initial=initial,
        desc=desc,
        keys=keys,
        file=file,
        disable=disable,
        dynamic_ncols=True,
        unit="upd",
    )
