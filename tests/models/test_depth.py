"""Depth replay (per-position exit depths, LAST_EXITED) and static loop budgets in the decoder.

Against the float64 PyTorch reference (tests/models/torch_reference.py) at fp32 logits tolerance
max|a-b| / max|b| <= 1e-5; "equals the other path" comparisons at <= 2e-6 (see SAME_TOL). Two
families cover both loop endings: Ouro (every loop ends with model.norm) and Nanbeige with
skip_loop_final_norm (only the last loop does; an exited position's output is normed).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxloop.io.hf import load_hf
from jaxloop.models import init_cache
from tests.models.helpers import FP32_REL_TOL, check_rel, padded_mask, random_ids
from tests.models.torch_reference import (
    reference_forward,
    rel_err,
    rms_norm,
    write_random_checkpoint,
)

B, PROMPT, NEW, MAX_LEN = 2, 6, 3, 12
TOTAL = PROMPT + NEW
LEFT_PAD = [2, 0]
LOOPS = 3
# depths == K vs depths=None: the same math compiled with extra selects, so XLA fuses it
# differently; measured <= 1.1e-6 (Ouro hidden), a few fp32 ulps of the sandwich-normed states
SAME_TOL = 2e-6

FAMILIES = {
    "ouro": (dict(total_ut_steps=LOOPS, rope_theta=300.0), 31),
    "nanbeige_skip_norm": (dict(num_loops=LOOPS, skip_loop_final_norm=True), 32),
}


def _jit(model):
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames=("num_loops",))
    def fwd(state, ids, mask, depths=None, cache=None, num_loops=None):
        m = nnx.merge(graphdef, state)
        return m.forward(
            ids,
            attention_mask=mask,
            cache=cache,
            return_loops=True,
            depths=depths,
            num_loops=num_loops,
        )

    return functools.partial(fwd, state)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory):
    family = request.param
    overrides, seed = FAMILIES[family]
    base = "ouro" if family == "ouro" else "nanbeige"
    path = tmp_path_factory.mktemp(f"depth-{family}")
    hf, tensors = write_random_checkpoint(path, base, seed=seed, **overrides)
    model = load_hf(path, dtype="float32")
    assert model.config.num_loops == LOOPS
    assert model.config.norm_between_loops == (family == "ouro")
    ids = random_ids(hf["vocab_size"], (B, TOTAL), seed)
    mask = np.concatenate(
        [padded_mask(B, PROMPT, LEFT_PAD, [0] * B), np.ones((B, NEW), np.int32)], axis=1
    )
    depths = np.random.default_rng(seed).integers(1, LOOPS + 1, (B, TOTAL)).astype(np.int32)
    depths[:, -1] = [1, 2]  # both early depths appear among the decoded tokens
    return dict(
        family=family,
        hf=hf,
        tensors=tensors,
        model=model,
        fwd=_jit(model),
        ids=ids,
        mask=mask,
        depths=depths,
    )


def test_replay_matches_reference(case):
    fam, ids, mask, depths = case["family"], case["ids"], case["mask"], case["depths"]
    keep = mask.astype(bool)
    out = case["fwd"](ids, mask, depths)
    ref = reference_forward(case["tensors"], case["hf"], ids, attention_mask=mask, depths=depths)
    check_rel(
        f"depth {fam} logits", np.asarray(out.logits)[keep], ref["logits"][keep], FP32_REL_TOL
    )
    check_rel(
        f"depth {fam} loop logits",
        np.asarray(out.loop_logits)[:, keep],
        ref["loop_logits"][:, keep],
        FP32_REL_TOL,
    )
    check_rel(
        f"depth {fam} hidden",
        np.asarray(out.hidden)[keep],
        ref["loop_hidden"][-1][keep],
        FP32_REL_TOL,
    )
    if fam == "ouro":
        check_rel(
            "depth ouro exit probs",
            np.asarray(out.exit_probs)[:, keep],
            ref["exit_probs"][:, keep],
            FP32_REL_TOL,
        )
    # the replay really differs from full depth, also for the full-depth positions (they attend
    # to frozen keys / values)
    full = reference_forward(case["tensors"], case["hf"], ids, attention_mask=mask)
    deep = keep & (depths == LOOPS)
    assert rel_err(ref["logits"][deep], full["logits"][deep]) > 1e-3
    # a depth-1 position's logits are the head on the full model's loop-0 state, normed
    shallow = keep & (depths == 1)
    loop0 = full["loop_hidden"][0]
    if fam != "ouro":  # loops do not end with a norm: the exit output is normed
        loop0 = rms_norm(loop0, case["tensors"]["model.norm.weight"].double(), 1e-6)
    head = case["tensors"]["lm_head.weight"].double()
    assert rel_err(ref["logits"][shallow], (loop0 @ head.T)[shallow]) < 1e-12
    check_rel(
        f"depth {fam} depth-1 logits",
        np.asarray(out.logits)[shallow],
        (loop0 @ head.T)[shallow],
        FP32_REL_TOL,
    )


def test_full_depth_equals_default(case):
    ids, mask = case["ids"], case["mask"]
    full_depths = np.full((B, TOTAL), LOOPS, np.int32)
    got = case["fwd"](ids, mask, full_depths)
    want = case["fwd"](ids, mask)
    for field in ("logits", "loop_logits", "hidden"):
        check_rel(f"full depth {field}", getattr(got, field), getattr(want, field), SAME_TOL)


def test_prefill_decode_with_depths(case):
    """Prefill (per-token depths) then one token at a time (per-token depths) == the replay."""
    fam, ids, mask, depths = case["family"], case["ids"], case["mask"], case["depths"]
    fwd = case["fwd"]
    cache = init_cache(case["model"].config, B, MAX_LEN)
    outs = [fwd(ids[:, :PROMPT], mask[:, :PROMPT], depths[:, :PROMPT], cache)]
    for t in range(PROMPT, TOTAL):
        outs.append(
            fwd(ids[:, t : t + 1], mask[:, t : t + 1], depths[:, t : t + 1], outs[-1].cache)
        )
    logits = np.concatenate([np.asarray(o.logits) for o in outs], axis=1)
    replay = case["fwd"](ids, mask, depths)
    keep = mask.astype(bool)
    check_rel(
        f"depth {fam} decode vs replay", logits[keep], np.asarray(replay.logits)[keep], FP32_REL_TOL
    )
    ref = reference_forward(case["tensors"], case["hf"], ids, attention_mask=mask, depths=depths)
    check_rel(f"depth {fam} decode vs reference", logits[keep], ref["logits"][keep], FP32_REL_TOL)
    # a token that exits at depth d wrote its loop d-1 keys / values into the slots of loops >= d
    k = np.asarray(outs[-1].cache.token_major()[0])
    for r in range(B):
        for i in range(TOTAL):
            d = depths[r, i]
            for loop in range(d, LOOPS):
                np.testing.assert_array_equal(k[loop, :, r, i], k[d - 1, :, r, i])
            if d >= 2:
                assert rel_err(k[d - 1, :, r, i], k[d - 2, :, r, i]) > 1e-3


def test_loop_budget(case):
    """num_loops=K runs K loops: equals depths == K, the K-loop reference, and its cached decode
    (which leaves the cache slots of loops >= K untouched)."""
    fam, ids, mask, fwd = case["family"], case["ids"], case["mask"], case["fwd"]
    budget = 2
    keep = mask.astype(bool)
    got = fwd(ids, mask, num_loops=budget)
    assert got.loop_logits.shape[0] == budget
    as_depths = fwd(ids, mask, np.full((B, TOTAL), budget, np.int32))
    check_rel(f"budget {fam} vs depths", got.logits, as_depths.logits, SAME_TOL)
    ref = reference_forward(case["tensors"], case["hf"], ids, attention_mask=mask, num_loops=budget)
    check_rel(
        f"budget {fam} vs reference",
        np.asarray(got.logits)[keep],
        ref["logits"][keep],
        FP32_REL_TOL,
    )
    if fam == "ouro":
        check_rel(
            f"budget {fam} exit probs",
            np.asarray(got.exit_probs)[:, keep],
            ref["exit_probs"][:, keep],
            FP32_REL_TOL,
        )
    cache = init_cache(case["model"].config, B, MAX_LEN)
    outs = [fwd(ids[:, :PROMPT], mask[:, :PROMPT], cache=cache, num_loops=budget)]
    for t in range(PROMPT, TOTAL):
        outs.append(
            fwd(ids[:, t : t + 1], mask[:, t : t + 1], cache=outs[-1].cache, num_loops=budget)
        )
    logits = np.concatenate([np.asarray(o.logits) for o in outs], axis=1)
    check_rel(f"budget {fam} decode", logits[keep], np.asarray(got.logits)[keep], FP32_REL_TOL)
    k = np.asarray(outs[-1].cache.token_major()[0])
    assert not k[budget:].any() and k[:budget, :, :, :TOTAL].any()
    with pytest.raises(ValueError, match="num_loops=4 is outside 1..3"):
        fwd(ids, mask, num_loops=LOOPS + 1)
