"""Learning, not just running: algorithms x seeds x tasks, with and without an SFT warm start,
and beside peers (TRL) on the same learning problem.

    python scripts/learning_check.py [--algorithms ppo,grpo,dppo,flow_dppo] [--seeds 0,1,2]
        [--tasks reverse:3+warm,add:2+warm,reverse:2] [--updates N] [--warm-steps N]
        [--systems jaxloop[,trl][,tunix]] [--trl-python PY] [--tunix-python PY]
        [--out runs/learning_check] [--config.key=value ...]

A task is `NAME[:DIGITS][+warm]`: built-in task NAME with DIGITS digits (default 3), trained with
each algorithm's own settings from its config file; `+warm` keeps the config's warm start (SFT
until the validation reward reaches `warm_start.stop_at_reward`; `--warm-steps N`: exactly N
steps instead), without it the run starts from random init.
`default` is the config's own job (the README's default job). Per task only what the task needs
changes: `data.task`, `data.num_digits`, `rollout.max_new_tokens` (the longest answer plus one
for EOS), the `format` reward. Every other argument goes to `jaxloop.train` (after these: it wins).

Prints one table (eval reward before any training, after the warm start = at update 0, final,
the mean over the eval curve, the first update and the minutes of training at which greedy eval
reached --target) and one JSON line; every row has a `system`. Exit code 1 if a run fails or
misses --target, or (with peers) jaxloop's final < a peer's final - 0.05 or its curve mean < the
peer's.

Peers (`--systems jaxloop,trl`): for each GRPO (task, seed) scripts/peers/jaxloop_prep.py
exports, for the resolved jaxloop command line, the start model (`+warm`: the actor after
jaxloop's own warm start; otherwise the actor at init) as an HF fp32 checkpoint, the RL prompts in
order and the held-out eval prompts. jaxloop then trains from that checkpoint
(`--config.model.hf_dir=PREP/model`, warm start off) and TRL's GRPOTrainer
(scripts/peers/trl_learning.py, run with --trl-python) from the same weights: the update-0 evals
are equal and only RL is compared. Both are evaluated greedily on the same held-out prompts every
`eval_every` updates and at the end. `OUT/results.jsonl` gets each run as it ends, and
`OUT/curves-TASK.png` the curves of every system and seed of one task.

What maps from jaxloop's resolved config to GRPOConfig (trl_settings): n_samples_per_prompt ->
num_generations; updates_per_rollout -> steps_per_generation (jaxloop makes updates_per_rollout
optimizer steps per rollout batch, each on its part of the batch: so does TRL, num_iterations=1,
old log-probs from the generation batch in both; jaxloop's parts follow learner.step_split (the
recipe's interleaved: part of every group in every step; contiguous: whole groups), TRL shuffles the
generation batch before splitting it); prompts_per_update x n_samples_per_prompt
/ updates_per_rollout -> per_device_train_batch_size (gradient_accumulation_steps=1: the same
gradient as jaxloop's micro-batches); total_updates x updates_per_rollout -> max_steps; optim
lr / b1 / b2 / weight_decay / grad_clip / schedule (constant, constant with warm-up, cosine,
linear over the same steps) / warmup_steps; algo.entropy_coef -> entropy_coef (TRL: the coefficient
x the batch's mean per-token entropy; jaxloop: subtracted from each token's loss before the
reduction; equal where responses are equally long); algo.clip_eps / clip_eps_high -> epsilon /
epsilon_high; algo.kl_coef -> beta (both the k3 estimator); algo.grpo_use_std -> scale_rewards
group / none; algo.reduction seq_mean_token_mean -> loss_type grpo, token_mean -> bnpo; rollout
temperature / top_p / top_k / max_new_tokens; the `format` reward (the same arithmetic, of the
completion ids decoded as jaxloop decodes them: scripts/peers/trl_grpo.char_decoder); the
prompts and their order.
Refused (ValueError, exit 2) rather than dropped: an algorithm other than grpo for a peer (the
peers run the grpo rows only), rollout.dynamic_sampling_rounds != 0, algo.dual_clip, a KL
estimator other than k3 with kl_coef > 0, optim.name sgd, learner.pack_tokens.
Not mapped (they differ by construction): the random streams of sampling (torch vs JAX: the same
distribution, not the same samples), Adam's eps (both 1e-8 by default, not read), jaxloop's
staleness / engines (none in the default recipe), bf16 settings (both run fp32 here).
`--systems tunix` is accepted but refused (exit 2): no Tunix venv or learning runner here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxloop.data.tasks import MULTI_TOKEN_TASKS, BuiltinTask  # noqa: E402
from jaxloop.metrics import read_metrics  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning_peers import (  # noqa: E402
    DEFAULT_TRL_PYTHON,
    START_FROM_PREP,
    compare,
    curve_mean,
    end_gap,
    parse_systems,
    peer_python_error,
    plot_curves,
    prepare,
    print_comparison,
    run_timed,
    run_trl,
    trl_settings,
)


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


def run_tag(algorithm, task, warm, seed) -> str:
    return f"{algorithm}-{task.replace(':', '')}{'-warm' if warm else ''}-s{seed}"


def train_args(algorithm, task, warm, seed, args, extra) -> list[str]:
    """jaxloop.train's arguments of one run (all but run_dir)."""
    return [
        "--config",
        f"{algorithm}.py",
        f"--config.seed={seed}",
        "--config.progress=false",
        "--config.checkpoint_every=None",
        *task_overrides(task),
        *warm_overrides(task, warm, args.warm_steps),
        *([f"--config.total_updates={args.updates}"] if args.updates else []),
        *extra,
    ]


def run_one(algorithm, task, warm, seed, args, extra, start_from=None) -> dict:
    """One jaxloop run; `start_from`: a jaxloop_prep.py dir whose model/ it starts from, with
    the warm start off (the peers' start)."""
    run_dir = Path(args.out) / run_tag(algorithm, task, warm, seed)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "jaxloop.train",
        *train_args(algorithm, task, warm, seed, args, extra),
        f"--config.run_dir={run_dir}",
    ]
    if start_from is not None:
        cmd += [*START_FROM_PREP, f"--config.model.hf_dir={Path(start_from) / 'model'}"]
    row = {"system": "jaxloop", "algorithm": algorithm, "task": task, "warm": warm, "seed": seed}
    row["command"] = " ".join(["python", *cmd[1:]])
    if not run_timed(cmd, row):
        return row
    rows = read_metrics(run_dir)
    points = curve(rows)
    first = rows[0]
    reached = next(((u, m) for u, r, m in points if r >= args.target), None)
    if start_from is not None:  # the warm start ran in jaxloop_prep.py
        prep_warm = Path(start_from) / "warm_start.json"
        if prep_warm.exists():
            first = {**first, **json.loads(prep_warm.read_text())}
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
        curve_mean=curve_mean([[u, r] for u, r, _ in points]),
        end_gap=end_gap([[u, r] for u, r, _ in points]),
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
    ap.add_argument(
        "--systems", default="jaxloop", help="jaxloop[,trl][,tunix]: peers run the grpo rows"
    )
    ap.add_argument("--trl-python", default=DEFAULT_TRL_PYTHON, help="a python with TRL")
    ap.add_argument("--tunix-python", default=None, help="a python with Tunix")
    args, extra = ap.parse_known_args()
    try:
        systems = parse_systems(args.systems)
    except ValueError as err:
        print(f"error: --systems {args.systems}: {err}", file=sys.stderr)
        return 2
    peers = [s for s in systems if s != "jaxloop"]
    if peers and "grpo" not in args.algorithms.split(","):
        print(
            "error: --systems with a peer: the peers run GRPO, add grpo to --algorithms",
            file=sys.stderr,
        )
        return 2
    for peer in peers:
        why = peer_python_error(peer, getattr(args, f"{peer}_python"))
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 2
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
    if peers:  # refuse a config TRL cannot mirror before anything runs
        from jaxloop.config import parse_args

        try:
            trl_settings(parse_args(train_args("grpo", *tasks[0], seeds[0], args, extra)))
        except ValueError as err:
            print(f"error: --systems {args.systems}: {err}", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    log = open(out / "results.jsonl", "a")

    def record(r: dict) -> None:
        results.append(r)
        log.write(json.dumps(r) + "\n")
        log.flush()
        print(json.dumps({k: v for k, v in r.items() if k != "curve"}), file=sys.stderr)

    for task, warm in tasks:
        for algorithm in args.algorithms.split(","):
            for seed in seeds:
                if not (peers and algorithm == "grpo"):
                    record(run_one(algorithm, task, warm, seed, args, extra))
                    continue
                prep = out / f"prep-{run_tag(algorithm, task, warm, seed)}"
                base = {"algorithm": algorithm, "task": task, "warm": warm, "seed": seed}
                try:
                    prepare(prep, train_args(algorithm, task, warm, seed, args, extra), warm)
                except (RuntimeError, ValueError) as err:
                    for system in systems:
                        record({**base, "system": system, "ok": False, "error": [str(err)]})
                    continue
                # one system at a time: the machine is shared
                record(run_one(algorithm, task, warm, seed, args, extra, start_from=prep))
                if "trl" in peers:
                    record(run_trl(prep, args.trl_python, base))
    log.close()
    head = (
        f"{'system':<8} {'algorithm':<10} {'task':<12} {'seed':>4} {'before':>6} {'@0':>6} "
        f"{'final':>6} {'mean':>6} {'gap':>5} {'upd>=' + format(args.target, 'g'):>8} {'min>=':>6} "
        f"{'train min':>9}  pass"
    )
    print(head)
    all_ok = True
    for r in results:
        task = r["task"] + ("+warm" if r["warm"] else "")
        lead = f"{r['system']:<8} {r['algorithm']:<10} {task:<12} {r['seed']:>4}"
        if not r["ok"]:
            all_ok = False
            print(f"{lead} failed: {r['error']}")
            continue
        r["pass"] = (r["final"] or 0.0) >= args.target
        all_ok &= r["pass"] or r["system"] != "jaxloop"  # a peer missing --target is no failure
        print(
            f"{lead} {fmt(r['eval_before']):>6} "
            f"{fmt(r['eval_at_0']):>6} {fmt(r['final']):>6} {fmt(r['curve_mean']):>6} "
            f"{fmt(r.get('end_gap')):>5} "
            f"{fmt(r.get('updates_to_target'), 'd'):>8} {fmt(r.get('minutes_to_target')):>6} "
            f"{fmt(r.get('train_minutes')):>9}  {r['pass']}"
        )
    comparison = compare(results) if peers else []
    if comparison:
        print()
        print_comparison(comparison)
        all_ok &= all(c["ok"] and c["final_ok"] and c["mean_ok"] for c in comparison)
        for path in plot_curves(results, out):
            print(f"plot: {path}")
    passed = [r for r in results if r.get("pass") and r["system"] == "jaxloop"]
    summary = {
        "runs": len(results),
        "passed": len(passed),
        "median_minutes_to_target": statistics.median(
            [r["minutes_to_target"] for r in passed if r["minutes_to_target"] is not None] or [0.0]
        ),
    }
    if comparison:
        summary["comparison"] = comparison
    print(json.dumps({"learning_check": results, "summary": summary}))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
