"""scripts/bench_decode.py: its transformers baseline is the looped model (the timing runs by hand).

The unrolled LlamaForCausalLM (loops x layers layers, layer l + i * layers = looped layer l) must
compute the looped model's logits, else the transformers column times another model. fp32,
max|a-b| / max|b| <= 1e-5 against jaxloop's forward on the same weights.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxloop.io.hf_walk import iter_hf
from jaxloop.models import LoopedConfig, LoopedLM
from tests.models.helpers import FP32_REL_TOL, check_rel

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_decode.py"
_spec = importlib.util.spec_from_file_location("bench_decode", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_unrolled_llama_computes_the_looped_model():
    import torch

    shape = dict(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16, loops=2)
    hf = bench.looped_hf_config(SimpleNamespace(**shape))
    model = LoopedLM(LoopedConfig.from_hf_dict(hf), rngs=nnx.Rngs(3))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        param = getattr(model.blocks, name)
        param[...] = param[...] * 8.0  # away from the near-uniform init: mistakes would show
    tensors = dict(iter_hf(model, model.config))
    llama = bench.unrolled_llama(hf, tensors)
    assert llama.config.num_hidden_layers == 4
    ids = np.random.default_rng(0).integers(0, 96, (2, 9)).astype(np.int32)
    want = np.asarray(model(jnp.asarray(ids)))
    with torch.no_grad():
        got = llama(torch.from_numpy(ids).long()).logits.numpy()
    assert want.std() > 0.1
    check_rel("unrolled llama vs looped", got, want, FP32_REL_TOL)
    with pytest.raises(ValueError, match="skip_loop_final_norm"):
        bench.unrolled_llama(hf | {"skip_loop_final_norm": False}, tensors)
