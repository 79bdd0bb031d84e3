"""JAX forward vs the independent float64 PyTorch reference (and vs transformers' Llama).

Tiny configs with head_dim (16) != hidden / heads (8) and GQA (4 heads / 2 kv heads). Weights are
random with norm weights around 1 and a rope_theta other than the default. Tolerance for fp32
logits, per-loop logits and Ouro exit probabilities: max|a-b| / max|b| <= 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxloop.io.hf import load_hf
from tests.models.helpers import FP32_REL_TOL, check_rel, jit_forward, padded_mask, random_ids
from tests.models.torch_reference import reference_forward, rel_err, write_random_checkpoint

B, S = 3, 12
# row 0 left-padded by 4, row 1 unpadded, row 2 right-padded by 3
LEFT_PAD, RIGHT_PAD = [4, 0, 0], [0, 0, 3]
# bf16 parameters + bf16 compute vs the float64 reference: measured ~1-3% (Nanbeige) and ~5-6%
# (Ouro, whose sandwich norms amplify rounding) on these models; the bound is loose on purpose.
BF16_REL_TOL = 0.15

FAMILIES = {
    # family: (tiny_hf_config overrides, seed)
    "nanbeige": (dict(num_loops=2, rope_theta=500.0), 11),
    "ouro": (dict(total_ut_steps=4, rope_theta=500.0), 12),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory):
    family = request.param
    overrides, seed = FAMILIES[family]
    path = tmp_path_factory.mktemp(f"parity-{family}")
    hf, tensors = write_random_checkpoint(path, family, seed=seed, **overrides)
    assert hf["head_dim"] * hf["num_attention_heads"] != hf["hidden_size"]
    assert hf["num_key_value_heads"] < hf["num_attention_heads"]
    model = load_hf(path, dtype="float32")
    ids = random_ids(hf["vocab_size"], (B, S), seed)
    return dict(family=family, path=path, hf=hf, tensors=tensors, fwd=jit_forward(model), ids=ids)


def test_full_sequence_parity(case):
    hf, ids = case["hf"], case["ids"]
    mask = np.ones((B, S), np.int32)
    out = case["fwd"](ids, mask)
    ref = reference_forward(case["tensors"], hf, ids)
    loops = hf["num_loops"] if case["family"] == "nanbeige" else hf["total_ut_steps"]
    assert out.logits.shape == (B, S, hf["vocab_size"])
    assert out.loop_logits.shape == (loops, B, S, hf["vocab_size"])
    name = case["family"]
    check_rel(f"parity {name} logits", out.logits, ref["logits"], FP32_REL_TOL)
    check_rel(f"parity {name} per-loop logits", out.loop_logits, ref["loop_logits"], FP32_REL_TOL)
    check_rel(f"parity {name} hidden", out.hidden, ref["loop_hidden"][-1], FP32_REL_TOL)
    # the loops really differ (the test would not notice a model that ran one loop otherwise)
    assert rel_err(ref["loop_logits"][0], ref["loop_logits"][-1]) > 1e-2
    if case["family"] == "ouro":
        assert out.exit_probs.shape == (loops, B, S)
        check_rel("parity ouro exit probs", out.exit_probs, ref["exit_probs"], FP32_REL_TOL)
        np.testing.assert_allclose(np.asarray(out.exit_probs).sum(0), 1.0, atol=1e-6)
        assert np.all(np.asarray(out.exit_probs) >= 0)
        # no single step takes all the mass, so the distribution is exercised
        assert float(np.asarray(out.exit_probs).max()) < 0.99
    else:
        assert out.exit_probs is None


def test_padded_batch_parity(case):
    """Left- and right-padded rows: valid positions match the reference run on each row's real
    tokens alone (positions 0..n-1), and the reference run on the padded batch with the mask."""
    hf, ids = case["hf"], case["ids"]
    mask = padded_mask(B, S, LEFT_PAD, RIGHT_PAD)
    out = case["fwd"](ids, mask)
    batch_ref = reference_forward(case["tensors"], hf, ids, attention_mask=mask)
    name = case["family"]
    keep = mask.astype(bool)
    check_rel(
        f"parity {name} padded logits",
        np.asarray(out.logits)[keep],
        batch_ref["logits"][keep],
        FP32_REL_TOL,
    )
    for r in range(B):
        valid = keep[r]
        row_ref = reference_forward(case["tensors"], hf, ids[r : r + 1, valid])
        got = np.asarray(out.logits)[r, valid]
        check_rel(f"parity {name} row {r} vs unpadded", got, row_ref["logits"][0], FP32_REL_TOL)
        got_loops = np.asarray(out.loop_logits)[:, r, valid]
        check_rel(
            f"parity {name} row {r} loops vs unpadded",
            got_loops,
            row_ref["loop_logits"][:, 0],
            FP32_REL_TOL,
        )
        if case["family"] == "ouro":
            got_p = np.asarray(out.exit_probs)[:, r, valid]
            check_rel(
                f"parity ouro row {r} exit probs vs unpadded",
                got_p,
                row_ref["exit_probs"][:, 0],
                FP32_REL_TOL,
            )


def test_bf16_compute_smoke(case):
    """bf16 parameters and compute: finite float32 logits, close to the fp32 model and to the
    float64 reference within BF16_REL_TOL."""
    model = load_hf(case["path"], dtype="bfloat16")
    assert model.config.compute_dtype == "bfloat16"
    assert model.blocks.q_proj[...].dtype == np.dtype("bfloat16")
    ids, mask = case["ids"], np.ones((B, S), np.int32)
    out = model.forward(ids, attention_mask=mask)
    assert out.logits.dtype == np.float32
    fam = case["family"]
    fp32 = case["fwd"](ids, mask).logits
    check_rel(f"parity {fam} bf16 vs fp32 logits", out.logits, fp32, BF16_REL_TOL)
    ref = reference_forward(case["tensors"], case["hf"], ids)
    check_rel(f"parity {fam} bf16 vs float64 ref logits", out.logits, ref["logits"], BF16_REL_TOL)


def test_llama_vs_transformers(tmp_path):
    """num_loops=1 Nanbeige == a transformers LlamaForCausalLM saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=500.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norm weights initialise to ones; make them random around 1
        for name, p in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.25 * torch.randn_like(p))
    hf_model.save_pretrained(tmp_path, safe_serialization=True)

    model = load_hf(tmp_path, dtype="float32")
    assert model.config.family == "nanbeige" and model.config.num_loops == 1
    assert model.config.head_dim == 16 and model.config.rope_theta == 500.0

    ids = random_ids(64, (B, S), 3)
    mask = padded_mask(B, S, LEFT_PAD, RIGHT_PAD)
    hf64 = hf_model.to(torch.float64)
    fwd = jit_forward(model)
    with torch.no_grad():
        want = hf64(input_ids=torch.tensor(ids, dtype=torch.long)).logits
    got = fwd(ids, np.ones((B, S), np.int32)).logits
    check_rel("parity llama vs transformers", got, want, FP32_REL_TOL)
    # padded rows vs transformers on each row's real tokens alone (its eager attention gives NaN
    # for fully masked left-padding rows in float64, so it is not run on the padded batch)
    got_pad = np.asarray(fwd(ids, mask).logits)
    for r in range(B):
        valid = mask[r].astype(bool)
        with torch.no_grad():
            want_row = hf64(input_ids=torch.tensor(ids[r : r + 1, valid], dtype=torch.long)).logits
        check_rel(
            f"parity llama padded row {r} vs transformers",
            got_pad[r, valid],
            want_row[0],
            FP32_REL_TOL,
        )
