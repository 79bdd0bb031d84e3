"""Per-loop log-probs of the embedded sampler (SamplingConfig.loop_logprobs, for per-loop credit):
each response token's log-prob under every loop's logits equals an independent recompute of the
whole sequence (<= 3e-6 fp32), early exits included (loops past the exit repeat the exit loop, as
the trainer's replay does), and asking for them changes no token, log-prob or depth."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.rl.batch import RolloutBatch
from jaxloop.rollout.api import Policy
from jaxloop.rollout.jax_sampler import JaxSamplerEngine
from jaxloop.rollout.types import SamplingConfig
from tests.rollout import test_early_exit as early_exit
from tests.rollout.test_early_exit import LOOPS, THRESHOLD, T, _requests, _response_positions

engine = early_exit.engine  # the Ouro sampler whose gate exits tokens at every depth

TOLERANCE = 3e-6  # fp32 selected log-probs, as the engine-vs-trainer check


def _sampling(mode, loop_logprobs=True):
    return SamplingConfig(
        temperature=T,
        max_new_tokens=6,
        early_exit=mode,
        exit_threshold=THRESHOLD,
        loop_logprobs=loop_logprobs,
    )


def _selected(loop_logits, tokens):
    """[L, N, T]: log_softmax(loop logits / T) at the targets tokens[:, 1:]."""
    x = np.asarray(loop_logits, np.float64) / T
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    targets = np.broadcast_to(tokens[None, :, 1:, None], logp.shape[:3] + (1,))
    return np.take_along_axis(logp, targets, axis=-1)[..., 0]


def _assert_loop_logprobs_match(samples, expected):
    """expected [L, N, T] at input positions; samples' extras['loop_logprobs'] [L][len]."""
    worst = 0.0
    for i, pos, j in _response_positions(samples):
        engine_lp = np.asarray(samples[i].extras["loop_logprobs"])[:, j]
        worst = max(worst, float(np.abs(engine_lp - expected[:, i, pos - 1]).max()))
        # the last loop is the distribution the token was sampled from
        assert abs(engine_lp[-1] - samples[i].response_logprobs[j]) <= TOLERANCE
    assert worst <= TOLERANCE, worst


@pytest.mark.parametrize("mode", ["none", "threshold"])
def test_loop_logprobs_equal_the_full_sequence_recompute(engine, mode):
    samples = engine.generate(_requests(), _sampling(mode))
    assert all(np.shape(s.extras["loop_logprobs"]) == (LOOPS, len(s.response_ids)) for s in samples)
    batch = RolloutBatch.from_samples(samples, [0.0] * len(samples), num_loops=LOOPS)
    tokens, attn = jnp.asarray(batch.tokens), jnp.asarray(batch.attention_mask)
    depths = None if mode == "none" else jnp.asarray(batch.depths)
    if depths is not None:  # some tokens exit early: their deeper loops are the exit loop's
        assert (batch.depths * batch.response_mask < LOOPS).any()
    out = engine.model.forward(
        tokens[:, :-1], attention_mask=attn[:, :-1], depths=depths, return_loops=True
    )
    _assert_loop_logprobs_match(samples, _selected(out.loop_logits, batch.tokens))
    off = engine.generate(_requests(), _sampling(mode, loop_logprobs=False))
    for a, b in zip(samples, off, strict=True):  # the flag changes nothing that was there
        assert "loop_logprobs" not in b.extras
        assert a.response_ids == b.response_ids and a.response_logprobs == b.response_logprobs
        assert a.extras["response_depths"] == b.extras["response_depths"]
        assert a.extras["response_exit_logprobs"] == b.extras["response_exit_logprobs"]


def test_loop_logprobs_of_a_family_without_a_norm_between_loops():
    """Nanbeige with skip_loop_final_norm: loop t's logits are those of the (t + 1)-loop model
    (the LM head reads the normed state, as the trainer's per-loop recompute does)."""
    cfg = LoopedConfig.from_hf_dict(
        tiny_hf_config("nanbeige", num_hidden_layers=1, skip_loop_final_norm=True)
    )
    model = LoopedLM(cfg, rngs=nnx.Rngs(1))
    model.final_norm[...] = 1.7 * model.final_norm[...]  # a missing (or second) norm would show
    sampler = JaxSamplerEngine(model)
    sampler.publish(Policy(nnx.state(model), 0, model.config))
    samples = sampler.generate(_requests(), _sampling("none"))
    batch = RolloutBatch.from_samples(samples, [0.0] * len(samples))
    tokens, attn = jnp.asarray(batch.tokens[:, :-1]), jnp.asarray(batch.attention_mask[:, :-1])
    budgets = [
        model.forward(tokens, attention_mask=attn, num_loops=t + 1).logits
        for t in range(cfg.num_loops)
    ]
    _assert_loop_logprobs_match(samples, _selected(np.stack(budgets), batch.tokens))
