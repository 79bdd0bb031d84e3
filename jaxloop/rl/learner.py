"""Jitted actor and critic steps: old log-prob recompute, advantages, micro-batched updates.

The learner knows the algorithm only through its registry entry (`rl.algorithms.Algorithm`):
which policy loss and advantage estimator, whether there is a critic, whether the loss needs
the frozen old policy's full-vocabulary logits. Parameters are pure dicts (nnx state), merged
into the one NNX decoder inside each jitted function.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxloop.models.looped import LoopedLM
from jaxloop.rl import advantages as adv_lib
from jaxloop.rl.algorithms import Algorithm
from jaxloop.rl.losses import (
    POLICY_LOSSES,
    LossHParams,
    LossInputs,
    categorical_kl,
    kl_penalty,
    masked_metric_sums,
    reduce_loss,
    value_loss,
)
from jaxloop.rollout.types import Sample


@dataclasses.dataclass
class RolloutArrays:
    """Host arrays for one rollout. T = S - 1 target positions (token j+1 predicted at j)."""

    tokens: np.ndarray  # [N, S] int32, prompt + response, right-padded
    attention_mask: np.ndarray  # [N, S] bool
    response_mask: np.ndarray  # [N, T] float32: targets that are response tokens
    behav_logprobs: np.ndarray  # [N, T] engine log-probs at response targets
    scores: np.ndarray  # [N] float32 sequence rewards
    group_ids: np.ndarray  # [N] int32

    @property
    def num_samples(self) -> int:
        return self.tokens.shape[0]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_rollout_arrays(samples: list[Sample], scores, seq_multiple: int = 16) -> RolloutArrays:
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    seq = _round_up(max(lengths) + 1, seq_multiple)
    n = len(samples)
    tokens = np.zeros((n, seq), np.int32)
    attn = np.zeros((n, seq), np.bool_)
    resp = np.zeros((n, seq - 1), np.float32)
    behav = np.zeros((n, seq - 1), np.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, : p + r] = s.prompt_ids + s.response_ids
        attn[i, : p + r] = True
        resp[i, p - 1 : p - 1 + r] = 1.0
        behav[i, p - 1 : p - 1 + r] = s.response_logprobs
    return RolloutArrays(
        tokens=tokens,
        attention_mask=attn,
        response_mask=resp,
        behav_logprobs=behav,
        scores=np.asarray(scores, np.float32),
        group_ids=np.asarray([s.group_id for s in samples], np.int32),
    )


def make_optimizer(
    name: str,
    lr: float,
    schedule: str,
    warmup: int,
    total_steps: int,
    weight_decay: float,
    b1: float,
    b2: float,
    grad_clip: float,
):
    total_steps = max(total_steps, 1)
    if schedule == "constant":
        sched = optax.constant_schedule(lr)
    elif schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 0), total_steps)
    elif schedule == "linear":
        sched = optax.linear_schedule(lr, 0.0, total_steps)
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    if schedule == "constant" and warmup > 0:
        sched = optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
        )
    if name == "adamw":
        opt = optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay)
    elif name == "sgd":
        opt = optax.sgd(sched, momentum=None)
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
    return optax.chain(*parts, opt)


# ---- pure model functions (jit-friendly) ----
def forward_logprobs(graphdef, params, tokens, attention_mask, temperature):
    """Selected-token log-probs of log_softmax(logits / T) at every target position, the scaled
    logits (only materialised inside jit, per micro-batch) and the LM-head input hidden states."""
    model = nnx.merge(graphdef, params)
    out = model.forward(tokens[:, :-1], attention_mask=attention_mask[:, :-1])
    logits = out.logits / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return lp, logits, out.hidden


def token_logprobs(graphdef, params, tokens, attention_mask, temperature):
    lp, logits, _ = forward_logprobs(graphdef, params, tokens, attention_mask, temperature)
    return lp, logits


def token_values(graphdef, params, tokens, attention_mask):
    model = nnx.merge(graphdef, params)
    return model.forward(tokens[:, :-1], attention_mask=attention_mask[:, :-1]).values


def _split_micro(batch: dict, micro: int) -> dict:
    """[N, ...] -> [K, micro, ...], padding N with zero rows (mask 0: no loss, no metrics)."""
    n = next(iter(batch.values())).shape[0]
    total = _round_up(n, micro)

    def pad(x):
        x = jnp.asarray(x)
        if total != n:
            x = jnp.concatenate([x, jnp.zeros((total - n,) + x.shape[1:], x.dtype)], axis=0)
        return x.reshape((total // micro, micro) + x.shape[1:])

    return {k: pad(v) for k, v in batch.items()}


def _accumulate(micro_loss, params, batch):
    """Sum loss, gradients and metric sums of `micro_loss(params, x) -> (loss, sums)` over the
    leading micro-batch axis of `batch` with one scan (one compiled body for any count)."""
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    first = jax.tree.map(lambda v: v[0], batch)
    sum_shapes = jax.eval_shape(lambda: micro_loss(params, first)[1])

    def step(carry, x):
        grads, loss, sums = carry
        (micro, micro_sums), g = grad_fn(params, x)
        return (
            jax.tree.map(jnp.add, grads, g),
            loss + micro,
            jax.tree.map(jnp.add, sums, micro_sums),
        ), None

    init = (
        jax.tree.map(jnp.zeros_like, params),
        jnp.float32(0.0),
        jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), sum_shapes),
    )
    return jax.lax.scan(step, init, batch)[0]


@dataclasses.dataclass
class LearnerConfig:
    micro_batch_size: int
    temperature: float
    updates_per_rollout: int
    critic_steps: int
    gamma: float
    lam: float
    whiten_advantages: bool
    grpo_use_std: bool


class Learner:
    def __init__(
        self,
        actor: LoopedLM,
        critic: LoopedLM | None,
        algorithm: Algorithm,
        hparams: LossHParams,
        config: LearnerConfig,
        actor_tx: optax.GradientTransformation,
        critic_tx: optax.GradientTransformation | None = None,
        reference: LoopedLM | None = None,
    ):
        self.algorithm = algorithm
        self.hp = hparams
        self.cfg = config
        self.actor_graphdef, state = nnx.split(actor)
        self.actor_params = state.to_pure_dict()
        self.actor_tx = actor_tx
        self.actor_opt_state = actor_tx.init(self.actor_params)
        self.ref_params = None
        if reference is not None:
            self.ref_params = nnx.split(reference)[1].to_pure_dict()
        self.critic_graphdef = self.critic_params = self.critic_tx = self.critic_opt_state = None
        if critic is not None:
            self.critic_graphdef, cstate = nnx.split(critic)
            self.critic_params = cstate.to_pure_dict()
            self.critic_tx = critic_tx
            self.critic_opt_state = critic_tx.init(self.critic_params)
        self._logprobs = jax.jit(self._logprobs_impl, static_argnames="with_hidden")
        self._values = jax.jit(self._values_impl)
        self._policy_step = jax.jit(self._policy_step_impl)
        self._critic_step = jax.jit(self._critic_step_impl)

    # ---- views ----
    def actor_model(self) -> LoopedLM:
        return nnx.merge(self.actor_graphdef, self.actor_params)

    def actor_state(self) -> nnx.State:
        return nnx.split(self.actor_model())[1]

    def critic_model(self) -> LoopedLM | None:
        if self.critic_params is None:
            return None
        return nnx.merge(self.critic_graphdef, self.critic_params)

    # ---- batched recomputes (micro-batched, jitted) ----
    def _logprobs_impl(self, params, mb, with_hidden: bool):
        def one(_, x):
            lp, _, hidden = forward_logprobs(
                self.actor_graphdef, params, x["tokens"], x["attention_mask"], self.cfg.temperature
            )
            return None, (lp, hidden) if with_hidden else lp

        return jax.lax.scan(one, None, mb)[1]

    def _values_impl(self, params, mb):
        def one(_, x):
            return None, token_values(
                self.critic_graphdef, params, x["tokens"], x["attention_mask"]
            )

        return jax.lax.scan(one, None, mb)[1]

    def _per_sample(self, fn, params, arrays: RolloutArrays) -> jax.Array:
        n = arrays.num_samples
        mb = _split_micro(
            {"tokens": arrays.tokens, "attention_mask": arrays.attention_mask},
            self.cfg.micro_batch_size,
        )
        out = fn(params, mb)
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[:n], out)

    def recompute_logprobs(self, arrays: RolloutArrays, params=None, with_hidden=False):
        """[N, T] log-probs (and, with_hidden, the [N, T, E] LM-head inputs of the last loop)."""
        fn = functools.partial(self._logprobs, with_hidden=with_hidden)
        return self._per_sample(fn, params or self.actor_params, arrays)

    def compute_values(self, arrays: RolloutArrays) -> jax.Array:
        return self._per_sample(self._values, self.critic_params, arrays)

    # ---- jitted optimizer steps ----
    def _policy_step_impl(self, params, opt_state, old_params, batch, num_samples, num_tokens):
        algo, hp = self.algorithm, self.hp
        loss_fn = POLICY_LOSSES[algo.policy_loss]

        def micro_loss(p, x):
            lp, logits = token_logprobs(
                self.actor_graphdef, p, x["tokens"], x["attention_mask"], self.cfg.temperature
            )
            old_kl = None
            if algo.needs_old_policy_logits:
                _, old_logits = token_logprobs(
                    self.actor_graphdef,
                    old_params,
                    x["tokens"],
                    x["attention_mask"],
                    self.cfg.temperature,
                )
                old_kl = categorical_kl(jax.lax.stop_gradient(old_logits), logits)
            inputs = LossInputs(
                logprobs=lp,
                old_logprobs=x["old_logprobs"],
                behav_logprobs=x["behav_logprobs"],
                advantages=x["advantages"],
                mask=x["mask"],
                ref_logprobs=x.get("ref_logprobs"),
                old_kl=old_kl,
            )
            per_token, metrics = loss_fn(inputs, hp)
            metrics = dict(metrics)
            metrics["approx_kl"] = kl_penalty(lp, x["old_logprobs"], "k3")
            loss = reduce_loss(per_token, x["mask"], hp.reduction, num_samples, num_tokens)
            return loss, masked_metric_sums(metrics, x["mask"])

        grads, loss, sums = _accumulate(micro_loss, params, batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.actor_tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {k: s / jnp.maximum(c, 1.0) for k, (s, c) in sums.items()}
        metrics["policy_loss"] = loss
        metrics["grad_norm"] = grad_norm
        return params, opt_state, metrics

    def _critic_step_impl(self, params, opt_state, batch, num_samples, num_tokens):
        def micro_loss(p, x):
            values = token_values(self.critic_graphdef, p, x["tokens"], x["attention_mask"])
            per_token, metrics = value_loss(
                values, x["old_values"], x["returns"], x["mask"], self.hp.value_clip
            )
            loss = reduce_loss(per_token, x["mask"], self.hp.reduction, num_samples, num_tokens)
            return loss, masked_metric_sums({"vf_clip_frac": metrics["vf_clip_frac"]}, x["mask"])

        grads, loss, sums = _accumulate(micro_loss, params, batch)
        updates, opt_state = self.critic_tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        s, c = sums["vf_clip_frac"]
        return (
            params,
            opt_state,
            {
                "value_loss": loss,
                "vf_clip_frac": s / jnp.maximum(c, 1.0),
                "critic_grad_norm": optax.tree.norm(grads),
            },
        )

    # ---- one rollout -> update ----
    def update(self, arrays: RolloutArrays, old_logprobs: jax.Array | None = None) -> dict:
        """Advantages + all optimizer steps for one rollout. Returns float metrics."""
        timings = {}
        t0 = time.perf_counter()
        algo, cfg = self.algorithm, self.cfg
        mask = jnp.asarray(arrays.response_mask)
        if old_logprobs is None:
            old_logprobs = self.recompute_logprobs(arrays)
        old_logprobs = jax.block_until_ready(old_logprobs)
        ref_lp = None
        if self.ref_params is not None:
            ref_lp = self.recompute_logprobs(arrays, self.ref_params)
        timings["time_old_logprobs"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        scores = jnp.asarray(arrays.scores)
        metrics: dict[str, float] = {}
        old_values = returns = None
        if algo.advantage == "gae":
            old_values = self.compute_values(arrays)
            kl = None
            if ref_lp is not None and self.hp.kl_coef > 0:
                kl = old_logprobs - ref_lp
            rewards = adv_lib.token_level_rewards(scores, mask, kl, self.hp.kl_coef)
            advantages, returns = adv_lib.ADVANTAGE_ESTIMATORS["gae"](
                rewards, old_values, mask, cfg.gamma, cfg.lam
            )
            metrics["explained_variance"] = float(_explained_variance(old_values, returns, mask))
        else:
            adv_lib.check_group_sizes(arrays.group_ids)
            advantages = adv_lib.ADVANTAGE_ESTIMATORS[algo.advantage](
                scores, jnp.asarray(arrays.group_ids), mask, use_std=cfg.grpo_use_std
            )
        if cfg.whiten_advantages and algo.advantage == "gae":
            advantages = adv_lib.masked_whiten(advantages, mask)

        batch = {
            "tokens": jnp.asarray(arrays.tokens),
            "attention_mask": jnp.asarray(arrays.attention_mask),
            "mask": mask,
            "old_logprobs": old_logprobs,
            "behav_logprobs": jnp.asarray(arrays.behav_logprobs),
            "advantages": advantages,
        }
        if ref_lp is not None:
            batch["ref_logprobs"] = ref_lp
        # pi_old: the parameters before this rollout's first optimizer step (arrays are
        # immutable, so holding the reference freezes them)
        old_params = self.actor_params if algo.needs_old_policy_logits else None
        steps = cfg.updates_per_rollout
        per_step = []
        for part in np.array_split(np.arange(arrays.num_samples), steps):
            sub = {k: v[part] for k, v in batch.items()}
            n_tok = jnp.sum(sub["mask"])
            mb = _split_micro(sub, cfg.micro_batch_size)
            self.actor_params, self.actor_opt_state, m = self._policy_step(
                self.actor_params,
                self.actor_opt_state,
                old_params,
                mb,
                jnp.float32(len(part)),
                n_tok,
            )
            per_step.append(m)
        for k in per_step[0]:
            metrics[k] = float(np.mean([float(m[k]) for m in per_step]))

        if self.critic_params is not None:
            cbatch = {
                "tokens": batch["tokens"],
                "attention_mask": batch["attention_mask"],
                "mask": mask,
                "old_values": old_values,
                "returns": returns,
            }
            mb = _split_micro(cbatch, cfg.micro_batch_size)
            for _ in range(cfg.critic_steps):
                self.critic_params, self.critic_opt_state, cm = self._critic_step(
                    self.critic_params,
                    self.critic_opt_state,
                    mb,
                    jnp.float32(arrays.num_samples),
                    jnp.sum(mask),
                )
            metrics.update({k: float(v) for k, v in cm.items()})
        metrics["advantage_mean"] = float(adv_lib.masked_mean(advantages, mask))
        timings["time_update"] = time.perf_counter() - t1
        metrics.update(timings)
        return metrics


@functools.partial(jax.jit)
def _explained_variance(values, returns, mask):
    var_r = adv_lib.masked_var(returns, mask)
    var_diff = adv_lib.masked_var(returns - values, mask)
    return 1.0 - var_diff / jnp.maximum(var_r, 1e-8)
