"""A soak: the unit model trained for many updates with checkpoints, evaluations and their
samples on, recording what a long run must not accumulate.

    python scripts/soak.py --updates 3000 --every 100 --out runs/soak [--config.KEY=VALUE ...]

One trainer in this process (`jaxloop.train`'s Trainer: ppo on the unit task, a tiny model).
Every --every updates, after that update's checkpoint (if one is due), a row goes to
<out>/soak.jsonl: host RSS (VmRSS of /proc/self/status), device memory (the bytes of
jax.live_arrays(), and the backend's bytes_in_use where it reports one), open file descriptors
(/proc/self/fd), threads, the checkpoints in checkpoints/ and the files in samples/. At the end:
<out>/soak.png (one panel per measure) and one summary line per measure: its value at update
--baseline (default 100, or the first row after it) and at the end, and the growth in %.
--max-growth P: exit 1 when RSS, device memory or open files grew by more than P % (and when
the checkpoints outnumber keep_checkpoints + 1). Extra `--config.KEY=VALUE` arguments override
the run's config (e.g. --config.eval_every=25).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

MEASURES = ("rss_mb", "device_live_mb", "open_fds", "threads", "checkpoints", "sample_files")
GUARDED = ("rss_mb", "device_live_mb", "open_fds")  # --max-growth applies to these


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=3000, help="updates of the run")
    p.add_argument("--every", type=int, default=100, help="a row every N updates")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=50, help="evaluations (and samples files)")
    p.add_argument("--keep", type=int, default=2, help="keep_checkpoints")
    p.add_argument("--baseline", type=int, default=100, help="growth is measured from here")
    p.add_argument("--max-growth", type=float, default=None, help="percent; exit 1 above it")
    p.add_argument("--out", default="runs/soak", help="run dir; soak.jsonl and soak.png in it")
    return p.parse_known_args(argv)


def _config(opts, extra: list[str]):
    from jaxloop.config import TINY_MODEL_OVERRIDES, parse_command, unit_overrides

    bad = [a for a in extra if not a.startswith("--config.")]
    if bad:
        raise SystemExit(f"error: unknown arguments {bad} (only --config.KEY=VALUE pass through)")
    argv = [
        "--config",
        "ppo.py",
        *unit_overrides(),
        *TINY_MODEL_OVERRIDES,
        "--config.progress=false",
        "--config.curves=false",
        f"--config.run_dir={opts.out}",
        f"--config.total_updates={opts.updates}",
        f"--config.checkpoint_every={opts.checkpoint_every}",
        f"--config.eval_every={opts.eval_every}",
        f"--config.keep_checkpoints={opts.keep}",
        *extra,
    ]
    return parse_command(argv).cfg


def measure(run_dir: Path) -> dict[str, float]:
    """This process's host RSS, live device bytes, open fds and threads, and the run dir's
    checkpoint and samples counts."""
    import jax

    rss_kb = next(
        int(line.split()[1])
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    live = sum(a.nbytes for a in jax.live_arrays())
    row = {
        "rss_mb": rss_kb / 1024,
        "device_live_mb": live / 2**20,
        "open_fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "checkpoints": sum(1 for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()),
        "sample_files": len(list((run_dir / "samples").glob("*.jsonl")))
        if (run_dir / "samples").is_dir()
        else 0,
    }
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_in_use" in stats:
        row["device_in_use_mb"] = stats["bytes_in_use"] / 2**20
    return row


def growth(rows: list[dict], baseline: int) -> dict[str, tuple[float, float, float]]:
    """Per measure: (value at the first row at or after `baseline`, last value, growth %)."""
    start = next((r for r in rows if r["update"] >= baseline), rows[0])
    out = {}
    for key in MEASURES:
        a, b = start[key], rows[-1][key]
        out[key] = (a, b, 100.0 * (b - a) / a if a else 0.0)
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 6), constrained_layout=True)
    updates = [r["update"] for r in rows]
    for ax, key in zip(axes.flat, MEASURES, strict=True):
        ax.plot(updates, [r[key] for r in rows], marker=".")
        ax.set_title(key)
        ax.set_xlabel("update")
        ax.set_ylim(bottom=0)
    fig.suptitle("soak: unit model, checkpoints, evaluations and samples on")
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    opts, extra = _args(sys.argv[1:] if argv is None else argv)
    from jaxloop.train.hooks import Hook
    from jaxloop.train.loop import Trainer

    cfg = _config(opts, extra)
    run_dir = Path(cfg.run_dir).resolve()
    trainer = Trainer(cfg)
    log = run_dir / "soak.jsonl"
    rows: list[dict] = []
    started = time.perf_counter()

    def record(step) -> None:
        row = {"update": step.finished, "seconds": time.perf_counter() - started}
        row.update(measure(run_dir))
        rows.append(row)
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    # after the checkpoint hook of the same update (hooks run in list order)
    trainer.hooks.hooks.append(Hook(record, at="saved", every=opts.every))
    trainer.run()
    if not rows:
        print("soak: no row recorded (fewer updates than --every)", file=sys.stderr)
        return 1
    plot(rows, run_dir / "soak.png")
    failed = False
    for key, (a, b, pct) in growth(rows, opts.baseline).items():
        guarded = opts.max_growth is not None and key in GUARDED and pct > opts.max_growth
        failed |= guarded
        flag = "  > --max-growth" if guarded else ""
        print(f"soak: {key:15s} {a:10.1f} -> {b:10.1f}  ({pct:+.1f}%){flag}")
    most = max(r["checkpoints"] for r in rows)
    if opts.max_growth is not None and most > opts.keep + 1:
        print(f"soak: {most} checkpoints at once (keep_checkpoints={opts.keep})")
        failed = True
    print(f"soak: {rows[-1]['update']} updates in {rows[-1]['seconds']:.0f} s; rows in {log}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
