"""Learning, not just running: each algorithm x task from random init, eval reward before vs after.

    python scripts/learning_check.py [--algorithms ppo,grpo,dppo,flow_dppo]
        [--tasks default,reverse:3,sort:3,add:1] [--updates N] [--out runs/learning_check]
        [--config.key=value ...]

`default` is each config's own task and settings (the README's default job); `NAME[:DIGITS]`
trains on built-in task NAME with DIGITS digits (default 3), rollout.max_new_tokens = the longest
answer (add --config.rollout.max_new_tokens=... for room for EOS) and, for the multi-token tasks,
the `format` reward and lr 2e-3 (the settings of the README's table). Every other argument goes
to `jaxloop.train` (after these, so it wins). After each run `jaxloop.evaluate --reward
exact_match` scores its final checkpoint (column `exact`: the fraction of exactly right greedy
answers).

Prints a table (algorithm x task: eval reward at update 0, final, exact, minutes) and one JSON
line. Exit code 1 if any run misses the bar (initial eval reward <= 0.2 and final >= 0.8) or
takes longer than --max-minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxloop.data.tasks import MULTI_TOKEN_TASKS, BuiltinTask  # noqa: E402
from jaxloop.metrics import read_metrics  # noqa: E402


def task_overrides(spec: str) -> list[str]:
    """`default` -> []; `NAME[:DIGITS]` -> the config overrides that train on that task."""
    if spec == "default":
        return []
    name, _, digits = spec.partition(":")
    task = BuiltinTask(name, int(digits or 3))  # ValueError on a bad name / digit count
    out = [
        f"--config.data.task={task.name}",
        f"--config.data.num_digits={task.num_digits}",
        f"--config.rollout.max_new_tokens={task.max_answer_tokens}",
    ]
    if task.name in MULTI_TOKEN_TASKS:
        out += ["--config.data.reward=format", "--config.optim.lr=2e-3"]
    return out


def exact_match(run_dir: Path) -> float | None:
    """Greedy exact-match reward of the run's final checkpoint (jaxloop.evaluate)."""
    cmd = [sys.executable, "-m", "jaxloop.evaluate", "--checkpoint", str(run_dir)]
    proc = subprocess.run([*cmd, "--reward", "exact_match"], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["greedy_reward"]


def run_one(algorithm: str, task: str, out: Path, updates: int | None, extra: list[str]) -> dict:
    run_dir = out / f"{algorithm}-{task.replace(':', '')}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cmd = [
        sys.executable,
        "-m",
        "jaxloop.train",
        "--config",
        f"{algorithm}.py",
        f"--config.run_dir={run_dir}",
        "--config.progress=false",
        *task_overrides(task),
        *extra,
    ]
    if updates:
        cmd.append(f"--config.total_updates={updates}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    minutes = (time.perf_counter() - start) / 60
    if proc.returncode != 0:
        return {
            "algorithm": algorithm,
            "task": task,
            "ok": False,
            "minutes": minutes,
            "error": proc.stderr.strip().splitlines()[-1:],
        }
    rows = read_metrics(run_dir)
    evals = [r["eval_reward"] for r in rows if r.get("eval_reward") is not None]
    final = rows[-1].get("final_eval_reward")
    return {
        "algorithm": algorithm,
        "task": task,
        "updates": len(rows),
        "initial_eval_reward": evals[0] if evals else None,
        "final_eval_reward": final,
        "best_eval_reward": max(evals + [final]) if evals and final is not None else None,
        "final_exact_match": exact_match(run_dir),
        "minutes": round(minutes, 2),
        "curve": [[r["update"], r["eval_reward"]] for r in rows if "eval_reward" in r]
        + [[len(rows), final]],
        "command": " ".join(["python", *cmd[1:]]),
        "ok": True,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithms", default="ppo,grpo,dppo,flow_dppo")
    ap.add_argument(
        "--tasks", default="default", help="comma list: default and/or NAME[:DIGITS] (e.g. sort:3)"
    )
    ap.add_argument("--updates", type=int, default=0, help="0: each config's default")
    ap.add_argument("--out", default="runs/learning_check")
    ap.add_argument("--max-minutes", type=float, default=10.0)
    ap.add_argument("--min-final", type=float, default=0.8)
    ap.add_argument("--max-initial", type=float, default=0.2)
    args, extra = ap.parse_known_args()
    out = Path(args.out)
    results = []
    tasks = args.tasks.split(",")
    for task in tasks:
        try:
            task_overrides(task)
        except ValueError as err:
            print(f"error: --tasks {task}: {err}", file=sys.stderr)
            return 2
    for task in tasks:
        for algorithm in args.algorithms.split(","):
            results.append(run_one(algorithm, task, out, args.updates or None, extra))
    print(
        f"{'algorithm':<10} {'task':<10} {'updates':>7} {'eval@0':>7} {'final':>7} {'exact':>7} "
        f"{'minutes':>8}  pass"
    )
    all_ok = True
    for r in results:
        passed = (
            r["ok"]
            and r["initial_eval_reward"] is not None
            and r["initial_eval_reward"] <= args.max_initial
            and (r["final_eval_reward"] or 0.0) >= args.min_final
            and r["minutes"] <= args.max_minutes
        )
        r["pass"] = bool(passed)
        all_ok &= passed
        if r["ok"]:
            exact = r["final_exact_match"]
            exact = "-" if exact is None else format(exact, ".3f")
            print(
                f"{r['algorithm']:<10} {r['task']:<10} {r['updates']:>7} "
                f"{r['initial_eval_reward']:>7.3f} {r['final_eval_reward']:>7.3f} "
                f"{exact:>7} {r['minutes']:>8.2f}  {passed}"
            )
        else:
            print(f"{r['algorithm']:<10} {r['task']:<10} failed: {r['error']}")
    print(json.dumps({"learning_check": results}))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
