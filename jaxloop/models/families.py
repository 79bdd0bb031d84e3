"""Which HF name table a config uses (the tables live in jaxloop/families)."""

from __future__ import annotations

from jaxloop import families
from jaxloop.families.tables import TensorMap
from jaxloop.models.config import LoopedConfig


def hf_table(cfg: LoopedConfig, role: str = "actor") -> list[TensorMap]:
    return families.hf_table(cfg.family, role)
