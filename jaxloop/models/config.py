"""The looped-decoder config: one dataclass covering both families, read from HF config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A model config asks for something jaxloop does not implement, or is malformed."""


REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_IMPLS = ("xla", "cudnn")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LoopedConfig:
    """Architecture + numerics of a looped decoder.

    `family` selects the block shape: 'nanbeige' (pre-norm) or 'ouro' (sandwich norm + exit gate).
    `hf_config` keeps the original config.json keys so that export writes them back unchanged.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_loops: int
    rope_theta: float
    rms_norm_eps: float
    sandwich_norm: bool = False
    early_exit_gate: bool = False
    norm_between_loops: bool = True
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    attention_impl: str = "xla"
    hf_config: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"remat={self.remat!r}; expected one of {REMAT_POLICIES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"attention_impl={self.attention_impl!r}; expected {ATTENTION_IMPLS}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"{name}={getattr(self, name)!r}; expected one of {DTYPES}")
        if self.num_loops < 1:
            raise ConfigError(f"num_loops={self.num_loops} must be >= 1")

    def replace(self, **changes) -> LoopedConfig:
        return dataclasses.replace(self, **changes)

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ---- HF config.json -----------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> LoopedConfig:
        model_type = hf.get("model_type")
        if model_type not in FAMILY_READERS:
            raise ConfigError(
                f"model_type={model_type!r} is not supported; expected one of "
                f"{sorted(FAMILY_READERS)}"
            )
        _reject_common(hf)
        fields = FAMILY_READERS[model_type](hf)
        fields.update(overrides)
        return cls(hf_config=dict(hf), **fields)

    @classmethod
    def from_hf_dir(cls, path: str | Path, **overrides) -> LoopedConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{config_path} does not exist")
        try:
            hf = json.loads(config_path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"{config_path} is not valid JSON ({e})") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"{config_path} is not a JSON object")
        return cls.from_hf_dict(hf, **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json for export: every original key kept, head_dim explicit."""
        out = dict(self.hf_config) if self.hf_config else _default_hf_dict(self)
        out["head_dim"] = self.head_dim
        return out


def _require(hf: dict, key: str):
    if key not in hf:
        raise ConfigError(f"config.json is missing required key {key!r}")
    return hf[key]


def _reject_common(hf: dict) -> None:
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
        head_dim = _require(hf, "hidden_size") // _require(hf, "num_attention_heads")
    return int(head_dim)


def _rope_theta(hf: dict) -> float:
    if hf.get("rope_theta") is not None:
        return float(hf["rope_theta"])
    rope_parameters = hf.get("rope_parameters") or {}
    return float(rope_parameters.get("rope_theta", 10000.0))


def _common_fields(hf: dict) -> dict[str, Any]:
    num_heads = int(_require(hf, "num_attention_heads"))
    return dict(
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=int(_require(hf, "hidden_size")),
        intermediate_size=int(_require(hf, "intermediate_size")),
        num_layers=int(_require(hf, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=_head_dim(hf),
        rope_theta=_rope_theta(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )


def _read_nanbeige(hf: dict) -> dict[str, Any]:
    if hf.get("enable_double_loop_split", False):
        raise ConfigError("enable_double_loop_split=true is not implemented")
    if hf.get("loop_share_kv", False):
        raise ConfigError("loop_share_kv=true is not implemented (each loop keeps its own KV)")
    fields = _common_fields(hf)
    fields.update(
        family="nanbeige",
        num_loops=int(hf.get("num_loops", 1)),
        norm_between_loops=not bool(hf.get("skip_loop_final_norm", False)),
    )
    return fields


def _read_llama(hf: dict) -> dict[str, Any]:
    # A plain Llama is the Nanbeige block run once; used for parity against transformers.
    fields = _common_fields(hf)
    fields.update(family="nanbeige", num_loops=1)
    return fields


def _read_ouro(hf: dict) -> dict[str, Any]:
    fields = _common_fields(hf)
    fields.update(
        family="ouro",
        num_loops=int(_require(hf, "total_ut_steps")),
        sandwich_norm=True,
        early_exit_gate=True,
    )
    return fields


FAMILY_READERS = {"nanbeige": _read_nanbeige, "ouro": _read_ouro, "llama": _read_llama}


def _default_hf_dict(cfg: LoopedConfig) -> dict[str, Any]:
    base = {
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
    if cfg.family == "ouro":
        base.update(
            architectures=["OuroForCausalLM"],
            model_type="ouro",
            total_ut_steps=cfg.num_loops,
            early_exit_threshold=1.0,
            use_sliding_window=False,
        )
    else:
        base.update(
            architectures=["NanbeigeForCausalLM"],
            model_type="nanbeige",
            num_loops=cfg.num_loops,
            skip_loop_final_norm=not cfg.norm_between_loops,
            attention_bias=False,
        )
    return base


def tiny_hf_config(family: str = "nanbeige", **overrides) -> dict[str, Any]:
    """A small HF-style config.json dict (head_dim != hidden/heads, GQA) for tests and defaults."""
    base: dict[str, Any] = {
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
    if family == "ouro":
        base.update(
            architectures=["OuroForCausalLM"],
            model_type="ouro",
            total_ut_steps=4,
            early_exit_threshold=1.0,
            use_sliding_window=False,
        )
    elif family == "nanbeige":
        base.update(
            architectures=["NanbeigeForCausalLM"],
            model_type="nanbeige",
            num_loops=2,
            skip_loop_final_norm=False,
            attention_bias=False,
            loop_loss_weights=[],
        )
    else:
        raise ConfigError(f"unknown family {family!r}")
    base.update(overrides)
    return base
