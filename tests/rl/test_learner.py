"""Learner-level checks: an update does not depend on the micro-batch size (<= 1e-6), and the
old log-probs / Flow-DPPO old-policy logits come from the frozen pre-update parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.rl.algorithms import get_algorithm
from jaxloop.rl.learner import Learner, LearnerConfig, RolloutArrays
from jaxloop.rl.losses import LossHParams
from jaxloop.train import build_critic

CFG = LoopedConfig.from_hf_dict(tiny_hf_config("nanbeige", num_hidden_layers=1))


def _arrays(n=8, seq=12, prompt=4):
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, CFG.vocab_size, (n, seq)).astype(np.int32)
    lengths = rng.integers(prompt + 2, seq + 1, n)
    attn = np.arange(seq)[None, :] < lengths[:, None]
    tokens = np.where(attn, tokens, 0)
    resp = np.zeros((n, seq - 1), np.float32)
    for i, length in enumerate(lengths):
        resp[i, prompt - 1 : length - 1] = 1.0
    return RolloutArrays(
        tokens=tokens,
        attention_mask=attn,
        response_mask=resp,
        behav_logprobs=np.zeros((n, seq - 1), np.float32),
        scores=rng.normal(size=n).astype(np.float32),
        group_ids=np.repeat(np.arange(n // 2), 2).astype(np.int32),
    )


def _learner(name, micro, kl_coef=0.0, flow_delta=0.01):
    algo = get_algorithm(name)
    actor = LoopedLM(CFG, rngs=nnx.Rngs(0))
    critic = build_critic(actor, 1) if algo.uses_critic else None
    ref = LoopedLM(CFG, rngs=nnx.Rngs(5)) if kl_coef > 0 else None
    lcfg = LearnerConfig(micro, 0.8, algo.default_updates_per_rollout, 1, 1.0, 0.95, True, True)
    hp = LossHParams(kl_coef=kl_coef, flow_delta=flow_delta)
    return Learner(actor, critic, algo, hp, lcfg, optax.sgd(0.5), optax.sgd(0.5), ref)


@pytest.mark.parametrize("name, kl", [("ppo", 0.0), ("grpo", 0.1), ("flow_dppo", 0.0)])
def test_update_independent_of_micro_batch(name, kl):
    arrays = _arrays()
    small, big = _learner(name, 2, kl), _learner(name, 8, kl)
    behav = np.asarray(small.recompute_logprobs(arrays))
    arrays.behav_logprobs = behav - 0.01 * arrays.response_mask
    m_small, m_big = small.update(arrays), big.update(arrays)
    moved = jax.tree.map(
        lambda a, b: float(jnp.abs(a - b).max()),
        small.actor_params,
        _learner(name, 8, kl).actor_params,
    )
    assert max(jax.tree.leaves(moved)) > 1e-4  # the update did something
    diff = jax.tree.map(
        lambda a, b: float(jnp.abs(a - b).max()), small.actor_params, big.actor_params
    )
    assert max(jax.tree.leaves(diff)) <= 1e-6, diff
    for key in ("policy_loss", "grad_norm"):
        assert abs(m_small[key] - m_big[key]) <= 1e-6 * max(1.0, abs(m_big[key])), key
    if small.critic_params is not None:
        cdiff = jax.tree.map(
            lambda a, b: float(jnp.abs(a - b).max()), small.critic_params, big.critic_params
        )
        assert max(jax.tree.leaves(cdiff)) <= 1e-6
    if name == "flow_dppo":
        # 2 optimizer steps on halves: the second step's D_t is measured against pi_old, so it
        # is > 0 and reported
        assert m_big["old_kl"] > 0.0


def test_flow_dppo_zero_delta_blocks_outward_moves():
    arrays = _arrays()
    learner = _learner("flow_dppo", 4)
    learner.hp = LossHParams(flow_delta=0.0)
    learner.__init__(
        learner.actor_model(),
        learner.critic_model(),
        learner.algorithm,
        LossHParams(flow_delta=0.0),
        learner.cfg,
        optax.sgd(0.5),
        optax.sgd(0.5),
    )
    metrics = learner.update(arrays)
    # delta = 0: after the first step, every outward token with D > 0 is blocked
    assert metrics["blocked_frac"] > 0.0
