"""A checkpoint write the file system refuses (a full disk, a file-size limit, a quota, a
read-only file system) as one OSError with its errno, which every entry point reports in one
line (exit 2: jaxloop/errors.py), instead of orbax's tracebacks from each of its threads and
tensorstore's from the asyncio loops it completes writes on after orbax closed them."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from pathlib import Path

from jaxloop.errors import WRITE_ONLY_ERRNOS
from jaxloop.io.run_dir import CHECKPOINT_DIR

_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")  # how tensorstore names the errno


def _refused_errno(err: BaseException) -> int | None:
    """The errno of a write the file system refused (a full disk, a size limit: WRITE_ONLY_ERRNOS)
    behind `err`: an OSError, or tensorstore's ValueError naming it in its text; else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in WRITE_ONLY_ERRNOS:
            return err.errno
        match = _OS_ERROR_CODE.search(str(err))
        if match and int(match.group(1)) in WRITE_ONLY_ERRNOS:
            return int(match.group(1))
        err = err.__cause__ or err.__context__
    return None


class _QuietRefusedWrite(logging.Filter):
    """While a save runs (and after a refused one, for good: the process is ending): the records
    orbax's threads log (absl) and asyncio's unretrieved futures for a refused write, each with
    a traceback, are dropped; the refusal is reported in one line instead. Once a write was
    refused, so are the failures of orbax's threads that the ending process cuts short ("cannot
    schedule new futures after shutdown")."""

    # how orbax's threads and asyncio report a failure in the background
    BACKGROUND = ("_SignalingThread.run() raised an exception", "exception was never retrieved")

    def __init__(self):
        super().__init__()
        self.refused = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and _refused_errno(record.exc_info[1]) is not None:
            return False
        message = record.getMessage()
        if self.refused and any(text in message for text in self.BACKGROUND):
            return False
        return _OS_ERROR_CODE.search(message) is None


def _closed_loop(value) -> bool:
    return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


class _QuietClosedLoops:
    """A refused write fails the save while tensorstore still completes its other writes, on
    asyncio loops orbax has closed: each prints an 'Event loop is closed' traceback (through
    sys.excepthook / sys.unraisablehook). Installed while a save runs, these hooks drop exactly
    those and pass anything else on."""

    def __init__(self):
        self.hook, self.unraisable = sys.excepthook, sys.unraisablehook

    def excepthook(self, kind, value, tb):
        if not _closed_loop(value):
            self.hook(kind, value, tb)

    def unraisablehook(self, info):
        if not _closed_loop(info.exc_value):
            self.unraisable(info)

    def install(self) -> None:
        sys.excepthook, sys.unraisablehook = self.excepthook, self.unraisablehook

    def remove(self) -> None:
        sys.excepthook, sys.unraisablehook = self.hook, self.unraisable


@contextlib.contextmanager
def write_refusals_as_os_errors(run_dir: Path, step: int, previous: int | None):
    """A save the file system refuses (ENOSPC, EFBIG under RLIMIT_FSIZE, EDQUOT, EROFS), which
    orbax raises as tensorstore's ValueError after logging it from each of its threads, becomes
    one OSError with that errno (a user error: one line, exit 2). Orbax never renamed the step's
    temporary directory into place, so the previous checkpoint is still the newest. After a
    refusal the quieting stays: orbax's threads go on failing while the process ends."""
    quiet, hooks = _QuietRefusedWrite(), _QuietClosedLoops()
    loggers = [logging.getLogger("absl"), logging.getLogger("asyncio")]
    for logger in loggers:
        logger.addFilter(quiet)
    hooks.install()
    refused = False
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised unless the file system refused a write
        code = _refused_errno(err)
        if code is None:
            raise
        refused = quiet.refused = True
        # orbax's write coroutines that the refusal cut short are collected unawaited as the
        # process ends, each a RuntimeWarning line after the one-line error
        warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)
        kept = "no earlier checkpoint" if previous is None else f"checkpoint {previous} is intact"
        raise OSError(
            code,
            f"{os.strerror(code)}: checkpoint {step} was not written ({kept}; a rerun resumes "
            "from it)",
            str(run_dir / CHECKPOINT_DIR),
        ) from None
    finally:
        if not refused:
            hooks.remove()
            for logger in loggers:
                logger.removeFilter(quiet)
