"""Advantage estimators vs hand numbers and plain numpy / python-loop references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxloop.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageHParams,
    AdvantageInputs,
    gae,
    gae_estimator,
    grpo,
    grpo_estimator,
    masked_mean,
    masked_var,
    masked_whiten,
    register_advantage,
    token_level_rewards,
)

TOL = 1e-5


def _ragged_mask(lengths, t):
    return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


# --------------------------------------------------------------------------- masked statistics


def test_masked_mean_var_whiten_vs_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 6)).astype(np.float32)
    mask = _ragged_mask([6, 2, 4], 6)
    sel = x[mask > 0]
    np.testing.assert_allclose(masked_mean(x, mask), sel.mean(), rtol=TOL)
    np.testing.assert_allclose(
        masked_mean(x, mask, axis=1),
        [x[0].mean(), x[1, :2].mean(), x[2, :4].mean()],
        rtol=TOL,
    )
    np.testing.assert_allclose(masked_var(x, mask), sel.var(ddof=1), rtol=TOL)
    np.testing.assert_allclose(masked_var(x, mask, unbiased=False), sel.var(), rtol=TOL)
    w = np.asarray(masked_whiten(x, mask))
    ref = (sel - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(w[mask > 0], ref, rtol=TOL, atol=1e-6)
    assert np.all(w[mask == 0] == 0)
    w2 = np.asarray(masked_whiten(x, mask, shift_mean=False))
    np.testing.assert_allclose(w2[mask > 0], ref + sel.mean(), rtol=TOL, atol=1e-6)
    # an all-zero mask gives 0, not NaN
    assert float(masked_mean(x, np.zeros_like(mask))) == 0.0


# --------------------------------------------------------------------------- token rewards


def test_token_level_rewards_hand():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
    scores = np.array([2.0, -1.0, 5.0], np.float32)
    out = np.asarray(token_level_rewards(scores, mask))
    expected = np.array([[0, 0, 2, 0], [-1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
    np.testing.assert_array_equal(out, expected)

    kl = np.full((3, 4), 0.5, np.float32)
    out = np.asarray(token_level_rewards(scores, mask, kl=kl, kl_coef=0.1))
    expected = np.array([[-0.05, -0.05, 1.95, 0], [-1.05, 0, 0, 0], [0, 0, 0, 0]], np.float32)
    np.testing.assert_allclose(out, expected, rtol=TOL, atol=1e-7)


# --------------------------------------------------------------------------- GAE


def _gae_loop(rewards, values, lengths, gamma, lam):
    """Plain python reference on right-padded sequences: value after the end is 0."""
    b, t = rewards.shape
    adv = np.zeros((b, t), np.float64)
    for i in range(b):
        n = lengths[i]
        last = 0.0
        for s in reversed(range(n)):
            v_next = values[i, s + 1] if s + 1 < n else 0.0
            delta = rewards[i, s] + gamma * v_next - values[i, s]
            last = delta + gamma * lam * last
            adv[i, s] = last
    ret = adv + values * _ragged_mask(lengths, t)
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 0.95), (0.99, 1.0)])
def test_gae_matches_python_loop_ragged(gamma, lam):
    rng = np.random.default_rng(1)
    lengths = [7, 3, 1, 5, 0]
    b, t = len(lengths), 7
    mask = _ragged_mask(lengths, t)
    rewards = rng.normal(size=(b, t)).astype(np.float32)
    values = rng.normal(size=(b, t)).astype(np.float32)
    # garbage beyond the end must not leak in
    rewards_pad = np.where(mask > 0, rewards, 1e3).astype(np.float32)
    values_pad = np.where(mask > 0, values, -7e2).astype(np.float32)
    adv, ret = jax.jit(gae, static_argnames=("gamma", "lam"))(
        rewards_pad, values_pad, mask, gamma=gamma, lam=lam
    )
    adv_ref, ret_ref = _gae_loop(rewards * mask, values * mask, lengths, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), adv_ref, rtol=TOL, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), ret_ref, rtol=TOL, atol=1e-5)
    assert np.all(np.asarray(adv)[mask == 0] == 0)


def test_gae_hand_single_token_and_two_tokens():
    # one token: A = r - V
    adv, ret = gae(np.array([[1.0, 0.0]]), np.array([[0.25, 9.0]]), np.array([[1.0, 0.0]]))
    np.testing.assert_allclose(np.asarray(adv), [[0.75, 0.0]], rtol=TOL)
    np.testing.assert_allclose(np.asarray(ret), [[1.0, 0.0]], rtol=TOL)
    # two tokens, gamma=0.5, lam=0.5: d1 = 2 - 1 = 1; d0 = 0 + 0.5*1 - 0.5 = 0; A0 = 0 + .25*1
    adv, _ = gae(np.array([[0.0, 2.0]]), np.array([[0.5, 1.0]]), np.ones((1, 2)), 0.5, 0.5)
    np.testing.assert_allclose(np.asarray(adv), [[0.25, 1.0]], rtol=TOL)


def test_gae_skips_masked_holes():
    """A hole inside the response (e.g. tool output) is skipped: GAE equals GAE on the sequence
    with the hole removed."""
    rng = np.random.default_rng(2)
    r = rng.normal(size=(1, 6)).astype(np.float32)
    v = rng.normal(size=(1, 6)).astype(np.float32)
    mask = np.array([[1, 1, 0, 0, 1, 1]], np.float32)
    adv, _ = gae(r, v, mask, gamma=0.9, lam=0.7)
    keep = mask[0] > 0
    ref, _ = _gae_loop(r[:, keep], v[:, keep], [4], 0.9, 0.7)
    np.testing.assert_allclose(np.asarray(adv)[0, keep], ref[0], rtol=TOL, atol=1e-6)
    assert np.all(np.asarray(adv)[0, ~keep] == 0)


# --------------------------------------------------------------------------- GRPO


def test_grpo_hand_pair():
    # group {1, 0}: mean 0.5, unbiased std sqrt(0.5)
    mask = np.ones((2, 3), np.float32)
    adv = np.asarray(grpo(np.array([1.0, 0.0]), np.array([0, 0], np.int32), mask, eps=0.0))
    np.testing.assert_allclose(adv[:, 0], [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5)], rtol=TOL)
    np.testing.assert_allclose(adv[:, 0], [0.70710678, -0.70710678], rtol=TOL)


@pytest.mark.parametrize("use_std", [True, False])
def test_grpo_vs_numpy_arbitrary_ids(use_std):
    rng = np.random.default_rng(3)
    ids = np.array([1000, -3, 1000, 7, -3, 7, 7, 1000, 42, 42], np.int32)
    b, t = ids.size, 5
    scores = rng.normal(size=b).astype(np.float32)
    mask = _ragged_mask(rng.integers(1, t + 1, size=b), t)
    fn = jax.jit(grpo, static_argnames=("use_std", "eps"))
    adv = np.asarray(fn(scores, ids, mask, use_std=use_std, eps=1e-6))
    ref = np.zeros(b)
    for g in np.unique(ids):
        sel = ids == g
        centered = scores[sel] - scores[sel].mean()
        ref[sel] = centered / (scores[sel].std(ddof=1) + 1e-6) if use_std else centered
    np.testing.assert_allclose(adv, ref[:, None] * mask, rtol=1e-4, atol=1e-5)
    assert np.all(adv[mask == 0] == 0)


def test_grpo_equal_scores_give_zero():
    adv = np.asarray(grpo(np.array([1.0, 1.0, 0.0, 0.0]), np.array([5, 5, 9, 9]), np.ones((4, 2))))
    np.testing.assert_array_equal(adv, np.zeros((4, 2)))


def test_registry():
    assert ADVANTAGE_ESTIMATORS["gae"] is gae_estimator
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo_estimator

    @register_advantage("_test_zero")
    def zero(x):
        return jnp.zeros_like(x)

    try:
        assert ADVANTAGE_ESTIMATORS["_test_zero"] is zero
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("_test_zero")(lambda x: x)
    finally:
        ADVANTAGE_ESTIMATORS.pop("_test_zero")


def test_estimators_share_one_signature():
    """Both registry entries take (AdvantageInputs, AdvantageHParams) and equal the plain
    functions they are built from (GAE: KL reward on every token, then whitening)."""
    rng = np.random.default_rng(1)
    mask = np.ones((4, 3), np.float32)
    mask[1, 2] = 0.0
    scores = rng.normal(size=4).astype(np.float32)
    values = rng.normal(size=(4, 3)).astype(np.float32)
    kl = rng.normal(size=(4, 3)).astype(np.float32)
    inputs = AdvantageInputs(scores, mask, np.array([0, 0, 1, 1]), values, kl)
    hp = AdvantageHParams(gamma=0.9, lam=0.8, kl_coef=0.1, whiten=True)
    adv, ret = ADVANTAGE_ESTIMATORS["gae"](inputs, hp)
    want_adv, want_ret = gae(token_level_rewards(scores, mask, kl, 0.1), values, mask, 0.9, 0.8)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-6)
    np.testing.assert_allclose(adv, masked_whiten(want_adv, mask), rtol=1e-5, atol=1e-6)
    adv, ret = ADVANTAGE_ESTIMATORS["grpo"](inputs, hp)
    assert ret is None
    np.testing.assert_allclose(adv, grpo(scores, np.array([0, 0, 1, 1]), mask), rtol=1e-6)
