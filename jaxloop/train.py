"""`python -m jaxloop.train --config flow_dppo.py [--config.key=value ...]`

Builds everything from the config and runs rollout -> rewards -> update -> publish, with metrics,
evaluation and checkpoints. A run dir that holds a checkpoint resumes from it automatically.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxloop.checkpoint import TrainCheckpointer
from jaxloop.config import UsageError, default_logprob_diff, parse_args
from jaxloop.data.datasets import DataError
from jaxloop.data.tokenizer import TokenizerError
from jaxloop.draft_features import DraftFeatureWriter, config_digest
from jaxloop.metrics import MetricsWriter, progress
from jaxloop.models import ConfigError, LoopedConfig, LoopedLM, load_hf, tiny_hf_config
from jaxloop.models.hf_io import CheckpointError
from jaxloop.models.orbax_io import RunDirError, restore_model
from jaxloop.rl.algorithms import get_algorithm
from jaxloop.rl.learner import Learner, LearnerConfig, build_rollout_arrays, make_optimizer
from jaxloop.rl.losses import LossHParams
from jaxloop.rollout.producer import (
    ProducerSettings,
    RolloutProducer,
    build_tokenizer,
    derive_seed,
)
from jaxloop.rollout.types import SamplingConfig


class LogprobMismatchError(RuntimeError):
    """Engine and trainer disagree on the sampled tokens' log-probs beyond the configured bound."""


# ---- building blocks from the config ----
def build_actor(cfg) -> LoopedLM:
    m = cfg.model
    numerics = dict(remat=m.remat, attention_impl=m.attention_impl)
    if m.hf_dir:
        return load_hf(m.hf_dir, dtype=m.param_dtype, compute_dtype=m.compute_dtype, **numerics)
    if m.init_checkpoint:
        return restore_model(
            m.init_checkpoint,
            "actor",
            dtype=m.param_dtype,
            compute_dtype=m.compute_dtype,
            **numerics,
        )
    overrides = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        rope_theta=m.rope_theta,
    )
    overrides["total_ut_steps" if m.family == "ouro" else "num_loops"] = m.num_loops
    model_cfg = LoopedConfig.from_hf_dict(tiny_hf_config(m.family, **overrides)).replace(
        param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, **numerics
    )
    return LoopedLM(model_cfg, rngs=nnx.Rngs(derive_seed(cfg.seed, 0xA)))


def build_critic(actor: LoopedLM, seed: int) -> LoopedLM:
    """Same architecture with a value head; the backbone starts as a copy of the actor's."""
    critic = LoopedLM(actor.config, rngs=nnx.Rngs(seed), role="critic")
    actor_params = nnx.state(actor, nnx.Param).to_pure_dict()
    critic_state = nnx.state(critic, nnx.Param)
    pure = critic_state.to_pure_dict()
    for key in pure:
        if key in actor_params:
            pure[key] = jax.tree.map(jnp.copy, actor_params[key])
    critic_state.replace_by_pure_dict(pure)
    nnx.update(critic, critic_state)
    return critic


def loss_hparams(cfg) -> LossHParams:
    a = cfg.algo
    opt = lambda v: None if v < 0 else float(v)
    return LossHParams(
        clip_eps=a.clip_eps,
        clip_eps_high=opt(a.clip_eps_high),
        dual_clip=opt(a.dual_clip),
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        behav_weight_min=a.behav_weight_min,
        behav_weight_max=a.behav_weight_max,
        behav_drop_cap=opt(a.behav_drop_cap),
        flow_delta=a.flow_delta,
        value_clip=opt(a.value_clip),
        reduction=a.reduction,
    )


def build_learner(cfg, actor: LoopedLM) -> Learner:
    algo = get_algorithm(cfg.algorithm)
    try:
        hparams = loss_hparams(cfg)
    except ValueError as err:
        raise UsageError(f"algo: {err}") from None
    steps = cfg.updates_per_rollout or algo.default_updates_per_rollout
    o = cfg.optim
    total = cfg.total_updates * steps
    actor_tx = make_optimizer(
        o.name, o.lr, o.schedule, o.warmup_steps, total, o.weight_decay, o.b1, o.b2, o.grad_clip
    )
    critic = critic_tx = None
    if algo.uses_critic:
        critic = build_critic(actor, derive_seed(cfg.seed, 0xC))
        critic_tx = make_optimizer(
            o.name, cfg.critic.lr, "constant", 0, total, 0.0, o.b1, o.b2, o.grad_clip
        )
    reference = None
    if algo.uses_reference and cfg.algo.kl_coef > 0:
        reference = (
            actor  # frozen: the learner keeps its own (immutable) copy of the initial params
        )
    lcfg = LearnerConfig(
        micro_batch_size=cfg.micro_batch_size,
        temperature=cfg.rollout.temperature,
        updates_per_rollout=steps,
        critic_steps=cfg.critic.steps_per_rollout,
        gamma=cfg.algo.gamma,
        lam=cfg.algo.lam,
        whiten_advantages=cfg.algo.whiten_advantages,
        grpo_use_std=cfg.algo.grpo_use_std,
    )
    return Learner(actor, critic, algo, hparams, lcfg, actor_tx, critic_tx, reference)


# ---- the loop ----
def producer_settings(cfg, requires_groups: bool) -> ProducerSettings:
    return ProducerSettings(
        seed=cfg.seed,
        data={
            "source": cfg.data.source,
            "task": cfg.data.task,
            "num_digits": cfg.data.num_digits,
            "seed": cfg.seed,
        },
        tokenizer=cfg.data.tokenizer,
        vocab_size=cfg.model.vocab_size,
        reward=cfg.data.reward,
        prompts_per_update=cfg.prompts_per_update,
        n_samples_per_prompt=cfg.n_samples_per_prompt,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        eval_prompts=cfg.eval_prompts,
        requires_groups=requires_groups,
        sampling=SamplingConfig(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens,
        ),
    )


def build_producer(cfg, actor: LoopedLM, settings: ProducerSettings):
    """In-process producer around the embedded engine, or the Ray manager for vLLM engines."""
    if cfg.rollout.engine == "jax":
        from jaxloop.rollout.jax_sampler import JaxSamplerEngine

        return RolloutProducer(settings, JaxSamplerEngine(actor))
    from jaxloop.rollout.ray_bridge import RayRolloutClient

    return RayRolloutClient(cfg, actor, settings)


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir).resolve()
        self.algo = get_algorithm(cfg.algorithm)
        actor = build_actor(cfg)
        settings = producer_settings(cfg, self.algo.requires_groups)
        if cfg.data.tokenizer == "char" and cfg.model.vocab_size != actor.config.vocab_size:
            settings = dataclasses.replace(settings, vocab_size=actor.config.vocab_size)
        self.learner = build_learner(cfg, actor)
        self.producer = build_producer(cfg, actor, settings)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpointer = TrainCheckpointer(self.run_dir, keep=cfg.keep_checkpoints)
        self.start_update, self.version = 0, 0
        step = self.checkpointer.latest_step()
        if step is not None:
            state = self.checkpointer.restore(step, self.learner)
            self.start_update = int(state["update"])
            self.version = int(state["policy_version"])
            self.producer.restore(state["data_cursor"])
        else:
            self.checkpointer.write_configs(self.learner)
            (self.run_dir / "config.json").write_text(cfg.to_json_best_effort(indent=2) + "\n")
        self.metrics = MetricsWriter(self.run_dir, start_update=self.start_update)
        self.features = None
        if cfg.draft_features.enabled:
            tokenizer = build_tokenizer(settings.tokenizer, settings.vocab_size)
            self.features = DraftFeatureWriter(
                self.run_dir,
                cfg.draft_features.max_tokens_per_update,
                cfg.draft_features.max_bytes,
                config_digest(actor.config.to_hf_dict()),
                tokenizer.digest(),
            )

    def check_logprobs(self, update: int, arrays, old_lp) -> dict[str, float]:
        diff = np.abs(np.asarray(old_lp) - arrays.behav_logprobs) * arrays.response_mask
        stats = {
            "logprob_diff_max": float(diff.max()),
            "logprob_diff_mean": float(diff.sum() / max(arrays.response_mask.sum(), 1.0)),
        }
        rollout = self.cfg.rollout
        bound = rollout.max_logprob_diff or default_logprob_diff(
            rollout.engine, self.cfg.model.compute_dtype
        )
        if stats["logprob_diff_max"] > bound:
            raise LogprobMismatchError(
                f"update {update}: engine vs trainer log-prob difference "
                f"{stats['logprob_diff_max']:.3g} exceeds rollout.max_logprob_diff={bound:g}"
            )
        return stats

    def run(self) -> int:
        cfg = self.cfg
        self.producer.publish(self.learner.actor_state(), self.version)
        last = cfg.total_updates
        stop_at = last if cfg.stop_after <= 0 else min(last, self.start_update + cfg.stop_after)
        bar = progress(
            total=last,
            initial=self.start_update,
            desc=cfg.algorithm,
            disable=None if cfg.progress else True,
        )
        try:
            for update in range(self.start_update, stop_at):
                self.one_update(update, last, bar)
                done = update + 1
                if done % cfg.checkpoint_every == 0 or done == stop_at:
                    self.checkpointer.save(
                        done,
                        self.learner,
                        {
                            "update": done,
                            "policy_version": self.version,
                            "data_cursor": self.producer.state(),
                            "seed": cfg.seed,
                        },
                    )
        finally:
            bar.close()
            self.metrics.close()
            self.checkpointer.close()
            self.producer.close()
        return 0

    def one_update(self, update: int, last: int, bar) -> None:
        cfg = self.cfg
        metrics = {"policy_version": float(self.version)}
        if update % cfg.eval_every == 0:
            metrics["eval_reward"] = self.producer.evaluate()
        t0 = time.perf_counter()
        samples, stats = self.producer.produce(update)
        metrics.update(stats)
        metrics["time_generate"] = time.perf_counter() - t0
        if not samples:
            raise DataError(f"update {update}: every sample was dropped (non-finite rewards)")
        arrays = build_rollout_arrays(samples, [s.reward for s in samples])
        t1 = time.perf_counter()
        if self.features is None:
            old_lp = jax.block_until_ready(self.learner.recompute_logprobs(arrays))
        else:  # the same forward also yields the draft-model features
            old_lp, hidden = self.learner.recompute_logprobs(arrays, with_hidden=True)
            metrics["draft_feature_tokens"] = float(
                self.features.write(update, self.version, samples, arrays, hidden)
            )
        time_old = time.perf_counter() - t1
        metrics.update(self.check_logprobs(update, arrays, old_lp))
        metrics.update(self.learner.update(arrays, old_lp))
        metrics["time_old_logprobs"] += time_old
        t2 = time.perf_counter()
        self.version += 1
        publish = self.producer.publish(self.learner.actor_state(), self.version)
        metrics["time_publish"] = time.perf_counter() - t2
        metrics["publish_gb_per_s"] = float(publish.gb_per_s)
        metrics["tokens_per_s"] = float(
            arrays.response_mask.sum() / max(time.perf_counter() - t0, 1e-9)
        )
        if update + 1 == last:
            metrics["final_eval_reward"] = self.producer.evaluate()
        self.metrics.write(update, metrics)
        bar.step(metrics)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_args(argv)
        trainer = Trainer(cfg)
        code = trainer.run()
    except (
        UsageError,
        DataError,
        ConfigError,
        CheckpointError,
        RunDirError,
        TokenizerError,
    ) as err:
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    except LogprobMismatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    summary = Path(cfg.run_dir) / "metrics.jsonl"
    print(f"done: {cfg.total_updates} updates; metrics in {summary}", file=sys.stderr)
    print(json.dumps({"run_dir": str(cfg.run_dir)}))
    return code


if __name__ == "__main__":
    sys.exit(main())
