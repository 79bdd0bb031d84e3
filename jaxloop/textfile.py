"""Reading line-oriented text files that users and crashes can damage (JSONL data, metrics.jsonl):
one place that turns bytes that are not UTF-8 into an error naming the line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def utf8_lines(path: Path, error: type[Exception], hint: str = "") -> Iterator[tuple[int, str]]:
    """(line number, text) of every non-blank line of `path`; a line that is not UTF-8 raises
    `error` naming the line, the byte and its column (plus `hint`)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(
                    f"{path}: line {lineno} is not UTF-8 (byte {raw[e.start]:#04x} at column "
                    f"{e.start + 1}){hint}"
                ) from None
            if line.strip():
                yield lineno, line
