"""Asynchronous rollouts: updates per minute and learning at rollout.max_staleness = 0 vs k.

    python scripts/bench_async.py [--staleness 0,1] [--repeats 3] [--updates 12]
        [--engine vllm|jax] [--num-engines 2] [--out runs/bench_async] [--config.key=value ...]

Each repeat trains every staleness once, interleaved (0, 1, 0, 1, ...), each a fresh
`python -m jaxloop.train` (default: GRPO on the 2-digit reverse task with the format reward,
through `--num-engines` vLLM engines on a local Ray cluster started by each run). Updates per
minute are 60 / the median `time_total` of the updates after the first two (start-up and
compilation excluded); the median over repeats is reported, with the engine and learner idle
fractions, the mean staleness, the learning curve (eval reward per update, the first repeat) and,
with `--config.rollout.publish=delta`, the bytes published over the run against full
publications. A table and one JSON line. Extra `--config.*` arguments go to every run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxloop.metrics import read_metrics  # noqa: E402

DEFAULTS = [
    "--config.data.task=reverse",
    "--config.data.num_digits=2",
    "--config.rollout.max_new_tokens=3",
    "--config.data.reward=format",
    "--config.optim.lr=2e-3",
    "--config.model.head_dim=32",  # the smallest head_dim the vLLM CPU attention serves
    "--config.eval_every=1",
    "--config.checkpoint_every=1000",
    "--config.progress=false",
]


def run(k: int, repeat: int, args, extra: list[str]) -> dict:
    run_dir = Path(args.out) / f"k{k}-r{repeat}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "jaxloop.train", "--config", f"{args.algorithm}.py"]
    cmd += [f"--config.run_dir={run_dir}", *DEFAULTS, f"--config.total_updates={args.updates}"]
    cmd += [f"--config.rollout.engine={args.engine}", f"--config.rollout.max_staleness={k}"]
    if args.engine == "vllm":
        cmd.append(f"--config.rollout.num_engines={args.num_engines}")
    proc = subprocess.run([*cmd, *extra], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"staleness {k}: training failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = read_metrics(run_dir)
    steady = rows[2:] or rows
    return {
        "updates_per_min": 60.0 / statistics.median(r["time_total"] for r in steady),
        "engine_idle": statistics.mean(r["engine_idle_fraction"] for r in steady),
        "learner_idle": statistics.mean(r["learner_idle_fraction"] for r in steady),
        "staleness_mean": statistics.mean(r["staleness_mean"] for r in rows),
        "eval_curve": [
            [r["update"], round(r["eval_reward"], 4)]
            for r in rows
            if r.get("eval_reward") is not None
        ],
        "final_eval_reward": rows[-1].get("final_eval_reward"),
        # rollout.publish=delta: the bytes sent over the run against full publications
        "publish_bytes": sum(r.get("publish_bytes") or 0.0 for r in rows),
        "publish_full_bytes": sum(r.get("publish_full_bytes") or 0.0 for r in rows),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staleness", default="0,1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--algorithm", default="grpo")
    parser.add_argument("--engine", choices=("vllm", "jax"), default="vllm")
    parser.add_argument("--num-engines", type=int, default=2)
    parser.add_argument("--out", default="runs/bench_async")
    args, extra = parser.parse_known_args(argv)
    ks = [int(x) for x in args.staleness.split(",")]
    results: dict[int, list[dict]] = {k: [] for k in ks}
    for repeat in range(args.repeats):
        for k in ks:
            results[k].append(run(k, repeat, args, extra))
            print(
                f"repeat {repeat} staleness {k}: {results[k][-1]['updates_per_min']:.2f} upd/min",
                file=sys.stderr,
            )
    table = {}
    for k in ks:
        rs = results[k]
        table[k] = {
            "updates_per_min": statistics.median(r["updates_per_min"] for r in rs),
            "engine_idle": statistics.median(r["engine_idle"] for r in rs),
            "learner_idle": statistics.median(r["learner_idle"] for r in rs),
            "staleness_mean": rs[0]["staleness_mean"],
            "final_eval_reward": [r["final_eval_reward"] for r in rs],
            "eval_curve": rs[0]["eval_curve"],
            "publish_bytes": rs[0]["publish_bytes"],
            "publish_full_bytes": rs[0]["publish_full_bytes"],
        }
    base = table[ks[0]]["updates_per_min"]
    print(
        f"{'staleness':>9} {'upd/min':>8} {'ratio':>6} {'engine idle':>11} {'learner idle':>12} "
        f"{'staleness':>9}  final eval (per repeat)"
    )
    for k in ks:
        t = table[k]
        finals = ", ".join(f"{x:.2f}" for x in t["final_eval_reward"] if x is not None)
        print(
            f"{k:>9} {t['updates_per_min']:>8.2f} {t['updates_per_min'] / base:>6.2f} "
            f"{t['engine_idle']:>11.2f} {t['learner_idle']:>12.2f} {t['staleness_mean']:>9.2f}"
            f"  {finals}"
        )
    for k in ks:
        print(f"eval curve k={k}: {table[k]['eval_curve']}")
        sent, full = table[k]["publish_bytes"], table[k]["publish_full_bytes"]
        if full:
            print(
                f"publication k={k}: {sent / 1e6:.2f} MB sent of {full / 1e6:.2f} MB full "
                f"({sent / full:.1%})"
            )
    summary = {
        "bench": "async",
        "engine": args.engine,
        "num_engines": args.num_engines if args.engine == "vllm" else 0,
        "algorithm": args.algorithm,
        "updates": args.updates,
        "repeats": args.repeats,
        **{f"k{k}": table[k] for k in ks},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
