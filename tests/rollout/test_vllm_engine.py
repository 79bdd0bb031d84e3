"""VLLMEngine + the vLLM plugin against the JAX model, on tiny looped checkpoints (fp32, CPU).

One engine per family (module-scoped). The reference is jaxloop's own LoopedLM on the same weights:
log_softmax(logits / temperature), compared per token. Weights are scaled up from the default
init (std 0.02 gives near-uniform attention and logits, which would hide RoPE / KV-cache / loop
mistakes), so attention is sharp and the log-probs spread over several nats.
"""

from __future__ import annotations

import functools
import time
from importlib.metadata import entry_points

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxloop.families import hf_tensor_shapes
from jaxloop.io.hf import save_hf
from jaxloop.io.hf_walk import iter_hf
from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.rollout.api import NotPublishedError, PublicationError
from jaxloop.rollout.publication.transaction import Manifest, make_chunks
from jaxloop.rollout.types import PromptRequest, SamplingConfig

TOL = 1e-4  # fp32, engine vs JAX, absolute on log-probs
FAMILIES = {
    # GQA, head_dim 32 != hidden / heads = 16
    "nanbeige": dict(num_loops=2),
    "ouro": dict(total_ut_steps=4),
}
MEASURED: dict[str, float] = {}  # max errors, printed at the end of the module


def _hf_config(family: str) -> dict:
    return tiny_hf_config(
        family,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        **FAMILIES[family],
    )


def _make_model(family: str, seed: int) -> LoopedLM:
    cfg = LoopedConfig.from_hf_dict(_hf_config(family))
    model = LoopedLM(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 100)
    scales = {"q_proj": 8.0, "k_proj": 8.0, "v_proj": 5.0, "o_proj": 5.0}
    scales |= {"gate_proj": 5.0, "up_proj": 5.0, "down_proj": 5.0}
    for name, s in scales.items():
        p = getattr(model.blocks, name)
        p[...] = p[...] * s
    for path in [("final_norm",)] + [
        ("blocks", n)
        for n in ("input_norm", "post_attn_norm", "attn_out_norm", "mlp_out_norm")
        if hasattr(model.blocks, n)
    ]:
        p = functools.reduce(getattr, path, model)
        p[...] = jnp.asarray(1.0 + 0.3 * rng.standard_normal(p.shape), jnp.float32)
    model.lm_head[...] = model.lm_head[...] * 10.0
    return model


def _tensors(model):
    return list(iter_hf(model, model.config))


def _ref_logprobs(model, ids, temperature=1.0) -> np.ndarray:
    """[len(ids), vocab] log_softmax(logits / T) of the JAX model."""
    logits = model(jnp.asarray([ids], jnp.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))


def _ref_prompt_logprobs(model, ids) -> np.ndarray:
    lp = _ref_logprobs(model, ids)
    return lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def _sample_errors(model, samples, temperature) -> float:
    worst = 0.0
    for s in samples:
        lp = _ref_logprobs(model, s.prompt_ids + s.response_ids, temperature)
        p = len(s.prompt_ids)
        ref = lp[p - 1 + np.arange(len(s.response_ids)), np.asarray(s.response_ids)]
        assert len(s.response_logprobs) == len(s.response_ids)
        worst = max(worst, float(np.abs(ref - np.asarray(s.response_logprobs)).max()))
    return worst


def _requests(n=4, base_len=40, seed0=0):
    rng = np.random.default_rng(1234)
    return [
        PromptRequest(
            prompt_ids=tuple(int(t) for t in rng.integers(3, 128, size=base_len + 3 * i)),
            seed=seed0 + i,
            group_id=i // 2,
            sample_index=i % 2,
            label=f"l{i}",
        )
        for i in range(n)
    ]


PROMPTS = [list(r.prompt_ids) for r in _requests(3)] + [[5, 9, 3, 77, 12, 100, 64]]


class Harness:
    """One engine and two weight sets (A: the checkpoint the engine started from, B: another
    seed). `serve(x)` publishes x as the next version unless x is already being served."""

    def __init__(self, family, tmp_path):
        from jaxloop.rollout.vllm_engine import VLLMEngine

        self.family = family
        self.models = {"A": _make_model(family, 0), "B": _make_model(family, 1)}
        self.tensors = {k: _tensors(m) for k, m in self.models.items()}
        path = save_hf(self.models["A"], tmp_path / family, dtype="float32")
        start = time.perf_counter()
        self.engine = VLLMEngine(
            path, dtype="float32", seed=0, max_model_len=256, block_size=32, enforce_eager=True
        )
        self.startup_seconds = time.perf_counter() - start
        self.serving: str | None = None
        # Before any publication the engine must refuse to serve.
        self.refused_before_publish = []
        for call in (
            lambda: self.engine.generate(_requests(1), SamplingConfig()),
            lambda: self.engine.prompt_logprobs([1, 2, 3]),
        ):
            try:
                call()
            except NotPublishedError as e:
                self.refused_before_publish.append(str(e))

    def serve(self, which: str):
        if self.serving != which:
            version = 0 if self.engine.version is None else self.engine.version + 1
            self.engine.publish_tensors(self.tensors[which], version)
            self.serving = which
        return self.models[which]


@pytest.fixture(scope="module", params=list(FAMILIES))
def harness(request, tmp_path_factory):
    h = Harness(request.param, tmp_path_factory.mktemp("ckpt"))
    yield h
    h.engine.close()
    print(f"\n[{h.family}] engine start-up {h.startup_seconds:.1f} s; max |err|:", end=" ")
    print({k: f"{v:.2e}" for k, v in MEASURED.items() if k.startswith(h.family)})


def _record(harness, what, err):
    key = f"{harness.family}/{what}"
    MEASURED[key] = max(MEASURED.get(key, 0.0), err)


# ---- fast: plugin wiring -------------------------------------------------------------------------
def test_plugin_entry_point_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("jaxloop") == "jaxloop.rollout.vllm_models:register"


def test_numpy_to_torch_bf16_and_fp32_exact():
    import torch

    from jaxloop.rollout.vllm_models.worker import numpy_to_torch

    x = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    assert torch.equal(numpy_to_torch(x), torch.from_numpy(x.copy()))
    xb = x.astype(ml_dtypes.bfloat16)
    tb = numpy_to_torch(xb)
    assert tb.dtype == torch.bfloat16
    assert torch.equal(tb, torch.from_numpy(x).to(torch.bfloat16))


# ---- slow: real engines --------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_before_publish_raises(harness):
    assert len(harness.refused_before_publish) == 2, harness.refused_before_publish


@pytest.mark.slow
def test_engine_expects_exactly_jaxloop_hf_names(harness):
    cfg = harness.models["A"].config
    want = {n: (tuple(s), "float32") for n, s in hf_tensor_shapes(cfg).items()}
    assert harness.engine.expected == want
    assert set(want) == {n for n, _ in harness.tensors["A"]}


@pytest.mark.slow
def test_prompt_logprobs_match_jax(harness):
    model = harness.serve("A")
    for ids in PROMPTS:
        got = harness.engine.prompt_logprobs(ids)
        ref = _ref_prompt_logprobs(model, ids)
        assert got.shape == ref.shape
        err = float(np.abs(got - ref).max())
        _record(harness, "prompt", err)
        assert err <= TOL, err
        assert ref.std() > 0.5  # the reference is not near-uniform


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0, max_new_tokens=12),
        SamplingConfig(temperature=0.7, max_new_tokens=12),
        # filtering must not leak into the log-probs (contract: unfiltered distribution)
        SamplingConfig(temperature=1.3, top_k=5, top_p=0.9, max_new_tokens=12),
        SamplingConfig(greedy=True, max_new_tokens=12),
    ],
    ids=["t1", "t0.7", "t1.3-topk5-topp0.9", "greedy"],
)
def test_sampled_logprobs_match_jax(harness, sampling):
    model = harness.serve("A")
    reqs = _requests(4)
    samples = harness.engine.generate(reqs, sampling)
    assert len(samples) == len(reqs)
    for r, s in zip(reqs, samples, strict=True):
        assert s.prompt_ids == list(r.prompt_ids)
        assert (s.seed, s.group_id, s.sample_index, s.label) == (
            r.seed,
            r.group_id,
            r.sample_index,
            r.label,
        )
        assert s.policy_version == harness.engine.version
        assert len(s.response_ids) == sampling.max_new_tokens and s.finish_reason == "length"
    temperature = 1.0 if sampling.greedy else sampling.temperature
    err = _sample_errors(model, samples, temperature)
    _record(harness, "sampled", err)
    assert err <= TOL, err
    if sampling.greedy:
        for s in samples:
            lp = _ref_logprobs(model, s.prompt_ids + s.response_ids)
            p = len(s.prompt_ids)
            assert s.response_ids == [int(lp[p - 1 + i].argmax()) for i in range(len(lp) - p)]
    if sampling.top_k is not None:
        for s in samples:  # every sampled token is inside the top-k of the processed distribution
            lp = _ref_logprobs(model, s.prompt_ids + s.response_ids, temperature)
            p = len(s.prompt_ids)
            for i, t in enumerate(s.response_ids):
                assert (lp[p - 1 + i] > lp[p - 1 + i, t]).sum() < sampling.top_k


@pytest.mark.slow
def test_seeded_sampling_reproducible(harness):
    harness.serve("A")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=10)
    reqs = _requests(3)
    a = harness.engine.generate(reqs, sampling)
    b = harness.engine.generate(list(reversed(reqs)), sampling)[::-1]
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    same_prompt = [
        PromptRequest(prompt_ids=reqs[0].prompt_ids, seed=s, group_id=0, sample_index=s)
        for s in range(4)
    ]
    outs = {tuple(s.response_ids) for s in harness.engine.generate(same_prompt, sampling)}
    assert len(outs) > 1  # different seeds, different samples


@pytest.mark.slow
def test_stop_tokens_end_the_response(harness):
    model = harness.serve("A")
    stop = tuple(range(3, 128, 2))  # half the vocabulary: some sample stops early
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12, stop_token_ids=stop)
    samples = harness.engine.generate(_requests(4), sampling)
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped
    for s in samples:
        inner = s.response_ids if s.finish_reason == "length" else s.response_ids[:-1]
        assert not set(inner) & set(stop)
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in stop  # the stop token is kept
        else:
            assert len(s.response_ids) == 12
    err = _sample_errors(model, samples, 1.0)
    _record(harness, "sampled", err)
    assert err <= TOL, err


@pytest.mark.slow
def test_second_eos_id_ends_the_response(harness):
    # a model with several EOS ids (Qwen's generation_config lists two): the producer passes them
    # all as stop_token_ids, and the greedy response ends at the second one as at the first
    harness.serve("A")
    greedy = SamplingConfig(greedy=True, max_new_tokens=6)
    first = harness.engine.generate(_requests(1), greedy)[0]
    second_eos = first.response_ids[2]
    never = next(t for t in range(3, 128) if t not in first.response_ids)
    eos_ids = SamplingConfig(greedy=True, max_new_tokens=6, stop_token_ids=(never, second_eos))
    stopped = harness.engine.generate(_requests(1), eos_ids)[0]
    cut = first.response_ids.index(second_eos) + 1
    assert stopped.response_ids == first.response_ids[:cut]
    assert stopped.finish_reason == "stop"


@pytest.mark.slow
def test_publish_changed_weights(harness):
    engine = harness.engine
    model_a = harness.serve("A")
    reqs = _requests(3)
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=8)
    engine.generate(reqs, sampling)  # fills the prefix cache with A's KV
    before = engine.prompt_logprobs(PROMPTS[0])
    v = engine.version

    model_b = harness.serve("B")
    assert engine.version == v + 1
    stats = engine.last_publish
    assert stats.version == v + 1 and stats.num_tensors == len(harness.tensors["B"])
    assert stats.num_bytes == sum(a.nbytes for _, a in harness.tensors["B"])
    assert stats.seconds > 0 and stats.gb_per_s > 0

    samples = engine.generate(reqs, sampling)
    assert all(s.policy_version == v + 1 for s in samples)
    err = _sample_errors(model_b, samples, 0.8)
    _record(harness, "after-publish", err)
    assert err <= TOL, err
    for ids in PROMPTS:
        got = engine.prompt_logprobs(ids)
        err = float(np.abs(got - _ref_prompt_logprobs(model_b, ids)).max())
        _record(harness, "after-publish", err)
        assert err <= TOL, err
    # the weights did change: B's log-probs are far from A's
    assert np.abs(engine.prompt_logprobs(PROMPTS[0]) - before).max() > 0.1
    np.testing.assert_allclose(before, _ref_prompt_logprobs(model_a, PROMPTS[0]), atol=TOL)

    harness.serve("A")  # and back
    np.testing.assert_allclose(engine.prompt_logprobs(PROMPTS[0]), before, atol=0)


def _refused(harness, attempt, match):
    """`attempt` must raise PublicationError; the engine keeps serving the same version with
    bit-identical log-probs."""
    engine = harness.engine
    version = engine.version
    before = [engine.prompt_logprobs(ids) for ids in PROMPTS[:2]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    samples_before = engine.generate(_requests(2), sampling)
    with pytest.raises(PublicationError, match=match):
        attempt()
    assert engine.version == version
    after = [engine.prompt_logprobs(ids) for ids in PROMPTS[:2]]
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)
    samples_after = engine.generate(_requests(2), sampling)
    assert [s.response_ids for s in samples_after] == [s.response_ids for s in samples_before]
    assert [s.response_logprobs for s in samples_after] == [
        s.response_logprobs for s in samples_before
    ]
    assert all(s.policy_version == version for s in samples_after)


@pytest.mark.slow
def test_wrong_digest_refused(harness):
    harness.serve("A")
    engine = harness.engine
    new = harness.tensors["B"]  # other weights: a partial load would show
    version = engine.version + 1
    manifest = Manifest.build(version, new)

    def corrupted_in_transit():
        chunks = [bytearray(c) for c in make_chunks(new, 64 << 10)]
        chunks[0][-1] ^= 0x01
        engine.publish_chunks(manifest, [bytes(c) for c in chunks])

    _refused(harness, corrupted_in_transit, "digest mismatch")

    def wrong_digest_at_finish():
        engine.publish_chunks(manifest, make_chunks(new, 64 << 10), digest="0" * 64)

    _refused(harness, wrong_digest_at_finish, "digest")

    def chunk_lost_on_the_way():
        def chunks():
            it = iter(make_chunks(new, 64 << 10))
            yield next(it)
            raise OSError("object lost")

        engine.publish_chunks(manifest, chunks())

    _refused(harness, chunk_lost_on_the_way, "object lost")


@pytest.mark.slow
def test_missing_tensor_refused(harness):
    harness.serve("A")
    engine = harness.engine
    new = [t for t in harness.tensors["B"] if t[0] != "model.layers.1.mlp.down_proj.weight"]
    _refused(
        harness,
        lambda: engine.publish_tensors(new, engine.version + 1),
        "missing tensor model.layers.1.mlp.down_proj.weight",
    )


@pytest.mark.slow
def test_wrong_shape_refused(harness):
    harness.serve("A")
    engine = harness.engine
    new = [
        (n, a[:-1] if n == "model.layers.0.self_attn.k_proj.weight" else a)
        for n, a in harness.tensors["B"]
    ]
    _refused(
        harness,
        lambda: engine.publish_tensors(new, engine.version + 1),
        "model.layers.0.self_attn.k_proj.weight has shape",
    )


@pytest.mark.slow
def test_wrong_dtype_unknown_tensor_and_stale_version_refused(harness):
    harness.serve("A")
    engine = harness.engine
    v = engine.version
    bf16 = [(n, a.astype(ml_dtypes.bfloat16)) for n, a in harness.tensors["B"]]
    _refused(
        harness, lambda: engine.publish_tensors(bf16, v + 1), "dtype bfloat16, expected float32"
    )
    extra = harness.tensors["B"] + [("model.layers.7.mlp.up_proj.weight", np.zeros(3, np.float32))]
    _refused(harness, lambda: engine.publish_tensors(extra, v + 1), "unknown tensor")
    _refused(harness, lambda: engine.publish_tensors(harness.tensors["B"], v), "not newer")
