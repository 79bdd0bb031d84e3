"""The warm start: SFT steps on the task's train split before RL (`warm_start.sft_steps`), a phase
of a training run; `jaxloop.sft` trains with the same data batches and optimizer."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx

from jaxloop.data.datasets import (
    DataError,
    encode_prompts,
    make_eval_examples,
    make_source,
    sft_data,
)
from jaxloop.metrics import progress
from jaxloop.parallel import mesh as shd
from jaxloop.rl.optim import make_optimizer
from jaxloop.rl.sft import (
    SFTBatch,
    SFTStepper,
    answer_budget,
    sft_batch,
    sft_seq_len,
    sft_sequences,
)
from jaxloop.rl.state import abstract_params
from jaxloop.rollout.api import Policy
from jaxloop.rollout.producer import build_tokenizer, derive_seed

WARM_START_SEED = 0x5F7  # the warm start's data order: its own stream, not the RL cursor's
PROBE_SEED = 0x9B0  # the probe's train prompts (no validation left): apart from the SFT data


def sft_optimizer(cfg, steps: int):
    """The SFT optimizer: optim's family and settings at the constant sft.lr."""
    o = cfg.optim
    return make_optimizer(
        o.name, cfg.sft.lr, "constant", 0, steps, o.weight_decay, o.b1, o.b2, o.grad_clip
    )


class SFTData:
    """Batches of `sft_batch` from a prompt source, in one row length; a resumable cursor."""

    def __init__(self, data: dict, tokenizer, max_prompt_tokens: int, batch_size: int):
        self.source = make_source(data)
        self.tokenizer, self.batch_size = tokenizer, batch_size
        # every file row's prompt renders and fits, as the rollout's must (errors name the row)
        encode_prompts(tokenizer, getattr(self.source, "examples", []), max_prompt_tokens)
        self.seq_len = sft_seq_len(max_prompt_tokens, answer_budget(self.source, tokenizer))

    def next_batch(self) -> SFTBatch:
        prompts, answers = sft_sequences(self.tokenizer, self.source.next_batch(self.batch_size))
        try:
            return sft_batch(prompts, answers, self.seq_len)
        except ValueError as err:
            raise DataError(
                f"sft: {err} (data.max_prompt_tokens + the longest label + EOS)"
            ) from None

    def state(self) -> dict:
        return self.source.state()

    def restore(self, state: dict) -> None:
        self.source.restore(state)


def sft_batches(cfg, data: dict, tokenizer) -> SFTData:
    """The SFT batches of `jaxloop.sft` and of the warm start (whose preflight builds them too):
    sft.source's rows when it is set, else `data`'s (the producer's data settings) {prompt,
    label} rows, in the warm start's own data order."""
    data_cfg = {**sft_data(data, cfg.sft.source), "seed": derive_seed(cfg.seed, WARM_START_SEED)}
    return SFTData(data_cfg, tokenizer, cfg.data.max_prompt_tokens, cfg.sft.batch_size)


def probe_examples(data: dict, eval_prompts: int, seed: int, n: int) -> list:
    """What `warm_start.stop_at_reward` is measured on: up to `n` held-out prompts past the
    `eval_prompts` that evaluation reports (a validation set: neither trained on nor reported),
    or, where the held-out set has none left, `n` train-split prompts in their own fixed order."""
    validation = make_eval_examples(data, eval_prompts + n)[eval_prompts:]
    return validation or make_source({**data, "seed": derive_seed(seed, PROBE_SEED)}).next_batch(n)


def warm_start(cfg, setup, producer, actor_params) -> tuple[dict, dict]:
    """Up to `warm_start.sft_steps` SFT steps on the task's train split (its own data order) from
    `actor_params` (donated); with `warm_start.stop_at_reward` set it stops after the first step
    whose mean reward on `warm_start.probe_prompts` validation prompts (`probe_examples`) reaches
    that value, so the RL run starts from a model that answers partly right, whatever the seed;
    the probe answers greedily, or with `probe_sampling=rollout` one sample per prompt at the
    rollout's temperature (the sampled policy can be far flatter than its greedy answer).
    Returns the warm-started actor parameters and the metrics of the warm start (steps run,
    greedy eval reward before and after it, the last probe reward and loss, seconds)."""
    from jaxloop.train.setup import producer_settings

    ws = cfg.warm_start
    steps = ws.sft_steps
    mesh, shardings = setup.mesh, setup.shardings
    tx = sft_optimizer(cfg, steps)
    graphdef = nnx.split(setup.actor_abstract)[0]
    opt_sharding = None
    if mesh is not None:
        from jaxloop.rl.state import opt_shardings

        opt_sharding = opt_shardings(
            tx, abstract_params(setup.actor_abstract), shardings.actor_params, mesh
        )
    stepper = SFTStepper(
        graphdef,
        tx,
        cfg.micro_batch_size,
        mesh=mesh,
        params_sharding=shardings.actor_params,
        opt_sharding=opt_sharding,
    )
    # the data and tokenizer from the config, as the producer's: the Ray client in front of vLLM
    # engines holds neither (the engines never see text)
    settings = producer_settings(cfg, requires_groups=False)
    tokenizer = build_tokenizer(settings.tokenizer, setup.model_cfg.vocab_size)
    data = sft_batches(cfg, settings.data, tokenizer)
    probe, probe_sampling = None, None  # None: the producer's greedy evaluation sampling
    if ws.stop_at_reward is not None:
        probe = probe_examples(settings.data, cfg.eval_prompts, cfg.seed, ws.probe_prompts)
        if ws.probe_sampling == "rollout":
            probe_sampling = dataclasses.replace(producer.eval_sampling, greedy=False)
    started = time.perf_counter()
    config = setup.actor_abstract.config

    def publish(params):
        producer.publish(Policy(setup.policy_of(params), 0, config))

    publish(actor_params)
    before = producer.evaluate()
    bar = progress(
        total=steps,
        desc="warm start (sft)",
        keys=("sft_loss", "sft_token_accuracy", "probe_reward"),
        disable=None if cfg.progress and jax.process_index() == 0 else True,
    )
    last: dict = {}
    steps_run = 0
    try:
        opt_state = stepper.init(actor_params, opt_sharding)
        for step in range(1, steps + 1):
            actor_params, opt_state, metrics = stepper.step(
                actor_params, opt_state, data.next_batch()
            )
            last.update(shd.metrics_to_host(metrics))
            steps_run = step
            if probe is not None:
                publish(actor_params)
                rewards = producer.eval_rewards(sampling=probe_sampling, examples=probe)
                last["probe_reward"] = float(np.mean(rewards))
            bar.step(last)
            if probe is not None and last["probe_reward"] >= ws.stop_at_reward:
                break
    finally:
        bar.close()
    publish(actor_params)
    after = producer.evaluate()
    metrics = {
        "warm_start_sft_steps": float(steps_run),
        "warm_start_eval_before": before,
        "warm_start_eval_after": after,
        "warm_start_sft_loss": last.get("sft_loss", float("nan")),
        "warm_start_seconds": time.perf_counter() - started,
    }
    if probe is not None:
        metrics["warm_start_probe_reward"] = last.get("probe_reward", float("nan"))
    return actor_params, metrics
