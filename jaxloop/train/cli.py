"""`python -m jaxloop.train --config flow_dppo.py [--config.key=value ...]`: the command line.

Checks the config and its inputs before anything is built or written (`preflight`, also a dry
run's), then runs a `Trainer`. Exit codes: 0 done (or already complete); 2 a user error, one line
on stderr, and what a fresh start had created is removed again; 3 a run stopped by a log-prob
mismatch or non-finite updates; 1 anything else (a bug, with its traceback).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import jax

from jaxloop import errors
from jaxloop.config import UsageError, format_tree, parse_command
from jaxloop.rl.algorithms import get_algorithm
from jaxloop.rollout.producer import RolloutProducer
from jaxloop.summary import finish_report
from jaxloop.train.checkpoint import (
    FreshStartCleanup,
    check_fresh_start,
    check_resume_config,
    resumed_update,
)
from jaxloop.train.consistency import STOPPED_RUN_ERRORS
from jaxloop.train.guards import (
    check_model_source,
    check_writable,
    run_cleaning_up,
    run_dir_lock,
    stored_vocab_size,
)
from jaxloop.train.loop import Trainer
from jaxloop.train.setup import (
    check_tokenizer_fits,
    checked_loss_hparams,
    logprob_bound,
    run_producer_settings,
    updates_per_rollout,
)


def check_sft_keys_read(cfg) -> None:
    """A training run reads the sft.* keys and the other warm_start.* keys only for its warm
    start, and the probe's keys only for warm_start.stop_at_reward: one changed from its
    default while it is not read would be silently ignored, so it is refused."""
    from jaxloop.config import base_config, flat_items

    base = base_config()
    if cfg.warm_start.sft_steps > 0:
        if cfg.warm_start.stop_at_reward is None:
            for key in ("probe_sampling", "probe_prompts"):
                value, default = cfg.warm_start[key], base.warm_start[key]
                if value != default:
                    raise UsageError(
                        f"warm_start.{key}={value!r} is read only by the probe behind "
                        "warm_start.stop_at_reward, which is None: set stop_at_reward, or "
                        f"--config.warm_start.{key}={default!r} as well"
                    )
        return
    for section in ("sft", "warm_start"):
        defaults = dict(flat_items(base[section]))
        for key, value in flat_items(cfg[section]):
            if key != "sft_steps" and value != defaults[key]:
                raise UsageError(
                    f"{section}.{key}={value!r} is read only by a warm start and "
                    "warm_start.sft_steps is 0: set sft_steps > 0 (or run python -m "
                    f"jaxloop.sft), or --config.{section}.{key}={defaults[key]!r} as well"
                )


def preflight(cfg):
    """The checks a run makes before it builds a model or writes anything (a dry run makes them
    too): loss hyper-parameters; model.hf_dir's config.json, index and tensor headers (names,
    shapes, dtypes; headers only); the data source, the tokenizer (its vocabulary must fit the
    model's), the reward (it must return a number) and every prompt's length. Returns the
    algorithm."""
    from jaxloop.io.hf import check_hf_dir

    algo = get_algorithm(cfg.algorithm)
    checked_loss_hparams(cfg)
    check_sft_keys_read(cfg)
    if cfg.model.hf_dir:
        check_hf_dir(cfg.model.hf_dir)
    check_model_source(cfg)
    vocab = stored_vocab_size(cfg)
    settings = run_producer_settings(cfg, algo.requires_groups, vocab)
    producer = RolloutProducer(settings, engine=None)  # the data / tokenizer / reward errors
    check_tokenizer_fits(settings.tokenizer, producer.tokenizer, vocab)
    if cfg.warm_start.sft_steps > 0:  # the warm start's rows (sft.source's): their errors too
        from jaxloop.train.warm_start import sft_batches

        sft_batches(cfg, settings.data, producer.tokenizer)
    return algo


def run_dir_status(cfg) -> str:
    done = resumed_update(cfg)  # resume_step's, when set
    if done is None:
        return "new" if not Path(cfg.run_dir).exists() else "no checkpoint: starts at update 0"
    if done >= cfg.total_updates:
        return f"already complete: update {done} of {cfg.total_updates}"
    return f"resumes at update {done} of {cfg.total_updates}"


def dry_run(cfg) -> str:
    """The checks a real run makes before it builds a model (config, loss hyper-parameters,
    data source, tokenizer, reward, prompt lengths), then the resolved config. Writes nothing."""
    preflight(cfg)
    done = resumed_update(cfg)  # resume_step's, when set
    if done is None or done < cfg.total_updates:
        check_resume_config(cfg, Path(cfg.run_dir).resolve())
        check_fresh_start(cfg, Path(cfg.run_dir).resolve())
    steps, bound = updates_per_rollout(cfg), logprob_bound(cfg)
    return "\n".join(
        [
            format_tree(cfg),
            "resolved:",
            f"  updates_per_rollout = {steps}",
            f"  rollout.max_logprob_diff = {bound:g}",
            f"  run_dir = {str(Path(cfg.run_dir).resolve())!r} ({run_dir_status(cfg)})",
            "dry run: the config is valid; nothing was written",
        ]
    )


def _report(cfg, trainer, started: float) -> None:
    """The end-of-run summary on stderr (process 0 only); writes curves.png."""
    if trainer is None or jax.process_index() != 0:
        return
    print(
        finish_report(
            cfg.run_dir,
            getattr(trainer, "start_update", 0),
            time.perf_counter() - started,
            cfg.total_updates,
            curves=cfg.curves,
        ),
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxloop.train`. One exception boundary (jaxloop/errors.py): a user error is one
    line on stderr and exit code 2, and what a fresh start had created is removed again; a run
    stopped by a log-prob mismatch, non-finite updates or rollout engines that cannot be restarted
    exits with code 3; anything else is a
    bug and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    if threading.current_thread() is threading.main_thread():
        # a file-size limit (ulimit -f, RLIMIT_FSIZE) kills with SIGXFSZ by default: ignored,
        # the write fails with EFBIG instead and the run ends in one line (exit 2)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return run_cleaning_up(lambda cleanup: _main(argv, cleanup))


def _main(argv: list[str], cleanup: list) -> int:
    started = time.perf_counter()
    command = parse_command(argv)
    if command.help:
        print(command.help)
        return 0
    cfg = command.cfg
    if command.dry_run:
        print(dry_run(cfg))
        return 0
    # before anything is built or written: a finished run dir is reported, not re-entered
    done = resumed_update(cfg)  # resume_step's, when set
    if done is not None and done >= cfg.total_updates:
        print(
            f"run already complete: update {done} of {cfg.total_updates} "
            "(raise --config.total_updates to continue)",
            file=sys.stderr,
        )
        return 0
    preflight(cfg)
    check_writable(cfg.run_dir)
    cleanup.append(FreshStartCleanup(cfg.run_dir))
    with run_dir_lock(cfg.run_dir, cfg.dist):  # before anything is written
        return _train(cfg, started)


def _train(cfg, started) -> int:
    trainer = None
    try:
        trainer = Trainer(cfg)
        code = trainer.run()
    except STOPPED_RUN_ERRORS as err:
        print(errors.error_line(err), file=sys.stderr)  # raised in a Ray actor: its cause's line
        _report(cfg, trainer, started)
        return 3
    _report(cfg, trainer, started)
    print(json.dumps({"run_dir": str(cfg.run_dir)}))
    return code
