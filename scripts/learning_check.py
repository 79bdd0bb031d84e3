"""Learning, not just running: algorithms x seeds x tasks, with and without an SFT warm start.

    python scripts/learning_check.py [--algorithms ppo,grpo,dppo,flow_dppo] [--seeds 0,1,2]
        [--tasks reverse:3+warm,add:2+warm,reverse:2] [--updates N] [--warm-steps N]
        [--out runs/learning_check] [--config.key=value ...]

A task is `NAME[:DIGITS][+warm]`: built-in task NAME with DIGITS digits (default 3), trained with
each algorithm's own settings from its config file; `+warm` keeps the config's warm start (SFT
until the validation reward reaches `warm_start.stop_at_reward`; `--warm-steps N`: exactly N
steps instead), without it the run starts from random init.
`default` is the config's own job (the README's default job). Per task only what the task needs
changes: `data.task`, `data.num_digits`, `rollout.max_new_tokens` (the longest answer plus one
for EOS), the `format` reward. Every other argument goes to `jaxloop.train` (after these: it wins).

Prints one table (eval reward before any training, after the warm start = at update 0, final,
the first update and the minutes of training at which greedy eval reached --target) and one JSON
line. Exit code 1 if a run fails or misses --target.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxloop.data.tasks import MULTI_TOKEN_TASKS, BuiltinTask  # noqa: E402
from jaxloop.metrics import read_metrics  # noqa: E402


def parse_task(spec: str) -> tuple[str, bool]:
    """`NAME[:DIGITS][+warm]` -> (task spec, warm start)."""
    name, plus, warm = spec.partition("+")
    if plus and warm != "warm":
        raise ValueError(f"{spec!r}: the only suffix is +warm")
    return name, bool(plus)


def task_overrides(spec: str) -> list[str]:
    """`default` -> []; `NAME[:DIGITS]` -> the config overrides that train on that task."""
    if spec == "default":
        return []
    name, _, digits = spec.partition(":")
    task = BuiltinTask(name, int(digits or 3))  # ValueError on a bad name / digit count
    out = [
        f"--config.data.task={task.name}",
        f"--config.data.num_digits={task.num_digits}",
        f"--config.rollout.max_new_tokens={task.max_answer_tokens + 1}",
    ]
    if task.name in MULTI_TOKEN_TASKS:
        out.append("--config.data.reward=format")
    return out


def curve(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(update, eval reward, minutes of training so far) of every evaluation, the final one
    included. Minutes count the warm start and every update's time_total."""
    minutes = rows[0].get("warm_start_seconds", 0.0) / 60 if rows else 0.0
    out = []
    for row in rows:
        if row.get("eval_reward") is not None:
            out.append((int(row["update"]), float(row["eval_reward"]), minutes))
        minutes += row.get("time_total", 0.0) / 60
        if row.get("final_eval_reward") is not None:
            out.append((int(row["update"]) + 1, float(row["final_eval_reward"]), minutes))
    return out


def warm_overrides(task: str, warm: bool, warm_steps: int) -> list[str]:
    """+warm: the config's warm start (with --warm-steps N: exactly N steps, no early stop);
    without it none (the configs carry one); `default`: the config as it is."""
    if task == "default":
        return []
    if not warm:
        return ["--config.warm_start.sft_steps=0", "--config.warm_start.stop_at_reward=None"]
    if warm_steps:
        return [
            f"--config.warm_start.sft_steps={warm_steps}",
            "--config.warm_start.stop_at_reward=None",
        ]
    return []


def run_one(algorithm, task, warm, seed, args, extra) -> dict:
    tag = f"{algorithm}-{task.replace(':', '')}{'-warm' if warm else ''}-s{seed}"
    run_dir = Path(args.out) / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "jaxloop.train",
        "--config",
        f"{algorithm}.py",
        f"--config.run_dir={run_dir}",
        f"--config.seed={seed}",
        "--config.progress=false",
        "--config.checkpoint_every=None",
        *task_overrides(task),
        *warm_overrides(task, warm, args.warm_steps),
        *([f"--config.total_updates={args.updates}"] if args.updates else []),
        *extra,
    ]
    row = {"algorithm": algorithm, "task": task, "warm": warm, "seed": seed}
    row["command"] = " ".join(["python", *cmd[1:]])
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row["wall_minutes"] = round((time.perf_counter() - start) / 60, 2)
    if proc.returncode != 0:
        row.update(ok=False, error=proc.stderr.strip().splitlines()[-1:])
        return row
    rows = read_metrics(run_dir)
    points = curve(rows)
    first = rows[0]
    reached = next(((u, m) for u, r, m in points if r >= args.target), None)
    row.update(
        ok=True,
        updates=len(rows),
        eval_before=first.get("warm_start_eval_before", points[0][1] if points else None),
        eval_at_0=points[0][1] if points else None,
        final=points[-1][1] if points else None,
        updates_to_target=None if reached is None else reached[0],
        minutes_to_target=None if reached is None else round(reached[1], 2),
        train_minutes=round(points[-1][2], 2) if points else None,
        curve=[[u, round(r, 3)] for u, r, _ in points],
    )
    return row


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithms", default="ppo,grpo,dppo,flow_dppo")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--tasks", default="reverse:3+warm,add:2+warm,reverse:2")
    ap.add_argument("--updates", type=int, default=0, help="0: each config's total_updates")
    ap.add_argument(
        "--warm-steps",
        type=int,
        default=0,
        help="a +warm task's SFT steps, no early stop (0: the config's warm start)",
    )
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--out", default="runs/learning_check")
    args, extra = ap.parse_known_args()
    tasks = []
    for spec in args.tasks.split(","):
        try:
            name, warm = parse_task(spec)
            task_overrides(name)
        except ValueError as err:
            print(f"error: --tasks {spec}: {err}", file=sys.stderr)
            return 2
        tasks.append((name, warm))
    seeds = [int(s) for s in args.seeds.split(",")]
    results = []
    for task, warm in tasks:
        for algorithm in args.algorithms.split(","):
            for seed in seeds:
                r = run_one(algorithm, task, warm, seed, args, extra)
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "curve"}), file=sys.stderr)
    head = (
        f"{'algorithm':<10} {'task':<12} {'seed':>4} {'before':>6} {'@0':>6} {'final':>6} "
        f"{'upd>=' + format(args.target, 'g'):>8} {'min>=':>6} {'train min':>9}  pass"
    )
    print(head)
    all_ok = True
    for r in results:
        task = r["task"] + ("+warm" if r["warm"] else "")
        if not r["ok"]:
            all_ok = False
            print(f"{r['algorithm']:<10} {task:<12} {r['seed']:>4} failed: {r['error']}")
            continue
        r["pass"] = (r["final"] or 0.0) >= args.target
        all_ok &= r["pass"]
        print(
            f"{r['algorithm']:<10} {task:<12} {r['seed']:>4} {fmt(r['eval_before']):>6} "
            f"{fmt(r['eval_at_0']):>6} {fmt(r['final']):>6} "
            f"{fmt(r['updates_to_target'], 'd'):>8} {fmt(r['minutes_to_target']):>6} "
            f"{fmt(r['train_minutes']):>9}  {r['pass']}"
        )
    passed = [r for r in results if r.get("pass")]
    summary = {
        "runs": len(results),
        "passed": len(passed),
        "median_minutes_to_target": statistics.median(
            [r["minutes_to_target"] for r in passed if r["minutes_to_target"] is not None] or [0.0]
        ),
    }
    print(json.dumps({"learning_check": results, "summary": summary}))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
