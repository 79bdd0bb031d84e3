"""Checks and the error boundary that the entry points (`jaxloop.train`, `jaxloop.sft`) share:
the model source, a writable run dir, and user errors that undo a fresh start."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from jaxloop import errors
from jaxloop.config import UsageError
from jaxloop.io.run_dir import checkpoint_steps
from jaxloop.models import ConfigError, LoopedConfig
from jaxloop.train.build import actor_config
from jaxloop.train.checkpoint import FreshStartCleanup


def stored_vocab_size(cfg) -> int:
    """The vocabulary of the model a run starts from, read from its config file (dry run: no
    model is built); the config's model.vocab_size for the built-in model."""
    m = cfg.model
    for path in (
        Path(m.hf_dir) / "config.json" if m.hf_dir else None,
        Path(m.init_checkpoint) / "actor_config.json" if m.init_checkpoint else None,
    ):
        if path is not None and path.is_file():
            try:
                return int(json.loads(path.read_text())["vocab_size"])
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{path}: no integer vocab_size") from None
    return int(m.vocab_size)


def check_model_source(cfg) -> LoopedConfig:
    """model.init_checkpoint holds a checkpoint, and the model's own rules hold (query heads
    divisible by key/value heads, an even head_dim, ...): the actor's LoopedConfig. Reads only;
    a dry run makes these checks too (train and sft)."""
    if cfg.model.init_checkpoint and not checkpoint_steps(cfg.model.init_checkpoint):
        raise UsageError(
            f"model.init_checkpoint={cfg.model.init_checkpoint!r} holds no checkpoint "
            "(checkpoints/<step>/): give a run dir written by jaxloop.train, jaxloop.sft or "
            "conversion.from_hf"
        )
    return actor_config(cfg)


def check_writable(run_dir) -> None:
    """UsageError unless a file can be created, written and synced in run_dir (a new one: in its
    nearest existing parent); the probe file is removed. A read-only or full file system fails
    here, before anything is written."""
    path = Path(run_dir).resolve()
    if path.exists() and not path.is_dir():
        raise UsageError(f"run_dir {str(path)!r} exists and is not a directory")
    where = path
    while not where.exists():
        where = where.parent
    probe = where / f".jaxloop-write-probe-{os.getpid()}"
    times = where.stat()
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise UsageError(
            f"run_dir {str(path)!r} is not writable: {err.strerror or err} (in {where})"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
            os.utime(where, ns=(times.st_atime_ns, times.st_mtime_ns))  # the probe leaves no trace


def run_cleaning_up(body) -> int:
    """`body(cleanup)` behind the entry points' boundary (jaxloop/errors.py); `body` appends a
    FreshStartCleanup for every fresh start it makes, and a user error undoes them all."""
    cleanup: list[FreshStartCleanup] = []

    def undo(err) -> None:
        for fresh in cleanup:
            fresh.undo(err)

    return errors.run_entry_point(lambda: body(cleanup), on_user_error=undo)


LOCK_FILE = ".lock"


@contextlib.contextmanager
def run_dir_lock(run_dir, dist):
    """One writer per run dir: an exclusive flock on <run_dir>/.lock for the body's duration
    (the kernel also releases it on exit and on kill -9, so a stale file never blocks). The
    holder writes host, pid and start time into it; a second process gets a UsageError naming
    them. A clean release removes the file (a run leaves no trace of it). Only process 0 of a
    multi-process run takes it (dist.process_id: jax.distributed is not started yet, and
    nothing may touch devices before it is)."""
    import fcntl
    import socket
    import time

    if dist.coordinator_address and (dist.process_id or 0) != 0:
        yield
        return
    path = Path(run_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    before = (sorted(os.listdir(path)), path.stat())  # what a refused run restores (below)
    lock = path / LOCK_FILE
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown holder"
            os.close(fd)
            raise UsageError(
                f"run_dir {str(path)!r} is in use by another run ({holder}); "
                "wait for it to end or give another run_dir"
            ) from None
        try:  # the file a releasing holder unlinked is not the lock any more: take the new one
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {since}".encode(), 0)
    try:
        yield
    except BaseException:
        _release(lock, fd)
        # a run refused before it wrote anything leaves the run dir as it found it: the lock
        # file's creation and removal changed only the directory's times
        with contextlib.suppress(OSError):
            if sorted(os.listdir(path)) == before[0]:
                os.utime(path, ns=(before[1].st_atime_ns, before[1].st_mtime_ns))
        raise
    _release(lock, fd)


def _release(lock: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        lock.unlink()
    os.close(fd)
