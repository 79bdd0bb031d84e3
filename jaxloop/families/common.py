"""HF config.json reading and writing shared by every family (pure Python)."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A model config asks for something jaxloop does not implement, or is malformed."""


def require(hf: dict, key: str):
    if key not in hf:
        raise ConfigError(f"config.json is missing required key {key!r}")
    return hf[key]


def reject_common(hf: dict) -> None:
    if hf.get("rope_scaling") is not None:
        raise ConfigError(f"rope_scaling={hf['rope_scaling']!r} is not implemented (only null)")
    rope_parameters = hf.get("rope_parameters")  # transformers >= 5 writes RoPE settings here
    if rope_parameters is not None:
        rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(
                f"rope_parameters={rope_parameters!r} is not implemented (only default RoPE)"
            )
    if hf.get("tie_word_embeddings", False):
        raise ConfigError("tie_word_embeddings=true is not implemented (looped models are untied)")
    if hf.get("attention_bias", False):
        raise ConfigError("attention_bias=true is not implemented")
    if hf.get("mlp_bias", False):
        raise ConfigError("mlp_bias=true is not implemented")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r} is not implemented (only silu / SwiGLU)")
    if hf.get("use_sliding_window", False):
        raise ConfigError("use_sliding_window=true is not implemented")
    if hf.get("pretraining_tp", 1) != 1:
        raise ConfigError(f"pretraining_tp={hf['pretraining_tp']} is not implemented (only 1)")


def _head_dim(hf: dict) -> int:
    head_dim = hf.get("head_dim") or hf.get("kv_channels")
    if head_dim is None:
        head_dim = require(hf, "hidden_size") // require(hf, "num_attention_heads")
    return int(head_dim)


def _rope_theta(hf: dict) -> float:
    if hf.get("rope_theta") is not None:
        return float(hf["rope_theta"])
    rope_parameters = hf.get("rope_parameters") or {}
    return float(rope_parameters.get("rope_theta", 10000.0))


def common_fields(hf: dict) -> dict[str, Any]:
    """LoopedConfig fields every family reads the same way."""
    num_heads = int(require(hf, "num_attention_heads"))
    return dict(
        vocab_size=int(require(hf, "vocab_size")),
        hidden_size=int(require(hf, "hidden_size")),
        intermediate_size=int(require(hf, "intermediate_size")),
        num_layers=int(require(hf, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=_head_dim(hf),
        rope_theta=_rope_theta(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )


def common_hf_dict(cfg) -> dict[str, Any]:
    """The family-independent keys of a config.json written for `cfg` (a LoopedConfig)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }


# A small config.json (head_dim != hidden/heads, GQA) for tests and defaults; a family's
# TINY_HF_KEYS are added to it.
TINY_COMMON: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
