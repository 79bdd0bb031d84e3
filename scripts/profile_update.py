"""Where one learner update's time goes: the bench_peers shape, one process, variants interleaved.

    python scripts/profile_update.py                       # model A and B, default settings
    python scripts/profile_update.py --models A --variant unrolled:model.scan_layers=false \\
        --variant mb16:micro_batch_size=16 --hlo-stats

Builds jaxloop's learner (`jaxloop.train.setup.TrainSetup`) for the benchmark's work (GRPO, 64
samples, one AdamW step per rollout, one micro-batch of 64, fp32, the bench_peers model shapes) and
a synthetic rollout batch of the benchmark's lengths (10-token prompts, responses of 1..32 tokens,
one of 32), then times, per variant and after a compile-and-warm-up round:

  old_logprobs   the separate forward (Learner.old_logprobs; what several steps per rollout run)
  update         Learner.update given those log-probs (forward + backward + AdamW)
  separate       old_logprobs + update (the path before fusing)
  fused          Learner.update_fused (one forward: the old log-probs come out of the step)
  metrics_host   metrics_to_host of the update's metrics

Run from a worktree of an older commit (copy this file into its scripts/) to measure the
learner as it was: phases it lacks read nan. `--hlo-stats` adds the compiled update's cost
analysis (GFLOP, bytes accessed) and its HLO's counts of while loops, fusions and copies. Rounds
interleave the variants; medians over --rounds. Prints a table and one JSON line. Never run
beside a test suite: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

# the checkout this script is in (a worktree of an older commit measures that commit)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_peers  # noqa: E402  (scripts/, stdlib only)

from jaxloop.config import parse_args, validate_mesh  # noqa: E402
from jaxloop.parallel import mesh as shd  # noqa: E402

try:
    from jaxloop.parallel.mesh import metrics_to_host  # noqa: E402
except ImportError:  # a checkout older than its move out of the learner
    from jaxloop.rl.learner import metrics_to_host  # noqa: E402
from jaxloop.rl.batch import RolloutBatch  # noqa: E402
from jaxloop.train.build import actor_config  # noqa: E402
from jaxloop.train.setup import TrainSetup  # noqa: E402

LEARNER_KEYS = (
    "micro_batch_size",
    "updates_per_rollout",
    "warm_start.sft_steps",
    "rollout.max_new_tokens",
    "algo.kl_coef",
    "optim.name",
    "optim.lr",
    "model.remat",
)
# the model shapes of scripts/bench_peers.py (one definition), and its learner settings
SHAPE = {
    **bench_peers.SHAPE,
    **{k: bench_peers.WORKLOAD[k] for k in LEARNER_KEYS},
}
MODELS = bench_peers.MODELS
PROMPT, SAMPLES, GROUP = 10, 64, 8
ROOT = Path(__file__).resolve().parent.parent
COMMIT = subprocess.run(
    ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
).stdout.strip()


def build(model: str, overrides: dict, algorithm: str):
    keys = {**SHAPE, **MODELS[model], **overrides}
    argv = ["--config", f"{algorithm}.py", "--config.run_dir=/tmp/profile_update_unused"]
    argv += [f"--config.{k}={v}" for k, v in keys.items()]
    cfg = parse_args(argv)
    model_cfg = actor_config(cfg)
    mesh = shd.make_mesh(**validate_mesh(cfg, jax.device_count(), model_cfg))
    training = TrainSetup(cfg, model_cfg, mesh)
    return cfg, training


def synthetic_batch(cfg, rng: np.random.Generator) -> RolloutBatch:
    """64 samples: 10-token prompts, responses of 1..max_new tokens (the first one the longest),
    random tokens, rewards in {0, 1} per group."""
    max_new, vocab = cfg.rollout.max_new_tokens, cfg.model.vocab_size
    lengths = rng.integers(1, max_new + 1, SAMPLES)
    lengths[0] = max_new
    prompts = [list(rng.integers(3, vocab, PROMPT)) for _ in range(SAMPLES)]
    responses = [list(rng.integers(3, vocab, n)) for n in lengths]
    logprobs = [list(-rng.random(n).astype(np.float32)) for n in lengths]
    scores = rng.integers(0, 2, SAMPLES).astype(np.float32)
    groups = np.arange(SAMPLES) // GROUP
    args = (prompts, responses, logprobs, scores, groups)
    if "seq_multiple" not in cfg.learner:  # a checkout before learner.seq_multiple (--before)
        return RolloutBatch.from_sequences(*args)
    return RolloutBatch.from_sequences(
        *args, seq_multiple=cfg.learner.seq_multiple, max_length=PROMPT + max_new
    )


def hlo_stats(learner, state, batch) -> dict:
    if hasattr(learner, "_update_fused"):
        lowered = learner._update_fused.lower(state, batch, False)
    else:  # a checkout before the fused update: the update given the old log-probs
        old = learner.old_logprobs(state, batch)
        lowered = learner._update.lower(state, batch.replace(old_logprobs=old), False)
    compiled = lowered.compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    return {
        "gflop": float(cost.get("flops", 0.0)) / 1e9,
        "gb_accessed": float(cost.get("bytes accessed", 0.0)) / 1e9,
        "while_loops": len(re.findall(r"\bwhile\(", text)),
        "fusions": len(re.findall(r"\bfusion\(", text)),
        "copies": len(re.findall(r"\bcopy\(", text)),
    }


class Variant:
    def __init__(self, label: str, model: str, overrides: dict, algorithm: str, seed: int):
        self.label, self.model = label, model
        self.cfg, self.training = build(model, overrides, algorithm)
        self.learner = self.training.learner
        self.state = self.training.fresh_state()
        host = synthetic_batch(self.cfg, np.random.default_rng(seed))
        self.positions = host.tokens.shape[1] - 1
        self.batch = self.learner.place_batch(host.train_batch())
        self.times: dict[str, list[float]] = {}

    def timed(self, name: str, fn):
        start = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        self.times.setdefault(name, []).append(time.perf_counter() - start)
        return out

    def round(self) -> None:
        learner = self.learner
        old = self.timed("old_logprobs", lambda: learner.old_logprobs(self.state, self.batch))
        self.state, metrics = self.timed(
            "update", lambda: learner.update(self.state, self.batch.replace(old_logprobs=old))
        )
        self.times.setdefault("separate", []).append(
            self.times["old_logprobs"][-1] + self.times["update"][-1]
        )
        self.timed("metrics_host", lambda: metrics_to_host(metrics))
        if not hasattr(learner, "update_fused"):  # a checkout before it
            self.times.setdefault("fused", []).append(float("nan"))
            return
        self.state, metrics, _ = self.timed(
            "fused", lambda: learner.update_fused(self.state, self.batch)
        )
        metrics_to_host(metrics)


def parse_variant(text: str) -> tuple[str, dict]:
    label, _, rest = text.partition(":")
    overrides = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return label, overrides


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="A,B")
    parser.add_argument("--algorithm", default="grpo", help="grpo | ppo | dppo | flow_dppo")
    parser.add_argument("--variant", action="append", default=[], help="LABEL:key=value,...")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hlo-stats", action="store_true")
    args = parser.parse_args(argv)
    specs = [("default", {})] + [parse_variant(v) for v in args.variant]
    variants = []
    for model in args.models.split(","):
        for label, overrides in specs:
            print(f"building {model}/{label}", file=sys.stderr)
            variants.append(Variant(label, model, overrides, args.algorithm, args.seed))
    for v in variants:  # compile + warm up
        v.round()
        v.times.clear()
    for r in range(args.rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            v.round()
    phases = ("old_logprobs", "update", "separate", "fused", "metrics_host")
    rows = []
    for v in variants:
        row = {"model": v.model, "variant": v.label, "positions": v.positions}
        row.update({p: statistics.median(v.times[p]) for p in phases})
        if args.hlo_stats:
            row.update(hlo_stats(v.learner, v.state, v.batch))
        row["commit"] = COMMIT
        rows.append(row)
    cols = ["model", "variant", "positions", *phases] + (
        ["gflop", "gb_accessed", "while_loops", "fusions", "copies"] if args.hlo_stats else []
    )
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = [f"{row[c]:.4f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        print("| " + " | ".join(cells) + " |")
    print(json.dumps({"profile_update": rows, "rounds": args.rounds, "jax": jax.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
