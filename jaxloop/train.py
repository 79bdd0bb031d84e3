"""`python -m jaxloop.train --config flow_dppo.py [--config.key=value ...]`

Builds everything from the config and runs rollout -> rewards -> update -> publish, with metrics,
evaluation and checkpoints. A run dir that holds a checkpoint resumes from it automatically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxloop import errors
from jaxloop.checkpoint import TrainCheckpointer
from jaxloop.config import (
    UsageError,
    default_logprob_diff,
    format_tree,
    loop_budget_at,
    parse_command,
    parse_loop_budget,
    validate_mesh,
)
from jaxloop.data.datasets import DataError
from jaxloop.data.tokenizer import TokenizerError
from jaxloop.draft_features import DraftFeatureWriter, config_digest
from jaxloop.metrics import METRICS_FILE, MetricsWriter, progress, read_metrics
from jaxloop.models import ConfigError, LoopedConfig, LoopedLM, load_hf, tiny_hf_config
from jaxloop.models.digests import warn_unverified
from jaxloop.models.hf_io import abstract_model, read_hf_config
from jaxloop.models.orbax_io import (
    RunDirError,
    check_step,
    older_step_offer,
    read_config,
    restore_model,
    write_text_atomic,
)
from jaxloop.models.presets import FULL_SIZE
from jaxloop.parallel import distributed
from jaxloop.parallel import mesh as shd
from jaxloop.rl.advantages import AdvantageHParams
from jaxloop.rl.algorithms import get_algorithm
from jaxloop.rl.batch import RolloutBatch
from jaxloop.rl.learner import Learner, LearnerConfig, metrics_to_host
from jaxloop.rl.losses import LossHParams
from jaxloop.rl.offload import OffloadConfig
from jaxloop.rl.optim import make_optimizer
from jaxloop.rl.state import (
    TrainState,
    abstract_params,
    abstract_train_state,
    build_train_state,
    state_shardings,
)
from jaxloop.rollout.api import Policy, RolloutSource
from jaxloop.rollout.pipeline import RolloutPipeline
from jaxloop.rollout.producer import (
    ProducerSettings,
    RolloutProducer,
    build_tokenizer,
    derive_seed,
)
from jaxloop.rollout.types import SamplingConfig
from jaxloop.summary import checkpoint_steps, completed_update, finish_report


class LogprobMismatchError(RuntimeError):
    """Engine and trainer disagree on the sampled tokens' log-probs beyond the configured bound."""


def check_engine_logprobs(
    update: int, arrays, old_lp, bound: float, loop_old_lp=None
) -> dict[str, float]:
    """Engine vs trainer selected log-probs of the sampled (last) loop, `old_lp` [N, T]; with
    `loop_old_lp` [L, N, T] (per-loop credit) and the engine's per-loop log-probs
    (`arrays.loop_behav_logprobs`, the embedded sampler's), also of every loop t:
    loop<t>_logprob_diff_max. Each is held to `bound` (LogprobMismatchError)."""
    mask = arrays.response_mask
    diff = np.abs(old_lp - arrays.behav_logprobs) * mask
    stats = {
        "logprob_diff_max": float(diff.max()),
        "logprob_diff_mean": float(diff.sum() / max(mask.sum(), 1.0)),
    }
    checked = [("", stats["logprob_diff_max"])]
    if loop_old_lp is not None and arrays.loop_behav_logprobs is not None:
        engine_lp = np.moveaxis(arrays.loop_behav_logprobs, 1, 0)  # [L, N, T] as the trainer's
        for t, (trainer, engine) in enumerate(zip(loop_old_lp, engine_lp, strict=True)):
            worst = float((np.abs(trainer - engine) * mask).max())
            stats[f"loop{t + 1}_logprob_diff_max"] = worst
            checked.append((f" of loop {t + 1}", worst))
    for where, worst in checked:
        if worst > bound:
            raise LogprobMismatchError(
                f"update {update}: engine vs trainer log-prob difference{where} "
                f"{worst:.3g} exceeds rollout.max_logprob_diff={bound:g}"
            )
    return stats


class NonFiniteUpdateError(RuntimeError):
    """optim.max_skipped_updates updates in a row had a non-finite loss or gradient norm, or
    would have left non-finite parameters or optimizer state (the learner's guard)."""


# ---- building blocks from the config ----
def actor_config(cfg) -> LoopedConfig:
    """The actor's LoopedConfig: from model.hf_dir, model.init_checkpoint, model.preset (a
    released model's shape, random init) or the tiny keys."""
    m = cfg.model
    numerics = dict(
        param_dtype=m.param_dtype,
        compute_dtype=m.compute_dtype,
        remat=m.remat,
        attention_impl=m.attention_impl,
        scan_layers=m.scan_layers,
    )
    if m.hf_dir:
        return read_hf_config(m.hf_dir)[0].replace(**numerics)
    if m.init_checkpoint:
        return read_config(m.init_checkpoint, "actor").replace(**numerics)
    if m.preset:
        return LoopedConfig.from_hf_dict(FULL_SIZE[m.preset]).replace(**numerics)
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
    return LoopedConfig.from_hf_dict(tiny_hf_config(m.family, **overrides)).replace(**numerics)


def init_actor_params(cfg, model_cfg: LoopedConfig, mesh, shardings: dict) -> dict:
    """Fresh actor parameters, each tensor straight onto its sharding."""
    m = cfg.model
    numerics = dict(remat=m.remat, attention_impl=m.attention_impl, scan_layers=m.scan_layers)
    if m.hf_dir:
        model = load_hf(
            m.hf_dir, dtype=m.param_dtype, compute_dtype=m.compute_dtype, mesh=mesh, **numerics
        )
        return nnx.state(model).to_pure_dict()
    if m.init_checkpoint:
        model = restore_model(
            m.init_checkpoint,
            "actor",
            dtype=m.param_dtype,
            compute_dtype=m.compute_dtype,
            mesh=mesh,
            **numerics,
        )
        return nnx.state(model).to_pure_dict()
    seed = derive_seed(cfg.seed, 0xA)
    return jax.jit(
        lambda: nnx.state(LoopedLM(model_cfg, rngs=nnx.Rngs(seed))).to_pure_dict(),
        out_shardings=shardings,
    )()


def build_actor(cfg) -> LoopedLM:
    """The actor as a LoopedLM on the default device (tests, scripts; training uses `Training`)."""
    model_cfg = actor_config(cfg)
    params = init_actor_params(cfg, model_cfg, None, None)
    model = abstract_model(model_cfg, "actor")
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(nnx.graphdef(model), state)


def critic_from_actor(actor_params: dict, model_cfg: LoopedConfig, seed: int) -> dict:
    """Critic parameters: the actor's backbone (copied) with a fresh value head."""
    critic = nnx.state(LoopedLM(model_cfg, rngs=nnx.Rngs(seed), role="critic")).to_pure_dict()
    for key in critic:
        if key in actor_params:
            critic[key] = jax.tree.map(jnp.copy, actor_params[key])
    return critic


def build_critic(actor: LoopedLM, seed: int) -> LoopedLM:
    """Same architecture with a value head; the backbone starts as a copy of the actor's."""
    critic = LoopedLM(actor.config, rngs=nnx.Rngs(seed), role="critic")
    pure = critic_from_actor(nnx.state(actor).to_pure_dict(), actor.config, seed)
    state = nnx.state(critic)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(critic, state)
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
        value_loss_scale=cfg.critic.loss_scale,
        entropy_coef=a.entropy_coef,
    )


def uses_reference(cfg) -> bool:
    """A KL-to-reference term is on: in the loss (GRPO) or in the rewards (the critic family)."""
    return cfg.algo.kl_coef > 0


class Training:
    """The learner and the shardings of its state, built from the config on a mesh."""

    def __init__(self, cfg, model_cfg: LoopedConfig, mesh):
        algo = get_algorithm(cfg.algorithm)
        try:
            hparams = loss_hparams(cfg)
        except ValueError as err:
            raise UsageError(f"algo: {err}") from None
        self.cfg, self.model_cfg, self.mesh = cfg, model_cfg, mesh
        steps = cfg.updates_per_rollout or algo.default_updates_per_rollout
        o = cfg.optim
        total = cfg.total_updates * steps
        self.actor_tx = make_optimizer(
            o.name, o.lr, o.schedule, o.warmup_steps, total, o.weight_decay, o.b1, o.b2, o.grad_clip
        )
        self.actor_abstract = abstract_model(model_cfg, "actor")
        actor_graphdef = nnx.split(self.actor_abstract)[0]
        self.critic_abstract = self.critic_tx = critic_graphdef = None
        if algo.uses_critic:
            self.critic_abstract = abstract_model(model_cfg, "critic")
            critic_graphdef = nnx.split(self.critic_abstract)[0]
            self.critic_tx = make_optimizer(
                o.name, cfg.critic.lr, "constant", 0, total, 0.0, o.b1, o.b2, o.grad_clip
            )
        self.shardings = state_shardings(
            mesh,
            shd.param_shardings(self.actor_abstract, mesh),
            abstract_params(self.actor_abstract),
            self.actor_tx,
            None
            if self.critic_abstract is None
            else shd.param_shardings(self.critic_abstract, mesh),
            None if self.critic_abstract is None else abstract_params(self.critic_abstract),
            self.critic_tx,
            with_reference=uses_reference(cfg),
        )
        lcfg = LearnerConfig(
            micro_batch_size=cfg.micro_batch_size,
            temperature=cfg.rollout.temperature,
            updates_per_rollout=steps,
            critic_steps=cfg.critic.steps_per_rollout,
            logits_chunk=cfg.model.logits_chunk,
            pack_tokens=cfg.learner.pack_tokens,
            loop_credit=cfg.algo.loop_credit,
            advantage=AdvantageHParams(
                gamma=cfg.algo.gamma,
                lam=cfg.algo.lam,
                kl_coef=cfg.algo.kl_coef,
                whiten=cfg.algo.whiten_advantages,
                grpo_use_std=cfg.algo.grpo_use_std,
            ),
        )
        self._learner_args = (algo, hparams, lcfg, self.actor_tx, self.critic_tx)
        self._learner_kwargs = dict(
            mesh=mesh,
            state_shardings=self.shardings,
            offload=OffloadConfig(
                critic=cfg.offload.critic,
                optimizer=cfg.offload.optimizer,
                reference=cfg.offload.reference,
            ),
        )
        self.learner = Learner(
            actor_graphdef, critic_graphdef, *self._learner_args, **self._learner_kwargs
        )
        self._budget_learners = {model_cfg.num_loops: self.learner}

    def learner_for(self, loops: int | None) -> Learner:
        """The learner whose actor, reference and critic run `loops` loops (a loop budget; None:
        all): the same parameters under graphdefs of config.num_loops = K, so a K-loop update
        costs K loops; built (and compiled) once per distinct K."""
        loops = self.model_cfg.num_loops if loops is None else loops
        if loops not in self._budget_learners:
            budget_cfg = self.model_cfg.replace(num_loops=loops)
            actor = nnx.split(abstract_model(budget_cfg, "actor"))[0]
            critic = None
            if self.critic_abstract is not None:
                critic = nnx.split(abstract_model(budget_cfg, "critic"))[0]
            self._budget_learners[loops] = Learner(
                actor, critic, *self._learner_args, **self._learner_kwargs
            )
        return self._budget_learners[loops]

    def fresh_state(self, actor: dict | None = None) -> TrainState:
        """A new TrainState around `actor` (default: the configured initial weights); the
        critic copies its backbone, the reference its parameters, optimizer states are fresh."""
        cfg = self.cfg
        if actor is None:
            actor = self.initial_actor()
        critic = None
        if self.critic_abstract is not None:
            seed = derive_seed(cfg.seed, 0xC)
            critic = jax.jit(
                lambda a: critic_from_actor(a, self.model_cfg, seed),
                out_shardings=self.shardings.critic_params,
            )(actor)
        return build_train_state(
            actor, self.actor_tx, critic, self.critic_tx, shardings=self.shardings, seed=cfg.seed
        )

    def abstract_state(self) -> TrainState:
        return abstract_train_state(
            abstract_params(self.actor_abstract),
            self.actor_tx,
            None if self.critic_abstract is None else abstract_params(self.critic_abstract),
            self.critic_tx,
            with_reference=uses_reference(self.cfg),
        )

    def initial_actor(self) -> dict:
        """The configured initial actor parameters on their shardings."""
        return init_actor_params(self.cfg, self.model_cfg, self.mesh, self.shardings.actor_params)

    def policy(self, state: TrainState) -> nnx.State:
        """The actor parameters of `state` as the nnx.State engines take (no copy)."""
        return self.policy_of(state.actor_params)

    def policy_of(self, actor_params: dict) -> nnx.State:
        policy = nnx.state(self.actor_abstract)
        nnx.replace_by_pure_dict(policy, actor_params)
        return policy

    def actor_model(self, state: TrainState) -> LoopedLM:
        return nnx.merge(nnx.graphdef(self.actor_abstract), self.policy(state))


# ---- the loop ----
def producer_settings(cfg, requires_groups: bool) -> ProducerSettings:
    return ProducerSettings(
        seed=cfg.seed,
        data={
            "source": cfg.data.source,
            "eval_source": cfg.data.eval_source,
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
            early_exit=cfg.rollout.early_exit,
            exit_threshold=cfg.rollout.exit_threshold,
            # per-loop credit: the embedded sampler's per-loop log-probs, checked per loop
            # (vLLM engines have none)
            loop_logprobs=cfg.algo.loop_credit != "last" and cfg.rollout.engine == "jax",
        ),
        loop_budget=parse_loop_budget(cfg.model.loop_budget),
    )


def build_producer(cfg, actor: LoopedLM, settings: ProducerSettings, mesh=None) -> RolloutSource:
    """In-process producer around the embedded engine, or the Ray manager for vLLM engines."""
    if cfg.rollout.engine == "jax":
        from jaxloop.rollout.jax_sampler import JaxSamplerEngine

        return RolloutProducer(settings, JaxSamplerEngine(actor, mesh=mesh))
    from jaxloop.rollout.ray.client import RayRolloutClient

    return RayRolloutClient(cfg, actor, settings)


def device_memory(phase: str) -> dict[str, float]:
    """GB in use on this process's first device after `phase`, and the process's peak so far
    (from `device.memory_stats()`; empty where the backend has none, e.g. CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    out = {}
    if "bytes_in_use" in stats:
        out[f"device_gb_after_{phase}"] = stats["bytes_in_use"] / 1e9
    if "peak_bytes_in_use" in stats:
        out["device_peak_gb"] = stats["peak_bytes_in_use"] / 1e9
    return out


class _NoMetrics:
    """Metrics sink of processes other than 0 (only process 0 writes metrics)."""

    def write(self, update, metrics) -> None:
        pass

    def close(self) -> None:
        pass


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir).resolve()
        self.algo = get_algorithm(cfg.algorithm)
        distributed.initialize(cfg.dist)
        self.is_main = distributed.is_main_process()
        model_cfg = actor_config(cfg)
        sizes = validate_mesh(cfg, jax.device_count(), model_cfg)
        self.mesh = shd.make_mesh(**sizes)
        self.training = Training(cfg, model_cfg, self.mesh)
        check_resume(cfg, self.run_dir, self.training)  # before anything is written or restored
        check_fresh_start(cfg, self.run_dir)  # no checkpoint: refuse to overwrite another run
        self.learner = self.training.learner
        settings = producer_settings(cfg, self.algo.requires_groups)
        if cfg.data.tokenizer == "char" and cfg.model.vocab_size != model_cfg.vocab_size:
            settings = dataclasses.replace(settings, vocab_size=model_cfg.vocab_size)
        # nothing is written before the state is built (a fresh one reads model.init_checkpoint or
        # model.hf_dir and may fail): the run dir and its checkpoints/ come after it
        step = (checkpoint_steps(self.run_dir) or [None])[-1]
        cursor, ahead = None, []
        # warm start: recorded in every checkpoint, so a resume never repeats it
        self.warm_start: dict = {}
        if step is not None:
            self.checkpointer = TrainCheckpointer(self.run_dir, keep=cfg.keep_checkpoints)
            self.state, extra = self.checkpointer.restore(  # verified by check_resume
                step, self.training.abstract_state(), self.training.shardings, verify=False
            )
            cursor = extra["data_cursor"]
            ahead = extra.get("batches_ahead", [])
            self.warm_start = extra.get("warm_start", {})
        else:
            self.state = self.training.fresh_state()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.checkpointer = TrainCheckpointer(self.run_dir, keep=cfg.keep_checkpoints)
            if self.is_main:
                self.checkpointer.write_configs(
                    self.training.actor_abstract, self.training.critic_abstract
                )
                write_text_atomic(
                    self.run_dir / "config.json", cfg.to_json_best_effort(indent=2) + "\n"
                )
        self.state = self.learner.rest(self.state)  # offloaded parts to host memory
        self.start_update = self.state.update_count
        engine_model = (
            self.training.actor_abstract
            if cfg.rollout.engine == "jax"
            else self.training.actor_model(self.state)
        )
        self.producer: RolloutSource = build_producer(cfg, engine_model, settings, self.mesh)
        if cursor is not None:
            self.producer.restore(cursor)
        elif cfg.warm_start.sft_steps > 0:
            self.run_warm_start()
        # remote engines generate while the learner trains; the embedded sampler shares the
        # learner's devices, so it generates its batch ahead in this thread (the same batches)
        self.pipeline = RolloutPipeline(
            self.producer,
            cfg.rollout.max_staleness,
            cfg.total_updates,
            background=cfg.rollout.engine != "jax",
        )
        self.pipeline.restore(ahead)
        if cfg.rollout.max_staleness and self.algo.policy_loss != "decoupled_ppo" and self.is_main:
            print(
                f"warning: rollout.max_staleness={cfg.rollout.max_staleness} with "
                f"{cfg.algorithm}: its ratio is taken to the recomputed log-probs of the current "
                "policy, so it is off-policy for batches generated by older versions; "
                "algorithm=dppo corrects for that",
                file=sys.stderr,
            )
        self.metrics = (
            MetricsWriter(self.run_dir, start_update=self.start_update)
            if self.is_main
            else _NoMetrics()
        )
        self.warned_constant_values = False
        self.features = None
        if cfg.draft_features.enabled and self.is_main:
            tokenizer = build_tokenizer(settings.tokenizer, settings.vocab_size)
            self.features = DraftFeatureWriter(
                self.run_dir,
                cfg.draft_features.max_tokens_per_update,
                cfg.draft_features.max_bytes,
                config_digest(model_cfg.to_hf_dict()),
                tokenizer.digest(),
            )

    def run_warm_start(self) -> None:
        """warm_start.sft_steps SFT steps on the fresh actor; the state is then built around
        the warm-started actor (critic backbone and reference copied from it, fresh optimizer
        states). Its metrics go into update 0's row."""
        from jaxloop.sft import warm_start

        actor = self.state.actor_params
        self.state = self.state.replace(actor_params=None)
        actor, self.warm_start = warm_start(self.cfg, self.training, self.producer, actor)
        self.state = self.learner.rest(self.training.fresh_state(actor))

    @property
    def version(self) -> int:
        return self.state.version

    def publish(self):
        params, config = self.training.policy(self.state), self.training.actor_abstract.config
        return self.producer.publish(Policy(params, self.state.version, config))

    def staleness(self, samples) -> dict[str, float]:
        """How many versions older than the policy being trained the batch's samples are."""
        lag = np.array([self.version - s.policy_version for s in samples], np.float64)
        return {"staleness_mean": float(lag.mean()), "staleness_max": float(lag.max())}

    def check_logprobs(self, update: int, arrays, old_lp, loop_old_lp=None) -> dict[str, float]:
        rollout = self.cfg.rollout
        bound = rollout.max_logprob_diff or default_logprob_diff(
            rollout.engine, self.cfg.model.compute_dtype
        )
        return check_engine_logprobs(update, arrays, old_lp, bound, loop_old_lp)

    def warn_constant_values(self, update: int, metrics: dict) -> None:
        """Once per process: the critic gave (nearly) the same value to every response token of a
        batch whose returns vary, so its advantages are the returns shifted by a constant."""
        if self.warned_constant_values or "value_std" not in metrics or not self.is_main:
            return
        if metrics["value_std"] < 1e-6 and metrics.get("reward_std", 0.0) > 0:
            self.warned_constant_values = True
            print(
                f"warning: update {update}: the critic's values are constant over the batch "
                f"(value_std {metrics['value_std']:.2g}, value_mean {metrics['value_mean']:.3g}) "
                "while the rewards vary: it has not learned yet (see critic.warmup_updates, "
                "critic.lr)",
                file=sys.stderr,
            )

    def run(self) -> int:
        cfg = self.cfg
        self.publish()
        self.pipeline.fill(self.start_update)
        last = cfg.total_updates
        stop_at = last if cfg.stop_after <= 0 else min(last, self.start_update + cfg.stop_after)
        bar = progress(
            total=last,
            initial=self.start_update,
            desc=cfg.algorithm,
            disable=None if cfg.progress and self.is_main else True,
        )
        finished = False
        try:
            for update in range(self.start_update, stop_at):
                self.one_update(update, last, bar)
                done = update + 1
                if done == stop_at or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                    self.checkpointer.save(
                        self.state,
                        {
                            "data_cursor": self.producer.state(),
                            "seed": cfg.seed,
                            "batches_ahead": self.pipeline.state(),
                            # the record, not its timing: a rerun computes the same record
                            "warm_start": {
                                k: v
                                for k, v in self.warm_start.items()
                                if k != "warm_start_seconds"
                            },
                        },
                    )
            finished = True
        finally:
            self.pipeline.close()
            bar.close(summary=finished)  # a failed run: its error is the one line
            self.metrics.close()
            self.checkpointer.close()
            self.producer.close()
        return 0

    def old_logprobs(self, learner, update: int, metrics: dict, samples, batch, device_batch):
        """The separate old-log-prob forward (several optimizer steps per rollout, per-loop
        credit, a reference, draft features, critic warm-up), with the draft features it also
        yields and the engine-vs-trainer check; its time goes to metrics."""
        t1 = time.perf_counter()
        if not self.cfg.draft_features.enabled:
            old_lp = learner.old_logprobs(self.state, device_batch)
        else:  # the same forward also yields the draft-model features
            # every process runs the same programs (SPMD); only process 0 writes the features
            old_lp, hidden = learner.old_logprobs(self.state, device_batch, with_hidden=True)
            hidden = shd.to_host(hidden)
            if self.features is not None:
                metrics["draft_feature_tokens"] = float(
                    self.features.write(update, self.version, samples, batch, hidden)
                )
        # per-loop credit: [L, N, T]; the engine sampled from the last loop
        old_lp_host = shd.to_host(old_lp[-1] if learner.per_loop else old_lp)
        metrics["time_old_logprobs"] = time.perf_counter() - t1
        if metrics["staleness_max"] == 0:  # a batch of older versions cannot be checked
            loop_old_lp = None
            if learner.per_loop and batch.loop_behav_logprobs is not None:  # embedded sampler
                loop_old_lp = shd.to_host(old_lp)  # every loop is checked
            metrics.update(self.check_logprobs(update, batch, old_lp_host, loop_old_lp))
        return old_lp

    def one_update(self, update: int, last: int, bar) -> None:
        cfg = self.cfg
        metrics = {"policy_version": float(self.version)}
        if update == 0:
            metrics.update(self.warm_start)
        t0 = time.perf_counter()
        if cfg.eval_every and update % cfg.eval_every == 0:
            metrics["eval_reward"] = self.producer.evaluate()
        t_generate = time.perf_counter()
        samples, stats = self.pipeline.take(update)
        metrics.update(stats)
        metrics["time_generate"] = time.perf_counter() - t_generate
        metrics.update(device_memory("generate"))
        if not samples:
            raise DataError(f"update {update}: every sample was dropped (non-finite rewards)")
        metrics.update(self.staleness(samples))
        # the loop budget of this update: sampler, recompute, loss and critic all run K loops
        loops = self.training.model_cfg.num_loops
        loops = loop_budget_at(parse_loop_budget(cfg.model.loop_budget), update) or loops
        sampled = {x.extras.get("loop_budget", loops) for x in samples}
        if sampled != {loops}:
            raise RuntimeError(f"update {update}: samples ran {sampled} loops, the trainer {loops}")
        metrics["loop_budget"] = float(loops)
        learner = self.training.learner_for(loops)
        early_exit = cfg.rollout.early_exit != "none"
        if early_exit:  # the trainer replays each token's depth
            metrics.update(depth_metrics(samples, loops))
        batch = RolloutBatch.from_samples(
            samples,
            num_loops=loops if early_exit else 0,
            depth_as_action=cfg.algo.depth_as_action,
            seq_multiple=cfg.learner.seq_multiple,
            max_new_tokens=cfg.rollout.max_new_tokens,
        ).pad_to(shd.data_parallel_size(self.mesh))
        if cfg.learner.pack_tokens > 0:  # one sample length: the packed learner's shapes are fixed
            batch = batch.with_length(cfg.learner.pack_tokens + 1)
        device_batch = learner.place_batch(batch.arrays())
        critic_only = update < cfg.critic.warmup_updates  # critic warm-up: the actor waits
        metrics["critic_warmup"] = float(critic_only)
        # the engine-vs-trainer check compares log-probs of the policy that sampled the batch
        checked = metrics["staleness_max"] == 0  # a batch of older versions cannot be checked
        fused = (
            learner.fuses_old_logprobs
            and not critic_only
            and not cfg.draft_features.enabled
            and self.state.ref_params is None
        )
        if fused:  # one optimizer step: the update's own forward gives the old log-probs
            metrics["time_old_logprobs"] = 0.0
            t_update = time.perf_counter()
            self.state, update_metrics, old_lp = learner.update_fused(self.state, device_batch)
            if checked:  # after the step, before anything of it is saved or published
                metrics.update(self.check_logprobs(update, batch, shd.to_host(old_lp)))
        else:
            old_lp = self.old_logprobs(learner, update, metrics, samples, batch, device_batch)
            t_update = time.perf_counter()
            self.state, update_metrics = learner.update(
                self.state, {**device_batch, "old_logprobs": old_lp}, critic_only=critic_only
            )
        metrics.update(metrics_to_host(update_metrics))
        self.warn_constant_values(update, metrics)
        metrics["skipped_updates"] = float(self.state.skipped_updates)
        in_a_row, limit = int(self.state.consecutive_skips), cfg.optim.max_skipped_updates
        if in_a_row >= limit:  # nothing of this update is saved: the last checkpoint stays good
            raise NonFiniteUpdateError(
                f"update {update}: non-finite loss or gradient norm in {in_a_row} consecutive "
                f"updates (optim.max_skipped_updates={limit}); nothing was applied since update "
                f"{update - in_a_row}, last checkpoint: step {self.checkpointer.latest_step()}"
            )
        metrics["time_update"] = time.perf_counter() - t_update
        metrics.update(device_memory("update"))
        self.pipeline.join()  # the next batch, generated with this update's policy
        t2 = time.perf_counter()
        publish = self.publish()
        metrics["time_publish"] = time.perf_counter() - t2
        metrics["publish_gb_per_s"] = float(publish.gb_per_s)
        metrics["publish_bytes"] = float(publish.sent_bytes)  # shipped to the engines
        metrics["publish_full_bytes"] = float(publish.num_bytes)  # the whole version
        metrics["publish_fallback"] = float(publish.fell_back)  # a refused delta, sent in full
        metrics["tokens_per_s"] = float(
            batch.response_mask.sum() / max(time.perf_counter() - t0, 1e-9)
        )
        wall = max(time.perf_counter() - t0, 1e-9)
        engine_s, wait_s = self.pipeline.take_timings()
        metrics["engine_idle_fraction"] = max(0.0, 1.0 - engine_s / wall)
        metrics["learner_idle_fraction"] = min(1.0, wait_s / wall)
        metrics["time_total"] = wall
        if update + 1 == last:
            metrics["final_eval_reward"] = self.producer.evaluate()
        self.metrics.write(update, metrics)
        bar.step(metrics)


def depth_metrics(samples, loops: int) -> dict[str, float]:
    """Early-exit rollouts: the mean loops a response token ran, the fraction that exited at each
    loop t (depth_hist_<t>, t = 1..loops) and the compute saved against running every loop. Over
    every response token but the last: its forward would only predict past the response (vLLM
    never runs it; the embedded sampler's is discarded), so both engines count the same tokens."""
    depths = np.concatenate(
        [np.asarray(s.extras["response_depths"][:-1], np.int64) for s in samples] or [np.zeros(0)]
    )
    if depths.size == 0:
        return {}
    mean = float(depths.mean())
    metrics = {"depth_mean": mean, "saved_compute": 1.0 - mean / loops}
    for t in range(1, loops + 1):
        metrics[f"depth_hist_{t}"] = float(np.mean(depths == t))
    return metrics


def _stored_vocab_size(cfg) -> int:
    """The vocabulary of the model a run starts from, read from its config file (dry run: no
    model is built); the config's model.vocab_size for the built-in model."""
    m = cfg.model
    for path in (
        Path(m.hf_dir) / "config.json" if m.hf_dir else None,
        Path(m.init_checkpoint) / "actor_config.json" if m.init_checkpoint else None,
    ):
        if path is not None and path.is_file():
            try:
                return int(json.loads(path.read_text())["vocab_size"])
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{path}: no integer vocab_size") from None
    return int(m.vocab_size)


# ---- before anything is written ----
def check_model_source(cfg) -> LoopedConfig:
    """model.init_checkpoint holds a checkpoint, and the model's own rules hold (query heads
    divisible by key/value heads, an even head_dim, ...): the actor's LoopedConfig. Reads only;
    a dry run makes these checks too (train and sft)."""
    if cfg.model.init_checkpoint and not checkpoint_steps(cfg.model.init_checkpoint):
        raise UsageError(
            f"model.init_checkpoint={cfg.model.init_checkpoint!r} holds no checkpoint "
            "(checkpoints/<step>/): give a run dir written by jaxloop.train, jaxloop.sft or "
            "conversion.from_hf"
        )
    return actor_config(cfg)


def check_sft_keys_read(cfg) -> None:
    """A training run reads the sft.* keys and the other warm_start.* keys only for its warm
    start: one changed from its default while warm_start.sft_steps is 0 would be silently
    ignored, so it is refused."""
    from jaxloop.config import base_config, flat_items

    if cfg.warm_start.sft_steps > 0:
        return
    base = base_config()
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
    from jaxloop.models.hf_io import check_hf_dir

    algo = get_algorithm(cfg.algorithm)
    try:
        loss_hparams(cfg)
    except ValueError as err:
        raise UsageError(f"algo: {err}") from None
    check_sft_keys_read(cfg)
    if cfg.model.hf_dir:
        check_hf_dir(cfg.model.hf_dir)
    check_model_source(cfg)
    vocab = _stored_vocab_size(cfg)
    settings = producer_settings(cfg, algo.requires_groups)
    if cfg.data.tokenizer == "char":
        settings = dataclasses.replace(settings, vocab_size=vocab)
    producer = RolloutProducer(settings, engine=None)  # the data / tokenizer / reward errors
    if producer.tokenizer.vocab_size > vocab:
        raise TokenizerError(
            f"data.tokenizer={cfg.data.tokenizer!r} has {producer.tokenizer.vocab_size} tokens, "
            f"more than the model's vocabulary of {vocab}: its ids would index past the embedding"
        )
    return algo


WRITE_ERRNOS = errors.WRITE_ERRNOS  # a write the file system refuses: a user error (exit 2)


def check_writable(run_dir) -> None:
    """UsageError unless a file can be created, written and synced in run_dir (a new one: in its
    nearest existing parent); the probe file is removed. A read-only or full file system fails
    here, before anything is written."""
    path = Path(run_dir).resolve()
    if path.exists() and not path.is_dir():
        raise UsageError(f"run_dir {str(path)!r} exists and is not a directory")
    where = path
    while not where.exists():
        where = where.parent
    probe = where / f".jaxloop-write-probe-{os.getpid()}"
    times = where.stat()
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise UsageError(
            f"run_dir {str(path)!r} is not writable: {err.strerror or err} (in {where})"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
            os.utime(where, ns=(times.st_atime_ns, times.st_mtime_ns))  # the probe leaves no trace


# ---- resuming a run dir ----
# Keys a resume may change: where and how the run executes, how often it evaluates, checkpoints
# and logs, when it stops. They leave what an update computes alone: micro_batch_size splits the
# same sums into other partial sums (equal up to float rounding; bitwise only when unchanged),
# remat / attention_impl / logits_chunk / scan_layers compute the same values, learner.seq_multiple
# only adds padding columns that every sum masks out, a mesh or an offload places
# them, model.hf_dir / model.init_checkpoint only gave the first weights (the architecture they
# give is compared through actor_config.json), rollout.engine samples the same policy. Every other
# key is the run's math (seed, algorithm, algo.*, optim.*, critic.* when the algorithm has a
# critic, model shape and dtypes, data.*, sampling, batch sizes, updates_per_rollout): a resume
# that changes one is refused. total_updates is free under optim.schedule=constant only (cosine
# and linear decay over it). Keys the run dir's config.json does not have (it predates them) are
# not compared.
RESUME_FREE_KEYS = frozenset(
    {
        "run_dir",
        "stop_after",
        "checkpoint_every",
        "keep_checkpoints",
        "eval_every",
        "eval_prompts",
        "progress",
        "verbose",
        "micro_batch_size",
        "model.hf_dir",
        "model.init_checkpoint",
        "model.remat",
        "model.attention_impl",
        "model.logits_chunk",
        "model.scan_layers",
        "learner.seq_multiple",
        "data.eval_source",
        "data.max_prompt_tokens",
        "rollout.engine",
        "rollout.max_logprob_diff",
        "rollout.num_engines",
        "rollout.ray_address",
        "rollout.publish_bucket_mb",
        "rollout.transport",
        "rollout.publish",
        "rollout.engine_timeout_s",
        "rollout.publish_timeout_s",
        "rollout.engine_log_level",
        "optim.max_skipped_updates",
    }
)
RESUME_FREE_SECTIONS = ("mesh.", "dist.", "draft_features.", "offload.")
ARCHITECTURE_FIELDS = (
    "family",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_loops",
    "rope_theta",
    "rms_norm_eps",
    "sandwich_norm",
    "early_exit_gate",
    "norm_between_loops",
)


def _flat_json(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat_json(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_changes_math(cfg, key: str) -> bool:
    """Whether `key` may not change when a run dir resumes (see RESUME_FREE_KEYS)."""
    if key in RESUME_FREE_KEYS or key.startswith(RESUME_FREE_SECTIONS):
        return False
    if key == "total_updates":
        return cfg.optim.schedule != "constant"
    if key.startswith("critic."):
        return get_algorithm(cfg.algorithm).uses_critic
    return True


def check_resume(cfg, run_dir: Path, training: Training) -> None:
    """Before a checkpoint is restored: refuse to resume `run_dir` with a config whose math
    differs from the one it was started with (its config.json), a model of another architecture
    (its actor_config.json), or a checkpoint that holds another algorithm's state, arrays of other
    shapes, or is incomplete. Reads only; without a checkpoint nothing is checked (the run starts
    afresh)."""
    from jaxloop.checkpoint import ARRAY_ITEMS, TRAIN_STATE
    from jaxloop.models.orbax_io import CHECKPOINT_DIR

    steps = checkpoint_steps(run_dir)
    if not steps:
        return
    refuse = "(start a new run_dir to change it)"
    check_resume_config(cfg, run_dir)
    actor_path = run_dir / "actor_config.json"
    if actor_path.is_file():
        before = read_config(run_dir, "actor")  # RunDirError when it is not a model config
        for name in ARCHITECTURE_FIELDS:
            old, new = getattr(before, name), getattr(training.model_cfg, name)
            if old != new:
                raise UsageError(
                    f"run dir {run_dir} was started with a model of {name}={old!r}; this run's "
                    f"model has {name}={new!r} {refuse}"
                )
    # the checkpoint itself: the items of this algorithm, the shapes of this model
    step = steps[-1]
    ckpt = run_dir / CHECKPOINT_DIR / str(step)
    abstract = training.abstract_state()
    want = {item for item, field in ARRAY_ITEMS.items() if getattr(abstract, field) is not None}
    have = {p.name for p in ckpt.iterdir() if p.is_dir()}
    extra = sorted(have - want - {TRAIN_STATE})
    if extra:
        raise UsageError(
            f"run dir {run_dir}: checkpoint {step} holds {', '.join(extra)}, which a "
            f"{cfg.algorithm} run does not have (written by another algorithm or config) {refuse}"
        )
    lacking = sorted((want | {TRAIN_STATE}) - have)
    delete = older_step_offer(  # names the newest older step that verifies
        run_dir, step, fallback=f"move {ckpt} out of checkpoints/ to resume from it"
    )
    if lacking:
        raise RunDirError(
            f"run dir {run_dir}: checkpoint {step} is incomplete: it lacks "
            f"{', '.join(lacking)} ({delete})"
        )
    try:
        counters = json.loads((ckpt / TRAIN_STATE / "metadata").read_text())
        int(counters["update"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RunDirError(
            f"run dir {run_dir}: checkpoint {step} is corrupt: its {TRAIN_STATE} is unreadable "
            f"({type(err).__name__}) ({delete})"
        ) from None
    for item, field in ARRAY_ITEMS.items():
        if item in want and field.endswith("_params"):
            _check_stored_shapes(ckpt / item, getattr(abstract, field), run_dir, step, delete)
    # the bytes: every item against the digests written at save (a same-size corruption too)
    fallback = f"move {ckpt} out of checkpoints/ to resume from it"
    verified = check_step(run_dir, step, fallback=fallback, warn=False)
    if (run_dir / METRICS_FILE).is_file():
        read_metrics(run_dir)  # MetricsFileError (one line) when it is damaged
    if not verified and jax.process_index() == 0:  # restored as before, with one warning
        warn_unverified(step, run_dir)


def _stored_config(run_dir: Path) -> dict | None:
    """The run dir's config.json flattened (None without one; RunDirError when unreadable)."""
    stored_path = run_dir / "config.json"
    if not stored_path.is_file():
        return None
    try:
        return _flat_json(json.loads(stored_path.read_text()))
    except (ValueError, AttributeError, UnicodeDecodeError) as err:
        raise RunDirError(f"{stored_path} is unreadable ({type(err).__name__}: {err})") from None


def config_conflict(cfg, stored: dict, changes_math=None) -> tuple[str, object, object] | None:
    """The first key of the run's math (`changes_math(cfg, key)`, default resume_changes_math)
    whose value in `stored` (a flattened config.json) differs from cfg's: (key, stored, new)."""
    from jaxloop.config import flat_items

    changes_math = changes_math or resume_changes_math
    for key, value in flat_items(cfg):
        value = json.loads(json.dumps(value))
        if key in stored and stored[key] != value and changes_math(cfg, key):
            return key, stored[key], value
    return None


def check_resume_config(cfg, run_dir: Path) -> None:
    """A run dir with a checkpoint resumes only with the math it was started with (config.json);
    reads only, needs no model (a dry run makes it too)."""
    if not checkpoint_steps(run_dir):
        return
    stored = _stored_config(run_dir)
    conflict = None if stored is None else config_conflict(cfg, stored)
    if conflict:
        key, old, new = conflict
        raise UsageError(
            f"run dir {run_dir} was started with {key}={old!r}; this run has {key}={new!r} "
            "(start a new run_dir to change it)"
        )


# What a run writes at the top of its run dir besides checkpoints/: a fresh start (no checkpoint
# to resume) over them would replace another run's files.
RUN_FILES = (
    "config.json",
    "actor_config.json",
    "critic_config.json",
    "metrics.jsonl",
    "curves.png",
    "tb",
    "draft_features",
)


def check_fresh_start(cfg, run_dir: Path, changes_math=None) -> None:
    """A run dir without a checkpoint starts afresh, writing RUN_FILES. Refuse (naming the file)
    when it already holds one of them and they are not this run's: its config.json is missing,
    not a jaxloop config, or differs in a key of the run's math (the same run restarted before its
    first checkpoint may start again). Reads only."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or checkpoint_steps(run_dir):
        return
    present = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not present:
        return
    why = "no config.json"
    try:
        stored = _stored_config(run_dir)
    except RunDirError:
        stored, why = None, "an unreadable config.json"
    if stored is not None:
        conflict = None
        if not {"algorithm", "seed", "run_dir"} <= set(stored):
            why = "a config.json that is not a jaxloop run's"
        elif conflict := config_conflict(cfg, stored, changes_math):
            key, old, new = conflict
            why = f"config.json with {key}={old!r} (this run has {new!r})"
        else:
            return  # this run's own files: it was started before and stopped before a checkpoint
    raise UsageError(
        f"run dir {run_dir} holds {present[0]} of another run ({why}) and no checkpoint to "
        "resume: starting here would overwrite it; move it away or choose another run_dir"
    )


class FreshStartCleanup:
    """What a fresh start creates (the run dir and its parents, or new entries in an existing run
    dir), removed again when the start fails with a user error before its first checkpoint: a
    refused run leaves no skeleton behind (run dir, checkpoints/, config.json, metrics.jsonl)."""

    def __init__(self, run_dir):
        self.run_dir = Path(run_dir).resolve()
        self.active = not checkpoint_steps(self.run_dir)
        self.top, parent = None, self.run_dir
        while not parent.exists():
            self.top, parent = parent, parent.parent
        self.parent, self.times = parent, parent.stat()
        self.before = set(os.listdir(self.run_dir)) if self.top is None else set()

    def undo(self, err=None) -> None:
        if not self.active or checkpoint_steps(self.run_dir) or jax.process_index() != 0:
            return
        if self.top is not None:
            if self.top.exists():
                shutil.rmtree(self.top, ignore_errors=True)
        elif self.run_dir.is_dir():
            for name in sorted(set(os.listdir(self.run_dir)) - self.before):
                path = self.run_dir / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the directory's times as they were
            os.utime(self.parent, ns=(self.times.st_atime_ns, self.times.st_mtime_ns))


def _check_stored_shapes(item_dir: Path, abstract, run_dir, step, delete) -> None:
    """The shapes and dtypes in an orbax item's metadata against the model's (metadata only)."""
    import logging

    import orbax.checkpoint as ocp

    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that an item dir has no step metadata of its own
    try:
        if (item_dir / "_METADATA").is_file():  # orbax's tree metadata: JSON
            json.loads((item_dir / "_METADATA").read_text())
        meta = ocp.StandardCheckpointer().metadata(item_dir)
        stored = {
            jax.tree_util.keystr(p): leaf
            for p, leaf in jax.tree_util.tree_leaves_with_path(meta.item_metadata)
        }
    except Exception as err:  # noqa: BLE001 - orbax / tensorstore raise many kinds
        raise RunDirError(
            f"run dir {run_dir}: checkpoint {step} is corrupt: {item_dir.name} metadata is "
            f"unreadable ({type(err).__name__}) ({delete})"
        ) from None
    finally:
        absl.setLevel(level)
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        key = jax.tree_util.keystr(path)
        got = stored.get(key)
        if got is None:
            raise RunDirError(
                f"run dir {run_dir}: checkpoint {step} lacks {item_dir.name}{key}: it is corrupt "
                f"or was written for another model ({delete})"
            )
        if tuple(got.shape) != tuple(leaf.shape) or jnp.dtype(got.dtype) != jnp.dtype(leaf.dtype):
            raise UsageError(
                f"run dir {run_dir}: checkpoint {step} holds {item_dir.name}{key} of shape "
                f"{tuple(got.shape)} {jnp.dtype(got.dtype)}; this model has {tuple(leaf.shape)} "
                f"{jnp.dtype(leaf.dtype)} (start a new run_dir to change it)"
            )


def run_dir_status(cfg) -> str:
    done = completed_update(cfg.run_dir)
    if done is None:
        return "new" if not Path(cfg.run_dir).exists() else "no checkpoint: starts at update 0"
    if done >= cfg.total_updates:
        return f"already complete: update {done} of {cfg.total_updates}"
    return f"resumes at update {done} of {cfg.total_updates}"


def dry_run(cfg) -> str:
    """The checks a real run makes before it builds a model (config, loss hyper-parameters,
    data source, tokenizer, reward, prompt lengths), then the resolved config. Writes nothing."""
    algo = preflight(cfg)
    done = completed_update(cfg.run_dir)
    if done is None or done < cfg.total_updates:
        check_resume_config(cfg, Path(cfg.run_dir).resolve())
        check_fresh_start(cfg, Path(cfg.run_dir).resolve())
    steps = cfg.updates_per_rollout or algo.default_updates_per_rollout
    bound = cfg.rollout.max_logprob_diff or default_logprob_diff(
        cfg.rollout.engine, cfg.model.compute_dtype
    )
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
        ),
        file=sys.stderr,
    )


def run_cleaning_up(body) -> int:
    """`body(cleanup)` behind the entry points' boundary (jaxloop/errors.py); `body` appends a
    FreshStartCleanup for every fresh start it makes, and a user error undoes them all."""
    cleanup: list[FreshStartCleanup] = []

    def undo(err) -> None:
        for fresh in cleanup:
            fresh.undo(err)

    return errors.run_entry_point(lambda: body(cleanup), on_user_error=undo)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxloop.train`. One exception boundary (jaxloop/errors.py): a user error is one
    line on stderr and exit code 2, and what a fresh start had created is removed again; a run
    stopped by a log-prob mismatch or non-finite updates exits with code 3; anything else is a
    bug and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else argv
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
    done = completed_update(cfg.run_dir)
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
    trainer = None
    try:
        trainer = Trainer(cfg)
        code = trainer.run()
    except (LogprobMismatchError, NonFiniteUpdateError) as err:
        print(f"error: {err}", file=sys.stderr)
        _report(cfg, trainer, started)
        return 3
    _report(cfg, trainer, started)
    print(json.dumps({"run_dir": str(cfg.run_dir)}))
    return code


if __name__ == "__main__":
    sys.exit(main())
