"""HF config.json reading and writing shared by every family (pure Python)."""

from __future__ import annotations

import math
from typing import Any

from jaxloop.errors import UsageError


class ConfigError(UsageError):
    """A model config asks for something jaxloop does not implement, or is malformed."""


# ---- the checked reader: every config.json field jaxloop reads goes through one of these ----
MAX_DIM = 2**31 - 1  # a size beyond this is no model (and overflows shape arithmetic)
_MISSING = object()
# Every numeric field the readers take (key -> kind), for the bad-input tests and the docs:
# "dim" = an integer >= 1 (<= MAX_DIM), "float" = a finite number > 0.
NUMERIC_FIELDS: dict[str, str] = {
    "vocab_size": "dim",
    "hidden_size": "dim",
    "intermediate_size": "dim",
    "num_hidden_layers": "dim",
    "num_attention_heads": "dim",
    "num_key_value_heads": "dim",
    "head_dim": "dim",
    "kv_channels": "dim",
    "rope_theta": "float",
    "rms_norm_eps": "float",
    "pretraining_tp": "dim",
}
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def _show(value) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _get(hf: dict, key: str, default, null_is_default: bool = True):
    """hf[key]; a missing key or null gives `default` (HF writes null for "the default"), and
    a required key (default _MISSING) that is missing or null is a ConfigError. With
    `null_is_default=False` (a key transformers keeps as None, e.g. rms_norm_eps: its layers
    then fail) only a missing key gives `default`; null is refused."""
    value = hf.get(key)
    if value is None:
        if key in hf and not null_is_default:
            raise ConfigError(
                f"config.json has null for {key}: give a value (or leave the key out for "
                f"{_show(default)})"
            )
        if default is _MISSING:
            what = "is missing required key" if key not in hf else "has null for required key"
            raise ConfigError(f"config.json {what} {key!r}")
        return default
    return value


def read_dim(hf: dict, key: str, default=_MISSING) -> int:
    """An integer >= 1 and <= MAX_DIM (an integral float such as 32.0 is taken as 32)."""
    value = _get(hf, key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json {key}={_show(value)} is not an integer")
    if not 1 <= value <= MAX_DIM:
        raise ConfigError(f"config.json {key}={value} must be between 1 and {MAX_DIM}")
    return value


def read_positive(hf: dict, key: str, default=_MISSING, null_is_default: bool = True) -> float:
    """A finite number > 0."""
    value = _get(hf, key, default, null_is_default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"config.json {key}={_show(value)} is not a number")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"config.json {key}={value} must be a finite number > 0")
    return value


def read_bool(hf: dict, key: str, default: bool = False) -> bool:
    """true or false (null or missing: `default`); a string "false" is not a boolean."""
    value = _get(hf, key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"config.json {key}={_show(value)} is not true or false")
    return value


def read_str(hf: dict, key: str, default=_MISSING) -> str:
    value = _get(hf, key, default)
    if not isinstance(value, str):
        raise ConfigError(f"config.json {key}={_show(value)} is not a string")
    return value


def read_dict(hf: dict, key: str) -> dict:
    """A JSON object (null or missing: {})."""
    value = _get(hf, key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"config.json {key}={_show(value)} is not a JSON object")
    return value


def require(hf: dict, key: str):
    return _get(hf, key, _MISSING)


def reject_common(hf: dict) -> None:
    if hf.get("rope_scaling") is not None:
        raise ConfigError(f"rope_scaling={hf['rope_scaling']!r} is not implemented (only null)")
    rope_parameters = read_dict(hf, "rope_parameters")  # transformers >= 5 writes RoPE here
    if rope_parameters:
        rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(
                f"rope_parameters={rope_parameters!r} is not implemented (only default RoPE)"
            )
    if read_bool(hf, "tie_word_embeddings"):
        raise ConfigError("tie_word_embeddings=true is not implemented (looped models are untied)")
    if read_bool(hf, "attention_bias"):
        raise ConfigError("attention_bias=true is not implemented")
    if read_bool(hf, "mlp_bias"):
        raise ConfigError("mlp_bias=true is not implemented")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={_show(act)} is not implemented (only silu / SwiGLU)")
    if read_bool(hf, "use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not implemented")
    if read_dim(hf, "pretraining_tp", 1) != 1:
        raise ConfigError(f"pretraining_tp={hf['pretraining_tp']} is not implemented (only 1)")


def _head_dim(hf: dict) -> int:
    for key in ("head_dim", "kv_channels"):
        if hf.get(key) is not None:
            return read_dim(hf, key)
    hidden, heads = read_dim(hf, "hidden_size"), read_dim(hf, "num_attention_heads")
    if hidden % heads:
        raise ConfigError(
            f"config.json hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
            "(and no head_dim is given)"
        )
    return hidden // heads


def _rope_theta(hf: dict) -> float:
    if hf.get("rope_theta") is not None:
        return read_positive(hf, "rope_theta")
    rope_parameters = read_dict(hf, "rope_parameters")
    if rope_parameters.get("rope_theta") is not None:
        try:
            return read_positive(rope_parameters, "rope_theta")
        except ConfigError as err:
            raise ConfigError(
                str(err).replace("rope_theta", "rope_parameters.rope_theta", 1)
            ) from None
    return 10000.0


def common_fields(hf: dict) -> dict[str, Any]:
    """LoopedConfig fields every family reads the same way (every value checked: a one-line
    ConfigError for a string, null, list, negative, zero or huge size)."""
    num_heads = read_dim(hf, "num_attention_heads")
    return dict(
        vocab_size=read_dim(hf, "vocab_size"),
        hidden_size=read_dim(hf, "hidden_size"),
        intermediate_size=read_dim(hf, "intermediate_size"),
        num_layers=read_dim(hf, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=read_dim(hf, "num_key_value_heads", num_heads),
        head_dim=_head_dim(hf),
        rope_theta=_rope_theta(hf),
        # transformers keeps a null eps as None (its RMSNorm fails): refused, not defaulted
        rms_norm_eps=read_positive(hf, "rms_norm_eps", 1e-6, null_is_default=False),
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
