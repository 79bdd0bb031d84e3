"""Advantage estimators and masked statistics (pure, jit-able jnp functions).

Shapes: ``B`` samples, ``T`` response tokens; ``mask`` is float ``[B, T]`` with 1 on real response
tokens. Every estimator returns arrays that are zero where ``mask`` is zero.

Registry: ``ADVANTAGE_ESTIMATORS[name]`` (``'gae'``, ``'grpo'``); add more with
``@register_advantage(name)``. Every registered estimator has ONE signature,
``fn(inputs: AdvantageInputs, hp: AdvantageHParams) -> (advantages [B,T], returns [B,T] | None)``,
so the learner calls the algorithm's entry without knowing which one it is. ``gae`` and ``grpo``
below are the plain array functions the entries are built from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxloop.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageHParams",
    "AdvantageInputs",
    "gae_estimator",
    "grpo_estimator",
    "gae",
    "grpo",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "register_advantage",
    "token_level_rewards",
]

ADVANTAGE_ESTIMATORS: Registry[Callable] = Registry("advantage estimator")


def register_advantage(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` in ``ADVANTAGE_ESTIMATORS`` under ``name``."""
    return ADVANTAGE_ESTIMATORS.register(name)


# --------------------------------------------------------------------------- masked statistics


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, and 0 where den == 0."""
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Mean of ``x`` over entries with ``mask`` (weights); 0 where the mask sums to 0."""
    mask = mask.astype(jnp.float32)
    x = jnp.where(mask > 0, x, 0.0).astype(jnp.float32)
    return _safe_div(jnp.sum(x * mask, axis=axis), jnp.sum(mask, axis=axis))


def masked_var(x: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Variance of the masked entries of ``x`` (all axes). ``unbiased`` applies Bessel's correction
    n / (n - 1) with n = sum(mask); with n <= 1 the correction is skipped."""
    mask = mask.astype(jnp.float32)
    mean = masked_mean(x, mask)
    var = masked_mean(jnp.square(x - mean), mask)
    if unbiased:
        n = jnp.sum(mask)
        var = jnp.where(n > 1, var * n / jnp.where(n > 1, n - 1.0, 1.0), var)
    return var


def masked_whiten(
    x: jax.Array, mask: jax.Array, shift_mean: bool = True, eps: float = 1e-8
) -> jax.Array:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased var); with
    ``shift_mean=False`` the mean is added back (scale only). The result is zero off the mask."""
    mask = mask.astype(jnp.float32)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(mask > 0, out, 0.0)


# --------------------------------------------------------------------------- rewards


def token_level_rewards(
    scores: jax.Array,
    mask: jax.Array,
    kl: jax.Array | None = None,
    kl_coef: float = 0.0,
) -> jax.Array:
    """Per-token rewards ``[B, T]``: ``-kl_coef * kl`` on every response token plus the scalar
    sequence score on the LAST valid response token (the last ``t`` with ``mask > 0``). Rows
    without any valid token get no score. The result is zero off the mask."""
    mask = mask.astype(jnp.float32)
    _, t = mask.shape
    valid = mask > 0
    has_any = jnp.any(valid, axis=-1)
    last = (t - 1) - jnp.argmax(valid[:, ::-1], axis=-1)  # index of the last valid token
    onehot = jax.nn.one_hot(last, t, dtype=jnp.float32) * has_any[:, None].astype(jnp.float32)
    rewards = onehot * scores.astype(jnp.float32)[:, None]
    if kl is not None:
        rewards = rewards - kl_coef * jnp.where(valid, kl.astype(jnp.float32), 0.0)
    return rewards * mask


# --------------------------------------------------------------------------- estimators


def gae(
    token_rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation with a reverse ``lax.scan`` over tokens.

    delta_t = r_t + gamma * V_{next} - V_t ;  A_t = delta_t + gamma * lam * A_{next}
    where "next" is the next VALID token: tokens with ``mask == 0`` are skipped (their value and
    TD error do not enter the recursion), so the value after the last valid token is 0 whatever
    ``values`` holds there. Returns ``(advantages, returns)`` with
    ``returns = advantages + values``, both zero off the mask. No whitening (use
    ``masked_whiten`` if wanted).
    """
    mask = mask.astype(jnp.float32)
    r = jnp.where(mask > 0, token_rewards.astype(jnp.float32), 0.0)
    v = jnp.where(mask > 0, values.astype(jnp.float32), 0.0)
    b = r.shape[0]

    def step(carry, xs):
        next_value, next_adv = carry
        r_t, v_t, m_t = xs
        delta = r_t + gamma * next_value - v_t
        adv_t = delta + gamma * lam * next_adv
        next_value = m_t * v_t + (1.0 - m_t) * next_value
        next_adv = m_t * adv_t + (1.0 - m_t) * next_adv
        return (next_value, next_adv), adv_t

    init = (jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.float32))
    _, adv_t_major = jax.lax.scan(step, init, (r.T, v.T, mask.T), reverse=True)
    advantages = adv_t_major.T * mask
    returns = (advantages + v) * mask
    return advantages, returns


def grpo(
    scores: jax.Array,
    group_ids: jax.Array,
    mask: jax.Array,
    use_std: bool = True,
    eps: float = 1e-6,
) -> jax.Array:
    """Group-relative advantages ``[B, T]``: (R - group mean) / (unbiased group std + eps), or
    R - group mean (Dr.GRPO) when ``use_std=False``; broadcast over the response tokens, masked.

    ``group_ids`` may be arbitrary integers (they are densified with a sized ``jnp.unique``, so
    the function jits); groups are reduced with ``segment_sum(num_segments=B)``. A group of one
    sample gets advantage 0 (the config validation refuses GRPO with n_samples_per_prompt < 2;
    the producer drops groups that non-finite rewards left with one sample).
    """
    mask = mask.astype(jnp.float32)
    scores = scores.astype(jnp.float32)
    b = scores.shape[0]
    group_ids = jnp.asarray(group_ids).reshape(-1)
    _, dense = jnp.unique(group_ids, size=b, fill_value=group_ids[0], return_inverse=True)
    dense = dense.reshape(-1)
    seg = jax.ops.segment_sum
    count = seg(jnp.ones_like(scores), dense, num_segments=b)
    mean = _safe_div(seg(scores, dense, num_segments=b), count)
    centered = scores - mean[dense]
    if use_std:
        sq = seg(jnp.square(centered), dense, num_segments=b)
        var = jnp.where(count > 1, sq / jnp.maximum(count - 1.0, 1.0), 0.0)
        adv = centered / (jnp.sqrt(var)[dense] + eps)
    else:
        adv = centered
    return adv[:, None] * mask


# --------------------------------------------------------------------------- registered estimators


@struct.dataclass
class AdvantageInputs:
    """What an estimator may use (a pytree; ``[B]`` or ``[B, T]`` arrays). ``values``: the
    critic's values (None without a critic); ``token_kl``: per-token log pi_old - log pi_ref
    (None without a reference policy)."""

    scores: jax.Array
    mask: jax.Array
    group_ids: jax.Array
    values: jax.Array | None = None
    token_kl: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class AdvantageHParams:
    """gamma / lam: GAE; kl_coef: weight of the per-token KL reward (GAE); whiten: normalise GAE
    advantages over the batch; grpo_use_std: divide by the group std (False: Dr.GRPO)."""

    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.0
    whiten: bool = True
    grpo_use_std: bool = True


@register_advantage("gae")
def gae_estimator(inputs: AdvantageInputs, hp: AdvantageHParams):
    """Token rewards (score on the last token, minus kl_coef * KL to the reference on every token,
    the reference PyTorch stack's form), GAE over the critic's values, optional whitening."""
    if inputs.values is None:
        raise ValueError("the 'gae' estimator needs critic values")
    kl_coef = hp.kl_coef if inputs.token_kl is not None else 0.0
    rewards = token_level_rewards(inputs.scores, inputs.mask, inputs.token_kl, kl_coef)
    advantages, returns = gae(rewards, inputs.values, inputs.mask, hp.gamma, hp.lam)
    if hp.whiten:
        advantages = masked_whiten(advantages, inputs.mask)
    return advantages, returns


@register_advantage("grpo")
def grpo_estimator(inputs: AdvantageInputs, hp: AdvantageHParams):
    """Group-relative advantages; no returns (no critic). A KL to the reference enters GRPO's loss,
    not its rewards."""
    return grpo(inputs.scores, inputs.group_ids, inputs.mask, use_std=hp.grpo_use_std), None


def value_metrics(values: jax.Array, returns: jax.Array, mask: jax.Array) -> dict:
    """The critic's values against the returns, before any whitening (returns - values is
    GAE's raw advantage), and the explained variance."""
    raw = returns - values
    var_r = masked_var(returns, mask)
    return {
        "raw_advantage_mean": masked_mean(raw, mask),
        "raw_advantage_std": jnp.sqrt(masked_var(raw, mask)),
        "value_mean": masked_mean(values, mask),
        "value_std": jnp.sqrt(masked_var(values, mask)),
        "explained_variance": 1.0 - masked_var(returns - values, mask) / jnp.maximum(var_r, 1e-8),
    }
