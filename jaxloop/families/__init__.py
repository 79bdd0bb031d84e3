"""Family knowledge, jax-free: per family its HF tensor table, HF config reader/writer, tiny
config and architecture flags. The registry discovers every module of this package that defines
FAMILY, so adding a family is adding one file.

A family module defines: FAMILY (name), LOOP_KEY (config.json key of the loop count),
SANDWICH_NORM, EARLY_EXIT_GATE, BACKBONE_TABLE (list[TensorMap]), HF_READERS (model_type ->
reader of LoopedConfig fields), hf_keys(cfg) (its config.json keys when writing) and
TINY_HF_KEYS (its keys of the tiny test config).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

from jaxloop.families.common import TINY_COMMON, ConfigError, common_hf_dict, reject_common
from jaxloop.families.tables import LM_HEAD, VALUE_HEAD, TensorMap, table_hf_shapes

_REGISTRY: dict[str, ModuleType] = {}


def discover() -> dict[str, ModuleType]:
    """(Re)scan this package's path for family modules; returns family name -> module."""
    found: dict[str, ModuleType] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        name = getattr(module, "FAMILY", None)
        if name is None:
            continue
        if name in found:
            raise RuntimeError(f"family {name!r} is defined by two modules")
        found[name] = module
    _REGISTRY.clear()
    _REGISTRY.update(found)
    return dict(found)


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(family: str) -> ModuleType:
    if family not in _REGISTRY:
        raise ConfigError(f"unknown family {family!r}; expected one of {names()}")
    return _REGISTRY[family]


def hf_readers() -> dict[str, Any]:
    """config.json model_type -> reader, over all families."""
    return {t: r for module in _REGISTRY.values() for t, r in module.HF_READERS.items()}


def read_hf_config(hf: dict[str, Any]) -> dict[str, Any]:
    """LoopedConfig fields (family, dimensions, loops, arch flags) of an HF config.json dict."""
    readers = hf_readers()
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in readers:
        raise ConfigError(
            f"model_type={model_type!r} is not supported; expected one of {sorted(readers)}"
        )
    reject_common(hf)
    return readers[model_type](hf)


def default_hf_dict(cfg) -> dict[str, Any]:
    """config.json for a LoopedConfig that was not read from one."""
    out = common_hf_dict(cfg)
    out.update(get(cfg.family).hf_keys(cfg))
    return out


def tiny_hf_config(family: str = "nanbeige", **overrides) -> dict[str, Any]:
    """A small HF-style config.json dict (head_dim != hidden/heads, GQA) for tests and defaults."""
    out = dict(TINY_COMMON)
    out.update(get(family).TINY_HF_KEYS)
    out.update(overrides)
    return out


def hf_table(family: str, role: str = "actor") -> list[TensorMap]:
    """The HF tensor table of a family's actor (lm_head) or critic (value head)."""
    head = LM_HEAD if role == "actor" else VALUE_HEAD
    return get(family).BACKBONE_TABLE + head


def hf_tensor_shapes(cfg, role: str = "actor") -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor, from the table and `cfg`'s dimensions (any object with
    LoopedConfig's family / dimension attribute names)."""
    return table_hf_shapes(hf_table(cfg.family, role), cfg)


discover()
