"""End to end at the official shape: 2 updates of PPO, GRPO, DPPO and Flow-DPPO with the embedded
sampler, each algorithm in its own trainer process (configs/nanbeige_3b_<algorithm>.py).

    python scripts/e2e_official.py --config nanbeige-3b [--hf-dir DIR] [--out DIR]    # GPU
    python scripts/e2e_official.py --config nanbeige-3b --reduced                      # CPU

Reports, per algorithm and phase (generate, old log-probs, update, publish), the seconds of each
update and the device memory after it (peak over the run; GPU backends report it, CPU does not),
the process's peak host RSS, and the engine-vs-trainer selected log-prob difference, as a table
and one JSON line (last line of stdout). --reduced keeps every setting of the real-shape configs
(dtypes, remat, logits chunking, offloading, the sampler) but swaps the model for a tiny one and
shortens the responses: the CPU check of the same path (a test runs it). Without a GPU and
without --reduced the script refuses to start (the real shape needs an accelerator).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("ppo", "grpo", "dppo", "flow_dppo")
PHASES = ("generate", "old_logprobs", "update", "publish")
REDUCED = (
    "--config.model.preset=",
    "--config.model.hidden_size=64",
    "--config.model.intermediate_size=128",
    "--config.model.num_layers=2",
    "--config.model.num_heads=4",
    "--config.model.num_kv_heads=2",
    "--config.model.head_dim=32",
    "--config.model.logits_chunk=8",
    "--config.rollout.max_new_tokens=8",
    "--config.micro_batch_size=8",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="nanbeige-3b", choices=["nanbeige-3b"])
    p.add_argument("--hf-dir", default="", help="real weights (HF dir); default: random init")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--updates", type=int, default=2)
    p.add_argument("--reduced", action="store_true", help="tiny model, short responses (CPU)")
    p.add_argument("--out", default="", help="run dirs go here (default: a temporary dir)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per algorithm")
    return p.parse_args(argv)


def run_one(algorithm: str, args, out: Path) -> dict:
    run_dir = out / algorithm
    config = ROOT / "configs" / f"{args.config.replace('-', '_')}_{algorithm}.py"
    cmd = [
        sys.executable,
        "-m",
        "jaxloop.train",
        "--config",
        str(config),
        f"--config.run_dir={run_dir}",
        f"--config.total_updates={args.updates}",
        "--config.progress=false",
    ]
    if args.hf_dir:
        cmd.append(f"--config.model.hf_dir={args.hf_dir}")
    if args.reduced:
        cmd += list(REDUCED)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return {"algorithm": algorithm, "ok": False, "error": tail[0], "seconds": seconds}
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    result = {"algorithm": algorithm, "ok": True, "seconds": round(seconds, 1)}
    for phase in PHASES:
        result[f"{phase}_s"] = [round(r[f"time_{phase}"], 3) for r in rows]
    result["device_gb_after_generate"] = [r.get("device_gb_after_generate") for r in rows]
    result["device_gb_after_update"] = [r.get("device_gb_after_update") for r in rows]
    result["device_peak_gb"] = max((r.get("device_peak_gb") or 0.0) for r in rows) or None
    result["logprob_diff_max"] = max(r["logprob_diff_max"] for r in rows)
    result["tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in rows]
    # children's peak RSS so far (the largest of the trainer processes run until now)
    result["host_peak_rss_gb"] = round(
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2
    )
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = sorted(set(algorithms) - set(ALGORITHMS))
    if unknown:
        print(
            f"error: unknown algorithm(s) {unknown}; expected {list(ALGORITHMS)}", file=sys.stderr
        )
        return 2
    if not args.reduced:
        import jax

        if jax.default_backend() == "cpu":
            print(
                "error: the official shape needs an accelerator; use --reduced on CPU",
                file=sys.stderr,
            )
            return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="jaxloop-e2e-"))
    out.mkdir(parents=True, exist_ok=True)
    results = [run_one(a, args, out) for a in algorithms]
    shape = "reduced (tiny model)" if args.reduced else args.config
    print(f"e2e {shape}, {args.updates} updates each; seconds per update (first, second):")
    print(
        f"{'algorithm':<10} {'generate':>15} {'old_logprobs':>15} {'update':>15} {'publish':>15} "
        f"{'peak dev GB':>11} {'host GB':>8} {'lp diff':>9}"
    )
    for r in results:
        if not r["ok"]:
            print(f"{r['algorithm']:<10} FAILED: {r['error']}")
            continue
        cells = [", ".join(f"{x:.2f}" for x in r[f"{p}_s"]) for p in PHASES]
        peak = "n/a" if r["device_peak_gb"] is None else f"{r['device_peak_gb']:.1f}"
        print(
            f"{r['algorithm']:<10} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15} {cells[3]:>15} "
            f"{peak:>11} {r['host_peak_rss_gb']:>8.2f} {r['logprob_diff_max']:>9.2e}"
        )
    print(json.dumps({"config": args.config, "reduced": args.reduced, "results": results}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
