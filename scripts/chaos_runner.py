"""`python scripts/chaos_runner.py TRAIN_ARGS...`: `python -m jaxloop.train TRAIN_ARGS...` with
markers for scripts/chaos.py, which SIGKILLs this process at chosen moments.

Every marker is one line on stderr, `CHAOS <event> <n> <unix time>`, flushed before the moment it
names. Events (n: the step / update / version concerned):

  start                  the process started (before jax is imported)
  restore / restored     TrainCheckpointer.restore of step n begins / ends
  update                 Trainer.one_update(n) begins
  produce / produced     the rollout of update n begins / ends (engines generating)
  metrics                the metrics row of update n was written (its checkpoint is not yet)
  save / saved           TrainCheckpointer.save of step n begins / ends (orbax writing)
  commit                 orbax is about to rename step n's temporary directory (all written)
  delete / deleting      orbax is about to delete old step n / has deleted part of it (the trainer's
                         steps: after their rename into checkpoints/.deleted/)
  publish / published    Trainer.publish of version n begins / ends

With JAXLOOP_CHAOS_SLEEP=S (seconds) the process sleeps S after the markers of update, metrics,
commit, delete, deleting and publish (JAXLOOP_CHAOS_SLEEP_AT=a,b: only after those), so a kill can
land in those short windows (the sleeps change timing only, never a result);
JAXLOOP_CHAOS_PLOT=0 skips curves.png. The hooks wrap methods from outside; nothing in jaxloop
knows about them.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
from pathlib import Path

SLEEP = float(os.environ.get("JAXLOOP_CHAOS_SLEEP", "0") or 0)
# only these markers sleep (comma-separated; empty: all that can)
SLEEP_AT = {e for e in os.environ.get("JAXLOOP_CHAOS_SLEEP_AT", "").split(",") if e}


def mark(event: str, n: int | str = "-", sleep: bool = False) -> None:
    sys.stderr.write(f"CHAOS {event} {n} {time.time():.6f}\n")
    sys.stderr.flush()
    if sleep and SLEEP > 0 and (not SLEEP_AT or event in SLEEP_AT):
        time.sleep(SLEEP)


def _wrap(owner, name: str, before=None, after=None) -> None:
    """owner.name(*a) -> before(*a); result = original(*a); after(result, *a)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result

    setattr(owner, name, wrapper)


def _step_of(path) -> str:
    name = Path(str(path)).name
    return name.split(".", 1)[0] if name.split(".", 1)[0].isdigit() else name


def install() -> None:
    from orbax.checkpoint._src.path import async_path, atomicity, deleter

    import jaxloop.train.loop as train
    from jaxloop.metrics import MetricsWriter
    from jaxloop.train.checkpoint import TrainCheckpointer

    _wrap(
        TrainCheckpointer,
        "restore",
        before=lambda self, step, *a, **k: mark("restore", step),
        after=lambda r, self, step, *a, **k: mark("restored", step),
    )
    _wrap(
        TrainCheckpointer,
        "save",
        before=lambda self, state, *a, **k: mark("save", state.update_count),
        after=lambda r, self, state, *a, **k: mark("saved", state.update_count),
    )
    _wrap(
        MetricsWriter,
        "write",
        after=lambda r, self, update, *a, **k: mark("metrics", update, sleep=True),
    )
    _wrap(train.Trainer, "one_update", before=lambda self, u, *a, **k: mark("update", u, True))
    _wrap(
        train.Trainer,
        "publish",
        before=lambda self: mark("publish", self.state.version, sleep=True),
        after=lambda r, self: mark("published", self.state.version),
    )

    build_producer = train.build_producer

    def build_and_wrap(*args, **kwargs):
        producer = build_producer(*args, **kwargs)
        _wrap(
            producer,
            "produce",
            before=lambda u, *a, **k: mark("produce", u),
            after=lambda r, u, *a, **k: mark("produced", u),
        )
        return producer

    train.build_producer = build_and_wrap

    # orbax: the commit (tmp dir -> step dir) and the deletion of old steps
    rename = async_path.rename

    async def slow_rename(src, dst):
        mark("commit", _step_of(dst), sleep=True)
        return await rename(src, dst)

    atomicity.async_path.rename = slow_rename

    delete = deleter.PathDeleter.delete

    def slow_delete(self, path, *args, **kwargs):
        mark("delete", _step_of(path), sleep=True)
        destination = kwargs.get("destination")
        if destination is not None:
            # the trainer's deletion (todelete_subdir): the step is renamed into
            # checkpoints/.deleted/ and removed there later; take part of it away in the trash,
            # so that a kill in the following sleep leaves a half-deleted step there
            result = delete(self, path, *args, **kwargs)
            local = Path(str(destination))
            items = sorted(p for p in local.iterdir() if p.is_dir()) if local.is_dir() else []
            if items:
                shutil.rmtree(items[0], ignore_errors=True)
                mark("deleting", _step_of(path), sleep=True)
            return result
        # take away part of it first (the first item directory), so that a kill in the
        # following sleep leaves a step directory deleted half-way
        local = Path(str(path))
        items = sorted(p for p in local.iterdir() if p.is_dir()) if local.is_dir() else []
        if items:
            shutil.rmtree(items[0], ignore_errors=True)
            mark("deleting", _step_of(path), sleep=True)
        return delete(self, path, *args, **kwargs)

    deleter.PathDeleter.delete = slow_delete

    if os.environ.get("JAXLOOP_CHAOS_PLOT", "1") == "0":  # CI: skip curves.png (seconds each)
        import jaxloop.plot as plot

        def no_plot(*args, **kwargs):
            raise plot.PlotError("skipped by the chaos runner")

        plot.plot_run = no_plot


def main(argv: list[str] | None = None) -> int:
    mark("start")
    sys.path.insert(0, os.getcwd())  # as `python -m` would: module:function rewards of the cwd
    install()
    from jaxloop.train.cli import main as train_main

    return train_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
