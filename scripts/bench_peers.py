"""jaxloop's GRPO update side by side with Tunix and TRL: seconds per update on the same work.

    python scripts/bench_peers.py       # the full benchmark: models A and B, jaxloop, tunix and
                                        # trl, 3 repeats x 14 updates (about 30 min, 2 cores)
    python scripts/bench_peers.py --models A --reps 1 --updates 4      # a quick check
    python scripts/bench_peers.py --models A --systems jaxloop,jaxloop:scan,tunix,trl \\
        --variant scan=--config.model.scan_layers=true                # two jaxloop settings

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
machine, never seconds across runs. Prints a markdown table, then one JSON line (the last line
of stdout) with every median and ratio; progress goes to stderr; --out gets everything.

Only the standard library is used here: each system runs in its own python (the peers' venvs
are not project dependencies).
"""

from __future__ import annotations

import argparse
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
    return a


# ---- the schedule and the command lines ----
def schedule(reps: int, models: list[str], systems: list[str]) -> list[tuple[int, str, str]]:
    """(rep, model, system) in run order: per repeat and model every system once, the order
    rotated by the repeat, so no system always runs first (or right after another one)."""
    out = []
    for rep in range(reps):
        k = rep % len(systems)
        for model in models:
            out += [(rep, model, s) for s in systems[k:] + systems[:k]]
    return out


def jaxloop_config(model: str, updates: int, extra: list[str]) -> dict[str, object]:
    keys: dict[str, object] = {**SHAPE, **MODELS[model], **WORKLOAD, "total_updates": updates}
    keys.update(config_overrides(extra))  # later wins; no key twice on the command line
    return keys


def jaxloop_train_args(model: str, updates: int, extra: list[str], run_dir: str) -> list[str]:
    keys = {**jaxloop_config(model, updates, extra), "run_dir": run_dir}
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


def run_command(a, system: str, model: str, run_dir: Path, prep_dir: Path) -> tuple[list, Path]:
    """(command, cwd) of one run; its per-update output goes under run_dir."""
    if kind(system) == "jaxloop":
        cmd = [a.jaxloop_python, "-m", "jaxloop.train"]
        cmd += jaxloop_train_args(model, a.updates, system_extra(a, system), str(run_dir))
        return cmd, ROOT
    if kind(system) == "trl":
        cmd = [a.trl_python, str(PEERS / "trl_grpo.py"), "--prep", str(prep_dir)]
        cmd += ["--out", str(run_dir / "steps.json"), "--steps", str(a.updates)]
        cmd += ["--threads", str(a.trl_threads)]
        return cmd, run_dir
    prompt_len = 16 if system == "tunix_pl16" else prompt_tokens(prep_dir)
    w = {**SHAPE, **WORKLOAD}
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
                "tokens": r["response_length"] * r["num_samples"],  # EOS included
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
        }
        for r in rows
        if not r.get("summary")
    ]


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


def aggregate(runs: list[dict], drop: int) -> dict:
    """{model: {system: {phase: stats, ...}}} over the kept updates (index >= drop) of every run
    that finished (rc 0), pooled over the repeats."""
    out: dict[str, dict] = {}
    for r in runs:
        out.setdefault(r["model"], {}).setdefault(r["system"], [])
    for model, systems in out.items():
        for system in systems:
            rs = [r for r in runs if (r["model"], r["system"]) == (model, system)]
            ok = [r for r in rs if r["rc"] == 0]
            kept = [u for r in ok for u in r["records"] if u["index"] >= drop]
            s: dict = {}
            for key in (*PHASES, "tokens", "engine"):
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
    (jaxloop's initial weights, prompts, tokenizer) per model when a peer runs. Returns
    {model: prep_dir}."""
    kinds = {kind(s) for s in a.systems}
    for k, py in (("trl", a.trl_python), ("tunix", a.tunix_python)):
        if k in kinds and not (Path(py).is_file() and os.access(py, os.X_OK)):
            raise SystemExit(
                f"bench_peers: {k}: no python at {py} (--{k}-python / {k.upper()}_PYTHON)"
            )
    env = system_env("jaxloop", a.trl_threads, a.jax_platforms)
    for system in [s for s in a.systems if kind(s) == "jaxloop"]:
        for model in a.models:
            args = jaxloop_train_args(
                model, a.updates, system_extra(a, system), str(work / "dry_run")
            )
            cmd = [a.jaxloop_python, "-m", "jaxloop.train", *args, "--dry-run"]
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                last = ((p.stderr or p.stdout).strip().splitlines() or ["(no output)"])[-1]
                raise SystemExit(f"bench_peers: {system} model {model}: jaxloop refuses: {last}")
    preps = {}
    if kinds - {"jaxloop"}:
        for model in a.models:
            out = work / "prep" / model
            args = jaxloop_train_args(model, a.updates, a.jaxloop_extra, str(work / "dry_run"))
            cmd = [a.jaxloop_python, str(PEERS / "jaxloop_prep.py"), str(out)]
            cmd += ["--updates", str(a.updates), "--", *args]
            log(f"prep model {model}: jaxloop's initial weights and prompts -> {out}")
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"bench_peers: prep {model} failed: {p.stderr.strip()[-2000:]}")
            preps[model] = out
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


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    work = Path(a.work or ROOT / "runs" / "bench_peers" / time.strftime("%Y%m%d-%H%M%S"))
    out_path = Path(a.out) if a.out else work / "results.json"
    order = schedule(a.reps, a.models, a.systems)
    if a.print_commands:
        for rep, model, system in order:
            run_dir = work / "runs" / f"r{rep}_{model}_{system.replace(':', '_')}"
            cmd, cwd = run_command(a, system, model, run_dir, work / "prep" / model)
            print(f"# rep {rep} model {model} {system} (cwd {cwd})")
            print(" ".join(cmd))
        return 0
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    load_start = loadavg()
    preps = preflight(a, work)
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
            "workload": WORKLOAD,
            "jaxloop_args": a.jaxloop_extra,
            "variants": a.variants,
            "trl_threads": a.trl_threads,
            "jax_platforms": a.jax_platforms,
            "pythons": {"jaxloop": a.jaxloop_python, "trl": a.trl_python, "tunix": a.tunix_python},
        },
        "load_start": load_start,
        "runs": [],
    }
    for i, (rep, model, system) in enumerate(order):
        run_dir = work / "runs" / f"r{rep}_{model}_{system.replace(':', '_')}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        if kind(system) != "jaxloop":
            run_dir.mkdir(parents=True)
        cmd, cwd = run_command(a, system, model, run_dir, preps.get(model, work / "prep" / model))
        env = system_env(system, a.trl_threads, a.jax_platforms)
        log(f"run {i + 1}/{len(order)}: rep {rep} model {model} {system}, load {loadavg()}")
        log_path = work / "logs" / f"{run_dir.name}.log"
        info = run_process(cmd, cwd, env, log_path, a.timeout)
        records, meta = read_records(system, run_dir)
        if info["rc"] == 0 and len(records) < a.updates:
            info["rc"] = -1  # finished without every update's timings
        info.update(rep=rep, model=model, system=system, cmd=cmd, records=records, meta=meta)
        if info["rc"] != 0:
            info["error"] = tail(log_path)
            log(f"  FAILED rc {info['rc']}: {info['error'][-600:]}")
        else:
            kept = [u["total"] for u in records if u["index"] >= a.drop]
            med = statistics.median(kept)
            log(f"  wall {info['wall_s']:.1f} s, median whole update {med:.3f} s")
        result["runs"].append(info)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1))  # partial results survive a stop
    load_end = loadavg()
    summary = aggregate(result["runs"], a.drop)
    ratio = ratios(summary)
    result.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), load_end=load_end)
    result.update(summary=summary, ratios=ratio)
    out_path.write_text(json.dumps(result, indent=1))
    print(
        f"reps {a.reps}, {a.updates} updates per run, first {a.drop} dropped; "
        f"load {load_start} -> {load_end}; {out_path}\n"
    )
    print(markdown(summary, ratio))
    print()
    extra = {
        "reps": a.reps,
        "updates": a.updates,
        "drop": a.drop,
        "load_before": load_start,
        "load_after": load_end,
        "jaxloop_commit": result["jaxloop_commit"],
        "results": str(out_path),
    }
    print(json_line(summary, ratio, extra), flush=True)
    return 0 if all(r["rc"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
