"""Embedded sampler: log-probs equal the trainer's recompute, seeds reproduce, filters work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxloop.io.hf_walk import iter_hf
from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.models.kv_cache import read_lengths
from jaxloop.rl.batch import RolloutBatch
from jaxloop.rollout.api import NotPublishedError, Policy, PublicationError
from jaxloop.rollout.jax_sampler import JaxSamplerEngine, _generate, filter_logprobs
from jaxloop.rollout.types import PromptRequest, SamplingConfig
from tests.rl.oracle import token_logprobs

T = 0.7


@pytest.fixture(scope="module", params=["nanbeige", "ouro"])
def engine(request):
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config(request.param))
    model = LoopedLM(cfg, rngs=nnx.Rngs(0))
    eng = JaxSamplerEngine(model)
    eng.publish(Policy(nnx.state(model), 7, model.config))
    return eng


def _requests(n=6, seed0=100):
    # ragged prompts -> left padding inside the sampler
    return [
        PromptRequest(
            tuple(range(3, 3 + 1 + k % 4)), seed=seed0 + k, group_id=k // 2, sample_index=k
        )
        for k in range(n)
    ]


def _diff_to_trainer_recompute(engine, samples):
    """|engine log-prob - the trainer's whole-sequence recompute| per response token, and the
    batch the samples make."""
    arrays = RolloutBatch.from_samples(samples, [0.0] * len(samples))
    graphdef, state = nnx.split(engine.model)
    lp, _ = token_logprobs(
        graphdef,
        state.to_pure_dict(),
        jnp.asarray(arrays.tokens),
        jnp.asarray(arrays.attention_mask),
        T,
    )
    return np.abs(np.asarray(lp) - arrays.behav_logprobs) * arrays.response_mask, arrays


def test_logprobs_equal_trainer_recompute(engine):
    sampling = SamplingConfig(temperature=T, max_new_tokens=6, stop_token_ids=(2,))
    samples = engine.generate(_requests(), sampling)
    assert all(s.policy_version == 7 for s in samples)
    diff, arrays = _diff_to_trainer_recompute(engine, samples)
    assert arrays.response_mask.sum() >= len(samples)
    assert diff.max() <= 3e-6, diff.max()


def test_long_generation_through_every_read_length_equals_trainer_recompute(engine):
    """40 new tokens after a prompt bucket of 8: a 48-slot cache, decoded in four while loops
    that read 16 / 24 / 40 / 48 slots (kv_cache.read_lengths); every token's log-prob equals the
    trainer's whole-sequence recompute (3e-6)."""
    sampling = SamplingConfig(temperature=T, max_new_tokens=40)
    assert read_lengths(8 + 40) == (16, 24, 40, 48)
    samples = engine.generate(_requests(), sampling)
    assert all(len(s.response_ids) == 40 for s in samples)
    diff, _ = _diff_to_trainer_recompute(engine, samples)
    assert diff.max() <= 3e-6, diff.max()


def test_seeds_reproduce_and_differ(engine):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=5)
    a = engine.generate(_requests(), sampling)
    b = engine.generate(list(reversed(_requests())), sampling)[::-1]
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    c = engine.generate(_requests(seed0=999), sampling)
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_stop_tokens_and_finish_reason(engine):
    # find a token the greedy policy emits, then make it a stop token
    greedy = SamplingConfig(greedy=True, max_new_tokens=4)
    first = engine.generate(_requests(1), greedy)[0]
    assert first.finish_reason == "length" and len(first.response_ids) == 4
    stop = first.response_ids[1]
    stopped = engine.generate(
        _requests(1), SamplingConfig(greedy=True, max_new_tokens=4, stop_token_ids=(stop,))
    )[0]
    cut = first.response_ids.index(stop) + 1
    assert stopped.response_ids == first.response_ids[:cut]
    assert stopped.finish_reason == "stop"
    assert len(stopped.response_logprobs) == cut


def test_second_eos_id_ends_the_response(engine):
    # several EOS ids (as Qwen's generation_config lists): the response ends at the second one
    greedy = SamplingConfig(greedy=True, max_new_tokens=6)
    first = engine.generate(_requests(1), greedy)[0]
    second_eos = first.response_ids[2]
    never = next(t for t in range(3, 64) if t not in first.response_ids)
    eos_ids = SamplingConfig(greedy=True, max_new_tokens=6, stop_token_ids=(never, second_eos))
    stopped = engine.generate(_requests(1), eos_ids)[0]
    cut = first.response_ids.index(second_eos) + 1
    assert stopped.response_ids == first.response_ids[:cut]
    assert stopped.finish_reason == "stop"


def test_greedy_matches_argmax(engine):
    req = _requests(1)[0]
    out = engine.generate([req], SamplingConfig(greedy=True, max_new_tokens=1))[0]
    logits = engine.model(jnp.asarray([list(req.prompt_ids)]))
    assert out.response_ids[0] == int(jnp.argmax(logits[0, -1]))


def test_top_k_and_top_p_filters():
    lp = jax.nn.log_softmax(jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]])))
    k2 = np.asarray(filter_logprobs(lp, 2, 1.0))
    assert np.isfinite(k2[0, :2]).all() and (k2[0, 2:] < -1e30).all()
    p = np.asarray(filter_logprobs(lp, None, 0.7))  # 0.5 + 0.3 reaches 0.7: keep two
    assert (p[0, :2] > -1e30).all() and (p[0, 2:] < -1e30).all()
    p = np.asarray(filter_logprobs(lp, None, 0.5))  # the top token alone reaches 0.5
    assert p[0, 0] > -1e30 and (p[0, 1:] < -1e30).all()


def test_top_k_sampling_stays_in_top_k(engine):
    req = _requests(1)[0]
    logits = engine.model(jnp.asarray([list(req.prompt_ids)]))[0, -1]
    top2 = set(np.argsort(np.asarray(logits))[-2:].tolist())
    reqs = [PromptRequest(req.prompt_ids, seed=s, group_id=0, sample_index=s) for s in range(16)]
    out = engine.generate(reqs, SamplingConfig(top_k=2, max_new_tokens=1, temperature=2.0))
    firsts = {s.response_ids[0] for s in out}
    assert firsts <= top2 and len(firsts) == 2


def test_buckets_limit_recompiles(engine):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=3)
    engine.generate(_requests(5), sampling)
    before = _generate._cache_size()
    for n in (1, 3, 7, 8):  # all within the batch bucket of 8 and prompt bucket of 8
        engine.generate(_requests(n), sampling)
    assert _generate._cache_size() == before


def test_refuses_before_publish_and_checks_hf_publication():
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config("nanbeige"))
    model = LoopedLM(cfg, rngs=nnx.Rngs(1))
    eng = JaxSamplerEngine(model)
    with pytest.raises(NotPublishedError):
        eng.generate(_requests(1), SamplingConfig())
    other = LoopedLM(cfg, rngs=nnx.Rngs(2))
    tensors = list(iter_hf(other, cfg))
    with pytest.raises(PublicationError, match="missing tensor"):
        eng.publish_tensors(tensors[1:], 1)
    bad = [(n, a[:-1] if n == "lm_head.weight" else a) for n, a in tensors]
    with pytest.raises(PublicationError, match="lm_head.weight"):
        eng.publish_tensors(bad, 1)
    assert eng.version is None
    stats = eng.publish_tensors(tensors, 3)
    assert eng.version == 3 and stats.num_tensors == len(tensors)
    req = _requests(1)[0]
    out = eng.generate([req], SamplingConfig(greedy=True, max_new_tokens=1))[0]
    assert out.response_ids[0] == int(jnp.argmax(other(jnp.asarray([list(req.prompt_ids)]))[0, -1]))


def test_loop_budget_runs_k_loops(engine):
    """sampling.num_loops=K samples from the K-loop model (same parameters): log-probs equal the
    K-loop trainer recompute (<= 3e-6, not the full-depth one), tokens equal an engine built on
    a K-loop model, and every sample records its K."""
    cfg, state = engine.model.config, nnx.state(engine.model)
    budget = SamplingConfig(temperature=T, max_new_tokens=5, num_loops=1)
    samples = engine.generate(_requests(), budget)
    assert [s.extras["loop_budget"] for s in samples] == [1] * len(samples)
    full = engine.generate(_requests(), SamplingConfig(temperature=T, max_new_tokens=5))
    assert {s.extras["loop_budget"] for s in full} == {cfg.num_loops}
    one_loop = LoopedLM(cfg.replace(num_loops=1), rngs=nnx.Rngs(0))
    other = JaxSamplerEngine(one_loop)
    other.publish(Policy(state, 7, cfg))
    again = other.generate(_requests(), budget)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]
    assert [s.response_logprobs for s in again] == [s.response_logprobs for s in samples]
    arrays = RolloutBatch.from_samples(samples, [0.0] * len(samples))
    tokens, mask = jnp.asarray(arrays.tokens), jnp.asarray(arrays.attention_mask)
    params = state.to_pure_dict()
    k_lp, _ = token_logprobs(nnx.graphdef(one_loop), params, tokens, mask, T)
    full_lp, _ = token_logprobs(nnx.graphdef(engine.model), params, tokens, mask, T)
    k_diff = np.abs(np.asarray(k_lp) - arrays.behav_logprobs) * arrays.response_mask
    full_diff = np.abs(np.asarray(full_lp) - arrays.behav_logprobs) * arrays.response_mask
    assert k_diff.max() <= 3e-6, k_diff.max()
    assert full_diff.max() > 1e-3
    with pytest.raises(ValueError, match="outside 1.."):
        engine.generate(_requests(1), SamplingConfig(num_loops=cfg.num_loops + 1))
