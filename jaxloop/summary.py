"""What a training process prints when it ends: a short table of how the run went and where its
outputs are, after writing <run_dir>/curves.png (jaxloop.plot).
"""

from __future__ import annotations

import math
from pathlib import Path

from jaxloop.io.run_dir import checkpoint_steps, step_dir
from jaxloop.metrics import METRICS_FILE, TB_DIR, read_metrics

LAST_N = 10


def _values(rows: list[dict], key: str) -> list[float]:
    out = []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def summary_rows(
    rows: list[dict], start_update: int, wall_s: float, eval_key: str = "eval_reward"
) -> list[tuple[str, str]]:
    """(label, value) of the summary table. `rows`: every metrics row of the run dir (earlier
    processes included); "this process" = rows with update >= start_update. `eval_key`: the
    evaluation metric (jaxloop.sft: eval_accuracy)."""
    mine = [r for r in rows if r["update"] >= start_update]
    evals = [(r["update"], v) for r in rows for v in _values([r], eval_key)]
    finals = _values(rows[-1:], f"final_{eval_key}")
    final = finals[0] if finals else (evals[-1][1] if evals else None)
    best = max((v for _, v in evals), default=None)
    if finals:
        best = finals[0] if best is None else max(best, finals[0])
    recent = _values(rows[-LAST_N:], "reward_mean")
    speed = _values(mine, "tokens_per_s")
    restarts = _values(mine, "engine_restarts")  # a running count per process
    managers = _values(mine, "manager_restarts")  # the same (Ray rollouts only)
    skipped = _values(mine, "skipped_updates")  # the run's running count (0 when absent)
    first = mine[0]["update"] if mine else start_update
    last = mine[-1]["update"] + 1 if mine else start_update
    label = eval_key.replace("_", " ")
    warm = [
        (f"{name} ({key})", _fmt(rows[0].get(f"warm_start_{key}")))
        for name, key in (("warm start eval", "eval_before"), ("warm start eval", "eval_after"))
        if rows and rows[0].get(f"warm_start_{key}") is not None
    ]
    return [
        ("updates this process", f"{len(mine)} (updates {first} -> {last})"),
        *warm,
        (f"final {label}", _fmt(final)),
        (f"best {label}", _fmt(best)),
        (
            f"mean reward, last {min(LAST_N, len(rows))} updates",
            _fmt(sum(recent) / len(recent) if recent else None),
        ),
        ("tokens/s (mean per update)", _fmt(sum(speed) / len(speed) if speed else None, ".1f")),
        ("wall time", f"{wall_s:.1f} s"),
        ("engine restarts", f"{int(max(restarts, default=0))}"),
        ("skipped updates", f"{int(max(skipped, default=0))}"),
    ] + ([("manager restarts", f"{int(max(managers))}")] if managers else [])


def finish_report(
    run_dir: str | Path,
    start_update: int,
    wall_s: float,
    total: int,
    eval_key: str = "eval_reward",
    curves: bool = True,
) -> str:
    """Write curves.png (unless `curves` is False: the run's `curves` key) and return the summary
    table with the output paths."""
    from jaxloop.plot import PlotError, plot_run

    run_dir = Path(run_dir)
    try:
        rows = read_metrics(run_dir)
    except FileNotFoundError:
        rows = []
    try:
        curves = str(plot_run(run_dir)) if curves else "not written (curves=False)"
    except PlotError as err:
        curves = f"not written ({err})"
    except Exception as err:  # plotting must never fail a finished run
        curves = f"not written ({type(err).__name__}: {err})"
    steps = checkpoint_steps(run_dir)
    table = summary_rows(rows, start_update, wall_s, eval_key)
    table += [
        ("metrics", str(run_dir / METRICS_FILE)),
        ("tensorboard", str(run_dir / TB_DIR)),
        ("curves", curves),
        ("checkpoint", str(step_dir(run_dir, steps[-1])) if steps else "none"),
    ]
    done = rows[-1]["update"] + 1 if rows else start_update
    width = max(len(label) for label, _ in table)
    lines = [f"run summary: update {done} of {total}"]
    lines += [f"  {label:<{width}}  {value}" for label, value in table]
    return "\n".join(lines)
