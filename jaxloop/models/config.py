"""The looped-decoder config: one dataclass covering both families, read from HF config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxloop import families
from jaxloop.families.common import ConfigError

__all__ = ["ConfigError", "LoopedConfig", "tiny_hf_config"]

REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_IMPLS = ("xla", "cudnn")
DTYPES = ("float32", "bfloat16", "float16")
# LoopedConfig fields that are not architecture (config.json leaves them out)
NUMERICS = ("param_dtype", "compute_dtype", "remat", "attention_impl", "scan_layers")


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
    # True: lax.scan over layers and loops (one compiled body each); False: both unrolled. The
    # training configs' model.scan_layers sets it (false for tiny models, true at full size)
    scan_layers: bool = True
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

    def numerics(self) -> dict[str, Any]:
        """The fields config.json does not carry (dtypes, remat, attention, scan): with
        `from_hf_dict(to_hf_dict()).replace(**numerics())` a remote engine builds the same
        program as the trainer's sampler (scan vs unrolled layers round differently by ~1 ulp)."""
        return {name: getattr(self, name) for name in NUMERICS}

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ---- HF config.json -----------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> LoopedConfig:
        fields = families.read_hf_config(hf)
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
        out = dict(self.hf_config) if self.hf_config else families.default_hf_dict(self)
        out["head_dim"] = self.head_dim
        return out


def tiny_hf_config(family: str = "nanbeige", **overrides) -> dict[str, Any]:
    """A small HF-style config.json dict (head_dim != hidden/heads, GQA) for tests and defaults."""
    return families.tiny_hf_config(family, **overrides)
