"""transformers config classes for the looped families, so that vLLM can read a config.json with
model_type 'nanbeige' or 'ouro' without the model repos' remote code. Every config.json key is
kept as an attribute; the model classes read what they need (head_dim, num_loops, ...)."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig


class NanbeigeLoopedConfig(PretrainedConfig):
    model_type = "nanbeige"


class OuroLoopedConfig(PretrainedConfig):
    model_type = "ouro"


def register_configs() -> None:
    for cls in (NanbeigeLoopedConfig, OuroLoopedConfig):
        AutoConfig.register(cls.model_type, cls, exist_ok=True)
