"""Per-item checksums of a checkpoint step, written at save and verified at restore.

A step directory `checkpoints/<step>/` holds one directory per item (actor_params, actor_opt,
train_state...) as orbax wrote them. After orbax has committed the step, `write_digests` hashes
every file of every item (SHA-256 of the bytes as written, with their sizes) and writes
`checkpoints/<step>/jaxloop_digests.json` atomically (a temporary file, fsync, rename): it is the
last file of a step. `verify_step` re-hashes the files of the items a reader is about to restore
(resume: every item; evaluate and to_hf: `actor_params` only) and refuses a step whose files
differ (a flipped byte of the same size included), are missing or were cut short.

A step without a digest file (written by a jaxloop before digests, or by a save killed between
orbax's commit and the digest write) is *unverified*: it is restored as before (orbax's own
checks only), with one warning line on stderr.

Old steps are deleted atomically: orbax renames a step past `keep_checkpoints` into
`checkpoints/.deleted/` (CheckpointManagerOptions.todelete_subdir) and `empty_trash` removes it
there, so a kill during the deletion never leaves a half-deleted step under its number.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DIGEST_FILE = "jaxloop_digests.json"
TRASH_DIR = ".deleted"  # orbax's todelete_subdir, under checkpoints/
FORMAT = 1
_CHUNK = 8 * 2**20
_THREADS = 4


class DigestError(ValueError):
    """A checkpoint step whose files do not match the digests written when it was saved."""


def _hash_file(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks (hashlib releases the GIL: threads help).

    The read buffer is no larger than the file, and a full-size chunk is an anonymous mapping of
    its own: an 8 MiB heap buffer per file, allocated in fresh pool threads at every save, stayed
    in glibc's per-thread arenas (a soak's RSS rose 5-8 % and then held; docs/reliability.md)."""
    with open(path, "rb", buffering=0) as f:
        expected = os.fstat(f.fileno()).st_size
        if expected < _CHUNK:  # one read and the EOF read; a file grown since still hashes whole
            return _hash_reading(f, bytearray(expected + 1))
        with mmap.mmap(-1, _CHUNK) as chunk:
            return _hash_reading(f, chunk)


def _hash_reading(f, buf) -> tuple[int, str]:
    """(bytes read, sha256 hex) of the rest of `f`, read into `buf` (released before it closes)."""
    h = hashlib.sha256()
    size = 0
    with memoryview(buf) as view:
        while n := f.readinto(view):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _item_files(item_dir: Path) -> list[Path]:
    return sorted(p for p in item_dir.rglob("*") if p.is_file())


def _hash_all(paths: list[Path]) -> list[tuple[int, str]]:
    if len(paths) <= 1:
        return [_hash_file(p) for p in paths]
    with ThreadPoolExecutor(min(_THREADS, len(paths))) as pool:
        return list(pool.map(_hash_file, paths))


def item_dirs(step_dir: Path) -> list[Path]:
    return sorted(p for p in Path(step_dir).iterdir() if p.is_dir())


def compute_digests(step_dir: str | Path) -> dict:
    """{item: {relative path: [size, sha256]}} of every file of every item of a step."""
    step_dir = Path(step_dir)
    files = [(item.name, f) for item in item_dirs(step_dir) for f in _item_files(item)]
    hashes = _hash_all([f for _, f in files])
    out: dict[str, dict[str, list]] = {item.name: {} for item in item_dirs(step_dir)}
    for (item, f), (size, digest) in zip(files, hashes, strict=True):
        out[item][f.relative_to(step_dir / item).as_posix()] = [size, digest]
    return out


def _report_timing(what: str, items: dict, seconds: float) -> None:
    """With JAXLOOP_DIGEST_TIMING set, one stderr line per digest pass (scripts/check_full_size.py
    reads them to put the digests' cost beside the conversion's)."""
    if os.environ.get("JAXLOOP_DIGEST_TIMING"):
        nbytes = sum(int(size) for files in items.values() for size, _ in files.values())
        print(f"digests: {what} {nbytes} bytes in {seconds:.2f} s", file=sys.stderr, flush=True)


def write_digests(step_dir: str | Path) -> float:
    """Hash a committed step's items and write its digest file atomically, last. Returns the
    seconds spent."""
    t0 = time.perf_counter()
    step_dir = Path(step_dir)
    doc = {"format": FORMAT, "algorithm": "sha256", "items": compute_digests(step_dir)}
    _report_timing("hashed", doc["items"], time.perf_counter() - t0)
    tmp = step_dir / f".{DIGEST_FILE}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / DIGEST_FILE)
    _fsync_dir(step_dir)
    return time.perf_counter() - t0


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_digests(step_dir: str | Path) -> dict | None:
    """The digest file's items, or None when the step has none (unverified). A digest file that
    is not one (cut short, garbage) is a DigestError."""
    path = Path(step_dir) / DIGEST_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
        items = doc["items"]
        if doc.get("algorithm") != "sha256" or not isinstance(items, dict):
            raise ValueError("not a jaxloop digest file")
        for files in items.values():
            for size, digest in files.values():
                int(size), str(digest)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DigestError(f"its {DIGEST_FILE} is unreadable ({type(err).__name__})") from None
    return items


def verify_step(step_dir: str | Path, items: Iterable[str] | None = None) -> bool:
    """Check the files of `items` (default: every item the digest file lists) against the
    digests written at save: True when verified, False when the step has no digest file
    (unverified). Raises DigestError naming the first file that differs or is missing."""
    t0 = time.perf_counter()
    step_dir = Path(step_dir)
    stored = read_digests(step_dir)
    if stored is None:
        return False
    names = sorted(stored) if items is None else sorted(items)
    checks: list[tuple[str, str, int, str]] = []
    for item in names:
        if item not in stored:
            raise DigestError(f"its {DIGEST_FILE} lists no item {item}")
        for rel, (size, digest) in sorted(stored[item].items()):
            checks.append((item, rel, int(size), str(digest)))
    paths = [step_dir / item / rel for item, rel, _, _ in checks]
    for (item, rel, _, _), path in zip(checks, paths, strict=True):
        if not path.is_file():
            raise DigestError(f"{item}/{rel} is missing (deleted, or the step was cut short)")
    for (item, rel, size, _), path in zip(checks, paths, strict=True):
        if path.stat().st_size != size:
            raise DigestError(f"{item}/{rel} has {path.stat().st_size} bytes; {size} were written")
    for (item, rel, _, digest), (_, got) in zip(checks, _hash_all(paths), strict=True):
        if got != digest:
            raise DigestError(f"{item}/{rel} does not match its checksum (changed since saved)")
    _report_timing("verified", {i: stored[i] for i in names}, time.perf_counter() - t0)
    return True


def warn_unverified(step: int, where: str | Path) -> None:
    print(
        f"warning: checkpoint {step} of {where} has no {DIGEST_FILE} (written before jaxloop "
        "wrote digests, or its save was cut short): restored unverified",
        file=sys.stderr,
        flush=True,
    )


def empty_trash(checkpoint_dir: str | Path) -> None:
    """Remove the steps orbax moved into checkpoints/.deleted/ (kills included: a half-removed
    one there is finished next time)."""
    trash = Path(checkpoint_dir) / TRASH_DIR
    if trash.is_dir():
        shutil.rmtree(trash, ignore_errors=True)
