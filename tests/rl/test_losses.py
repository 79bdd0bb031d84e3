"""Policy/value losses, KL estimators, Flow-DPPO blocking, reduction and the algorithm table,
checked against hand-computed numbers and independent numpy formulas."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxloop.rl.advantages import gae
from jaxloop.rl.algorithms import ALGORITHMS, Algorithm, get_algorithm
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

TOL = 1e-5
LN = math.log


def _inputs(lp, old, adv, mask=None, behav=None, **kw):
    lp = jnp.asarray(lp, jnp.float32)
    mask = jnp.ones_like(lp) if mask is None else jnp.asarray(mask, jnp.float32)
    return LossInputs(
        logprobs=lp,
        old_logprobs=jnp.asarray(old, jnp.float32),
        behav_logprobs=None if behav is None else jnp.asarray(behav, jnp.float32),
        advantages=jnp.asarray(adv, jnp.float32),
        mask=mask,
        **kw,
    )


# --------------------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_values():
    lp, ref = np.array([[-1.0, -2.0]]), np.array([[-1.5, -2.0]])
    # d = lp - ref = 0.5 and 0
    np.testing.assert_allclose(kl_penalty(lp, ref, "k1"), [[0.5, 0.0]], rtol=TOL)
    np.testing.assert_allclose(kl_penalty(lp, ref, "k2"), [[0.125, 0.0]], rtol=TOL)
    # k3 = exp(-0.5) + 0.5 - 1
    np.testing.assert_allclose(kl_penalty(lp, ref, "k3"), [[0.10653066, 0.0]], rtol=TOL)
    # negative d = -1: k3 = e - 2
    np.testing.assert_allclose(kl_penalty([[-2.0]], [[-1.0]], "k3"), [[math.e - 2]], rtol=TOL)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(lp, ref, "k4")


# --------------------------------------------------------------------------- PPO


def test_ppo_clipping_hand():
    # tokens: (r, A) = (1.5, 1) (0.5, 1) (0.5, -1) (1.5, -1) (1.1, 2)
    r = np.array([[1.5, 0.5, 0.5, 1.5, 1.1]])
    a = np.array([[1.0, 1.0, -1.0, -1.0, 2.0]])
    old = np.full_like(r, -1.0)
    inp = _inputs(old + np.log(r), old, a)
    loss, m = POLICY_LOSSES["ppo"](inp, LossHParams(clip_eps=0.2))
    np.testing.assert_allclose(loss, [[-1.2, -0.5, 0.8, 1.5, -2.2]], rtol=TOL)
    np.testing.assert_array_equal(m["clip_frac"], [[1, 0, 1, 0, 0]])
    np.testing.assert_allclose(m["ratio"], r, rtol=TOL)
    # asymmetric clip-higher
    loss, _ = POLICY_LOSSES["ppo"](inp, LossHParams(clip_eps=0.2, clip_eps_high=0.28))
    np.testing.assert_allclose(loss, [[-1.28, -0.5, 0.8, 1.5, -2.2]], rtol=TOL)


def test_ppo_dual_clip_hand():
    # A<0 with a huge ratio: plain PPO loss = 5 * 1 = 5, dual clip c=3 caps at 3
    r = np.array([[5.0, 2.0, 5.0]])
    a = np.array([[-1.0, -1.0, 1.0]])
    old = np.zeros_like(r)
    inp = _inputs(np.log(r), old, a)
    loss, _ = POLICY_LOSSES["ppo"](inp, LossHParams())
    np.testing.assert_allclose(loss, [[5.0, 2.0, -1.2]], rtol=TOL)
    loss, m = POLICY_LOSSES["ppo"](inp, LossHParams(dual_clip=3.0))
    np.testing.assert_allclose(loss, [[3.0, 2.0, -1.2]], rtol=TOL)
    np.testing.assert_array_equal(m["dual_clip_frac"], [[1, 0, 0]])
    # the capped token carries no gradient, the others do
    g = jax.grad(
        lambda lp: POLICY_LOSSES["ppo"](_inputs(lp, old, a), LossHParams(dual_clip=3.0))[0].sum()
    )(jnp.log(jnp.asarray(r, jnp.float32)))
    np.testing.assert_allclose(g, [[0.0, 2.0, 0.0]], rtol=TOL, atol=1e-7)  # d(-rA)/dlp = -rA


def test_ppo_matches_numpy_random():
    rng = np.random.default_rng(0)
    lp = rng.normal(-2, 0.5, size=(4, 6)).astype(np.float32)
    old = (lp + rng.normal(0, 0.3, size=lp.shape)).astype(np.float32)
    a = rng.normal(size=lp.shape).astype(np.float32)
    loss, _ = POLICY_LOSSES["ppo"](_inputs(lp, old, a), LossHParams(clip_eps=0.1, dual_clip=2.0))
    r = np.exp(lp.astype(np.float64) - old)
    ref = np.maximum(-r * a, -np.clip(r, 0.9, 1.1) * a)
    ref = np.where(a < 0, np.minimum(ref, -2.0 * a), ref)
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- GRPO loss


def test_grpo_loss_adds_kl_term():
    r = np.array([[1.5, 0.5]])
    a = np.array([[1.0, -1.0]])
    old = np.array([[-1.0, -2.0]])
    lp = old + np.log(r)
    ref = lp - np.array([[0.5, -1.0]])  # lp - ref = 0.5, -1
    inp = _inputs(lp, old, a, ref_logprobs=jnp.asarray(ref, jnp.float32))
    loss, m = POLICY_LOSSES["grpo"](inp, LossHParams(kl_coef=0.1, kl_estimator="k3"))
    k3 = np.array([[math.exp(-0.5) + 0.5 - 1, math.e - 2]])
    np.testing.assert_allclose(loss, np.array([[-1.2, 0.8]]) + 0.1 * k3, rtol=TOL)
    np.testing.assert_allclose(m["kl_ref"], k3, rtol=TOL)
    loss, _ = POLICY_LOSSES["grpo"](inp, LossHParams(kl_coef=0.0))
    np.testing.assert_allclose(loss, [[-1.2, 0.8]], rtol=TOL)
    loss, _ = POLICY_LOSSES["grpo"](inp, LossHParams(kl_coef=1.0, kl_estimator="k1"))
    np.testing.assert_allclose(loss, [[-1.2 + 0.5, 0.8 - 1.0]], rtol=TOL)
    with pytest.raises(ValueError, match="ref_logprobs"):
        POLICY_LOSSES["grpo"](_inputs(lp, old, a), LossHParams(kl_coef=0.1))


# --------------------------------------------------------------------------- decoupled PPO


def test_decoupled_ppo_weights_clamp_and_drop_cap():
    # prox/behav weight exp(prox - behav) = 3, 0.25, 1.2, 2.2 ; ratio r = 1 (lp == prox)
    w_raw = np.array([[3.0, 0.25, 1.2, 2.2]])
    a = np.array([[1.0, -2.0, 0.5, 1.0]])
    prox = np.full_like(w_raw, -1.0)
    behav = prox - np.log(w_raw)
    inp = _inputs(prox, prox, a, behav=behav)
    loss, m = POLICY_LOSSES["decoupled_ppo"](inp, LossHParams())
    w = np.array([[2.0, 0.5, 1.2, 2.0]])
    np.testing.assert_allclose(m["behav_weight"], w, rtol=TOL)
    np.testing.assert_allclose(loss, -w * a, rtol=TOL)
    np.testing.assert_array_equal(m["dropped_frac"], [[0, 0, 0, 0]])
    # AReaL drop cap: weight > 2.5 dropped, the rest unclamped
    hp = LossHParams(behav_drop_cap=2.5)
    loss, m = POLICY_LOSSES["decoupled_ppo"](inp, hp)
    w = np.array([[0.0, 0.25, 1.2, 2.2]])
    np.testing.assert_allclose(m["behav_weight"], w, rtol=TOL)
    np.testing.assert_allclose(loss, -w * a, rtol=TOL)
    np.testing.assert_array_equal(m["dropped_frac"], [[1, 0, 0, 0]])
    # gradient w.r.t. lp is w * d(-rA)/dlp = -w A (r = 1, not clipped), 0 on the dropped token
    g = jax.grad(
        lambda lp: POLICY_LOSSES["decoupled_ppo"](_inputs(lp, prox, a, behav=behav), hp)[0].sum()
    )(jnp.asarray(prox, jnp.float32))
    np.testing.assert_allclose(g, -w * a, rtol=TOL)


@pytest.mark.parametrize("drop_cap", [None, 2.5])
def test_decoupled_ppo_no_gradient_through_behaviour_logprobs(drop_cap):
    """The behaviour weight exp(prox - behav) is a constant of the loss: d loss / d behav = 0
    exactly, while d loss / d lp is live. The weights are inside the clamp / under the cap, where
    a weight that were not stopped would carry a gradient -w * loss per token."""
    rng = np.random.default_rng(3)
    prox = rng.normal(-2, 0.3, size=(2, 5)).astype(np.float32)
    behav = (prox - rng.uniform(-0.4, 0.4, size=prox.shape)).astype(np.float32)  # w in (0.67, 1.5)
    lp = (prox + rng.normal(0, 0.1, size=prox.shape)).astype(np.float32)
    a = rng.normal(size=prox.shape).astype(np.float32)
    hp = LossHParams(behav_drop_cap=drop_cap)

    def total(lp, behav):
        loss, _ = POLICY_LOSSES["decoupled_ppo"](_inputs(lp, prox, a, behav=behav), hp)
        return loss.sum()

    g_lp, g_behav = jax.grad(total, argnums=(0, 1))(jnp.asarray(lp), jnp.asarray(behav))
    assert np.all(np.asarray(g_behav) == 0.0)
    assert np.all(np.abs(np.asarray(g_lp)) > 0)
    # the check has power: with the weight not stopped, d(w * l)/d behav = -w * l = -loss
    loss, _ = POLICY_LOSSES["decoupled_ppo"](_inputs(lp, prox, a, behav=behav), hp)
    assert np.all(np.asarray(loss) != 0.0)


def test_decoupled_ppo_ratio_is_vs_proximal():
    # lp - prox = log 1.5 (clipped at 1.2 for A>0); behaviour weight 1.25 within the clamp
    prox = np.array([[-1.0]])
    lp = prox + LN(1.5)
    behav = prox - LN(1.25)
    loss, m = POLICY_LOSSES["decoupled_ppo"](_inputs(lp, prox, [[2.0]], behav=behav), LossHParams())
    np.testing.assert_allclose(loss, [[-1.25 * 1.2 * 2.0]], rtol=TOL)
    np.testing.assert_allclose(m["ratio"], [[1.5]], rtol=TOL)
    with pytest.raises(ValueError, match="behav_logprobs"):
        POLICY_LOSSES["decoupled_ppo"](_inputs(lp, prox, [[2.0]]), LossHParams())


# --------------------------------------------------------------------------- Flow-DPPO


def test_categorical_kl_analytic():
    p = np.array([0.5, 0.25, 0.25])
    q = np.array([0.25, 0.5, 0.25])
    # KL(p||q) = 0.5 ln 2 + 0.25 ln 0.5 = 0.25 ln 2
    old_logits = jnp.asarray(np.log(p)[None, None] + 3.0, jnp.float32)  # shift: softmax-invariant
    logits = jnp.asarray(np.log(q)[None, None] - 1.0, jnp.float32)
    np.testing.assert_allclose(categorical_kl(old_logits, logits), [[0.25 * LN(2)]], rtol=TOL)
    np.testing.assert_allclose(categorical_kl(logits, old_logits), [[0.25 * LN(2)]], rtol=TOL)
    # identical distributions: exactly 0 (and never negative)
    assert float(categorical_kl(logits, logits)[0, 0]) == 0.0
    # random batch vs numpy float64
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2, 3, 11)).astype(np.float32)
    b = (a + rng.normal(0, 0.5, size=a.shape)).astype(np.float32)
    pa = np.exp(a - a.max(-1, keepdims=True))
    pa /= pa.sum(-1, keepdims=True)
    pb = np.exp(b - b.max(-1, keepdims=True))
    pb /= pb.sum(-1, keepdims=True)
    ref = (pa * (np.log(pa) - np.log(pb))).sum(-1)
    out = categorical_kl(jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(categorical_kl(a, b), ref, rtol=1e-5, atol=1e-6)


def _flow_case():
    # columns: (A, r, D) ->  blocked?
    a = np.array([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.0, 2.0]])
    r = np.array([[1.3, 1.3, 0.7, 0.7, 0.7, 1.3, 1.3, 1.0]])
    d = np.array([[0.5, 0.001, 0.5, 0.5, 0.001, 0.5, 0.5, 0.5]])
    blocked = np.array([[1, 0, 0, 1, 0, 0, 0, 0]], np.float32)
    old = np.full_like(a, -1.5)
    return a, r, d, blocked, old


def test_flow_dppo_blocking_and_gradient():
    a, r, d, blocked, old = _flow_case()
    hp = LossHParams(flow_delta=0.01, reduction="token_mean")
    lp = jnp.asarray(old + np.log(r), jnp.float32)

    def total(lp):
        inp = _inputs(lp, old, a, old_kl=jnp.asarray(d, jnp.float32))
        loss, m = POLICY_LOSSES["flow_dppo"](inp, hp)
        return reduce_loss(loss, inp.mask, hp.reduction, a.shape[0], a.size), (loss, m)

    (val, (loss, m)), g = jax.value_and_grad(total, has_aux=True)(lp)
    np.testing.assert_array_equal(m["blocked_frac"], blocked)
    np.testing.assert_allclose(loss, -a * r, rtol=TOL)  # unclipped value everywhere
    np.testing.assert_allclose(val, np.sum(-a * r) / a.size, rtol=TOL)
    # gradient: 0 on blocked tokens, -A r / num_tokens elsewhere
    expected = np.where(blocked > 0, 0.0, -a * r / a.size)
    np.testing.assert_allclose(g, expected, rtol=TOL, atol=1e-8)
    assert np.all(np.asarray(g)[blocked > 0] == 0.0)
    assert np.all(np.asarray(g)[(blocked == 0) & (a != 0)] != 0.0)
    # with a large delta nothing is blocked
    _, m = POLICY_LOSSES["flow_dppo"](
        _inputs(lp, old, a, old_kl=jnp.asarray(d, jnp.float32)), LossHParams(flow_delta=1.0)
    )
    assert float(m["blocked_frac"].sum()) == 0.0
    with pytest.raises(ValueError, match="old_kl"):
        POLICY_LOSSES["flow_dppo"](_inputs(lp, old, a), hp)


def test_flow_dppo_blocks_only_strictly_above_delta():
    """blocked = outward & (D > delta), strictly: D exactly at delta keeps its gradient, the next
    float32 above it is blocked (delta 0.25 is exact in float32)."""
    delta = 0.25
    above = float(np.nextafter(np.float32(delta), np.float32(1.0)))
    below = float(np.nextafter(np.float32(delta), np.float32(0.0)))
    # all outward (A > 0, r > 1): only D decides
    a = np.array([[1.0, 1.0, 1.0]])
    r = np.array([[1.3, 1.3, 1.3]])
    d = jnp.asarray([[below, delta, above]], jnp.float32)
    assert float(d[0, 1]) == delta and float(d[0, 2]) > delta
    old = np.full_like(a, -1.0)
    hp = LossHParams(flow_delta=delta)

    def total(lp):
        loss, m = POLICY_LOSSES["flow_dppo"](_inputs(lp, old, a, old_kl=d), hp)
        return loss.sum(), m

    (_, m), g = jax.value_and_grad(total, has_aux=True)(jnp.asarray(old + np.log(r), jnp.float32))
    np.testing.assert_array_equal(m["blocked_frac"], [[0, 0, 1]])
    np.testing.assert_allclose(g, [[-1.3, -1.3, 0.0]], rtol=TOL)


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean"])
def test_flow_dppo_identical_policies_live_gradient(reduction):
    """pi_theta == pi_old: D = 0 and the gradient is the plain policy gradient -A / normaliser."""
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
    tokens = jnp.asarray([[1, 4, 6], [0, 2, 2]])
    mask = jnp.asarray([[1, 1, 1], [1, 1, 0]], jnp.float32)
    a = jnp.asarray([[0.5, 0.5, 0.5], [-2.0, -2.0, 0.0]], jnp.float32)
    d = categorical_kl(logits, logits)
    np.testing.assert_array_equal(d, np.zeros((2, 3)))
    old_lp = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)[..., 0]
    hp = LossHParams(reduction=reduction)

    def total(lp):
        inp = _inputs(lp, old_lp, a, mask=mask, old_kl=d)
        loss, _ = POLICY_LOSSES["flow_dppo"](inp, hp)
        return reduce_loss(loss, mask, reduction, 2, float(mask.sum()))

    g = np.asarray(jax.grad(total)(old_lp))
    if reduction == "token_mean":
        expected = -np.asarray(a) / 5.0 * np.asarray(mask)
    else:
        expected = -np.asarray(a) / (np.array([[3.0], [2.0]]) * 2) * np.asarray(mask)
    np.testing.assert_allclose(g, expected, rtol=TOL)
    assert np.all(g[np.asarray(mask) * np.asarray(a) != 0] != 0)


# --------------------------------------------------------------------------- value loss


def test_value_loss_hand():
    v = np.array([[1.5, 1.1, 0.5, 2.5]])
    v_old = np.array([[1.0, 1.0, 1.0, 1.0]])
    ret = np.array([[2.0, 2.0, 0.0, 3.0]])
    mask = np.array([[1, 1, 1, 0]], np.float32)
    loss, m = value_loss(v, v_old, ret, mask, 0.2)
    # V_clip = 1.2, 1.1, 0.8, (1.2): max(.64,.25), .81, max(.64,.25), masked; no 1/2 (the
    # reference stack's loss)
    np.testing.assert_allclose(loss, [[0.64, 0.81, 0.64, 0.0]], rtol=TOL)
    np.testing.assert_array_equal(m["vf_clip_frac"], [[1, 0, 1, 0]])
    np.testing.assert_allclose(m["vf_error"][:, :3], [[-0.5, -0.9, 0.5]], rtol=TOL)
    loss, _ = value_loss(v, v_old, ret, mask, None)
    np.testing.assert_allclose(loss, [[0.25, 0.81, 0.25, 0.0]], rtol=TOL)
    # critic.loss_scale: 0.5 is the 1/2-squared-error convention
    loss, _ = value_loss(v, v_old, ret, mask, 0.2, scale=0.5)
    np.testing.assert_allclose(loss, [[0.32, 0.405, 0.32, 0.0]], rtol=TOL)
    loss, _ = value_loss(v, v_old, ret, mask, None, scale=0.5)
    np.testing.assert_allclose(loss, [[0.125, 0.405, 0.125, 0.0]], rtol=TOL)
    # the gradient of the default: 2 (V - R) on the unclipped branch, 0 where the clip is active
    g = jax.grad(lambda x: value_loss(x, v_old, ret, mask, 0.2)[0].sum())(jnp.asarray(v))
    np.testing.assert_allclose(g, [[0.0, -1.8, 0.0, 0.0]], rtol=TOL, atol=1e-7)
    assert LossHParams().value_loss_scale == 1.0
    with pytest.raises(ValueError, match="value_loss_scale"):
        LossHParams(value_loss_scale=0.0)


# --------------------------------------------------------------------------- reduction


def test_reduce_loss_hand():
    lt = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 7.0, 7.0]])
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], np.float32)
    # seq means 1.5, 4, (empty row -> 0) over 3 samples
    np.testing.assert_allclose(
        reduce_loss(lt, mask, "seq_mean_token_mean", 3, 3), (1.5 + 4.0) / 3, rtol=TOL
    )
    np.testing.assert_allclose(reduce_loss(lt, mask, "token_mean", 3, 3), 7.0 / 3, rtol=TOL)
    with pytest.raises(ValueError, match="unknown reduction"):
        reduce_loss(lt, mask, "sum", 3, 3)


def test_masked_metric_sums():
    metrics = {"x": jnp.asarray([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])}
    mask = jnp.asarray([[1, 1, 0], [1, 0, 0]], jnp.float32)
    out = masked_metric_sums(metrics, mask)
    assert float(out["x"][0]) == 6.0 and float(out["x"][1]) == 3.0


@pytest.mark.parametrize("loss_name", ["ppo", "grpo", "decoupled_ppo", "flow_dppo"])
@pytest.mark.parametrize("reduction", ["seq_mean_token_mean", "token_mean"])
def test_reduce_loss_micro_batch_invariance(loss_name, reduction):
    """Sum of micro-batch losses and gradients (w.r.t. shared params) is independent of the
    micro-batch size: 1, 2, 4 and the full batch of 8."""
    rng = np.random.default_rng(7)
    b, t = 8, 6
    lengths = np.array([6, 1, 3, 0, 5, 2, 6, 4])
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    base = rng.normal(-2, 0.3, size=(b, t)).astype(np.float32)
    feat = rng.normal(size=(b, t)).astype(np.float32)
    old = (base + rng.normal(0, 0.2, size=(b, t))).astype(np.float32)
    behav = (old + rng.normal(0, 0.5, size=(b, t))).astype(np.float32)
    ref = (old + rng.normal(0, 0.3, size=(b, t))).astype(np.float32)
    adv = rng.normal(size=(b, t)).astype(np.float32)
    old_kl = rng.uniform(0, 0.03, size=(b, t)).astype(np.float32)
    hp = LossHParams(kl_coef=0.05, reduction=reduction, dual_clip=3.0)
    n_samples, n_tokens = b, float(mask.sum())
    theta0 = jnp.asarray([0.3, -0.2], jnp.float32)

    @jax.jit
    def micro(theta, sl):
        base_, feat_, old_, behav_, ref_, adv_, m_, kl_ = sl
        lp = base_ + theta[0] * feat_ + theta[1] * feat_**2
        inp = LossInputs(lp, old_, behav_, adv_, m_, ref_logprobs=ref_, old_kl=kl_)
        loss, _ = POLICY_LOSSES[loss_name](inp, hp)
        return reduce_loss(loss, m_, hp.reduction, n_samples, n_tokens)

    arrays = [base, feat, old, behav, ref, adv, mask, old_kl]
    results = {}
    for mb in (1, 2, 4, 8):
        total, grad = 0.0, np.zeros(2)
        for s in range(0, b, mb):
            sl = [jnp.asarray(x[s : s + mb]) for x in arrays]
            val, g = jax.value_and_grad(micro)(theta0, sl)
            total += float(val)
            grad += np.asarray(g, np.float64)
        results[mb] = (total, grad)
    for mb in (1, 2, 4):
        np.testing.assert_allclose(results[mb][0], results[8][0], atol=1e-6, rtol=0)
        np.testing.assert_allclose(results[mb][1], results[8][1], atol=1e-6, rtol=0)
    assert np.any(np.abs(results[8][1]) > 1e-3)  # the gradient is live
    # independent numpy value and gradient of the full-batch loss, for every algorithm
    lp = (base + 0.3 * feat - 0.2 * feat**2).astype(np.float64)
    per_token, dloss_dlp = _numpy_policy_loss(loss_name, lp, old, behav, ref, adv, old_kl, hp)
    weights = _numpy_reduction_weights(mask, reduction, n_samples, n_tokens)
    np.testing.assert_allclose(results[8][0], np.sum(per_token * weights), rtol=1e-5, atol=1e-7)
    dlp_dtheta = np.stack([feat, feat**2], axis=-1)
    grad = np.einsum("bt,btk->k", dloss_dlp * weights, dlp_dtheta)
    np.testing.assert_allclose(results[8][1], grad, rtol=1e-4, atol=1e-6)


def _numpy_reduction_weights(mask, reduction, n_samples, n_tokens):
    """Per-token weight of reduce_loss: 1 / n_tokens, or 1 / (len_i * n_samples); 0 off mask."""
    if reduction == "token_mean":
        return mask / n_tokens
    return mask / (np.maximum(mask.sum(1, keepdims=True), 1) * n_samples)


def _numpy_policy_loss(name, lp, old, behav, ref, adv, old_kl, hp):
    """(per-token loss, d loss / d lp) in float64 from the papers' formulas, independent of
    jaxloop.rl.losses (for the hyper-parameters of the invariance test: k3, dual clip)."""
    r = np.exp(lp - old)
    lo, hi = 1.0 - hp.clip_eps, 1.0 + hp.eps_high
    unclipped, clipped = -adv * r, -adv * np.clip(r, lo, hi)
    surrogate = np.maximum(unclipped, clipped)
    # the unclipped branch carries the gradient where it is the max (or r is inside the range)
    grad = np.where((unclipped >= clipped) | ((r >= lo) & (r <= hi)), -adv * r, 0.0)
    cap = -hp.dual_clip * adv
    capped = (adv < 0) & (surrogate > cap)
    surrogate, grad = np.where(capped, cap, surrogate), np.where(capped, 0.0, grad)
    if name == "ppo":
        return surrogate, grad
    if name == "grpo":  # + kl_coef * k3(lp, ref), k3 = exp(ref - lp) - (ref - lp) - 1
        d = lp - ref
        return (
            surrogate + hp.kl_coef * (np.exp(-d) + d - 1),
            grad + hp.kl_coef * (1 - np.exp(-d)),
        )
    if name == "decoupled_ppo":  # constant behaviour weight, ratio against the proximal policy
        w = np.clip(np.exp(old - behav), hp.behav_weight_min, hp.behav_weight_max)
        return w * surrogate, w * grad
    if name == "flow_dppo":  # -A r unclipped; outward tokens with D > delta carry no gradient
        outward = ((adv > 0) & (r > 1)) | ((adv < 0) & (r < 1))
        blocked = outward & (old_kl > hp.flow_delta)
        assert 0 < blocked.sum() < blocked.size  # both kinds of token are in the batch
        return -adv * r, np.where(blocked, 0.0, -adv * r)
    raise AssertionError(name)


# --------------------------------------------------------------------------- robustness / jit


def test_padding_garbage_is_harmless():
    lp = np.array([[-1.0, -80.0]])
    old = np.array([[-1.1, 50.0]])  # exp(lp - old) would overflow/underflow on the pad
    mask = np.array([[1.0, 0.0]])
    a = np.array([[1.0, 1.0]])
    kw = {
        "behav": np.array([[-1.2, -300.0]]),
        "ref_logprobs": jnp.asarray([[-1.0, 500.0]], jnp.float32),
        "old_kl": jnp.asarray([[0.0, jnp.inf]], jnp.float32),
    }
    hp = LossHParams(kl_coef=0.1)
    for name, fn in POLICY_LOSSES.items():

        def total(lp, fn=fn):
            inp = _inputs(lp, old, a, mask=mask, **kw)
            loss, _ = fn(inp, hp)
            return reduce_loss(loss, mask, hp.reduction, 1, 1.0)

        val, g = jax.value_and_grad(total)(jnp.asarray(lp, jnp.float32))
        assert np.isfinite(float(val)), name
        assert np.all(np.isfinite(np.asarray(g))), name
        assert float(g[0, 1]) == 0.0, name


def test_hparams_hashable_and_jit_static():
    hp = LossHParams(clip_eps=0.1)
    assert hash(hp) == hash(LossHParams(clip_eps=0.1))
    assert hp.eps_high == 0.1 and LossHParams(clip_eps_high=0.3).eps_high == 0.3
    fn = jax.jit(lambda inp, hp: POLICY_LOSSES["ppo"](inp, hp)[0], static_argnums=1)
    inp = _inputs([[LN(2.0)]], [[0.0]], [[1.0]])
    np.testing.assert_allclose(fn(inp, hp), [[-1.1]], rtol=TOL)
    np.testing.assert_allclose(fn(inp, dataclasses.replace(hp, clip_eps=0.5)), [[-1.5]], rtol=TOL)
    for bad in (
        {"dual_clip": 1.0},
        {"kl_estimator": "k9"},
        {"reduction": "sum"},
        {"clip_eps": 0.0},
        {"behav_weight_min": 3.0},
    ):
        with pytest.raises(ValueError):
            LossHParams(**bad)


# --------------------------------------------------------------------------- algorithms


def test_algorithm_table():
    assert set(ALGORITHMS) == {"ppo", "grpo", "dppo", "flow_dppo"}
    for name, alg in ALGORITHMS.items():
        assert alg.name == name and alg.policy_loss in POLICY_LOSSES
    assert get_algorithm("dppo").policy_loss == "decoupled_ppo"
    assert get_algorithm("dppo").advantage == "gae" and get_algorithm("dppo").uses_critic
    fd = get_algorithm("flow_dppo")
    assert fd.needs_old_policy_logits and fd.default_updates_per_rollout == 2 and fd.uses_critic
    g = get_algorithm("grpo")
    assert g.requires_groups and not g.uses_critic and g.advantage == "grpo"
    assert get_algorithm("ppo").default_updates_per_rollout == 1
    with pytest.raises(ValueError, match="valid algorithms.*flow_dppo"):
        get_algorithm("reinforce")
    with pytest.raises(ValueError):
        Algorithm("x", "nope", "gae", False, False, False, 1, False)


def test_ppo_end_to_end_with_gae_jit():
    """Shapes compose: token rewards -> GAE -> ppo loss -> scalar, all under one jit."""
    mask = jnp.asarray([[1, 1, 1], [1, 1, 0]], jnp.float32)

    @jax.jit
    def f(lp):
        adv, ret = gae(jnp.asarray([[0, 0, 1.0], [0, -1.0, 0]]), jnp.zeros((2, 3)), mask, 1.0, 1.0)
        loss, _ = POLICY_LOSSES["ppo"](LossInputs(lp, lp, None, adv, mask), LossHParams())
        return reduce_loss(loss, mask, "token_mean", 2, 5.0)

    # r = 1: loss = -sum(A) / 5 with A = returns-to-go = [1,1,1], [-1,-1]
    np.testing.assert_allclose(f(jnp.zeros((2, 3))), -(3 - 2) / 5.0, rtol=TOL)
