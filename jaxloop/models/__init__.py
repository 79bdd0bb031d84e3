"""The looped decoder, its family configs and HF conversion."""

from jaxloop.models.config import ConfigError, LoopedConfig, tiny_hf_config
from jaxloop.models.hf_io import load_hf, save_hf
from jaxloop.models.kv_cache import KVCache, init_cache
from jaxloop.models.looped import LoopedLM, ModelOutput

__all__ = [
    "ConfigError",
    "KVCache",
    "LoopedConfig",
    "LoopedLM",
    "ModelOutput",
    "init_cache",
    "load_hf",
    "save_hf",
    "tiny_hf_config",
]
