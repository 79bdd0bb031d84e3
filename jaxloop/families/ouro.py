"""Ouro family: sandwich-norm blocks, model.norm after every step, early-exit gate; its HF tensor
table, config reader/writer and tiny config."""

from __future__ import annotations

from typing import Any

from jaxloop.families import nanbeige
from jaxloop.families.common import common_fields, read_dim
from jaxloop.families.tables import TensorMap

FAMILY = "ouro"
LOOP_KEY = "total_ut_steps"
SANDWICH_NORM = True
EARLY_EXIT_GATE = True

_LAYER = "model.layers.{layer}."

BACKBONE_TABLE: list[TensorMap] = nanbeige.BACKBONE_TABLE + [
    TensorMap(
        _LAYER + "input_layernorm_2.weight", ("blocks", "attn_out_norm"), "copy", ("e",), True
    ),
    TensorMap(
        _LAYER + "post_attention_layernorm_2.weight",
        ("blocks", "mlp_out_norm"),
        "copy",
        ("e",),
        True,
    ),
    TensorMap("model.early_exit_gate.weight", ("exit_gate",), "row", ("1", "e")),
    TensorMap("model.early_exit_gate.bias", ("exit_bias",), "scalar", ("1",)),
]


def read_ouro(hf: dict) -> dict[str, Any]:
    fields = common_fields(hf)
    fields.update(
        family=FAMILY,
        num_loops=read_dim(hf, LOOP_KEY),
        sandwich_norm=SANDWICH_NORM,
        early_exit_gate=EARLY_EXIT_GATE,
    )
    return fields


HF_READERS = {"ouro": read_ouro}


def hf_keys(cfg) -> dict[str, Any]:
    """This family's keys of a config.json written for `cfg`."""
    return {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        LOOP_KEY: cfg.num_loops,
        "early_exit_threshold": 1.0,
        "use_sliding_window": False,
    }


TINY_HF_KEYS: dict[str, Any] = {
    "architectures": ["OuroForCausalLM"],
    "model_type": "ouro",
    LOOP_KEY: 4,
    "early_exit_threshold": 1.0,
    "use_sliding_window": False,
}
