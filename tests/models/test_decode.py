"""Prefill + token-by-token decode through the per-(loop, layer) KV cache reproduces the
full-sequence forward, for both families, on a batch of left-padded prompts.

fp32; tolerance max|a-b| / max|b| <= 1e-5 against the full-sequence JAX forward and against the
float64 reference run on the whole (padded) sequence.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxloop.io.hf import load_hf
from jaxloop.models import LoopedConfig, LoopedLM, init_cache, tiny_hf_config
from jaxloop.models.kv_cache import read_length_for, read_lengths
from tests.models.helpers import (
    FP32_REL_TOL,
    check_rel,
    jit_cached_forward,
    jit_forward,
    padded_mask,
    random_ids,
)
from tests.models.torch_reference import (
    apply_rope,
    reference_forward,
    rel_err,
    rms_norm,
    write_random_checkpoint,
)

B, PROMPT, NEW, MAX_LEN = 3, 7, 4, 16  # MAX_LEN > PROMPT + NEW: some slots stay unused
LEFT_PAD = [3, 0, 5]
TOTAL = PROMPT + NEW

FAMILIES = {
    "nanbeige": (dict(num_loops=3, rope_theta=300.0), 21),
    "ouro": (dict(total_ut_steps=3, rope_theta=300.0), 22),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def run(request, tmp_path_factory):
    """Full forward, then prefill + NEW single-token steps; everything the tests compare."""
    family = request.param
    overrides, seed = FAMILIES[family]
    path = tmp_path_factory.mktemp(f"decode-{family}")
    hf, tensors = write_random_checkpoint(path, family, seed=seed, **overrides)
    model = load_hf(path, dtype="float32")
    cfg = model.config

    ids = random_ids(hf["vocab_size"], (B, TOTAL), seed)
    mask = np.concatenate(
        [padded_mask(B, PROMPT, LEFT_PAD, [0] * B), np.ones((B, NEW), np.int32)], axis=1
    )
    full = jit_forward(model)(ids, mask)

    step = jit_cached_forward(model)
    cache = init_cache(cfg, B, MAX_LEN)
    slot = (cfg.num_loops, cfg.num_layers, B, cfg.num_kv_heads)
    assert cache.k.shape == (*slot, MAX_LEN, hf["head_dim"])
    assert cache.v.shape == (*slot, hf["head_dim"], MAX_LEN)
    prefill = step(ids[:, :PROMPT], mask[:, :PROMPT], cache)
    cache = prefill.cache
    assert int(cache.index) == PROMPT
    steps = []
    for t in range(PROMPT, TOTAL):
        out = step(ids[:, t : t + 1], mask[:, t : t + 1], cache)
        cache = out.cache
        steps.append(out)
    ref = reference_forward(tensors, hf, ids, attention_mask=mask)
    return dict(
        family=family,
        hf=hf,
        tensors=tensors,
        cfg=cfg,
        ids=ids,
        mask=mask,
        full=full,
        prefill=prefill,
        steps=steps,
        cache=cache,
        ref=ref,
    )


def _decoded(run, field):
    """[.., B, TOTAL, ..] assembled from the prefill and the single-token steps."""
    axis = 1 if field == "logits" else 2  # loop_logits / exit_probs carry a leading loop axis
    parts = [np.asarray(getattr(run["prefill"], field))]
    parts += [np.asarray(getattr(o, field)) for o in run["steps"]]
    return np.concatenate(parts, axis=axis)


def test_cached_logits_match_full_sequence(run):
    fam = run["family"]
    keep = run["mask"].astype(bool)
    got = _decoded(run, "logits")
    assert got.shape == (B, TOTAL, run["hf"]["vocab_size"])
    full = np.asarray(run["full"].logits)
    pk = keep[:, :PROMPT]
    check_rel(
        f"decode {fam} prefill vs full", got[:, :PROMPT][pk], full[:, :PROMPT][pk], FP32_REL_TOL
    )
    check_rel(f"decode {fam} steps vs full", got[:, PROMPT:], full[:, PROMPT:], FP32_REL_TOL)
    check_rel(
        f"decode {fam} all vs float64 ref", got[keep], run["ref"]["logits"][keep], FP32_REL_TOL
    )
    # per-row: each row's decoded logits also match (a row-specific position bug would show here)
    for r in range(B):
        check_rel(
            f"decode {fam} row {r} steps vs full", got[r, PROMPT:], full[r, PROMPT:], FP32_REL_TOL
        )


def test_cached_loop_outputs_match(run):
    fam = run["family"]
    keep = run["mask"].astype(bool)
    loop_logits = _decoded(run, "loop_logits")
    ref = run["ref"]["loop_logits"].numpy()
    check_rel(
        f"decode {fam} loop logits vs float64 ref", loop_logits[:, keep], ref[:, keep], FP32_REL_TOL
    )
    if fam == "ouro":
        probs = _decoded(run, "exit_probs")
        want = run["ref"]["exit_probs"].numpy()
        check_rel(
            "decode ouro exit probs vs float64 ref", probs[:, keep], want[:, keep], FP32_REL_TOL
        )


def test_cache_bookkeeping(run):
    cache = run["cache"]
    assert int(cache.index) == TOTAL
    valid = np.asarray(cache.valid)
    np.testing.assert_array_equal(valid[:, :TOTAL], run["mask"].astype(bool))
    assert not valid[:, TOTAL:].any()
    # slots never written stay zero
    k, v = cache.token_major()
    assert not np.asarray(k)[:, :, :, TOTAL:].any()
    assert not np.asarray(v)[:, :, :, TOTAL:].any()


def test_loops_keep_independent_caches(run):
    """Each loop caches its own K/V: cache.k[loop, 0] equals RoPE(k_proj(input_norm(x_loop))) where
    x_loop is that loop's input (the embedding, then the previous loop's normed output)."""
    hf, tensors, cfg = run["hf"], run["tensors"], run["cfg"]
    keep = run["mask"].astype(bool)
    k, v = (np.asarray(x)[:, :, :, :TOTAL] for x in run["cache"].token_major())  # [.., B, T, KV, D]
    for loop in range(1, cfg.num_loops):
        for name, arr in (("k", k), ("v", v)):
            diff = rel_err(arr[loop][:, keep], arr[0][:, keep])
            assert diff > 1e-2, f"{name} cache of loop {loop} equals loop 0 ({diff:.1e})"

    W = {n: t.to(torch.float64) for n, t in tensors.items()}
    mask = torch.tensor(run["mask"]).bool()
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    inputs = [W["model.embed_tokens.weight"][torch.tensor(run["ids"], dtype=torch.long)]]
    inputs += list(run["ref"]["loop_hidden"][:-1])
    kv, d = hf["num_key_value_heads"], hf["head_dim"]
    for loop, x in enumerate(inputs):
        xn = rms_norm(x, W["model.layers.0.input_layernorm.weight"], hf["rms_norm_eps"])
        k_ref = (xn @ W["model.layers.0.self_attn.k_proj.weight"].T).view(B, TOTAL, kv, d)
        k_ref = apply_rope(k_ref.transpose(1, 2), positions, hf["rope_theta"]).transpose(1, 2)
        v_ref = (xn @ W["model.layers.0.self_attn.v_proj.weight"].T).view(B, TOTAL, kv, d)
        fam = run["family"]
        check_rel(
            f"decode {fam} cache k loop {loop}", k[loop, 0][keep], k_ref.numpy()[keep], FP32_REL_TOL
        )
        check_rel(
            f"decode {fam} cache v loop {loop}", v[loop, 0][keep], v_ref.numpy()[keep], FP32_REL_TOL
        )


def _copies_of_shape(hlo: str, dims: tuple[int, ...]) -> list[str]:
    """The instructions of compiled HLO text that copy an array of shape `dims` (any layout): a
    `copy`, or a fusion that wraps one."""
    shape = re.compile(r"=\s*[a-z0-9]+\[" + ",".join(map(str, dims)) + r"\]\S*\s+([\w-]+)\(")
    found = []
    for line in hlo.splitlines():
        m = shape.search(line)
        if m and ("copy" in m.group(1) or re.search(r"calls=%\S*copy", line)):
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("num_loops", [None, 1])
def test_decode_step_updates_the_cache_in_place(num_loops):
    """One compiled decode step (the sampler's while-loop body) writes the new token's keys /
    values into the donated cache: no copy of the whole cache, of one loop's slots or of one
    (loop, layer) slot, and the output cache aliases the input. The loop scan used to take the
    cache slices as scan inputs and stack new ones as outputs, which copied the whole cache every
    step (and a loop budget wrote the K new loops back with a full-cache update)."""
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config("nanbeige", num_loops=2))
    graphdef, state = nnx.split(LoopedLM(cfg, rngs=nnx.Rngs(0)))
    batch, length = 8, 40
    cache = init_cache(cfg, batch, length).replace(read_length=16)  # reads 16 of 40 slots

    def step(state, token, cache):
        model = nnx.merge(graphdef, state)
        ones = jnp.ones_like(token, jnp.bool_)
        out = model.forward(token, attention_mask=ones, cache=cache, num_loops=num_loops)
        return out.logits, out.cache

    token = jnp.zeros((batch, 1), jnp.int32)
    hlo = jax.jit(step, donate_argnums=2).lower(state, token, cache).compile().as_text()
    k_full, v_full = cache.k.shape, cache.v.shape  # [loops, layers, B, kv_heads, ...]
    for dims in (k_full, k_full[1:], k_full[2:], v_full, v_full[1:], v_full[2:]):
        assert not _copies_of_shape(hlo, dims), (dims, _copies_of_shape(hlo, dims))
    header = hlo.splitlines()[0]
    aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", header)
    assert aliases is not None, header[:300]
    # state leaves come first, then the token, then the cache's k and v
    first_cache_arg = len(jax.tree.leaves(state)) + 1
    for output, arg in ((1, first_cache_arg), (2, first_cache_arg + 1)):
        assert f"{{{output}}}: ({arg}, {{}}" in aliases.group(1), aliases.group(1)


@pytest.mark.parametrize("family", ["nanbeige", "ouro"])
def test_compute_dtype_state_changes_no_result(family):
    """fp32 parameters, bf16 compute: casting once (what the sampler's decode loop gets) gives
    bitwise the forward's own per-use casts, prefill and a cached decode step alike; the
    parameters the forward reads in float32 (the exit bias) stay as they are."""
    from jaxloop.models.looped import compute_dtype_state

    hf = tiny_hf_config(family, num_hidden_layers=2)
    cfg = LoopedConfig.from_hf_dict(hf).replace(compute_dtype="bfloat16")
    graphdef, state = nnx.split(LoopedLM(cfg, rngs=nnx.Rngs(0)))
    cast = compute_dtype_state(state, "bfloat16")
    flat = dict(nnx.to_flat_state(cast))
    assert flat[("blocks", "q_proj")][...].dtype == jnp.bfloat16
    assert flat[("lm_head",)][...].dtype == jnp.bfloat16
    if family == "ouro":
        assert flat[("exit_bias",)][...].dtype == jnp.float32

    @jax.jit
    def run(state, ids):
        model = nnx.merge(graphdef, state)
        out = model.forward(ids[:, :-1], cache=init_cache(cfg, ids.shape[0], ids.shape[1]))
        step = model.forward(ids[:, -1:], cache=out.cache, return_loops=True)
        return out.logits, step.logits, step.exit_probs

    ids = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 9)), jnp.int32)
    for a, b in zip(run(state, ids), run(cast, ids), strict=True):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decode_across_every_read_length_matches_the_full_forward(tmp_path):
    """A 40-slot cache read as the sampler reads it (KVCache.read_length: 16 / 24 / 32 / 40, the
    shortest that holds the filled slots): a left-padded prompt of 5 and 31 decode steps cross
    each length, and every step's logits (every loop's) equal the full-sequence forward's, the
    last loop's also the float64 reference's."""
    length, prompt, total = 40, 5, 36
    assert read_lengths(length) == (16, 24, 32, 40)
    hf, tensors = write_random_checkpoint(tmp_path, "nanbeige", seed=5, num_loops=2)
    model = load_hf(tmp_path, dtype="float32")
    ids = random_ids(hf["vocab_size"], (2, total), 5)
    mask = padded_mask(2, total, [0, 3], [0, 0])
    full = jit_forward(model)(ids, mask)
    step = jit_cached_forward(model)
    cache = init_cache(model.config, 2, length).replace(read_length=16)
    out = step(ids[:, :prompt], mask[:, :prompt], cache)
    cache, loop_logits, read = out.cache, [np.asarray(out.loop_logits)], {16}
    for t in range(prompt, total):
        cache = cache.replace(read_length=read_length_for(length, t + 1))
        read.add(cache.read_length)
        out = step(ids[:, t : t + 1], mask[:, t : t + 1], cache)
        cache = out.cache
        loop_logits.append(np.asarray(out.loop_logits))
    assert read == {16, 24, 32, 40}
    got = np.concatenate(loop_logits, axis=2)  # [loops, B, total, V]
    keep = mask.astype(bool)
    want = np.asarray(full.loop_logits)
    check_rel("decode vs full forward", got[:, keep], want[:, keep], FP32_REL_TOL)
    ref = reference_forward(tensors, hf, ids, attention_mask=mask)
    check_rel("decode vs float64", got[-1][keep], ref["logits"].numpy()[keep], FP32_REL_TOL)
