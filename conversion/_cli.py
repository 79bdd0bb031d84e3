"""What the conversion CLIs share: one-line errors (exit code 2), output-dir checks, and
progress bars only when stderr is a terminal."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

EXIT_ERROR = 2


class UsageError(ValueError):
    """A bad command line or output location."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are a single "error: ..." line (no usage block), exit code 2."""

    def error(self, message: str):
        raise UsageError(message)


def check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} exists and is not an empty directory")


def show_progress() -> bool:
    """Progress bars (on stderr) only for a person watching: never into a pipe or a log."""
    return sys.stderr.isatty()


def run(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None) -> int:
    """Run `main`; a ValueError/OSError becomes one stderr line and exit code 2."""
    try:
        return main(argv)
    except (ValueError, OSError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr, flush=True)
        return EXIT_ERROR
