"""Learner-level checks: an update does not depend on the micro-batch size (<= 1e-6), and the
old log-probs / Flow-DPPO old-policy logits come from the frozen pre-update parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.rl.advantages import AdvantageHParams
from jaxloop.rl.algorithms import get_algorithm
from jaxloop.rl.batch import RolloutBatch
from jaxloop.rl.learner import Learner, LearnerConfig
from jaxloop.rl.losses import LossHParams
from jaxloop.rl.offload import OffloadConfig
from jaxloop.rl.state import build_train_state
from jaxloop.train.build import build_critic

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
    return RolloutBatch(
        tokens=tokens,
        attention_mask=attn,
        response_mask=resp,
        behav_logprobs=np.zeros((n, seq - 1), np.float32),
        scores=rng.normal(size=n).astype(np.float32),
        group_ids=np.repeat(np.arange(n // 2), 2).astype(np.int32),
        sample_mask=np.ones((n,), np.float32),
    )


class _Run:
    """A learner and its train state on one device."""

    def __init__(
        self,
        name,
        micro,
        kl_coef=0.0,
        flow_delta=0.01,
        logits_chunk=None,
        offload=None,
        tx=None,
        value_loss_scale=1.0,
        pack_tokens=None,
        updates=0,
        loop_credit="last",
        model_cfg=CFG,
        entropy_coef=0.0,
        step_split="contiguous",
    ):
        algo = get_algorithm(name)
        actor = LoopedLM(model_cfg, rngs=nnx.Rngs(0))
        critic = build_critic(actor, 1) if algo.uses_critic else None
        lcfg = LearnerConfig(
            micro,
            0.8,
            updates or algo.default_updates_per_rollout,
            1,
            AdvantageHParams(kl_coef=kl_coef),
            logits_chunk=logits_chunk,
            pack_tokens=pack_tokens,
            loop_credit=loop_credit,
            step_split=step_split,
        )
        hp = LossHParams(
            kl_coef=kl_coef,
            flow_delta=flow_delta,
            value_loss_scale=value_loss_scale,
            entropy_coef=entropy_coef,
        )
        tx = tx or optax.sgd(0.5)
        self.learner = Learner(
            nnx.graphdef(actor),
            None if critic is None else nnx.graphdef(critic),
            algo,
            hp,
            lcfg,
            tx,
            tx,
            offload=offload or OffloadConfig(),
        )
        self.state = build_train_state(
            nnx.state(actor).to_pure_dict(),
            tx,
            None if critic is None else nnx.state(critic).to_pure_dict(),
            tx,
        )
        if kl_coef > 0:  # a reference that differs from the actor, so the KL term is non-zero
            ref = nnx.state(LoopedLM(model_cfg, rngs=nnx.Rngs(5))).to_pure_dict()
            self.state = self.state.replace(ref_params=ref)
        self.state = self.learner.rest(self.state)

    def old_logprobs(self, arrays):
        return self.learner.old_logprobs(self.state, self.learner.place_batch(arrays.train_batch()))

    def update(self, arrays):
        batch = self.learner.place_batch(arrays.train_batch())
        batch = batch.replace(old_logprobs=self.learner.old_logprobs(self.state, batch))
        self.state, metrics = self.learner.update(self.state, batch)
        return {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("name, kl", [("ppo", 0.0), ("grpo", 0.1), ("flow_dppo", 0.0)])
def test_update_independent_of_micro_batch(name, kl):
    arrays = _arrays()
    small, big = _Run(name, 2, kl), _Run(name, 8, kl)
    behav = np.asarray(small.old_logprobs(arrays))
    arrays.behav_logprobs = behav - 0.01 * arrays.response_mask
    m_small, m_big = small.update(arrays), big.update(arrays)
    moved = jax.tree.map(
        lambda a, b: float(jnp.abs(a - b).max()),
        small.state.actor_params,
        _Run(name, 8, kl).state.actor_params,
    )
    assert max(jax.tree.leaves(moved)) > 1e-4  # the update did something
    diff = jax.tree.map(
        lambda a, b: float(jnp.abs(a - b).max()), small.state.actor_params, big.state.actor_params
    )
    assert max(jax.tree.leaves(diff)) <= 1e-6, diff
    for key in ("policy_loss", "grad_norm"):
        assert abs(m_small[key] - m_big[key]) <= 1e-6 * max(1.0, abs(m_big[key])), key
    if small.state.critic_params is not None:
        cdiff = jax.tree.map(
            lambda a, b: float(jnp.abs(a - b).max()),
            small.state.critic_params,
            big.state.critic_params,
        )
        assert max(jax.tree.leaves(cdiff)) <= 1e-6
    if name == "flow_dppo":
        # 2 optimizer steps on halves: the second step's D_t is measured against pi_old, so it
        # is > 0 and reported
        assert m_big["old_kl"] > 0.0


def test_flow_dppo_zero_delta_blocks_outward_moves():
    arrays = _arrays()
    metrics = _Run("flow_dppo", 4, flow_delta=0.0).update(arrays)
    # delta = 0: after the first step, every outward token with D > 0 is blocked
    assert metrics["blocked_frac"] > 0.0


def test_update_advances_counters_and_donates_state():
    run = _Run("ppo", 8)
    before = run.state
    run.update(_arrays())
    assert run.state.update_count == 1 and run.state.version == 1
    # the old state's buffers were donated to the update: no second copy survives it
    assert jax.tree.leaves(before.actor_params)[0].is_deleted()


def test_a_state_built_off_the_mesh_compiles_each_entry_once():
    """`build_train_state` without shardings puts the state on one device, off the learner's
    (one-device) mesh; `Learner.rest` places it there, so the second update finds the programs
    of the first (without it every entry was traced and compiled again: the outputs live on the
    mesh)."""
    from tests.lowerings import counting_lowerings

    arrays, run = _arrays(), _Run("ppo", 4)
    with counting_lowerings() as lowered:
        run.update(arrays)
        first = lowered[0]
        run.update(arrays)
    assert first > 0 and lowered[0] == first


def test_kl_coef_enters_critic_algorithms_rewards():
    """algo.kl_coef > 0 for PPO / DPPO / Flow-DPPO: token rewards -kl_coef * (log pi_old -
    log pi_ref) (the reference stack's form) change the returns the critic fits and the
    advantages; with kl_coef = 0 the reference is not used at all. (The three algorithms share
    the registered 'gae' estimator; PPO stands for them.)"""
    arrays = _arrays()
    for name in ("ppo",):
        plain, kl = _Run(name, 8, 0.0), _Run(name, 8, 0.5)
        assert plain.state.ref_params is None and kl.state.ref_params is not None
        m_plain, m_kl = plain.update(arrays), kl.update(arrays)
        assert (
            abs(m_plain["advantage_mean"] - m_kl["advantage_mean"]) > 0
            or abs(m_plain["value_loss"] - m_kl["value_loss"]) > 1e-6
        ), name
        diff = jax.tree.map(
            lambda a, b: float(jnp.abs(a - b).max()),
            plain.state.critic_params,
            kl.state.critic_params,
        )
        assert max(jax.tree.leaves(diff)) > 1e-6, name


@pytest.mark.parametrize("name", ["flow_dppo", "grpo"])
def test_chunked_vocabulary_equals_whole(name):
    """LM head over chunks of 4 of the 11 target positions (the last chunk padded) vs all at
    once: log-probs, loss, metrics (entropy, Flow-DPPO's full-vocabulary D) and the updated
    parameters agree to 1e-6."""
    arrays = _arrays()
    whole, chunked = _Run(name, 4, 0.1), _Run(name, 4, 0.1, logits_chunk=4)
    np.testing.assert_allclose(
        np.asarray(chunked.old_logprobs(arrays)), np.asarray(whole.old_logprobs(arrays)), atol=1e-6
    )
    arrays.behav_logprobs = np.asarray(whole.old_logprobs(arrays)) - 0.01 * arrays.response_mask
    m_whole, m_chunked = whole.update(arrays), chunked.update(arrays)
    for key in ("policy_loss", "grad_norm", "entropy", "approx_kl"):
        assert abs(m_whole[key] - m_chunked[key]) <= 1e-6 * max(1.0, abs(m_whole[key])), key
    assert m_whole["entropy"] > 0
    if name == "flow_dppo":
        assert m_whole["old_kl"] > 0 and abs(m_whole["old_kl"] - m_chunked["old_kl"]) <= 1e-6
    diff = jax.tree.map(
        lambda a, b: float(jnp.abs(a - b).max()),
        whole.state.actor_params,
        chunked.state.actor_params,
    )
    assert max(jax.tree.leaves(diff)) <= 1e-6, diff


@pytest.mark.parametrize("name, kl", [("ppo", 0.1), ("grpo", 0.1)])
def test_offload_gives_the_same_update(name, kl):
    """Critic, actor optimizer state and reference resting in pinned host memory (the update then
    runs as three phases with moves between them): the same parameters and metrics as the fused
    update, the offloaded parts back in host memory afterwards, and the moves measured."""
    arrays = _arrays()
    adam = optax.adam(1e-3)  # an optimizer state with per-parameter moments to move
    plain = _Run(name, 4, kl, tx=adam)
    moved = _Run(
        name, 4, kl, tx=adam, offload=OffloadConfig(critic=True, optimizer=True, reference=True)
    )
    host = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}  # noqa: E731
    assert host(moved.state.ref_params) == {"pinned_host"}
    assert host(moved.state.actor_params) == {"device"}
    for _ in range(2):
        m_plain, m_moved = plain.update(arrays), moved.update(arrays)
    for key in ("policy_loss", "grad_norm", "advantage_mean"):
        assert abs(m_plain[key] - m_moved[key]) <= 1e-6 * max(1.0, abs(m_plain[key])), key
    for field in ("actor_params", "critic_params", "actor_opt"):
        a, b = getattr(plain.state, field), getattr(moved.state, field)
        if a is None:
            continue
        diff = jax.tree.map(lambda x, y: float(jnp.abs(x - np.asarray(y)).max()), a, b)
        assert max(jax.tree.leaves(diff), default=0.0) <= 1e-6, field
    assert host(moved.state.actor_opt) == {"pinned_host"}
    if moved.state.critic_params is not None:
        assert host(moved.state.critic_params) == host(moved.state.critic_opt) == {"pinned_host"}
    moves = m_moved  # the moves' times and sizes come back with the update's metrics
    assert moves["offload_reference_to_device_gb"] > 0 and moves["offload_optimizer_to_host_s"] >= 0


def test_value_loss_scale_reaches_the_critic_step():
    """critic.loss_scale (LossHParams.value_loss_scale): 0.5 halves the first update's value loss
    and its gradient (the reference stack's form is scale 1)."""
    arrays = _arrays()
    one, half = _Run("ppo", 8).update(arrays), _Run("ppo", 8, value_loss_scale=0.5).update(arrays)
    assert one["value_loss"] > 0
    np.testing.assert_allclose(half["value_loss"], 0.5 * one["value_loss"], rtol=1e-6)
    np.testing.assert_allclose(half["critic_grad_norm"], 0.5 * one["critic_grad_norm"], rtol=1e-5)


def test_entropy_coef_is_the_only_gradient_when_advantages_vanish():
    """Equal scores: GRPO's advantages are 0, so without the bonus nothing moves; with
    algo.entropy_coef the step follows the entropy's gradient and the entropy rises."""
    arrays = _arrays()
    arrays.scores[:] = 1.0
    flat = _Run("grpo", 8)
    assert flat.update(arrays)["grad_norm"] == 0.0
    bonus = _Run("grpo", 8, entropy_coef=0.5)
    before = bonus.update(arrays)
    assert before["grad_norm"] > 0.0
    after = bonus.update(arrays)
    assert after["entropy"] > before["entropy"]


@pytest.mark.parametrize(
    "name, pack, offload",
    [("grpo", None, False), ("ppo", None, False), ("dppo", 24, False), ("flow_dppo", None, True)],
)
def test_fused_old_logprobs_equal_the_separate_forward(name, pack, offload):
    """One optimizer step per rollout: `update_fused` (the old log-probs taken from the step's
    own forward under stop_gradient) gives the log-probs `old_logprobs` gives (3e-6, the fp32
    selected log-prob tolerance), and the parameters, critic and metrics of old_logprobs +
    update (1e-6), padded and packed, fused program and offloaded phases."""
    arrays = _arrays()
    off = OffloadConfig(optimizer=True, critic=True) if offload else None
    separate = _Run(name, 4, updates=1, pack_tokens=pack, offload=off)
    fused = _Run(name, 4, updates=1, pack_tokens=pack, offload=off)
    assert fused.learner.fuses_old_logprobs
    arrays.behav_logprobs = np.asarray(separate.old_logprobs(arrays)) - 0.01 * arrays.response_mask
    for _ in range(2):  # the second update starts from a moved policy
        expected_lp = np.asarray(separate.old_logprobs(arrays))
        m_separate = separate.update(arrays)
        fused.state, metrics, old_lp = fused.learner.update_fused(
            fused.state, fused.learner.place_batch(arrays.train_batch())
        )
        np.testing.assert_allclose(np.asarray(old_lp), expected_lp, atol=3e-6)
        m_fused = {k: float(v) for k, v in metrics.items()}
        for key in ("policy_loss", "grad_norm", "advantage_mean", "approx_kl"):
            assert abs(m_separate[key] - m_fused[key]) <= 1e-6 * max(1.0, abs(m_separate[key]))
    for field in ("actor_params", "critic_params"):
        a, b = getattr(separate.state, field), getattr(fused.state, field)
        if a is None:
            continue
        diff = jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)
        assert max(jax.tree.leaves(diff)) <= 1e-6, field
    moved = jax.tree.map(
        lambda a, b: float(jnp.abs(a - b).max()),
        fused.state.actor_params,
        _Run(name, 4, updates=1).state.actor_params,
    )
    assert max(jax.tree.leaves(moved)) > 1e-4  # the updates did something


def test_fused_update_refuses_what_it_cannot_fuse():
    two_steps = _Run("grpo", 4, updates=2)
    assert not two_steps.learner.fuses_old_logprobs
    batch = two_steps.learner.place_batch(_arrays().train_batch())
    with pytest.raises(ValueError, match="one optimizer step per rollout"):
        two_steps.learner.update_fused(two_steps.state, batch)
    with pytest.raises(ValueError, match="no 'old_logprobs'"):
        two_steps.learner.update(two_steps.state, batch)
    with_reference = _Run("grpo", 4, kl_coef=0.1, updates=1)
    batch = with_reference.learner.place_batch(_arrays().train_batch())
    with pytest.raises(ValueError, match="reference"):
        with_reference.learner.update_fused(with_reference.state, batch)
