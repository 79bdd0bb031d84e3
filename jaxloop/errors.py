"""The one exception boundary of the command-line entry points (train, sft, evaluate, plot,
launch, conversion.from_hf / to_hf).

A *user error* is a bad input: a config value, a file, a run dir, user code (a config file or a
reward function that raises or returns the wrong thing). It is reported as one line on stderr,
`error: <what>`, with exit code 2. The user-error types are the ones `user_error_types()` lists
(validation raises them; guarded user code is re-raised as `UserCodeError`); an entry point may
add its own (`extra`). A write the file system refuses (disk full, read-only, permissions) is one
too. Anything else is a bug: it keeps its traceback (exit code 1), so no catalogue of bad inputs
can be passed by swallowing every exception.

    from jaxloop.errors import run_entry_point

    def main(argv=None) -> int:
        return run_entry_point(lambda: _main(argv))
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable

__all__ = [
    "WRITE_ERRNOS",
    "UsageError",
    "UserCodeError",
    "error_line",
    "run_entry_point",
    "user_error_types",
]


class UsageError(ValueError):
    """Bad command line or config: reported as one line on stderr with exit code 2."""


class UserCodeError(UsageError):
    """User code (a config file, a reward function) failed or returned the wrong thing: one line
    naming the file or function and the exception, exit code 2 (below)."""


# OSError numbers of a write the file system refuses (EFBIG: a file-size limit, RLIMIT_FSIZE)
WRITE_ONLY_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG)
# ... and of any access it refuses, a read as well as a write: said as such, not as a write
ACCESS_ERRNOS = (errno.EACCES, errno.EPERM)
# OSError numbers that are a user error (exit 2), not a bug
WRITE_ERRNOS = WRITE_ONLY_ERRNOS + ACCESS_ERRNOS


def user_error_types() -> tuple[type[BaseException], ...]:
    """The documented user-error types: UsageError, which every layer's bad-input error
    subclasses (DataError, ConfigError, TokenizerError, CheckpointError, RunDirError, ...)."""
    return (UsageError,)


def error_line(err: BaseException, prefix: str = "") -> str:
    """`error: <prefix><first line of the message>` (the type name when the message is empty).
    An error raised in a Ray actor (a RayTaskError, also an instance of its cause's type) is
    reported by its cause: the user's message, not Ray's header."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        err = cause
    text = str(err).strip() or type(err).__name__
    return f"error: {prefix}{text.splitlines()[0]}"


def is_user_error(err: BaseException, extra: tuple[type[BaseException], ...] = ()) -> bool:
    if isinstance(err, user_error_types() + tuple(extra)):
        return True
    return isinstance(err, OSError) and err.errno in WRITE_ERRNOS


def os_error_prefix(err: BaseException) -> str:
    """What the file system refused: "cannot write: " for a full disk, a read-only file system,
    a quota or a size limit; "cannot access: " for a refused permission (a read or a write)."""
    if not isinstance(err, OSError):
        return ""
    return "cannot access: " if err.errno in ACCESS_ERRNOS else "cannot write: "


def run_entry_point(
    body: Callable[[], int],
    *,
    extra: tuple[type[BaseException], ...] = (),
    on_user_error: Callable[[BaseException], None] | None = None,
) -> int:
    """`body()`'s exit code; a user error (above) prints one line on stderr and returns 2 after
    `on_user_error(err)` (e.g. removing what a fresh run created); anything else propagates."""
    try:
        return body()
    except Exception as err:  # noqa: BLE001 - re-raised unless it is a user error
        if not is_user_error(err, extra):
            raise
        if on_user_error is not None:
            on_user_error(err)
        prefix = os_error_prefix(err)
        print(error_line(err, prefix), file=sys.stderr)
        return 2
