"""Ouro family: sandwich-norm blocks, model.norm after every step, early-exit gate."""

from __future__ import annotations

from jaxloop.models import nanbeige
from jaxloop.models.hf_mapping import TensorMap

_LAYER = "model.layers.{layer}."

BACKBONE_TABLE: list[TensorMap] = nanbeige.BACKBONE_TABLE + [
    TensorMap(_LAYER + "input_layernorm_2.weight", ("blocks", "attn_out_norm"), "copy", True),
    TensorMap(
        _LAYER + "post_attention_layernorm_2.weight", ("blocks", "mlp_out_norm"), "copy", True
    ),
    TensorMap("model.early_exit_gate.weight", ("exit_gate",), "row"),
    TensorMap("model.early_exit_gate.bias", ("exit_bias",), "scalar"),
]
