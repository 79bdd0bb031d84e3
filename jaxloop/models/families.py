"""Which HF name table a config uses."""

from __future__ import annotations

from jaxloop.models import nanbeige, ouro
from jaxloop.models.config import LoopedConfig
from jaxloop.models.hf_mapping import TensorMap


def hf_table(cfg: LoopedConfig, role: str = "actor") -> list[TensorMap]:
    backbone = ouro.BACKBONE_TABLE if cfg.family == "ouro" else nanbeige.BACKBONE_TABLE
    head = nanbeige.LM_HEAD if role == "actor" else nanbeige.VALUE_HEAD
    return backbone + head
