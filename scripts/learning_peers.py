"""The peers' side of scripts/learning_check.py: which systems, the mapping of jaxloop's resolved
config to TRL's GRPOConfig (see learning_check's docstring for what maps and what does not), the
shared start (scripts/peers/jaxloop_prep.py), TRL's run (scripts/peers/trl_learning.py), the
comparison and the plots."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SYSTEMS = ("jaxloop", "trl", "tunix")
PEERS_DIR = Path(__file__).resolve().parent / "peers"
DEFAULT_TRL_PYTHON = "/work/peers/trl-venv/bin/python"
# a jaxloop run from a jaxloop_prep.py dir: the warm start already ran there
START_FROM_PREP = ("--config.warm_start.sft_steps=0", "--config.warm_start.stop_at_reward=None")
FINAL_SLACK = 0.05  # jaxloop's final >= a peer's final - FINAL_SLACK


def parse_systems(spec: str) -> list[str]:
    """`jaxloop,trl[,tunix]` -> the systems in order (ValueError on an unknown or repeated one,
    or without jaxloop: the peers are compared with it)."""
    systems = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise ValueError(f"unknown system {bad[0]!r} (one of {', '.join(SYSTEMS)})")
    if len(set(systems)) != len(systems):
        raise ValueError(f"{spec!r} names a system twice")
    if "jaxloop" not in systems:
        raise ValueError("the peers are compared with jaxloop: name jaxloop too")
    return systems


def peer_python_error(system: str, python: str | None) -> str | None:
    """Why `system` cannot run with `python` (None: it can)."""
    if system == "tunix":
        if not python or not Path(python).is_file():
            return f"--systems tunix needs --tunix-python (a python with tunix), got {python!r}"
        return (
            "--systems tunix: no Tunix learning runner yet (scripts/peers/tunix_grpo.py only times)"
        )
    module = {"trl": "trl"}[system]
    if not python or not Path(python).is_file():
        return f"--{system}-python {python!r} is not a file"
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"--{system}-python {python}: cannot import {module}"
    return None


_TRL_SCHEDULES = {"constant": "constant", "cosine": "cosine", "linear": "linear"}
_TRL_LOSS_TYPES = {"seq_mean_token_mean": "grpo", "token_mean": "bnpo"}


def trl_settings(cfg) -> dict:
    """GRPOConfig arguments ("grpo") and the run's shape for trl_learning.py, from jaxloop's
    resolved config; ValueError for a setting TRL has no counterpart of (refused, not dropped)."""
    from jaxloop.train.setup import updates_per_rollout

    a, o, r = cfg.algo, cfg.optim, cfg.rollout
    refused = {
        "algorithm (the peers run GRPO)": cfg.algorithm != "grpo",
        "rollout.dynamic_sampling_rounds": r.dynamic_sampling_rounds != 0,
        "algo.dual_clip": a.dual_clip is not None,
        "algo.kl_estimator (TRL's KL is k3)": a.kl_coef > 0 and a.kl_estimator != "k3",
        "optim.name (TRL here: AdamW)": o.name != "adamw",
        "algo.reduction": a.reduction not in _TRL_LOSS_TYPES,
        "learner.pack_tokens": cfg.learner.pack_tokens is not None,
    }
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise ValueError(f"no TRL counterpart of {', '.join(bad)}")
    schedule = _TRL_SCHEDULES[o.schedule]
    if schedule == "constant" and o.warmup_steps:
        schedule = "constant_with_warmup"
    # jaxloop: updates_per_rollout optimizer steps, each on its part of the rollout batch (the
    # old log-probs from generation); TRL: steps_per_generation steps over one generation batch
    steps = updates_per_rollout(cfg)
    batch = cfg.prompts_per_update * cfg.n_samples_per_prompt
    if batch % steps:
        raise ValueError(f"no TRL counterpart of a batch of {batch} in {steps} uneven steps")
    grpo = {
        "per_device_train_batch_size": batch // steps,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": steps,
        "num_generations": cfg.n_samples_per_prompt,
        "num_iterations": 1,
        "max_completion_length": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k or 0,
        "beta": a.kl_coef,
        # TRL adds entropy_coef x the mean per-token entropy of the batch; jaxloop subtracts it
        # from each token's loss before its reduction: equal where responses are equally long
        "entropy_coef": a.entropy_coef,
        "epsilon": a.clip_eps,
        "epsilon_high": a.clip_eps if a.clip_eps_high is None else a.clip_eps_high,
        "loss_type": _TRL_LOSS_TYPES[a.reduction],
        "scale_rewards": "group" if a.grpo_use_std else "none",
        "learning_rate": o.lr,
        "lr_scheduler_type": schedule,
        "warmup_steps": o.warmup_steps,
        "optim": "adamw_torch",
        "adam_beta1": o.b1,
        "adam_beta2": o.b2,
        "adam_epsilon": 1e-8,
        "weight_decay": o.weight_decay,
        "max_grad_norm": o.grad_clip if o.grad_clip is not None else 0.0,
    }
    return {
        "grpo": grpo,
        "steps_per_update": steps,
        "updates": cfg.total_updates,
        "prompts_per_update": cfg.prompts_per_update,
        "eval_every": cfg.eval_every,
        "max_new_tokens": r.max_new_tokens,
        "seed": cfg.seed,
    }


def prepare(prep: Path, train_argv: list[str], warm: bool) -> dict:
    """The shared start of one (task, seed): jaxloop_prep.py for the jaxloop command line
    (`warm`: the actor after jaxloop's warm start)."""
    from jaxloop.config import parse_args

    cfg = parse_args(train_argv)
    shutil.rmtree(prep, ignore_errors=True)
    cmd = [
        sys.executable,
        str(PEERS_DIR / "jaxloop_prep.py"),
        str(prep),
        "--updates",
        str(cfg.total_updates),
        *(["--warm"] if warm else []),
        "--",
        *train_argv,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"jaxloop_prep.py failed: {proc.stderr.strip().splitlines()[-1:]}")
    settings = trl_settings(cfg)
    (prep / "trl_settings.json").write_text(json.dumps(settings, indent=1))
    return settings


def curve_mean(curve: list) -> float | None:
    """The mean greedy eval over the curve's points (update 0 and the final one included)."""
    return round(sum(r for _, r in curve) / len(curve), 4) if curve else None


def end_gap(curve: list) -> float | None:
    """The best greedy eval of the curve's last half minus its final one (0: the run ends at
    its late peak; issue 37 asks <= 0.03)."""
    if not curve:
        return None
    last = curve[-1][0]
    late = [r for u, r in curve if u >= last / 2]
    return round(max(late) - curve[-1][1], 4)


def run_timed(cmd: list[str], row: dict, env: dict | None = None) -> bool:
    """Runs `cmd` (with `env`); `row` gains its wall minutes and, on failure, ok=False and
    stderr's last line. True when it succeeded."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    row["wall_minutes"] = round((time.perf_counter() - start) / 60, 2)
    if proc.returncode != 0:
        row.update(ok=False, error=proc.stderr.strip().splitlines()[-1:])
    return proc.returncode == 0


def run_trl(prep: Path, trl_python: str, row: dict) -> dict:
    """TRL's run from `prep` (row: the run's algorithm, task, warm, seed)."""
    row = {**row, "system": "trl"}
    out = prep / "trl_curve.json"
    cmd = [
        trl_python,
        str(PEERS_DIR / "trl_learning.py"),
        "--prep",
        str(prep),
        "--settings",
        str(prep / "trl_settings.json"),
        "--out",
        str(out),
    ]
    row["command"] = " ".join(cmd)
    # OpenMP's default busy-waits between parallel regions: beside other processes on the same
    # cores that made a 0.6-minute TRL run take 25; waiting passively changes no result
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
    if not run_timed(cmd, row, env):
        return row
    result = json.loads(out.read_text())
    curve = [[int(u), round(float(r), 3)] for u, r in result["curve"]]
    warm = json.loads((prep / "warm_start.json").read_text()) if row["warm"] else {}
    row.update(
        ok=True,
        updates=curve[-1][0] if curve else 0,
        eval_before=warm.get("warm_start_eval_before", curve[0][1] if curve else None),
        eval_at_0=curve[0][1] if curve else None,
        final=curve[-1][1] if curve else None,
        curve=curve,
        curve_mean=curve_mean(result["curve"]),
        end_gap=end_gap(result["curve"]),
        logits_max_abs_diff_vs_jaxloop=result["logits_max_abs_diff_vs_jaxloop"],
    )
    return row


def compare(results: list[dict]) -> list[dict]:
    """Per (algorithm, task, warm, seed) with a peer: jaxloop's and each peer's final and curve
    mean, and whether jaxloop's final >= the peer's - FINAL_SLACK and its mean >= the peer's."""
    out = []
    jax_rows = {
        (r["algorithm"], r["task"], r["warm"], r["seed"]): r
        for r in results
        if r["system"] == "jaxloop"
    }
    for peer in results:
        if peer["system"] == "jaxloop":
            continue
        key = (peer["algorithm"], peer["task"], peer["warm"], peer["seed"])
        mine = jax_rows.get(key)
        row = {"task": peer["task"] + ("+warm" if peer["warm"] else ""), "seed": peer["seed"]}
        row["peer"] = peer["system"]
        if not (mine and mine.get("ok") and peer.get("ok")):
            out.append({**row, "ok": False})
            continue
        row.update(
            ok=True,
            jaxloop_at_0=mine["eval_at_0"],
            peer_at_0=peer["eval_at_0"],
            jaxloop_final=mine["final"],
            peer_final=peer["final"],
            jaxloop_mean=mine["curve_mean"],
            peer_mean=peer["curve_mean"],
        )
        row["final_ok"] = mine["final"] >= peer["final"] - FINAL_SLACK
        row["mean_ok"] = mine["curve_mean"] >= peer["curve_mean"]
        out.append(row)
    return out


def print_comparison(rows: list[dict]) -> None:
    print(
        f"{'task':<14} {'seed':>4} {'peer':<6} {'@0 jax':>6} {'@0 peer':>7} {'final jax':>9} "
        f"{'final peer':>10} {'mean jax':>8} {'mean peer':>9}  final>=peer-0.05  mean>=peer"
    )
    for r in rows:
        if not r["ok"]:
            print(f"{r['task']:<14} {r['seed']:>4} {r['peer']:<6} failed")
            continue
        print(
            f"{r['task']:<14} {r['seed']:>4} {r['peer']:<6} {r['jaxloop_at_0']:>6.3f} "
            f"{r['peer_at_0']:>7.3f} {r['jaxloop_final']:>9.3f} {r['peer_final']:>10.3f} "
            f"{r['jaxloop_mean']:>8.3f} {r['peer_mean']:>9.3f}  {str(r['final_ok']):<16}  "
            f"{r['mean_ok']}"
        )


def plot_curves(results: list[dict], out: Path) -> list[Path]:
    """OUT/curves-TASK.png per task: every system's (colour) and seed's (line style) greedy eval
    curve of the runs that have one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"jaxloop": "tab:blue", "trl": "tab:orange", "tunix": "tab:green"}
    styles = ["-", "--", ":", "-."]
    written = []
    tasks = sorted({(r["algorithm"], r["task"], r["warm"]) for r in results if r.get("curve")})
    for algorithm, task, warm in tasks:
        name = task + ("+warm" if warm else "")
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in results:
            if (r["algorithm"], r["task"], r["warm"]) != (algorithm, task, warm) or not r.get(
                "curve"
            ):
                continue
            xs, ys = zip(*r["curve"], strict=True)
            ax.plot(
                xs,
                ys,
                styles[r["seed"] % len(styles)],
                color=colours.get(r["system"], "black"),
                label=f"{r['system']} seed {r['seed']}",
            )
        ax.set(title=f"{algorithm} {name}", xlabel="update", ylabel="greedy eval reward")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = out / f"curves-{algorithm}-{name.replace(':', '').replace('+', '-')}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
