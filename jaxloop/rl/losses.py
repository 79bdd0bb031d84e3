"""Policy / value losses and their reduction (pure, jit-able jnp functions).

Shapes: ``B`` samples, ``T`` response tokens, ``mask`` float ``[B, T]`` (1 on real response
tokens). Per token: ``A`` advantage, ``lp`` current log-prob, ``old`` proximal/old log-prob
(recomputed by the trainer), ``behav`` the rollout engine's log-prob.

Every policy loss is registered in ``POLICY_LOSSES`` and has the signature
``fn(inputs: LossInputs, hp: LossHParams) -> (per_token_loss [B,T], metrics: dict[str, [B,T]])``.
Per-token losses are NOT reduced; metrics are per-token quantities the caller masked-averages
(``masked_metric_sums`` gives micro-batch-summable ``(sum, count)`` pairs). Log-ratios are
zeroed off the mask before ``exp`` so padding can never produce inf/NaN (values or gradients).
``hp`` is hashable: pass it as a static argument to ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import get_args

import jax
import jax.numpy as jnp
from flax import struct

from jaxloop.registry import Registry
from jaxloop.rl.settings import KlEstimator, Reduction

__all__ = [
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "REDUCTIONS",
    "LossHParams",
    "LossInputs",
    "categorical_kl",
    "decoupled_ppo_loss",
    "flow_dppo_loss",
    "grpo_loss",
    "kl_penalty",
    "masked_metric_sums",
    "ppo_loss",
    "reduce_loss",
    "register_policy_loss",
    "value_loss",
]

KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)
REDUCTIONS: tuple[str, ...] = get_args(Reduction)


@struct.dataclass
class LossInputs:
    """Per-token inputs of a policy loss (a pytree; all arrays ``[B, T]``).

    ``behav_logprobs`` may be None for losses that do not use it (all but 'decoupled_ppo').
    ``ref_logprobs``: frozen reference policy (KL penalty / 'kl_ref' metric).
    ``old_kl``: Flow-DPPO's D_t = KL(pi_old || pi_theta) over the full vocabulary
    (``categorical_kl``). ``values``/``old_values``/``returns``: for the critic (``value_loss``).
    """

    logprobs: jax.Array
    old_logprobs: jax.Array
    behav_logprobs: jax.Array | None
    advantages: jax.Array
    mask: jax.Array
    ref_logprobs: jax.Array | None = None
    old_kl: jax.Array | None = None
    values: jax.Array | None = None
    old_values: jax.Array | None = None
    returns: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class LossHParams:
    """Loss hyper-parameters (frozen, hashable: usable as a jit static argument).

    clip_eps / clip_eps_high: PPO ratio clip range [1 - clip_eps, 1 + clip_eps_high]
      (clip_eps_high None -> clip_eps).
    dual_clip: c > 1 enables dual clip for A < 0 (loss capped at -c * A); None disables.
    kl_coef, kl_estimator: KL-to-reference loss term ('grpo'); estimator 'k1' | 'k2' | 'k3'.
    behav_weight_min / behav_weight_max: clamp of the decoupled-PPO behaviour weight
      exp(old - behav) (None = unbounded on that side).
    behav_drop_cap: AReaL form: tokens whose behaviour weight exceeds the cap get weight 0 and the
      others keep the UNclamped weight (the min/max clamp is then not used).
    flow_delta: Flow-DPPO trust-region threshold on D_t.
    value_clip: critic value clip range (None disables).
    value_loss_scale: factor of the value loss (``value_loss(scale=...)``; 1 = the reference
      stack's loss, 0.5 = the 1/2-squared-error convention).
    reduction: 'seq_mean_token_mean' | 'token_mean' (see ``reduce_loss``).
    entropy_coef: the learner subtracts entropy_coef x the token's policy entropy from every
      policy loss token (an exploration bonus; 0 = off).
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    behav_weight_min: float | None = 0.5
    behav_weight_max: float | None = 2.0
    behav_drop_cap: float | None = None
    flow_delta: float = 0.01
    value_clip: float | None = 0.2
    reduction: str = "seq_mean_token_mean"
    value_loss_scale: float = 1.0
    entropy_coef: float = 0.0

    def __post_init__(self):
        if not self.value_loss_scale > 0:
            raise ValueError(f"value_loss_scale must be > 0, got {self.value_loss_scale}")
        if not self.clip_eps > 0:
            raise ValueError(f"clip_eps must be > 0, got {self.clip_eps}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise ValueError(f"clip_eps_high must be > 0 or None, got {self.clip_eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        lo, hi = self.behav_weight_min, self.behav_weight_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"behav_weight_min {lo} > behav_weight_max {hi}")
        if self.behav_drop_cap is not None and not self.behav_drop_cap > 0:
            raise ValueError(f"behav_drop_cap must be > 0 or None, got {self.behav_drop_cap}")
        if self.flow_delta < 0:
            raise ValueError(f"flow_delta must be >= 0, got {self.flow_delta}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip must be > 0 or None, got {self.value_clip}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


POLICY_LOSSES: Registry[Callable] = Registry("policy loss", "policy losses")


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(inputs, hp) -> (per_token_loss, metrics)`` under ``name``."""
    return POLICY_LOSSES.register(name)


# --------------------------------------------------------------------------- helpers


def _f32(x: jax.Array) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def _masked_diff(a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """a - b on the mask, 0 elsewhere (so exp() of it is safe on padding)."""
    return jnp.where(mask > 0, _f32(a) - _f32(b), 0.0)


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, kind: str = "k3") -> jax.Array:
    """Per-token estimator of KL(pi || ref) from sampled-token log-probs (Schulman's k1/k2/k3):
    k1 = lp - ref; k2 = 0.5 (lp - ref)^2; k3 = exp(ref - lp) - (ref - lp) - 1."""
    d = _f32(logprobs) - _f32(ref_logprobs)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * jnp.square(d)
    if kind == "k3":
        return jnp.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {KL_ESTIMATORS}")


def categorical_kl(old_logits: jax.Array, logits: jax.Array) -> jax.Array:
    """D_t = KL(pi_old || pi) = sum_v pi_old (log pi_old - log pi) over the FULL vocabulary, in
    float32, clamped at 0 (rounding). ``[B, T, V] x [B, T, V] -> [B, T]``."""
    old_lp = jax.nn.log_softmax(_f32(old_logits), axis=-1)
    lp = jax.nn.log_softmax(_f32(logits), axis=-1)
    kl = jnp.sum(jnp.exp(old_lp) * (old_lp - lp), axis=-1)
    return jnp.maximum(kl, 0.0)


def _clipped_surrogate(
    log_ratio: jax.Array, adv: jax.Array, hp: LossHParams
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate per token (+ optional dual clip). ``log_ratio`` already masked."""
    ratio = jnp.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * jnp.clip(ratio, 1.0 - hp.clip_eps, 1.0 + hp.eps_high)
    loss = jnp.maximum(loss_unclipped, loss_clipped)
    metrics = {
        "ratio": ratio,
        "clip_frac": (loss_clipped > loss_unclipped).astype(jnp.float32),
        "approx_kl": -log_ratio,  # k1 estimate of KL(old || current) on sampled tokens
    }
    if hp.dual_clip is not None:
        cap = -hp.dual_clip * adv
        dual = (adv < 0) & (loss > cap)
        loss = jnp.where(adv < 0, jnp.minimum(loss, cap), loss)
        metrics["dual_clip_frac"] = dual.astype(jnp.float32)
    return loss, metrics


def _kl_ref_metric(inputs: LossInputs, hp: LossHParams, metrics: dict) -> jax.Array | None:
    """Per-token KL to the reference (None without ``ref_logprobs``); also recorded as the
    'kl_ref' metric."""
    if inputs.ref_logprobs is None:
        return None
    # ref := lp off the mask so the estimator (and its gradient) is exactly 0 on padding.
    ref = jnp.where(inputs.mask > 0, _f32(inputs.ref_logprobs), _f32(inputs.logprobs))
    kl = kl_penalty(inputs.logprobs, ref, hp.kl_estimator)
    metrics["kl_ref"] = jax.lax.stop_gradient(kl)
    return kl


# --------------------------------------------------------------------------- policy losses


@register_policy_loss("ppo")
def ppo_loss(inputs: LossInputs, hp: LossHParams):
    """loss = max(-r A, -clip(r, 1-eps, 1+eps_high) A), r = exp(lp - old); dual clip (A < 0):
    min(loss, -c A). Metrics: ratio, clip_frac, approx_kl, [dual_clip_frac], [kl_ref]."""
    log_ratio = _masked_diff(inputs.logprobs, inputs.old_logprobs, inputs.mask)
    loss, metrics = _clipped_surrogate(log_ratio, _f32(inputs.advantages), hp)
    _kl_ref_metric(inputs, hp, metrics)
    return loss, metrics


@register_policy_loss("grpo")
def grpo_loss(inputs: LossInputs, hp: LossHParams):
    """PPO clipped surrogate + kl_coef * kl_penalty(lp, ref, hp.kl_estimator) when kl_coef > 0
    (which then requires ``ref_logprobs``). Metrics as 'ppo' plus kl_ref."""
    log_ratio = _masked_diff(inputs.logprobs, inputs.old_logprobs, inputs.mask)
    loss, metrics = _clipped_surrogate(log_ratio, _f32(inputs.advantages), hp)
    kl = _kl_ref_metric(inputs, hp, metrics)
    if hp.kl_coef > 0:
        if kl is None:
            raise ValueError("grpo loss with kl_coef > 0 needs inputs.ref_logprobs")
        loss = loss + hp.kl_coef * kl
    return loss, metrics


@register_policy_loss("decoupled_ppo")
def decoupled_ppo_loss(inputs: LossInputs, hp: LossHParams):
    """Decoupled PPO: the clipped surrogate uses r = exp(lp - prox) (prox = ``old_logprobs``),
    each token's loss is multiplied by the stop-gradient behaviour weight
    w = clamp(exp(prox - behav), behav_weight_min, behav_weight_max); with ``behav_drop_cap``
    set, tokens with exp(prox - behav) > cap get w = 0 and the rest the unclamped weight.
    Metrics: ratio, clip_frac, approx_kl, behav_weight, dropped_frac, [dual_clip_frac], [kl_ref]."""
    if inputs.behav_logprobs is None:
        raise ValueError("decoupled_ppo needs inputs.behav_logprobs (the engine's log-probs)")
    mask = inputs.mask
    log_ratio = _masked_diff(inputs.logprobs, inputs.old_logprobs, mask)
    loss, metrics = _clipped_surrogate(log_ratio, _f32(inputs.advantages), hp)
    raw = jnp.exp(_masked_diff(inputs.old_logprobs, inputs.behav_logprobs, mask))
    raw = jax.lax.stop_gradient(raw)
    if hp.behav_drop_cap is not None:
        dropped = raw > hp.behav_drop_cap
        weight = jnp.where(dropped, 0.0, raw)
    else:
        dropped = jnp.zeros_like(raw, dtype=bool)
        weight = jnp.clip(raw, hp.behav_weight_min, hp.behav_weight_max)
    loss = weight * loss
    metrics["behav_weight"] = weight
    metrics["dropped_frac"] = dropped.astype(jnp.float32)
    _kl_ref_metric(inputs, hp, metrics)
    return loss, metrics


@register_policy_loss("flow_dppo")
def flow_dppo_loss(inputs: LossInputs, hp: LossHParams):
    """Categorical Flow-DPPO. r = exp(lp - old) UNCLIPPED (old = frozen pi_old);
    D = stop_grad(inputs.old_kl) (full-vocab KL(pi_old || pi_theta), ``categorical_kl``);
    outward = (A > 0 & r > 1) | (A < 0 & r < 1); blocked = outward & (D > flow_delta);
    loss = -A * where(blocked, stop_grad(r), r), so blocked tokens carry no gradient.
    Metrics: ratio, blocked_frac, outward_frac, old_kl, approx_kl, [kl_ref]."""
    if inputs.old_kl is None:
        raise ValueError("flow_dppo needs inputs.old_kl (categorical_kl(old_logits, logits))")
    mask = inputs.mask
    adv = _f32(inputs.advantages)
    log_ratio = _masked_diff(inputs.logprobs, inputs.old_logprobs, mask)
    ratio = jnp.exp(log_ratio)
    d = jax.lax.stop_gradient(jnp.where(mask > 0, _f32(inputs.old_kl), 0.0))
    outward = ((adv > 0) & (ratio > 1.0)) | ((adv < 0) & (ratio < 1.0))
    blocked = outward & (d > hp.flow_delta)
    loss = -adv * jnp.where(blocked, jax.lax.stop_gradient(ratio), ratio)
    metrics = {
        "ratio": ratio,
        "blocked_frac": blocked.astype(jnp.float32),
        "outward_frac": outward.astype(jnp.float32),
        "old_kl": d,
        "approx_kl": -log_ratio,
    }
    _kl_ref_metric(inputs, hp, metrics)
    return loss, metrics


# --------------------------------------------------------------------------- critic


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip: float | None,
    scale: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss per token: scale * max((V_clip - R)^2, (V - R)^2) with
    V_clip = V_old + clip(V - V_old, -clip, +clip) (``clip=None``: scale * (V - R)^2). The
    default scale 1 is the reference stack's loss (no 1/2); critic.loss_scale=0.5 gives the
    1/2-squared-error convention. Zero off the mask. Metrics: 'vf_clip_frac' (1 where the clipped
    branch is the larger), 'vf_error' (V - R)."""
    m = mask > 0
    v = jnp.where(m, _f32(values), 0.0)
    v_old = jnp.where(m, _f32(old_values), 0.0)
    ret = jnp.where(m, _f32(returns), 0.0)
    err = jnp.square(v - ret)
    if clip is None:
        loss = scale * err
        clipped = jnp.zeros_like(err)
    else:
        v_clip = v_old + jnp.clip(v - v_old, -clip, clip)
        err_clip = jnp.square(v_clip - ret)
        loss = scale * jnp.maximum(err_clip, err)
        clipped = (err_clip > err).astype(jnp.float32)
    loss = jnp.where(m, loss, 0.0)
    return loss, {"vf_clip_frac": clipped, "vf_error": v - ret}


# --------------------------------------------------------------------------- reduction


def reduce_loss(
    per_token: jax.Array,
    mask: jax.Array,
    reduction: str,
    num_samples,
    num_tokens,
) -> jax.Array:
    """Scalar loss of a (micro-)batch, normalised by FULL-batch totals so that summing the results
    (and gradients) over micro-batches is independent of how the batch was split.

    'seq_mean_token_mean': sum_i [sum_t l*m / max(sum_t m, 1)] / num_samples
    'token_mean':          sum_{i,t} l*m / num_tokens
    ``num_samples`` = samples in the full batch, ``num_tokens`` = sum of the full batch's mask.
    """
    m = _f32(mask)
    lm = jnp.where(m > 0, _f32(per_token), 0.0) * m
    if reduction == "seq_mean_token_mean":
        per_seq = jnp.sum(lm, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
        return jnp.sum(per_seq) / jnp.maximum(_f32(num_samples), 1.0)
    if reduction == "token_mean":
        return jnp.sum(lm) / jnp.maximum(_f32(num_tokens), 1.0)
    raise ValueError(f"unknown reduction {reduction!r}; valid: {REDUCTIONS}")


def masked_metric_sums(
    metrics: dict[str, jax.Array], mask: jax.Array
) -> dict[str, tuple[jax.Array, jax.Array]]:
    """{name: (sum over masked tokens, mask count)}: add these over micro-batches, then divide."""
    m = _f32(mask)
    count = jnp.sum(m)
    return {
        k: (jnp.sum(jnp.where(m > 0, _f32(jax.lax.stop_gradient(v)), 0.0) * m), count)
        for k, v in metrics.items()
    }
