"""The looped decoder and its config (HF files are read and written by jaxloop.io)."""

from jaxloop.models.config import ConfigError, LoopedConfig, tiny_hf_config
from jaxloop.models.kv_cache import KVCache, init_cache
from jaxloop.models.looped import LoopedLM, ModelOutput

__all__ = [
    "ConfigError",
    "KVCache",
    "LoopedConfig",
    "LoopedLM",
    "ModelOutput",
    "init_cache",
    "tiny_hf_config",
]
