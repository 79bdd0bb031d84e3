"""Learning, not just running: each default config from random init, eval reward before vs after.

    python scripts/learning_check.py [--algorithms ppo,grpo,dppo,flow_dppo] [--updates N]
        [--out runs/learning_check] [--extra --config.key=value ...]

Prints a table and one JSON line. Exit code 1 if any run misses the bar (initial eval reward
<= 0.2 and final >= 0.8) or takes longer than --max-minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxloop.metrics import read_metrics  # noqa: E402


def run_one(algorithm: str, out: Path, updates: int | None, extra: list[str]) -> dict:
    run_dir = out / algorithm
    cmd = [
        sys.executable,
        "-m",
        "jaxloop.train",
        "--config",
        f"{algorithm}.py",
        f"--config.run_dir={run_dir}",
        "--config.progress=false",
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
            "ok": False,
            "minutes": minutes,
            "error": proc.stderr.strip().splitlines()[-1:],
        }
    rows = read_metrics(run_dir)
    evals = [r["eval_reward"] for r in rows if r.get("eval_reward") is not None]
    final = rows[-1].get("final_eval_reward")
    return {
        "algorithm": algorithm,
        "updates": len(rows),
        "initial_eval_reward": evals[0] if evals else None,
        "final_eval_reward": final,
        "best_eval_reward": max(evals + [final]) if evals and final is not None else None,
        "minutes": round(minutes, 2),
        "ok": True,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithms", default="ppo,grpo,dppo,flow_dppo")
    ap.add_argument("--updates", type=int, default=0, help="0: each config's default")
    ap.add_argument("--out", default="runs/learning_check")
    ap.add_argument("--max-minutes", type=float, default=10.0)
    ap.add_argument("--min-final", type=float, default=0.8)
    ap.add_argument("--max-initial", type=float, default=0.2)
    args, extra = ap.parse_known_args()
    out = Path(args.out)
    results = []
    for algorithm in args.algorithms.split(","):
        if (out / algorithm).exists():
            import shutil

            shutil.rmtree(out / algorithm)
        results.append(run_one(algorithm, out, args.updates or None, extra))
    print(f"{'algorithm':<10} {'updates':>7} {'eval@0':>7} {'final':>7} {'minutes':>8}  pass")
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
            print(
                f"{r['algorithm']:<10} {r['updates']:>7} {r['initial_eval_reward']:>7.3f} "
                f"{r['final_eval_reward']:>7.3f} {r['minutes']:>8.2f}  {passed}"
            )
        else:
            print(f"{r['algorithm']:<10} failed: {r['error']}")
    print(json.dumps({"learning_check": results}))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
