"""`python -m jaxloop.evaluate --checkpoint RUN_DIR [--step N] [--data FILE] [--samples K]`

Greedy reward and pass@k of a trained checkpoint on a prompt set, with the run's reward: what a
user runs after training. Reads `RUN_DIR/config.json` (written by `jaxloop.train`) for the data,
tokenizer, reward and sampling settings, restores the actor of step N (default: the latest; `best`:
the step of the best eval_reward, recorded by `--config.keep_best_checkpoint=true`) and
generates with the embedded sampler through the same `RolloutProducer` the trainer evaluates with,
so the greedy reward is the trainer's `eval_reward` of that checkpoint.

- prompts: `--data FILE` (JSONL / Parquet of {prompt, label}; every row, or the first
  `--prompts N`), else the run's held-out set (`data.eval_source`, or the built-in task's eval
  split, `eval_prompts` of them unless `--prompts N`).
- greedy: mean reward of the greedy responses, and the fraction that are correct (reward >= 1).
- `--samples K` (K >= 1): K responses per prompt at the run's `rollout.temperature` (or
  `--temperature`); mean reward, pass@1 (the mean fraction of correct samples) and pass@K (the
  fraction of prompts with at least one correct sample).
- `--reward NAME` scores with another reward (e.g. `exact_match` for a run trained on `format`).
- `--samples-out FILE`: the greedy responses as JSONL, one row per prompt, as the trainer's
  `samples/<update>.jsonl` (jaxloop/train/samples.py): prompt_text (the text the model saw,
  templates applied), response, label, reward; their mean is `greedy_reward`. Written whole at
  the end (a temporary file renamed over FILE).

Prints a table, then one JSON line on stdout. The step's actor_params are verified against its
digests first (a damaged step is refused, naming the newest older step that verifies). Errors are
one line on stderr, exit code 2 (jaxloop.errors' boundary); anything else keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np

from jaxloop.io.run_dir import CONFIG_FILE, checkpoint_steps

_BIG = 10**9  # "every row" of a --data file


class EvalUsageError(ValueError):
    """A bad command line or run dir: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        raise EvalUsageError(message)


def _step(value: str) -> int | str:
    if value in ("best", "latest"):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a step, latest or best (got {value!r})"
        ) from None


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = _Parser(prog="python -m jaxloop.evaluate", add_help=False)
    ap.add_argument("--checkpoint", required=True, help="a run dir written by jaxloop.train")
    ap.add_argument(
        "--step",
        type=_step,
        default=None,
        help="checkpoint step N, latest (the default) or best (keep_best_checkpoint's record)",
    )
    ap.add_argument("--data", default="", help="JSONL / Parquet of {prompt, label} to evaluate on")
    ap.add_argument("--samples", type=int, default=0, help="K: samples per prompt for pass@K")
    ap.add_argument("--prompts", type=int, default=0, help="evaluate on the first N prompts")
    ap.add_argument("--reward", default="", help="reward name (default: the run's data.reward)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="response length limit")
    ap.add_argument("--samples-out", default="", help="write the greedy responses to this JSONL")
    args = ap.parse_args(argv)
    if args.samples < 0:
        raise EvalUsageError(f"--samples must be >= 1 (got {args.samples})")
    if args.prompts < 0:
        raise EvalUsageError(f"--prompts must be >= 1 (got {args.prompts})")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise EvalUsageError(f"--temperature must be a finite number >= 0 (got {args.temperature})")
    if args.max_new_tokens < 0:
        raise EvalUsageError(
            f"--max-new-tokens must be >= 0 (0: the run's; got {args.max_new_tokens})"
        )
    if isinstance(args.step, int) and args.step < 0:
        raise EvalUsageError(f"--step must be >= 0 (got {args.step})")
    out = Path(args.samples_out)
    if args.samples_out and (out.is_dir() or not out.parent.is_dir()):
        why = "is a directory" if out.is_dir() else f"is in {out.parent}, which is not a directory"
        raise EvalUsageError(f"--samples-out {args.samples_out} {why}")
    return args


def read_run_config(run_dir: str | Path) -> dict:
    """The run's config.json as a dict (RunDirError-like EvalUsageError when absent)."""
    path = Path(run_dir) / CONFIG_FILE
    if not Path(run_dir).is_dir():
        raise EvalUsageError(f"run dir {run_dir} does not exist")
    if not path.is_file():
        raise EvalUsageError(f"{run_dir} has no {CONFIG_FILE} (not a jaxloop.train run dir?)")
    try:
        cfg = json.loads(path.read_text())
        for key in ("data", "rollout", "model"):
            if not isinstance(cfg[key], dict):
                raise TypeError(key)
    except (ValueError, KeyError, TypeError) as err:
        raise EvalUsageError(
            f"{path}: not a jaxloop config ({type(err).__name__}: {err})"
        ) from None
    return cfg


def run_config(raw: dict, path: Path):
    """The run's config: jaxloop.config's defaults with its config.json over them (keys these
    defaults lack, from another jaxloop version, are skipped; an older version's spelling of
    None is read as None: `upgrade_stored`), so evaluation reads every setting as the trainer
    does."""
    from jaxloop.config import base_config, flat_items, upgrade_stored
    from jaxloop.train.checkpoint import flat_json

    cfg = base_config()
    known = dict(flat_items(cfg))
    stored = upgrade_stored(flat_json(raw))
    try:
        cfg.update_from_flattened_dict({k: v for k, v in stored.items() if k in known})
    except (TypeError, ValueError) as err:
        raise EvalUsageError(
            f"{path}: not a jaxloop config ({type(err).__name__}: {err})"
        ) from None
    return cfg


def eval_settings(cfg, args: argparse.Namespace, vocab_size: int):
    """ProducerSettings whose held-out examples are the prompts to evaluate on: the trainer's
    (train.setup.producer_settings) with the prompt set, reward and sampling of the command
    line."""
    from jaxloop.rollout.types import SamplingConfig
    from jaxloop.train.setup import producer_settings

    settings = producer_settings(cfg, requires_groups=False)
    data = cfg.data
    # the training source is not needed: only the held-out examples are generated
    builtin = {**settings.data, "source": "builtin"}
    eval_file = args.data or data.eval_source
    if eval_file:
        settings_data = {**builtin, "eval_source": eval_file}
        n = args.prompts or (_BIG if args.data else int(cfg.eval_prompts))
        prompts = f"{eval_file} ({'--data' if args.data else 'data.eval_source'})"
    elif data.source == "builtin":
        settings_data = {**builtin, "eval_source": ""}
        n = args.prompts or int(cfg.eval_prompts)
        prompts = f"builtin {builtin['task']} ({builtin['num_digits']} digits), held-out split"
    else:
        raise EvalUsageError(
            f"the run trained on {data.source!r} without data.eval_source: pass --data FILE"
        )
    if settings.tokenizer != "char" and not Path(settings.tokenizer).is_dir():
        raise EvalUsageError(
            f"tokenizer dir {settings.tokenizer!r} of the run's data.tokenizer not found"
        )
    settings = dataclasses.replace(
        settings,
        data=settings_data,
        vocab_size=int(vocab_size),
        reward=args.reward or settings.reward,
        prompts_per_update=1,
        n_samples_per_prompt=1,
        eval_prompts=n,
        # the command line's sampling: the run's temperature and response length by default
        sampling=SamplingConfig(
            temperature=args.temperature or float(cfg.rollout.temperature),
            max_new_tokens=args.max_new_tokens or int(cfg.rollout.max_new_tokens),
        ),
    )
    return settings, prompts


def pass_at_k(correct: np.ndarray, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) from n >= k samples per prompt, averaged over prompts:
    1 - C(n - c, k) / C(n, k) with c correct samples of n."""
    n = correct.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= {n} samples")
    out = []
    for c in correct.sum(axis=1).astype(int):
        out.append(1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k))
    return float(np.mean(out)) if out else float("nan")


def evaluate_run(args: argparse.Namespace) -> dict:
    from flax import nnx

    from jaxloop.io.orbax import restore_model
    from jaxloop.rollout.api import Policy
    from jaxloop.rollout.jax_sampler import JaxSamplerEngine
    from jaxloop.rollout.producer import RolloutProducer

    run_dir = Path(args.checkpoint)
    cfg = run_config(read_run_config(run_dir), run_dir / CONFIG_FILE)
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise EvalUsageError(f"{run_dir} holds no checkpoint")
    step = steps[-1] if args.step in (None, "latest") else args.step
    if step == "best":
        from jaxloop.train.checkpoint import best_checkpoint

        best = best_checkpoint(run_dir)
        if best is None:
            raise EvalUsageError(
                f"{run_dir} has no best checkpoint (train with --config.keep_best_checkpoint=true)"
            )
        step = best["step"]
    if step not in steps:
        raise EvalUsageError(f"{run_dir} has no checkpoint at step {step} (steps: {steps})")
    model = restore_model(
        run_dir,
        "actor",
        step=step,
        dtype=cfg.model.param_dtype,
        compute_dtype=cfg.model.compute_dtype,
    )
    settings, prompts = eval_settings(cfg, args, model.config.vocab_size)
    producer = RolloutProducer(settings, JaxSamplerEngine(model))
    if not producer.eval_examples:
        raise EvalUsageError(f"no prompts to evaluate on in {prompts}")
    producer.publish(Policy(nnx.state(model), step, model.config))
    greedy, rows = producer.eval_samples()
    greedy = greedy[:, 0]
    result = {
        "checkpoint": str(run_dir),
        "step": step,
        "prompts": len(producer.eval_examples),
        "prompt_set": prompts,
        "reward": settings.reward,
        "greedy_reward": float(greedy.mean()),
        "greedy_correct": float((greedy >= 1.0).mean()),
    }
    if args.samples:
        sampling = dataclasses.replace(settings.sampling, greedy=False)
        rewards = producer.eval_rewards(args.samples, sampling)
        correct = rewards >= 1.0
        result.update(
            {
                "samples": args.samples,
                "temperature": sampling.temperature,
                "sample_reward": float(rewards.mean()),
                "pass@1": pass_at_k(correct, 1),
                f"pass@{args.samples}": pass_at_k(correct, args.samples),
            }
        )
    producer.close()
    if args.samples_out:  # last: a failed evaluation writes nothing
        from jaxloop.train.samples import write_samples

        write_samples(args.samples_out, rows)
        result["samples_out"] = args.samples_out
    return result


def format_table(result: dict) -> str:
    rows = [
        ("checkpoint", f"{result['checkpoint']} (step {result['step']})"),
        ("prompts", f"{result['prompts']}: {result['prompt_set']}"),
        ("reward", result["reward"]),
        ("greedy reward", f"{result['greedy_reward']:.4f}"),
        ("greedy correct", f"{result['greedy_correct']:.4f}  (reward >= 1)"),
    ]
    if "samples" in result:
        k = result["samples"]
        rows += [
            ("samples per prompt", f"{k} at temperature {result['temperature']:g}"),
            ("sampled reward", f"{result['sample_reward']:.4f}"),
            ("pass@1", f"{result['pass@1']:.4f}"),
        ]
        if k > 1:
            rows.append((f"pass@{k}", f"{result[f'pass@{k}']:.4f}"))
    width = max(len(label) for label, _ in rows) + 2
    return "\n".join(f"{label:<{width}}{value}" for label, value in rows)


def main(argv: list[str] | None = None) -> int:
    """The entry point's one exception boundary (jaxloop.errors): a user error (a bad command
    line, run dir, checkpoint, data file, tokenizer or reward) is one `error: ...` line on stderr
    and exit code 2; anything else is a bug and keeps its traceback."""
    from jaxloop.errors import run_entry_point

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip())
        return 0

    def body() -> int:
        result = evaluate_run(parse_args(argv))
        print(format_table(result))
        print(json.dumps(result))
        return 0

    return run_entry_point(body, extra=(EvalUsageError,))


if __name__ == "__main__":
    sys.exit(main())
