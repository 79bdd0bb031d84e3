"""What the conversion CLIs share: one exception boundary (jaxloop.errors: a user error, i.e. a
bad command line, output location, HF dir, run dir or checkpoint, or a write the file system
refuses, is one `error: ...` line on stderr and exit code 2; anything else is a bug and keeps its
traceback), output-dir checks, and progress bars only when stderr is a terminal."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


class UsageError(ValueError):
    """A bad command line or output location."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are a single "error: ..." line (no usage block), exit code 2."""

    def error(self, message: str):
        raise UsageError(message)


def check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} exists and is not an empty directory")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UsageError(f"--out {out}: {parent} is a file, not a directory")


def show_progress() -> bool:
    """Progress bars (on stderr) only for a person watching: never into a pipe or a log."""
    return sys.stderr.isatty()


def run(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None) -> int:
    """Run `main` inside the entry point's one exception boundary (jaxloop.errors)."""
    from jaxloop.errors import run_entry_point

    return run_entry_point(lambda: main(argv), extra=(UsageError,))
