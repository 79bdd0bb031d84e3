"""Plot a run's learning curves: `python -m jaxloop.plot RUN_DIR [--out PNG] [--keys k1,k2]`.

Writes <RUN_DIR>/curves.png (or --out) with one subplot per metric against the update number.
Exit code 2 with a one-line `error: ...` on stderr (jaxloop.errors' boundary) when the command
line is wrong, the run dir or its metrics are missing, empty or damaged (bytes that are not
UTF-8), none of the requested keys has a value, or --out is a directory / cannot be written;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from jaxloop.metrics import METRICS_FILE, read_metrics

DEFAULT_KEYS = (
    "reward_mean",
    "eval_reward",
    "response_length",
    "kl",
    "clip_frac",
    "blocked_frac",
    "value_loss",
    "grad_norm",
    "tokens_per_s",
    "sft_loss",  # jaxloop.sft
    "eval_accuracy",
)


class PlotError(Exception):
    """A bad command line, run dir or output path (a user error: one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        raise PlotError(message)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(updates, values) of the finite values of `key`."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["update"])
            ys.append(float(v))
    return xs, ys


def plot_run(run_dir: str | Path, out: str | Path | None = None, keys=None) -> Path:
    """Write the curves PNG and return its path; PlotError on a bad run dir or no data."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"run dir not found: {run_dir}")
    if not (run_dir / METRICS_FILE).is_file():
        raise PlotError(f"no {METRICS_FILE} in {run_dir}")
    rows = read_metrics(run_dir)
    if not rows:
        raise PlotError(f"{run_dir / METRICS_FILE} has no metrics")
    wanted = list(keys) if keys else list(DEFAULT_KEYS)
    data = {k: series(rows, k) for k in wanted}
    data = {k: v for k, v in data.items() if v[0]}
    if not data:
        present = sorted({k for r in rows for k in r if k != "update"})
        raise PlotError(f"none of the keys {wanted} has values in {run_dir}; present: {present}")
    out = Path(out) if out else run_dir / "curves.png"
    if out.is_dir():
        raise PlotError(f"--out {out} is a directory; give the path of a .png file")
    parent = next((p for p in [out.parent, *out.parent.parents] if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise PlotError(f"--out {out}: {parent} is a file, not a directory")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(data)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False)
    for ax, (key, (xs, ys)) in zip(axes.flat, data.items(), strict=False):
        ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3, linewidth=1.2)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("update", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(run_dir.name, fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    from jaxloop.errors import run_entry_point

    def body() -> int:
        ap = _Parser(prog="python -m jaxloop.plot", description=__doc__.split("\n")[0])
        ap.add_argument("run_dir")
        ap.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
        ap.add_argument("--keys", default=None, help="comma-separated metric names")
        args = ap.parse_args(argv)
        keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else None
        print(plot_run(args.run_dir, args.out, keys))
        return 0

    return run_entry_point(body, extra=(PlotError,))


if __name__ == "__main__":
    sys.exit(main())
