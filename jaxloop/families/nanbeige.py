"""Nanbeige4.2 family: pre-norm looped blocks (model.norm after every loop unless
skip_loop_final_norm), its HF tensor table, config reader/writer and tiny config. A plain Llama
config reads as this block run once (used for parity against transformers)."""

from __future__ import annotations

from typing import Any

from jaxloop.families.common import ConfigError, common_fields, read_bool, read_dim
from jaxloop.families.tables import TensorMap

FAMILY = "nanbeige"
LOOP_KEY = "num_loops"
SANDWICH_NORM = False
EARLY_EXIT_GATE = False

_LAYER = "model.layers.{layer}."

BACKBONE_TABLE: list[TensorMap] = [
    TensorMap("model.embed_tokens.weight", ("embed",), "copy", ("v", "e")),
    TensorMap(_LAYER + "input_layernorm.weight", ("blocks", "input_norm"), "copy", ("e",), True),
    TensorMap(
        _LAYER + "self_attn.q_proj.weight", ("blocks", "q_proj"), "heads_out", ("q", "e"), True
    ),
    TensorMap(
        _LAYER + "self_attn.k_proj.weight", ("blocks", "k_proj"), "heads_out", ("kv", "e"), True
    ),
    TensorMap(
        _LAYER + "self_attn.v_proj.weight", ("blocks", "v_proj"), "heads_out", ("kv", "e"), True
    ),
    TensorMap(
        _LAYER + "self_attn.o_proj.weight", ("blocks", "o_proj"), "heads_in", ("e", "q"), True
    ),
    TensorMap(
        _LAYER + "post_attention_layernorm.weight",
        ("blocks", "post_attn_norm"),
        "copy",
        ("e",),
        True,
    ),
    TensorMap(_LAYER + "mlp.gate_proj.weight", ("blocks", "gate_proj"), "linear", ("m", "e"), True),
    TensorMap(_LAYER + "mlp.up_proj.weight", ("blocks", "up_proj"), "linear", ("m", "e"), True),
    TensorMap(_LAYER + "mlp.down_proj.weight", ("blocks", "down_proj"), "linear", ("e", "m"), True),
    TensorMap("model.norm.weight", ("final_norm",), "copy", ("e",)),
]


def read_nanbeige(hf: dict) -> dict[str, Any]:
    if read_bool(hf, "enable_double_loop_split"):
        raise ConfigError("enable_double_loop_split=true is not implemented")
    if read_bool(hf, "loop_share_kv"):
        raise ConfigError("loop_share_kv=true is not implemented (each loop keeps its own KV)")
    fields = common_fields(hf)
    fields.update(
        family=FAMILY,
        num_loops=read_dim(hf, LOOP_KEY, 1),
        norm_between_loops=not read_bool(hf, "skip_loop_final_norm"),
    )
    return fields


def read_llama(hf: dict) -> dict[str, Any]:
    fields = common_fields(hf)
    fields.update(family=FAMILY, num_loops=1)
    return fields


# model_type in config.json -> reader of LoopedConfig fields
HF_READERS = {"nanbeige": read_nanbeige, "llama": read_llama}


def hf_keys(cfg) -> dict[str, Any]:
    """This family's keys of a config.json written for `cfg`."""
    return {
        "architectures": ["NanbeigeForCausalLM"],
        "model_type": "nanbeige",
        LOOP_KEY: cfg.num_loops,
        "skip_loop_final_norm": not cfg.norm_between_loops,
        "attention_bias": False,
    }


TINY_HF_KEYS: dict[str, Any] = {
    "architectures": ["NanbeigeForCausalLM"],
    "model_type": "nanbeige",
    LOOP_KEY: 2,
    "skip_loop_final_norm": False,
    "attention_bias": False,
    "loop_loss_weights": [],
}
