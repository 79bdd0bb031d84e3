"""Nanbeige4.2 family: pre-norm looped blocks (model.norm after every loop), HF name table."""

from __future__ import annotations

from jaxloop.models.hf_mapping import TensorMap

_LAYER = "model.layers.{layer}."

BACKBONE_TABLE: list[TensorMap] = [
    TensorMap("model.embed_tokens.weight", ("embed",), "copy"),
    TensorMap(_LAYER + "input_layernorm.weight", ("blocks", "input_norm"), "copy", True),
    TensorMap(_LAYER + "self_attn.q_proj.weight", ("blocks", "q_proj"), "heads_out", True),
    TensorMap(_LAYER + "self_attn.k_proj.weight", ("blocks", "k_proj"), "heads_out", True),
    TensorMap(_LAYER + "self_attn.v_proj.weight", ("blocks", "v_proj"), "heads_out", True),
    TensorMap(_LAYER + "self_attn.o_proj.weight", ("blocks", "o_proj"), "heads_in", True),
    TensorMap(
        _LAYER + "post_attention_layernorm.weight", ("blocks", "post_attn_norm"), "copy", True
    ),
    TensorMap(_LAYER + "mlp.gate_proj.weight", ("blocks", "gate_proj"), "linear", True),
    TensorMap(_LAYER + "mlp.up_proj.weight", ("blocks", "up_proj"), "linear", True),
    TensorMap(_LAYER + "mlp.down_proj.weight", ("blocks", "down_proj"), "linear", True),
    TensorMap("model.norm.weight", ("final_norm",), "copy"),
]

LM_HEAD = [TensorMap("lm_head.weight", ("lm_head",), "linear")]

# The critic's scalar head (HF has no standard name for a token-level value head).
VALUE_HEAD = [
    TensorMap("value_head.weight", ("value_head",), "row"),
    TensorMap("value_head.bias", ("value_bias",), "scalar"),
]
