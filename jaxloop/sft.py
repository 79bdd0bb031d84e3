"""`python -m jaxloop.sft --config sft.py [--config.key=value ...]`: supervised fine-tuning.

Teacher-forced cross-entropy on `sft.source`'s rows (JSONL / Parquet: `{prompt, response}`, the
prompt a string or chat messages, or `{messages}`, the last assistant message the target), else on
`data.source`'s `{prompt, label}` rows (the built-in task's train split, or a file), the loss on
the response tokens and EOS only; a prompt's tokens are the rollout's (docs/data.md). The same
model, tokenizer, mesh, optimizer family, progress bar, metrics.jsonl / TensorBoard / curves.png,
orbax checkpoints and resume as `jaxloop.train`; `sft.steps` optimizer steps of `sft.batch_size`
examples at the constant `sft.lr`; every `eval_every` steps the greedy exact-match accuracy on the
held-out split (`eval_accuracy`).

The run dir holds the actor like a training run's (`checkpoints/<step>/actor_params`,
`actor_config.json`), so it is a `model.init_checkpoint` for `jaxloop.train` (the critic copies its
backbone) and `conversion.to_hf` exports it.

A training run can do the same steps first: `warm_start.sft_steps = N` (train/warm_start.py).
SFT reads the keys of `SFT_KEYS`; overriding any other key on the command line is refused (it
would be silently ignored).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
from flax import nnx

from jaxloop.config import UsageError, format_tree, parse_command, validate_mesh
from jaxloop.io.hf import abstract_model
from jaxloop.io.orbax import RunDirError, write_text_atomic
from jaxloop.metrics import MetricsWriter, progress
from jaxloop.parallel import distributed
from jaxloop.parallel import mesh as shd
from jaxloop.rl.sft import SFTStepper
from jaxloop.rl.state import abstract_params, build_train_state, state_shardings
from jaxloop.rollout.api import Policy
from jaxloop.rollout.producer import RolloutProducer
from jaxloop.train.checkpoint import TrainCheckpointer
from jaxloop.train.guards import (
    check_model_source,
    check_writable,
    run_cleaning_up,
    run_dir_lock,
)
from jaxloop.train.warm_start import sft_batches, sft_optimizer

# what `python -m jaxloop.sft` reads (a section name covers its keys)
SFT_KEYS = (
    "run_dir",
    "seed",
    "stop_after",
    "micro_batch_size",
    "checkpoint_every",
    "keep_checkpoints",
    "eval_every",
    "eval_prompts",
    "progress",
    "curves",
    "verbose",
    "model",
    "data.source",
    "data.eval_source",
    "data.prompt_key",
    "data.label_key",
    "data.prompt_template",
    "data.label_extract",
    "data.task",
    "data.num_digits",
    "data.tokenizer",
    "data.max_prompt_tokens",
    "rollout.max_new_tokens",
    "optim.name",
    "optim.b1",
    "optim.b2",
    "optim.grad_clip",
    "optim.weight_decay",
    "optim.max_skipped_updates",
    "sft",
    "mesh",
    "dist",
)
# keys an SFT resume may change beyond the trainer's resume-free keys: the run's length and the
# eval's answer budget; the prompt budget sets SFT's row length, so it stays
SFT_RESUME_FREE = ("sft.steps", "rollout.max_new_tokens")
SFT_RESUME_FIXED = ("data.max_prompt_tokens",)
SFT_PROGRESS_KEYS = ("sft_loss", "sft_token_accuracy", "eval_accuracy")


# ---- python -m jaxloop.sft ----
def check_sft_overrides(argv: list[str]) -> None:
    """Refuse `--config.KEY` overrides of keys that SFT does not read (one line, exit 2)."""
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key = arg[len("--config.") :].split("=", 1)[0]
        if not _covered(key, SFT_KEYS):
            raise UsageError(
                f"--config.{key}: jaxloop.sft does not read it (it reads {', '.join(SFT_KEYS)})"
            )


def _covered(key: str, keys) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def _sft_resume_free(key: str) -> bool:
    """Whether an SFT resume may change `key`: the trainer's rule (the knobs declared
    resume=FREE, config.RESUME_FREE_KEYS) with SFT's own additions and exceptions."""
    from jaxloop.config import RESUME_FREE_KEYS

    if key in SFT_RESUME_FIXED:
        return False
    return key in SFT_RESUME_FREE or key in RESUME_FREE_KEYS


def _sft_changes_math(cfg, key: str) -> bool:
    """Whether `key` is part of an SFT run's math (read by SFT and not free on resume)."""
    return _covered(key, SFT_KEYS) and not _sft_resume_free(key)


def check_sft_resume(cfg, run_dir: Path) -> None:
    """Refuse to resume an SFT run dir with a config whose math differs from its config.json."""
    from jaxloop.config import flat_items
    from jaxloop.train.checkpoint import flat_json

    stored_path = run_dir / "config.json"
    if not stored_path.is_file():
        return
    try:
        stored = flat_json(json.loads(stored_path.read_text()))
    except (ValueError, AttributeError) as err:
        raise RunDirError(f"{stored_path} is unreadable ({err})") from None
    for key, value in flat_items(cfg):
        if not _covered(key, SFT_KEYS) or _sft_resume_free(key):
            continue
        value = json.loads(json.dumps(value))
        if key in stored and stored[key] != value:
            raise UsageError(
                f"run dir {run_dir} was started with {key}={stored[key]!r}; this run has "
                f"{key}={value!r} (start a new run_dir to change it)"
            )


class SFTRun:
    """Model, mesh, data, optimizer state and checkpoints of one `jaxloop.sft` run dir."""

    def __init__(self, cfg):
        from jaxloop.train.build import actor_config, init_actor_params
        from jaxloop.train.setup import actor_seed, producer_settings

        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir).resolve()
        distributed.initialize(cfg.dist)
        self.is_main = distributed.is_main_process()
        model_cfg = actor_config(cfg)
        sizes = validate_mesh(_as_sft_batch(cfg), jax.device_count(), model_cfg)
        self.mesh = shd.make_mesh(**sizes)
        self.actor_abstract = abstract_model(model_cfg, "actor")
        self.tx = sft_optimizer(cfg, cfg.sft.steps)
        self.shardings = state_shardings(
            self.mesh,
            shd.shardings_for(self.actor_abstract, self.mesh),
            abstract_params(self.actor_abstract),
            self.tx,
            None,
            None,
            None,
        )
        settings = producer_settings(cfg, requires_groups=False)
        settings = dataclasses.replace(
            settings, reward="exact_match", vocab_size=model_cfg.vocab_size
        )
        from jaxloop.rollout.jax_sampler import JaxSamplerEngine

        self.producer = RolloutProducer(
            settings, JaxSamplerEngine(self.actor_abstract, mesh=self.mesh)
        )
        self.data = sft_batches(cfg, settings.data, self.producer.tokenizer)
        from jaxloop.io.run_dir import checkpoint_steps
        from jaxloop.train.checkpoint import check_fresh_start

        check_fresh_start(cfg, self.run_dir, _sft_changes_math)  # before anything is written
        step = (checkpoint_steps(self.run_dir) or [None])[-1]
        abstract = _abstract_sft_state(self.actor_abstract, self.tx)
        if step is not None:
            check_sft_resume(cfg, self.run_dir)
            self.checkpointer = TrainCheckpointer(self.run_dir, keep=cfg.keep_checkpoints)
            self.state, extra = self.checkpointer.restore(step, abstract, self.shardings)
            self.data.restore(extra["data_cursor"])
        else:
            actor = init_actor_params(
                cfg, model_cfg, self.mesh, self.shardings.actor_params, actor_seed(cfg)
            )
            self.state = build_train_state(actor, self.tx, shardings=self.shardings, seed=cfg.seed)
            self.checkpointer = TrainCheckpointer(self.run_dir, keep=cfg.keep_checkpoints)
            if self.is_main:
                self.checkpointer.write_configs(self.actor_abstract)
                write_text_atomic(
                    self.run_dir / "config.json", cfg.to_json_best_effort(indent=2) + "\n"
                )
        self.start = self.state.update_count
        self.stepper = SFTStepper(
            nnx.split(self.actor_abstract)[0],
            self.tx,
            cfg.micro_batch_size,
            mesh=self.mesh,
            params_sharding=self.shardings.actor_params,
            opt_sharding=self.shardings.actor_opt,
        )
        self.metrics = (
            MetricsWriter(self.run_dir, start_update=self.start) if self.is_main else None
        )

    def evaluate(self) -> float:
        policy = nnx.state(self.actor_abstract)
        nnx.replace_by_pure_dict(policy, self.state.actor_params)
        self.producer.publish(Policy(policy, self.state.update_count, self.actor_abstract.config))
        return self.producer.evaluate()

    def run(self) -> int:
        cfg, total = self.cfg, self.cfg.sft.steps
        bar = progress(
            total=total,
            initial=self.start,
            desc="sft",
            keys=SFT_PROGRESS_KEYS,
            disable=None if cfg.progress and self.is_main else True,
        )
        skips = 0
        stop_at = total if cfg.stop_after is None else min(total, self.start + cfg.stop_after)
        finished = False
        try:
            for step in range(self.start, stop_at):
                t0 = time.perf_counter()
                row = {}
                if cfg.eval_every is not None and step % cfg.eval_every == 0:
                    row["eval_accuracy"] = self.evaluate()
                s = self.state
                params, opt, metrics = self.stepper.step(
                    s.actor_params, s.actor_opt, self.data.next_batch()
                )
                metrics = shd.metrics_to_host(metrics)
                skips = skips + 1 if metrics["skipped"] else 0
                self.state = s.replace(
                    actor_params=params,
                    actor_opt=opt,
                    step=s.step + 1,
                    policy_version=s.policy_version + int(not metrics["skipped"]),
                    skipped_updates=s.skipped_updates + int(metrics["skipped"]),
                    consecutive_skips=s.consecutive_skips * 0 + skips,
                )
                if skips >= cfg.optim.max_skipped_updates:
                    raise NonFiniteSFTError(
                        f"sft step {step}: non-finite loss or gradient norm in {skips} "
                        f"consecutive steps (optim.max_skipped_updates="
                        f"{cfg.optim.max_skipped_updates})"
                    )
                row.update(metrics)
                row["time_step"] = time.perf_counter() - t0
                done = step + 1
                if done == total:
                    row["final_eval_accuracy"] = self.evaluate()
                if self.metrics is not None:
                    self.metrics.write(step, row)
                bar.step(row)
                every = cfg.checkpoint_every
                if done == stop_at or (every is not None and done % every == 0):
                    self.checkpointer.save(self.state, {"data_cursor": self.data.state()})
            finished = True
        finally:
            bar.close(summary=finished)  # a failed run: its error is the one line
            if self.metrics is not None:
                self.metrics.close()
            self.checkpointer.close()
            self.producer.close()
        return 0


class NonFiniteSFTError(RuntimeError):
    """optim.max_skipped_updates SFT steps in a row had a non-finite loss or gradient norm."""


def _as_sft_batch(cfg):
    """The config with the SFT batch as the samples per update (the mesh checks divide it)."""
    c = cfg.copy_and_resolve_references()
    with c.unlocked():
        c.prompts_per_update, c.n_samples_per_prompt = cfg.sft.batch_size, 1
    return c


def _abstract_sft_state(actor_abstract, tx):
    from jaxloop.rl.state import abstract_train_state

    return abstract_train_state(abstract_params(actor_abstract), tx, None, None)


def sft_preflight(cfg) -> None:
    """The model source and its rules, data, tokenizer and prompt lengths, before anything is
    built or written."""
    from jaxloop.train.guards import stored_vocab_size
    from jaxloop.train.setup import check_tokenizer_fits, producer_settings

    check_model_source(cfg)

    settings = dataclasses.replace(
        producer_settings(cfg, requires_groups=False), reward="exact_match"
    )
    producer = RolloutProducer(settings, engine=None)
    check_tokenizer_fits(settings.tokenizer, producer.tokenizer, stored_vocab_size(cfg))
    sft_batches(cfg, settings.data, producer.tokenizer)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxloop.sft`, behind the entry points' one exception boundary
    (jaxloop/errors.py): a user error is one line and exit code 2 (what a fresh start had created
    is removed again), anything else keeps its traceback."""

    argv = sys.argv[1:] if argv is None else argv
    return run_cleaning_up(lambda cleanup: _main(argv, cleanup))


def _main(argv: list[str], cleanup: list) -> int:
    from jaxloop.summary import finish_report
    from jaxloop.train.checkpoint import FreshStartCleanup, check_fresh_start

    started = time.perf_counter()
    run = None
    try:
        command = parse_command(argv)
        if command.help:
            print(command.help.replace("jaxloop.train", "jaxloop.sft"))
            print(f"\njaxloop.sft reads: {', '.join(SFT_KEYS)}")
            return 0
        check_sft_overrides(argv)
        cfg = command.cfg
        sft_preflight(cfg)
        if command.dry_run:
            check_fresh_start(cfg, Path(cfg.run_dir).resolve(), _sft_changes_math)
            print(format_tree(cfg))
            print("dry run: the config is valid; nothing was written")
            return 0
        check_writable(cfg.run_dir)
        cleanup.append(FreshStartCleanup(cfg.run_dir))
        with run_dir_lock(cfg.run_dir, cfg.dist):  # one writer per run dir
            run = SFTRun(cfg)
            if run.start >= cfg.sft.steps:
                print(
                    f"sft run already complete: step {run.start} of {cfg.sft.steps}",
                    file=sys.stderr,
                )
                return 0
            code = run.run()
    except NonFiniteSFTError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    if run.is_main:
        print(
            finish_report(
                cfg.run_dir,
                run.start,
                time.perf_counter() - started,
                cfg.sft.steps,
                eval_key="eval_accuracy",
                curves=cfg.curves,
            ),
            file=sys.stderr,
        )
    print(json.dumps({"run_dir": str(cfg.run_dir)}))
    return code


if __name__ == "__main__":
    sys.exit(main())
