"""Early-exit rollouts (Ouro exit gate): the sampler's depths follow the rule of each mode, the
trainer's replay with those depths gives the engine's log-probs (<= 3e-6 fp32), and with
depth_as_action the gate is trained by the policy loss (and only then)."""

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
from jaxloop.rl.state import build_train_state
from jaxloop.rl.stats import actor_token_stats
from jaxloop.rollout.api import Policy
from jaxloop.rollout.jax_sampler import JaxSamplerEngine
from jaxloop.rollout.types import PromptRequest, SamplingConfig

T = 0.7
LOOPS = 4
THRESHOLD = 0.6


@pytest.fixture(scope="module")
def engine():
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config("ouro", num_hidden_layers=1))
    assert cfg.num_loops == LOOPS and cfg.early_exit_gate
    model = LoopedLM(cfg, rngs=nnx.Rngs(0))
    # a random-init gate gives every token about the same distribution (lambda ~ 0.5); a larger
    # gate makes the exit depend on the token, so every depth occurs
    model.exit_gate[...] = model.exit_gate[...] * 60.0
    eng = JaxSamplerEngine(model)
    eng.publish(Policy(nnx.state(model), 3, model.config))
    return eng


def _requests(n=8, seed0=10):
    return [
        PromptRequest(tuple(range(3, 5 + k % 3)), seed=seed0 + k, group_id=k // 2, sample_index=k)
        for k in range(n)
    ]


def _sampling(mode):
    return SamplingConfig(
        temperature=T, max_new_tokens=8, early_exit=mode, exit_threshold=THRESHOLD
    )


def _replay(engine, batch, exit_mask=None):
    """The trainer's selected log-probs with the batch's depths, and the replay's exit
    distribution [L, N, T] (forward(depths=, return_loops=True))."""
    graphdef, state = nnx.split(engine.model)
    params = state.to_pure_dict()
    tokens, attn = jnp.asarray(batch.tokens), jnp.asarray(batch.attention_mask)
    depths = jnp.asarray(batch.depths)
    mask = None if exit_mask is None else jnp.asarray(exit_mask)
    lp = actor_token_stats(graphdef, params, tokens, attn, T, depths=depths, exit_mask=mask)[0]
    model = nnx.merge(graphdef, state)
    out = model.forward(
        tokens[:, :-1], attention_mask=attn[:, :-1], depths=depths, return_loops=True
    )
    full = model.forward(tokens[:, :-1], attention_mask=attn[:, :-1], return_loops=True)
    return np.asarray(lp), np.asarray(out.exit_probs), np.asarray(full.exit_probs)


def _response_positions(samples):
    """(row, input position, response index) of every response token."""
    return [
        (i, len(s.prompt_ids) + j, j)
        for i, s in enumerate(samples)
        for j in range(len(s.response_ids))
    ]


def assert_logprobs_match(recomputed, behaviour, mask):
    """3e-6 relative (floor 1): a sampled token's log-prob plus its exit's (-4 to -9 here) is a
    sum the decode and the replay accumulate in fp32 a few ulps apart; how many ulps depends on
    the processor and on XLA's optimisation level (the session compiles at level 0)."""
    diff = np.abs(np.asarray(recomputed) - behaviour) * mask
    scale = np.maximum(1.0, np.abs(behaviour))
    assert (diff / scale).max() <= 3e-6, (diff.max(), (diff / scale).max())


def test_threshold_exits_where_the_cumulative_exit_probability_reaches_it(engine):
    samples = engine.generate(_requests(), _sampling("threshold"))
    batch = RolloutBatch.from_samples(samples, [0.0] * len(samples), num_loops=LOOPS)
    lp, replay_probs, full_probs = _replay(engine, batch)
    seen = set()
    for i, pos, j in _response_positions(samples):
        depth = samples[i].extras["response_depths"][j]
        seen.add(depth)
        # the first response token follows the prompt only (full depth): a plain full-depth
        # forward of the same tokens gives its exit distribution; later tokens see exited keys
        probs = full_probs[:, i, pos] if j == 0 else replay_probs[:, i, pos]
        cdf = np.cumsum(probs)
        expected = min(int(np.sum(cdf < THRESHOLD)) + 1, LOOPS)
        assert depth == expected, (i, j, cdf)
        if j == 0:  # the replay's loops up to the exit are the token's own (later: frozen)
            np.testing.assert_allclose(
                replay_probs[:depth, i, pos], probs[:depth], rtol=1e-5, atol=1e-7
            )
    assert seen - {LOOPS} and len(seen) >= 2, seen  # the gate exits early, at several depths
    assert_logprobs_match(lp, batch.behav_logprobs, batch.response_mask)


def test_sample_mode_draws_depths_from_the_exit_distribution_with_the_seed(engine):
    samples = engine.generate(_requests(), _sampling("sample"))
    again = engine.generate(list(reversed(_requests())), _sampling("sample"))[::-1]
    other = engine.generate(_requests(seed0=500), _sampling("sample"))
    depths = [s.extras["response_depths"] for s in samples]
    assert depths == [s.extras["response_depths"] for s in again]  # the seed decides
    assert depths != [s.extras["response_depths"] for s in other]
    flat = np.concatenate(depths)
    assert flat.min() >= 1 and flat.max() <= LOOPS and len(set(flat.tolist())) >= 2
    batch = RolloutBatch.from_samples(
        samples, [0.0] * len(samples), num_loops=LOOPS, depth_as_action=True
    )
    lp, replay_probs, _ = _replay(engine, batch, batch.exit_mask)
    for i, pos, j in _response_positions(samples):
        d = samples[i].extras["response_depths"][j]
        want = np.log(replay_probs[d - 1, i, pos])  # the gate's log p of the drawn exit
        # 3e-6 relative: the log of a product of up to LOOPS gate probabilities (~ -4 here),
        # accumulated in fp32 by two programs (decode, replay) a few ulps apart
        got = samples[i].extras["response_exit_logprobs"][j]
        assert abs(got - want) <= 3e-6 * max(1.0, abs(want))
    # token + exit log-probs: the engine's behaviour equals the trainer's recompute
    assert batch.exit_mask.sum() > 0
    assert_logprobs_match(lp, batch.behav_logprobs, batch.response_mask)


@pytest.mark.parametrize("depth_as_action", [False, True])
def test_gate_gradients_only_with_depth_as_action(engine, depth_as_action):
    samples = engine.generate(_requests(), _sampling("sample"))
    scores = np.linspace(-1.0, 1.0, len(samples)).tolist()
    arrays = RolloutBatch.from_samples(
        samples, scores, num_loops=LOOPS, depth_as_action=depth_as_action
    )
    graphdef, state = nnx.split(engine.model)
    params = jax.tree.map(jnp.copy, state.to_pure_dict())  # the update donates its state
    tx = optax.sgd(0.1)
    learner = Learner(
        graphdef,
        None,
        get_algorithm("grpo"),
        LossHParams(),
        LearnerConfig(8, T, 1, 1, AdvantageHParams()),
        tx,
    )
    gate = {name: np.asarray(params[name]) for name in ("exit_gate", "exit_bias")}
    train_state = build_train_state(params, tx, None, None)  # donated by the update
    batch = learner.place_batch(arrays.train_batch())
    batch = batch.replace(old_logprobs=learner.old_logprobs(train_state, batch))
    # the recompute includes the exit log-probs exactly when the engine's behaviour does
    old = np.asarray(batch.old_logprobs)
    assert_logprobs_match(old, arrays.behav_logprobs, arrays.response_mask)
    new_state, metrics = learner.update(train_state, batch)
    assert metrics["grad_norm"] > 0
    moved = {
        name: float(np.abs(np.asarray(new_state.actor_params[name]) - before).max())
        for name, before in gate.items()
    }
    if depth_as_action:
        assert min(moved.values()) > 0, moved
    else:
        assert max(moved.values()) == 0.0, moved
