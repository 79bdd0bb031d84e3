"""jaxloop's GRPO update side by side with Tunix and TRL: seconds per update on the same work.

    python scripts/bench_peers.py       # the full benchmark: models A and B, jaxloop, tunix and
                                        # trl, 3 repeats x 14 updates (about 30 min, 2 cores)
    python scripts/bench_peers.py --models A --reps 1 --updates 4      # a quick check
    python scripts/bench_peers.py --models A --systems jaxloop,jaxloop:scan,tunix,trl \\
        --variant scan=--config.model.scan_layers=true                # two jaxloop settings
    python scripts/bench_peers.py --workload long      # reasoning-length responses (<= 256)
    python scripts/bench_peers.py --curve --workload long   # seconds vs tokens and vs prompts

Every jaxloop command line is checked first (`jaxloop.train --dry-run`): a key jaxloop does not
know stops the benchmark before anything runs.

One GRPO update = 8 prompts x 8 samples of jaxloop's `reverse` task (8 digits, ~10-token
prompts), up to 32 new tokens at temperature 1.0, the `format` reward, one micro-batch of 64 and
one AdamW step (lr 1e-3) per rollout, no KL / reference model, fp32, on a random-init
Llama-shaped decoder (hidden 256, MLP 512, 8/4 heads x 32, vocab 64). Model A: jaxloop 2 layers x
2 loops; model B: 4 layers x 1 loop; the peers always run 4 layers (the same FLOPs per token).
TRL's model is jaxloop's own function with its own initial weights (for A, a Llama whose layer
l + 2 shares layer l's parameters; scripts/peers/trl_grpo.py checks the logits); Tunix's is its
own Llama3 at random init. scripts/peers/*.py say what each peer job matches.

--workload long: the same, but up to 256 new tokens whose lengths spread as reasoning outputs do,
the same way for every system. The model is a random-init decoder with vocab 64 and nearly flat
logits, so at temperature 1 each system samples EOS (id 2, jaxloop's char tokenizer; TRL's
generation_config eos_token_id [2]; Tunix's tokenizer eos_id 2) with p ~ 1/64 per step from the
same weights (TRL) or the same init law (Tunix): lengths are geometric, mean ~60, median ~40,
about a fifth under 16 tokens, 1-3% reach 256. No weight is changed. Every system stops a row at
its EOS (jaxloop's sampler writes 0s after it and leaves its while loop when every row has
finished; TRL's generate pads after EOS and stops when all rows have) and the learners train only
up to the EOS. optim.lr 1e-5 keeps the policy's length distribution where it starts over the run,
so every system does the same work; the work table shows it (generated tokens, length min /
median / max, share at the cap, per system). jaxloop's levers for long ragged responses, on in the
jaxloop system: learner.pack_tokens (first-fit-decreasing into rows of 384 tokens at 128 and 256
new tokens, of 16 + max_new_tokens below: see LONG_PACK_TOKENS; data.max_prompt_tokens 16) and
the sampler's early stop (always on). Off: model.logits_chunk (the [rows, seq, 64] logits are
small at vocab 64: chunks only add passes), rollout.early_exit (the built-in model has no exit
gate).

--curve: seconds per update at max_new_tokens 32 / 64 / 128 / 256 (8 prompts) and at 8 / 16 / 32
prompts (32 tokens), every system, one interleaved run (each point's systems in the rotated
order): a table with the growth factor per doubling (each point's median whole update / the
previous point's), WORK/results_curve.png (seconds vs setting, one line per system, log-2 x) and
both in the JSON line ("curve"). The workload (--workload) sets everything else; every update's
samples are one micro-batch at every point (micro_batch_size = prompts x 8).

The limit: scripts/bench_matmul.py before and after the runs, a [2048, 2048] fp32 product
(--matmul-n) in jaxloop's python (jnp.dot, XLA's own threads) and, when TRL runs, in TRL's
(torch.matmul, --trl-threads threads), median of 5, 2 n^3 / t; the limit is the best of them.
Each system's achieved model FLOP/s is that of its learner phase (old log-probs + update):
forward + backward FLOPs of the REAL tokens it trained (prompt + response up to and including
EOS; padding and packing slack count as waste) / the phase's seconds, counted the same way for
all (train_flops): 6 N per token, N = the matrix parameters a token passes through (4 layer
applications of q/k/v/o and the SwiGLU MLP, a looped layer once per loop, and the LM head; the
embedding lookup not), plus attention 12 x 4 x seq x (heads x head_dim) per token with seq the
mean sample length of the update. The work table gives GFLOP/s and the fraction of the limit.

Systems (--systems, comma list; interleaved in an order rotated by the repeat):
  jaxloop        python -m jaxloop.train --config grpo.py + the workload (+ --jaxloop-arg ...)
  jaxloop:LABEL  the same + the --variant LABEL=... arguments (two jaxloop settings in one run)
  tunix          google-tunix GRPOLearner (its venv: --tunix-python)
  tunix_pl16     the same with prompts left-padded to 16 (jaxloop's prefill bucket)
  trl            TRL GRPOTrainer, torch 2 threads, OpenMP's default settings (--trl-python)
  trl_passive    the same with OMP_WAIT_POLICY=PASSIVE (better on a loaded machine)

Every run is a fresh process of --updates updates; the first --drop are dropped (compilation,
allocation); medians are over the kept updates of all repeats. Phases per update:
  generate      jaxloop time_generate (sampler, detokenize, rewards, groups); TRL
                _generate_and_score_completions; Tunix _generate_and_compute_advantage
  old_logprobs  jaxloop time_old_logprobs: 0 here (one optimizer step per rollout: the update's
                own forward gives them), a separate forward with several steps; the peers
                skip it (none)
  update        jaxloop time_update (loss forward + backward + clip + AdamW, metrics to host);
                TRL the step minus generate; Tunix update_actor + block_until_ready
  learner       old_logprobs + update (what each system's learner spends per update)
  total         jaxloop time_total; TRL on_step_begin -> on_step_end; Tunix one global step
Ratios are jaxloop / peer (< 1: jaxloop faster), from the same run only; compare them on a quiet
machine, never seconds across runs. Prints the phase table, the ratios, the work table (tokens,
lengths, s per 1000 generated tokens, learner GFLOP/s, fraction of the limit), with --curve the
curve tables, then one JSON line (the last line of stdout) with every median, ratio, the work,
the matmul rates and the curve; progress goes to stderr; --out gets everything.

Only the standard library is used here: each system runs in its own python (the peers' venvs
are not project dependencies).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "scripts" / "peers"

SHAPE = {
    "model.hidden_size": 256,
    "model.intermediate_size": 512,
    "model.num_heads": 8,
    "model.num_kv_heads": 4,
    "model.head_dim": 32,
    "model.vocab_size": 64,
}
MODELS = {
    "A": {"model.num_layers": 2, "model.num_loops": 2},  # 4 layer applications per token
    "B": {"model.num_layers": 4, "model.num_loops": 1},
}
PEER_LAYERS = 4
# grpo.py carries the learning recipe (3 digits, SFT warm start, 2 optimizer steps per rollout):
# every key of the benchmark is set here, defaults that matter for the match included
WORKLOAD = {
    "seed": 0,
    "prompts_per_update": 8,
    "n_samples_per_prompt": 8,
    "micro_batch_size": 64,
    "updates_per_rollout": 1,
    "warm_start.sft_steps": 0,
    "warm_start.stop_at_reward": None,  # grpo.py's recipe sets it; refused without a warm start
    "rollout.max_new_tokens": 32,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "rollout.top_k": None,
    "data.task": "reverse",
    "data.num_digits": 8,
    "data.reward": "format",
    "algo.kl_coef": 0.0,
    "algo.clip_eps": 0.2,
    "algo.reduction": "seq_mean_token_mean",
    "optim.name": "adamw",
    "optim.lr": 0.001,
    "optim.schedule": "constant",
    "optim.warmup_steps": 0,
    "optim.b1": 0.9,
    "optim.b2": 0.99,
    "optim.weight_decay": 0.0,
    "optim.grad_clip": 1.0,
    "model.remat": "none",
    "model.scan_layers": "false",  # the default: layers and loops unrolled
    "learner.seq_multiple": 16,  # the default: rows capped at prompt + max_new_tokens
    "eval_every": None,  # None: one evaluation after the last update, outside its timings
    "eval_prompts": 8,  # (that evaluation: only the process wall time sees it)
    "checkpoint_every": None,  # None: one checkpoint after the last update, outside its timings
    "progress": "false",
}
# --workload long: reasoning-length responses. The benchmark model is a random-init decoder with
# vocab 64 whose logits are nearly flat, so at temperature 1 every system samples EOS with p ~ 1/64
# per step from the same weights (TRL) or the same init law (Tunix): lengths come out geometric,
# mean ~60, ~22% under 16 tokens and ~2% reaching the 256 cap. A small learning rate keeps that
# distribution where it starts over the run, so every system does the same work.
LONG_KEYS = {
    "rollout.max_new_tokens": 256,
    "optim.lr": 1e-5,
    "data.max_prompt_tokens": 16,  # the prompts are 10 tokens; sizes the packed rows below
}
# learner.pack_tokens of the long workload from LONG_PACK_FROM new tokens on: at least the prompt
# limit + max_new_tokens (the least jaxloop accepts) and at least LONG_PACK_TOKENS; below, the
# least. The packer's row count is bucketed by doubling (one compile per bucket), so the row size
# is chosen to keep one bucket. Geometric lengths (p 1/64) of 200 simulated updates of 64 rows:
# at 256 new tokens (~4,700 real tokens) rows of 272 need 16 or 32 rows (21% / 79%: a recompile
# at each flip, 7,800 tokens computed on average), rows of 384 16 every time (6,144, 76% real); at
# 128 rows of 144 need 32 or 64, 384 16 always; at 32 / 64 rows of 48 / 80 need 64 always (the
# padded learner's 3,072 / 5,120 tokens; longer rows only add attention)
LONG_PACK_TOKENS, LONG_PACK_FROM = 384, 128
WORKLOADS = ("short", "long")
CURVE_TOKENS = (32, 64, 128, 256)  # at CURVE_PROMPTS[0] prompts
CURVE_PROMPTS = (8, 16, 32)  # at the workload's max_new_tokens
PEER_SYSTEMS = ("tunix", "tunix_pl16", "trl", "trl_passive")
DEFAULT_SYSTEMS = "jaxloop,tunix,trl"
PHASES = ("generate", "old_logprobs", "update", "learner", "total")
PHASE_TITLES = {
    "generate": "generate",
    "old_logprobs": "old log-probs",
    "update": "update",
    "learner": "old log-probs + update",
    "total": "whole update",
}


# ---- arguments ----
def kind(system: str) -> str:
    """'jaxloop', 'tunix' or 'trl'."""
    if system == "jaxloop" or system.startswith("jaxloop:"):
        return "jaxloop"
    return "tunix" if system.startswith("tunix") else "trl"


def split_args(text: str) -> list[str]:
    """'--config.a=b,--config.c=1,2' -> ['--config.a=b', '--config.c=1,2'] (a comma splits only
    before the next '--', so values may hold commas)."""
    return [x for x in re.split(r",(?=--)", text.strip()) if x]


def config_overrides(args: list[str]) -> dict[str, str]:
    """['--config.a=b', ...] -> {'a': 'b', ...}; anything else is refused."""
    out = {}
    for arg in args:
        m = re.fullmatch(r"--config\.([A-Za-z0-9_.]+)=(.*)", arg, flags=re.S)
        if not m:
            raise ValueError(f"{arg!r}: jaxloop arguments here are --config.KEY=VALUE")
        out[m.group(1)] = m.group(2)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring (scripts/bench_peers.py) for what is matched and timed.",
    )
    ap.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help=f"comma list of jaxloop, jaxloop:LABEL, {', '.join(PEER_SYSTEMS)} "
        f"(default {DEFAULT_SYSTEMS})",
    )
    ap.add_argument("--models", default="A,B", help="A (jaxloop 2 layers x 2 loops), B (4 x 1)")
    ap.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="short",
        help="short: up to 32 new tokens (today's shapes); long: up to 256, lengths spread "
        "geometrically from a few tokens to the cap (see the module docstring)",
    )
    ap.add_argument(
        "--curve",
        action="store_true",
        help=f"the cost curve: max_new_tokens {'/'.join(map(str, CURVE_TOKENS))} at "
        f"{CURVE_PROMPTS[0]} prompts and {'/'.join(map(str, CURVE_PROMPTS))} prompts at "
        f"{CURVE_TOKENS[0]} tokens, every system, one interleaved run (table, png, growth)",
    )
    ap.add_argument("--matmul-n", type=int, default=2048, help="size of the matmul limit probe")
    ap.add_argument("--reps", type=int, default=3, help="repeats (each runs every system once)")
    ap.add_argument("--updates", type=int, default=14, help="updates per run")
    ap.add_argument("--drop", type=int, default=2, help="first updates of each run left out")
    ap.add_argument("--jaxloop-python", default=sys.executable)
    ap.add_argument(
        "--trl-python", default=os.environ.get("TRL_PYTHON", "/work/peers/trl-venv/bin/python")
    )
    ap.add_argument(
        "--tunix-python",
        default=os.environ.get("TUNIX_PYTHON", "/work/peers/tunix-venv/bin/python"),
    )
    ap.add_argument(
        "--jaxloop-arg",
        action="append",
        default=[],
        metavar="--config.KEY=VALUE",
        help="added to every jaxloop run (repeatable; a comma list before '--' also works)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=--config.a=b,--config.c=d",
        help="defines system jaxloop:LABEL (repeatable)",
    )
    ap.add_argument("--trl-threads", type=int, default=2, help="torch threads, OMP_NUM_THREADS")
    ap.add_argument(
        "--jax-platforms",
        default="cpu",
        help="JAX_PLATFORMS for jaxloop and Tunix ('' leaves the environment's)",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument(
        "--work", default=None, help="scratch dir (default runs/bench_peers/<time>, gitignored)"
    )
    ap.add_argument("--out", default=None, help="results JSON (default WORK/results.json)")
    ap.add_argument(
        "--print-commands",
        action="store_true",
        help="print the schedule and each run's command, run nothing",
    )
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser()
    a = ap.parse_args(argv)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    variants: dict[str, list[str]] = {}
    for spec in a.variant:
        label, sep, rest = spec.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", label):
            ap.error(f"--variant {spec!r}: LABEL=--config.a=b,--config.c=d")
        try:
            config_overrides(split_args(rest))
        except ValueError as err:
            ap.error(f"--variant {label}: {err}")
        variants[label] = split_args(rest)
    a.variants = variants
    extra = [x for arg in a.jaxloop_arg for x in split_args(arg)]
    try:
        config_overrides(extra)
    except ValueError as err:
        ap.error(f"--jaxloop-arg: {err}")
    a.jaxloop_extra = extra
    if not a.systems:
        ap.error("--systems is empty")
    if len(set(a.systems)) != len(a.systems):
        ap.error(f"--systems {','.join(a.systems)}: a system is named twice")
    for s in a.systems:
        if s.startswith("jaxloop:"):
            if s[len("jaxloop:") :] not in variants:
                ap.error(f"system {s}: no --variant {s[len('jaxloop:') :]}=...")
        elif s != "jaxloop" and s not in PEER_SYSTEMS:
            ap.error(f"unknown system {s!r} (jaxloop, jaxloop:LABEL, {', '.join(PEER_SYSTEMS)})")
    for m in a.models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r} (A, B)")
    if not a.models:
        ap.error("--models is empty")
    if a.reps < 1 or a.updates < 1 or a.drop < 0 or a.drop >= a.updates:
        ap.error("need --reps >= 1 and 0 <= --drop < --updates")
    if a.matmul_n < 1:
        ap.error("need --matmul-n >= 1")
    fixed = {"rollout.max_new_tokens", "prompts_per_update"} if a.curve else set()
    for label, args in [
        ("--jaxloop-arg", extra),
        *(("--variant " + k, v) for k, v in variants.items()),
    ]:
        clash = fixed & set(config_overrides(args))
        if clash:  # the curve sets them per point: an override would silently replace the point
            ap.error(f"{label}: {', '.join(sorted(clash))} is set by --curve per point")
    a.settings = curve_points() if a.curve else [default_setting(a.workload)]
    return a


# ---- the settings, the schedule and the command lines ----
Setting = tuple[int, int]  # (max_new_tokens, prompts per update)


def default_setting(workload: str) -> Setting:
    keys = {**WORKLOAD, **(LONG_KEYS if workload == "long" else {})}
    return int(keys["rollout.max_new_tokens"]), int(keys["prompts_per_update"])


def curve_points() -> list[Setting]:
    """The cost curve's settings: the token axis at the first prompt count, then the prompt axis
    at the first token count (their shared point once)."""
    points = [(t, CURVE_PROMPTS[0]) for t in CURVE_TOKENS]
    points += [(CURVE_TOKENS[0], p) for p in CURVE_PROMPTS]
    return list(dict.fromkeys(points))


def setting_keys(workload: str, setting: Setting | None = None) -> dict[str, object]:
    """The workload's jaxloop keys at one setting (default: the workload's own). All samples of
    an update are one micro-batch, as in the peers; the long workload packs the learner's rows
    (learner.pack_tokens: see LONG_PACK_TOKENS)."""
    tokens, prompts = setting or default_setting(workload)
    keys: dict[str, object] = {**WORKLOAD, **(LONG_KEYS if workload == "long" else {})}
    keys["rollout.max_new_tokens"] = tokens
    keys["prompts_per_update"] = prompts
    keys["micro_batch_size"] = prompts * int(keys["n_samples_per_prompt"])
    if workload == "long":
        least = int(keys["data.max_prompt_tokens"]) + tokens
        keys["learner.pack_tokens"] = (
            max(least, LONG_PACK_TOKENS) if tokens >= LONG_PACK_FROM else least
        )
    return keys


def setting_label(setting: Setting) -> str:
    return f"t{setting[0]}p{setting[1]}"


def group_label(model: str, setting: Setting, curve: bool) -> str:
    """What the tables' first column names: the model, and with --curve the setting too."""
    return f"{model} {setting_label(setting)}" if curve else model


def schedule(
    reps: int, models: list[str], systems: list[str], settings: list[Setting] | None = None
) -> list[tuple[int, str, Setting | None, str]]:
    """(rep, model, setting, system) in run order: per repeat, model and setting every system
    once, the order rotated by the repeat, so no system always runs first (or right after
    another one)."""
    out = []
    for rep in range(reps):
        k = rep % len(systems)
        for model in models:
            for setting in settings or [None]:
                out += [(rep, model, setting, s) for s in systems[k:] + systems[:k]]
    return out


def jaxloop_config(
    model: str,
    updates: int,
    extra: list[str],
    workload: str = "short",
    setting: Setting | None = None,
) -> dict[str, object]:
    keys: dict[str, object] = {**SHAPE, **MODELS[model], **setting_keys(workload, setting)}
    keys["total_updates"] = updates
    keys.update(config_overrides(extra))  # later wins; no key twice on the command line
    return keys


def jaxloop_train_args(
    model: str,
    updates: int,
    extra: list[str],
    run_dir: str,
    workload: str = "short",
    setting: Setting | None = None,
) -> list[str]:
    keys = {**jaxloop_config(model, updates, extra, workload, setting), "run_dir": run_dir}
    return ["--config", "grpo.py"] + [f"--config.{k}={v}" for k, v in keys.items()]


def system_extra(a: argparse.Namespace, system: str) -> list[str]:
    """The jaxloop arguments a jaxloop system adds to the workload."""
    label = system.partition(":")[2]
    return a.jaxloop_extra + (a.variants[label] if label else [])


def system_env(system: str, trl_threads: int, jax_platforms: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "KMP_"))}
    env["PYTHONUNBUFFERED"] = "1"
    if kind(system) == "trl":
        env["OMP_NUM_THREADS"] = str(trl_threads)
        if system == "trl_passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif jax_platforms:
        env["JAX_PLATFORMS"] = jax_platforms
    return env


def prep_dir_of(work: Path, model: str, setting: Setting) -> Path:
    """The prep (weights, prompts) a peer run reads: one per model and prompt count."""
    return work / "prep" / f"{model}_p{setting[1]}"


def run_command(
    a, system: str, model: str, setting: Setting, run_dir: Path, prep_dir: Path
) -> tuple[list, Path]:
    """(command, cwd) of one run; its per-update output goes under run_dir."""
    w = {**SHAPE, **setting_keys(a.workload, setting)}
    if kind(system) == "jaxloop":
        cmd = [a.jaxloop_python, "-m", "jaxloop.train"]
        extra = system_extra(a, system)
        cmd += jaxloop_train_args(model, a.updates, extra, str(run_dir), a.workload, setting)
        return cmd, ROOT
    if kind(system) == "trl":
        cmd = [a.trl_python, str(PEERS / "trl_grpo.py"), "--prep", str(prep_dir)]
        cmd += ["--out", str(run_dir / "steps.json"), "--steps", str(a.updates)]
        cmd += ["--threads", str(a.trl_threads)]
        cmd += ["--max-new-tokens", str(w["rollout.max_new_tokens"])]
        cmd += ["--prompts-per-step", str(w["prompts_per_update"])]
        cmd += ["--group", str(w["n_samples_per_prompt"]), "--lr", str(w["optim.lr"])]
        return cmd, run_dir
    prompt_len = 16 if system == "tunix_pl16" else prompt_tokens(prep_dir)
    cmd = [
        a.tunix_python,
        str(PEERS / "tunix_grpo.py"),
        "--prompts",
        str(prep_dir / "prompts.jsonl"),
    ]
    cmd += ["--out", str(run_dir / "metrics.jsonl"), "--updates", str(a.updates)]
    cmd += ["--prompts-per-update", str(w["prompts_per_update"])]
    cmd += ["--samples-per-prompt", str(w["n_samples_per_prompt"])]
    cmd += ["--max-new-tokens", str(w["rollout.max_new_tokens"])]
    cmd += ["--max-prompt-length", str(prompt_len), "--num-layers", str(PEER_LAYERS)]
    cmd += ["--hidden-size", str(w["model.hidden_size"])]
    cmd += ["--intermediate-size", str(w["model.intermediate_size"])]
    cmd += [
        "--num-heads",
        str(w["model.num_heads"]),
        "--num-kv-heads",
        str(w["model.num_kv_heads"]),
    ]
    cmd += ["--head-dim", str(w["model.head_dim"]), "--vocab-size", str(w["model.vocab_size"])]
    cmd += ["--lr", str(w["optim.lr"]), "--reward", str(w["data.reward"])]
    return cmd, run_dir


def prompt_tokens(prep_dir: Path) -> int:
    """The longest prompt in jaxloop's token ids (BOS included): Tunix's max_prompt_length."""
    path = prep_dir / "prompts.json"
    if not path.exists():  # --print-commands before any prep
        return 10
    return max(len(p["ids"]) for p in json.loads(path.read_text()))


# ---- per-update records, one schema for the three systems ----
# the length statistics of a record (EOS included) and jaxloop's metric of each
LENGTHS = ("len_min", "len_median", "len_max", "at_cap", "prompt_tokens")
JAXLOOP_LENGTHS = dict(
    zip(
        LENGTHS,
        (
            "response_length_min",
            "response_length_median",
            "response_length_max",
            "response_at_cap",
            "prompt_tokens",
        ),
        strict=True,
    )
)


def records_jaxloop(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        old = r["time_old_logprobs"]
        out.append(
            {
                "index": int(r["update"]),
                "generate": r["time_generate"],
                "old_logprobs": old,
                "update": r["time_update"],
                "learner": old + r["time_update"],
                "total": r["time_total"],
                "tokens": r.get("response_tokens", r["response_length"] * r["num_samples"]),
                **{k: r.get(v) for k, v in JAXLOOP_LENGTHS.items()},
            }
        )
    return out


def records_trl(steps: list[dict]) -> list[dict]:
    return [
        {
            "index": int(s["step"]),
            "generate": s["rollout_s"],  # generate + decode + rewards + advantages
            "old_logprobs": None,  # num_iterations=1: the loss forward's log-probs, detached
            "update": s["update_s"],
            "learner": s["update_s"],
            "total": s["step_s"],
            "tokens": s.get("completion_tokens"),
            "engine": s.get("generate_s"),  # the model.generate call alone
            **{k: s.get(k) for k in LENGTHS},
        }
        for s in steps
    ]


def records_tunix(rows: list[dict]) -> list[dict]:
    return [
        {
            "index": int(r["update"]),
            "generate": r["time_gen_and_adv"],  # generate + rewards + advantages
            "old_logprobs": None,  # num_iterations=1: stop_gradient of the current log-probs
            "update": r["time_update"],
            "learner": r["time_update"],
            "total": r["time_total"],
            "tokens": r.get("generated_tokens"),  # EOS included
            "engine": r.get("time_generate"),  # RLCluster.generate alone
            **{k: r.get(k) for k in LENGTHS},  # prompt_tokens: add_prompt_tokens
        }
        for r in rows
        if not r.get("summary")
    ]


def add_prompt_tokens(records: list[dict], prep_dir: Path, prompts: int, samples: int) -> None:
    """Tunix reports no prompt tokens: its update u trains jaxloop's prompts u * prompts.. (the
    same strings; their token ids from the prep) x samples each."""
    path = prep_dir / "prompts.json"
    if not path.exists():
        return
    ids = [len(p["ids"]) for p in json.loads(path.read_text())]
    for r in records:
        if r.get("prompt_tokens") is None:
            i = r["index"] * prompts
            r["prompt_tokens"] = samples * sum(ids[i : i + prompts])


# ---- work and FLOPs, counted the same way for every system ----
def layer_params(shape: dict) -> int:
    """Matrix parameters of one decoder layer: q, k, v, o projections and the SwiGLU MLP."""
    h, m, d = shape["model.hidden_size"], shape["model.intermediate_size"], shape["model.head_dim"]
    q, kv = shape["model.num_heads"] * d, shape["model.num_kv_heads"] * d
    return 2 * h * q + 2 * h * kv + 3 * h * m


def train_flops(shape: dict, layers_applied: int, tokens: float, rows: int) -> float:
    """Forward + backward FLOPs of one update that trains `tokens` real tokens in `rows` samples:
    6 N per token, N = the non-embedding matrix parameters a token passes through (every layer
    application, a looped layer once per loop, and the LM head), plus the attention scores and
    values 12 x layers_applied x seq x (heads x head_dim) per token, seq = the mean sample length
    tokens / rows (a lower bound of the per-sample sum; no causal halving). Padding is not
    counted: it is waste."""
    n = (
        layers_applied * layer_params(shape)
        + shape["model.hidden_size"] * shape["model.vocab_size"]
    )
    d_attn = shape["model.num_heads"] * shape["model.head_dim"]
    return 6.0 * n * tokens + 12.0 * layers_applied * d_attn * tokens * (tokens / max(rows, 1))


def add_work(records: list[dict], model: str, setting: Setting) -> None:
    """Per record: real tokens trained (prompt + response, EOS included), their FLOPs, the
    achieved FLOP/s of the learner phase and the seconds per 1000 generated tokens."""
    layers = MODELS[model]["model.num_layers"] * MODELS[model]["model.num_loops"]
    rows = setting[1] * int(WORKLOAD["n_samples_per_prompt"])
    for r in records:
        if r.get("tokens") and r.get("prompt_tokens") is not None:
            r["real_tokens"] = r["prompt_tokens"] + r["tokens"]
            r["flops"] = train_flops(SHAPE, layers, r["real_tokens"], rows)
            r["flop_per_s"] = r["flops"] / r["learner"] if r.get("learner") else None
        if r.get("tokens") and r.get("total"):
            r["s_per_1k_tokens"] = 1000.0 * r["total"] / r["tokens"]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_records(system: str, run_dir: Path) -> tuple[list[dict], dict]:
    """(records, meta) of a finished run."""
    if kind(system) == "jaxloop":
        return records_jaxloop(read_jsonl(run_dir / "metrics.jsonl")), {}
    if kind(system) == "trl":
        path = run_dir / "steps.json"
        data = json.loads(path.read_text()) if path.exists() else {"steps": []}
        return records_trl(data["steps"]), {k: v for k, v in data.items() if k != "steps"}
    rows = read_jsonl(run_dir / "metrics.jsonl")
    meta = next((r for r in rows if r.get("summary")), {})
    return records_tunix(rows), meta


# ---- aggregation ----
def stats(values: list[float]) -> dict | None:
    if not values:
        return None
    v = sorted(values)
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) >= 2 else [v[0]] * 3
    return {"median": statistics.median(v), "p25": q[0], "p75": q[2], "n": len(v)}


STAT_KEYS = ("tokens", "engine", *LENGTHS, "real_tokens", "flop_per_s", "s_per_1k_tokens")


def aggregate(runs: list[dict], drop: int) -> dict:
    """{group: {system: {phase: stats, ...}}} over the kept updates (index >= drop) of every run
    that finished (rc 0), pooled over the repeats; a run's group is its model (with --curve the
    model and the setting: run["group"])."""
    out: dict[str, dict] = {}
    for r in runs:
        out.setdefault(r.get("group", r["model"]), {}).setdefault(r["system"], [])
    for model, systems in out.items():
        for system in systems:
            rs = [r for r in runs if (r.get("group", r["model"]), r["system"]) == (model, system)]
            ok = [r for r in rs if r["rc"] == 0]
            kept = [u for r in ok for u in r["records"] if u["index"] >= drop]
            s: dict = {}
            for key in (*PHASES, *STAT_KEYS):
                s[key] = stats([u[key] for u in kept if u.get(key) is not None])
            s["run_medians_total"] = [
                statistics.median(u["total"] for u in r["records"] if u["index"] >= drop)
                for r in ok
                if any(u["index"] >= drop for u in r["records"])
            ]
            s["process_wall_s"] = [round(r["wall_s"], 1) for r in ok]
            s["runs_ok"], s["runs_failed"] = len(ok), len(rs) - len(ok)
            systems[system] = s
    return out


def median_of(summary: dict, model: str, system: str, phase: str) -> float | None:
    st = summary.get(model, {}).get(system, {}).get(phase)
    return st["median"] if st else None


def ratios(summary: dict) -> dict:
    """{model: {'J/P': {phase: median_J / median_P}}} for every jaxloop system J against every
    peer P, and every jaxloop:LABEL against jaxloop; a phase only where both have it."""
    out: dict[str, dict] = {}
    for model, systems in summary.items():
        names = list(systems)
        jax_systems = [s for s in names if kind(s) == "jaxloop"]
        pairs = [(j, p) for j in jax_systems for p in names if kind(p) != "jaxloop"]
        if "jaxloop" in names:
            pairs += [(j, "jaxloop") for j in jax_systems if j != "jaxloop"]
        for j, p in pairs:
            row = {}
            for phase in PHASES:
                num, den = median_of(summary, model, j, phase), median_of(summary, model, p, phase)
                if num is not None and den:
                    row[phase] = num / den
            out.setdefault(model, {})[f"{j}/{p}"] = row
    return out


def medians(summary: dict) -> dict:
    return {
        model: {
            system: {phase: median_of(summary, model, system, phase) for phase in PHASES}
            for system in systems
        }
        for model, systems in summary.items()
    }


def _r(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def json_line(summary: dict, ratio: dict, extra: dict) -> str:
    """The one-line result: every median (seconds) and ratio, plus `extra` (settings, load)."""
    med = {
        m: {s: {p: _r(v, 4) for p, v in ph.items()} for s, ph in ss.items()}
        for m, ss in medians(summary).items()
    }
    rat = {
        m: {k: {p: _r(v, 3) for p, v in ph.items()} for k, ph in rr.items()}
        for m, rr in ratio.items()
    }
    failed = {
        f"{m}/{s}": st["runs_failed"]
        for m, ss in summary.items()
        for s, st in ss.items()
        if st["runs_failed"]
    }
    return json.dumps(
        {"bench": "bench_peers", **extra, "medians": med, "ratios": rat, "failed_runs": failed},
        sort_keys=False,
    )


def _fmt(st: dict | None, digits: int = 3, spread: bool = False) -> str:
    if not st:
        return "-"
    text = f"{st['median']:.{digits}f}"
    if spread:
        text += f" ({st['p25']:.{digits}f}-{st['p75']:.{digits}f})"
    return text


def markdown(summary: dict, ratio: dict) -> str:
    lines = [
        "| model | system | generate s | old log-probs s | update s | old log-probs + update s "
        "| whole update s (p25-p75) | tokens/update | kept updates | runs ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, systems in summary.items():
        for system, st in systems.items():
            ok = f"{st['runs_ok']}/{st['runs_ok'] + st['runs_failed']}"
            n = st["total"]["n"] if st["total"] else 0
            cells = [_fmt(st[p]) for p in PHASES[:-1]] + [_fmt(st["total"], spread=True)]
            tokens = _fmt(st["tokens"], 0)
            lines.append(f"| {model} | {system} | {' | '.join(cells)} | {tokens} | {n} | {ok} |")
    if any(ratio.values()):
        lines += [
            "",
            "| model | ratio (< 1: the first faster) | generate | old log-probs | update "
            "| old log-probs + update | whole update |",
            "|---|---|---|---|---|---|---|",
        ]
        for model, rows in ratio.items():
            for name, row in rows.items():
                cells = [f"{row[p]:.2f}" if p in row else "-" for p in PHASES]
                lines.append(f"| {model} | {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def work_markdown(summary: dict, limit_flop_per_s: float | None) -> str:
    """The work each system did per update (generated tokens, the length spread, the share at
    the cap: equal work is the premise of the ratios), its seconds per 1000 generated tokens, and
    the learner phase's achieved model FLOP/s against the matmul limit."""
    limit = f"{limit_flop_per_s / 1e9:.0f} GFLOP/s" if limit_flop_per_s else "not measured"
    lines = [
        "| model | system | generated tokens/update | length min / median / max | at cap "
        "| s per 1000 generated tokens | real tokens trained/update | learner GFLOP/s "
        f"| of the limit ({limit}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for group, systems in summary.items():
        for system, st in systems.items():
            spread = " / ".join(_fmt(st.get(k), 0) for k in ("len_min", "len_median", "len_max"))
            at_cap = f"{st['at_cap']['median']:.1%}" if st.get("at_cap") else "-"
            flops = st.get("flop_per_s")
            gflops = f"{flops['median'] / 1e9:.1f}" if flops else "-"
            share = (
                f"{flops['median'] / limit_flop_per_s:.1%}" if flops and limit_flop_per_s else "-"
            )
            cells = [
                _fmt(st.get("tokens"), 0),
                spread,
                at_cap,
                _fmt(st.get("s_per_1k_tokens")),
                _fmt(st.get("real_tokens"), 0),
                gflops,
                share,
            ]
            lines.append(f"| {group} | {system} | {' | '.join(cells)} |")
    return "\n".join(lines)


def work_json(summary: dict, limit_flop_per_s: float | None) -> dict:
    """{group: {system: medians of the work keys, and the share of the limit}} for the JSON
    line."""
    keys = ("tokens", "len_min", "len_median", "len_max", "at_cap", "s_per_1k_tokens")
    out: dict = {}
    for group, systems in summary.items():
        for system, st in systems.items():
            row = {k: _r(st[k]["median"], 4) if st.get(k) else None for k in keys}
            flops = st.get("flop_per_s")
            row["learner_gflop_per_s"] = _r(flops["median"] / 1e9, 2) if flops else None
            share = flops["median"] / limit_flop_per_s if flops and limit_flop_per_s else None
            row["of_limit"] = _r(share, 4)
            out.setdefault(group, {})[system] = row
    return out


# ---- the cost curve ----
def growth_factors(values: list[float | None]) -> list[float | None]:
    """Ratios of consecutive points (each point doubles the last): how the cost grows per
    doubling; None where either point is missing."""
    return [b / a if a and b is not None else None for a, b in itertools.pairwise(values)]


def curve_data(summary: dict, models: list[str], systems: list[str]) -> dict:
    """{model: {system: {axis: {"x": [...], "seconds": [...], "growth": [...]}}}} of the median
    whole update, axis "tokens" (max_new_tokens at CURVE_PROMPTS[0] prompts) and "prompts" (at
    CURVE_TOKENS[0] tokens)."""
    axes = {
        "tokens": [(t, CURVE_PROMPTS[0]) for t in CURVE_TOKENS],
        "prompts": [(CURVE_TOKENS[0], p) for p in CURVE_PROMPTS],
    }
    out: dict = {}
    for model in models:
        for system in systems:
            for axis, points in axes.items():
                seconds = [
                    median_of(summary, group_label(model, pt, True), system, "total")
                    for pt in points
                ]
                x = [pt[0] if axis == "tokens" else pt[1] for pt in points]
                row = {"x": x, "seconds": seconds, "growth": growth_factors(seconds)}
                out.setdefault(model, {}).setdefault(system, {})[axis] = row
    return out


def curve_markdown(curve: dict) -> str:
    """Seconds per whole update at each point, the growth factor over the previous point after
    it (x2.0: the cost doubled with the setting)."""
    lines = []
    for axis, title in (("tokens", "max_new_tokens"), ("prompts", "prompts per update")):
        models = list(curve)
        if not models:
            break
        xs = next(iter(curve[models[0]].values()))[axis]["x"]
        fixed = f"{CURVE_PROMPTS[0]} prompts" if axis == "tokens" else f"{CURVE_TOKENS[0]} tokens"
        lines += [
            "",
            f"| model | system | {' | '.join(f'{title} {x}' for x in xs)} ({fixed}) |",
            "|---|---|" + "---|" * len(xs),
        ]
        for model, systems in curve.items():
            for system, axes in systems.items():
                row = axes[axis]
                cells = []
                for i, sec in enumerate(row["seconds"]):
                    cell = "-" if sec is None else f"{sec:.3f} s"
                    if i and row["growth"][i - 1] is not None:
                        cell += f" (x{row['growth'][i - 1]:.2f})"
                    cells.append(cell)
                lines.append(f"| {model} | {system} | {' | '.join(cells)} |")
    return "\n".join(lines).strip()


def plot_curve(curve: dict, path: Path) -> bool:
    """Seconds per update against each axis (log-2 x), one line per system, one row of plots per
    model. False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(curve)
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.6 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        for col, (axis, title) in enumerate(
            (("tokens", "max_new_tokens"), ("prompts", "prompts per update"))
        ):
            ax = axes[row][col]
            for system, data in curve[model].items():
                pts = [
                    (x, y) for x, y in zip(data[axis]["x"], data[axis]["seconds"], strict=True) if y
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=system)
            ax.set_xscale("log", base=2)
            xs = next(iter(curve[model].values()))[axis]["x"]
            ax.set_xticks(xs, [str(x) for x in xs])  # 32, 64, ... rather than 2^5, 2^6
            ax.minorticks_off()
            ax.set_xlabel(title)
            ax.set_ylabel("seconds per update")
            ax.set_title(f"model {model}")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- the limit: the machine's matmul rate ----
def measure_matmul(a, label: str) -> dict:
    """scripts/bench_matmul.py in jaxloop's python (jnp.dot) and, when a TRL system runs, in
    TRL's (torch.matmul, --trl-threads threads): {backend: its JSON line or an error}."""
    jobs = [("jax", a.jaxloop_python, system_env("jaxloop", a.trl_threads, a.jax_platforms))]
    if any(kind(s) == "trl" for s in a.systems):
        jobs.append(("torch", a.trl_python, system_env("trl", a.trl_threads, a.jax_platforms)))
    out = {}
    for backend, python, env in jobs:
        cmd = [python, str(ROOT / "scripts" / "bench_matmul.py"), "--backend", backend]
        cmd += ["--n", str(a.matmul_n), "--threads", str(a.trl_threads)]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        lines = p.stdout.strip().splitlines()
        out[backend] = (
            json.loads(lines[-1])
            if p.returncode == 0 and lines
            else {"error": (p.stderr.strip().splitlines() or ["(no output)"])[-1]}
        )
        if "gflop_per_s" in out[backend]:
            log(f"matmul {label} {backend}: {out[backend]['gflop_per_s']:.1f} GFLOP/s")
    return out


def matmul_limit(measurements: list[dict]) -> float | None:
    """The machine's limit in FLOP/s: the best median rate of any backend at any measurement."""
    rates = [m["gflop_per_s"] for ms in measurements for m in ms.values() if "gflop_per_s" in m]
    return max(rates) * 1e9 if rates else None


# ---- running ----
def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tail(path: Path, n: int = 5) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return " | ".join(x.strip() for x in lines[-n:] if x.strip())


def run_process(cmd: list, cwd: Path, env: dict, log_path: Path, timeout: float) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = loadavg()
    t = time.perf_counter()
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = 124
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "rc": rc,
        "wall_s": time.perf_counter() - t,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "load_before": load0,
        "load_after": loadavg(),
        "log": str(log_path),
    }


def preflight(a, work: Path) -> dict:
    """Peer pythons exist; jaxloop accepts every jaxloop command line (--dry-run); the prep
    (jaxloop's initial weights, prompts, tokenizer) per model and prompt count when a peer runs.
    Returns {(model, prompts): prep_dir}."""
    kinds = {kind(s) for s in a.systems}
    for k, py in (("trl", a.trl_python), ("tunix", a.tunix_python)):
        if k in kinds and not (Path(py).is_file() and os.access(py, os.X_OK)):
            raise SystemExit(
                f"bench_peers: {k}: no python at {py} (--{k}-python / {k.upper()}_PYTHON)"
            )
    env = system_env("jaxloop", a.trl_threads, a.jax_platforms)
    for system in [s for s in a.systems if kind(s) == "jaxloop"]:
        for model in a.models:
            for setting in a.settings:
                extra = system_extra(a, system)
                args = jaxloop_train_args(
                    model, a.updates, extra, str(work / "dry_run"), a.workload, setting
                )
                cmd = [a.jaxloop_python, "-m", "jaxloop.train", *args, "--dry-run"]
                p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                if p.returncode != 0:
                    last = ((p.stderr or p.stdout).strip().splitlines() or ["(no output)"])[-1]
                    raise SystemExit(
                        f"bench_peers: {system} model {model} {setting_label(setting)}: "
                        f"jaxloop refuses: {last}"
                    )
    preps = {}
    if kinds - {"jaxloop"}:
        for model in a.models:
            for setting in a.settings:
                out = prep_dir_of(work, model, setting)
                if out in preps.values():  # one prep per prompt count
                    continue
                args = jaxloop_train_args(
                    model, a.updates, a.jaxloop_extra, str(work / "dry_run"), a.workload, setting
                )
                cmd = [a.jaxloop_python, str(PEERS / "jaxloop_prep.py"), str(out)]
                cmd += ["--updates", str(a.updates), "--", *args]
                log(f"prep model {model}: jaxloop's initial weights and prompts -> {out}")
                p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                if p.returncode != 0:
                    raise SystemExit(
                        f"bench_peers: prep {model} failed: {p.stderr.strip()[-2000:]}"
                    )
                preps[(model, setting[1])] = out
    return preps


def jaxloop_commit() -> str | None:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def run_name(rep: int, model: str, setting: Setting, system: str, curve: bool) -> str:
    tag = f"_{setting_label(setting)}" if curve else ""
    return f"r{rep}_{model}{tag}_{system.replace(':', '_')}"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    work = Path(a.work or ROOT / "runs" / "bench_peers" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out_path = Path(a.out) if a.out else work / "results.json"
    order = schedule(a.reps, a.models, a.systems, a.settings)
    if a.print_commands:
        for rep, model, setting, system in order:
            run_dir = work / "runs" / run_name(rep, model, setting, system, a.curve)
            prep = prep_dir_of(work, model, setting)
            cmd, cwd = run_command(a, system, model, setting, run_dir, prep)
            print(f"# rep {rep} model {model} {setting_label(setting)} {system} (cwd {cwd})")
            print(" ".join(cmd))
        return 0
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    load_start = loadavg()
    preps = preflight(a, work)
    matmul = [measure_matmul(a, "before")]
    result: dict = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv if argv is None else argv,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "jaxloop_commit": jaxloop_commit(),
        "settings": {
            "systems": a.systems,
            "models": {m: {**SHAPE, **MODELS[m]} for m in a.models},
            "peer_layers": PEER_LAYERS,
            "reps": a.reps,
            "updates": a.updates,
            "drop": a.drop,
            "workload_name": a.workload,
            "workload": setting_keys(a.workload),
            "curve": a.curve,
            "points": a.settings,
            "jaxloop_args": a.jaxloop_extra,
            "variants": a.variants,
            "trl_threads": a.trl_threads,
            "jax_platforms": a.jax_platforms,
            "pythons": {"jaxloop": a.jaxloop_python, "trl": a.trl_python, "tunix": a.tunix_python},
        },
        "load_start": load_start,
        "matmul": matmul,
        "runs": [],
    }
    samples = int(WORKLOAD["n_samples_per_prompt"])
    for i, (rep, model, setting, system) in enumerate(order):
        run_dir = work / "runs" / run_name(rep, model, setting, system, a.curve)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        if kind(system) != "jaxloop":
            run_dir.mkdir(parents=True)
        prep = preps.get((model, setting[1]), prep_dir_of(work, model, setting))
        cmd, cwd = run_command(a, system, model, setting, run_dir, prep)
        env = system_env(system, a.trl_threads, a.jax_platforms)
        group = group_label(model, setting, a.curve)
        log(f"run {i + 1}/{len(order)}: rep {rep} {group} {system}, load {loadavg()}")
        log_path = work / "logs" / f"{run_dir.name}.log"
        info = run_process(cmd, cwd, env, log_path, a.timeout)
        records, meta = read_records(system, run_dir)
        if kind(system) == "tunix":
            add_prompt_tokens(records, prep, setting[1], samples)
        add_work(records, model, setting)
        if info["rc"] == 0 and len(records) < a.updates:
            info["rc"] = -1  # finished without every update's timings
        info.update(rep=rep, model=model, setting=list(setting), group=group, system=system)
        info.update(cmd=cmd, records=records, meta=meta)
        if info["rc"] != 0:
            info["error"] = tail(log_path)
            log(f"  FAILED rc {info['rc']}: {info['error'][-600:]}")
        else:
            kept = [u for u in records if u["index"] >= a.drop]
            med = statistics.median(u["total"] for u in kept)
            lens = [u.get(k) for u in kept[-1:] for k in ("len_min", "len_median", "len_max")]
            log(
                f"  wall {info['wall_s']:.1f} s, median whole update {med:.3f} s, last kept "
                f"update's lengths min/median/max {lens}, tokens {kept[-1].get('tokens')}"
            )
        result["runs"].append(info)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1))  # partial results survive a stop
    matmul.append(measure_matmul(a, "after"))
    limit = matmul_limit(matmul)
    load_end = loadavg()
    summary = aggregate(result["runs"], a.drop)
    ratio = ratios(summary)
    result.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), load_end=load_end)
    result.update(summary=summary, ratios=ratio, matmul_limit_flop_per_s=limit)
    extra = {
        "workload": a.workload,
        "reps": a.reps,
        "updates": a.updates,
        "drop": a.drop,
        "load_before": load_start,
        "load_after": load_end,
        "jaxloop_commit": result["jaxloop_commit"],
        "results": str(out_path),
        "matmul_gflop_per_s": {
            k: [m[k].get("gflop_per_s") for m in matmul if k in m] for k in matmul[0]
        },
        "work": work_json(summary, limit),
    }
    if a.curve:
        curve = curve_data(summary, a.models, a.systems)
        result["curve"] = extra["curve"] = curve
        png = out_path.with_name(out_path.stem + "_curve.png")
        extra["curve_png"] = str(png) if plot_curve(curve, png) else None
    out_path.write_text(json.dumps(result, indent=1))
    print(
        f"workload {a.workload}, reps {a.reps}, {a.updates} updates per run, first {a.drop} "
        f"dropped; load {load_start} -> {load_end}; {out_path}\n"
    )
    print(markdown(summary, ratio))
    print()
    print(work_markdown(summary, limit))
    print()
    if a.curve:
        print(curve_markdown(result["curve"]))
        print(f"\n{extra['curve_png'] or '(no png: matplotlib missing)'}\n")
    print(json_line(summary, ratio, extra), flush=True)
    return 0 if all(r["rc"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
