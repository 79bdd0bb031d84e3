"""HF tensor name <-> parameter path tables, and the layout transforms between them.

One table per family (nanbeige.py, ouro.py) serves HF import, HF export and policy publication
to rollout engines; nothing else in jaxloop spells an HF tensor name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from jaxloop.models.config import LoopedConfig

# Layouts: how one HF tensor (PyTorch [out, in]) maps onto one parameter slice.
#   copy       same shape (norm weights, embedding [vocab, embed])
#   linear     HF [out, in]          -> [in, out]
#   heads_out  HF [heads*dim, embed] -> [embed, heads, dim]    (q/k/v projections)
#   heads_in   HF [embed, heads*dim] -> [heads, dim, embed]    (o projection)
#   row        HF [1, embed]         -> [embed]                (exit gate, value head)
#   scalar     HF [1]                -> []                     (their biases)
LAYOUTS = ("copy", "linear", "heads_out", "heads_in", "row", "scalar")


@dataclasses.dataclass(frozen=True)
class TensorMap:
    hf_name: str  # may contain '{layer}'
    path: tuple[str, ...]  # attribute path on LoopedLM
    layout: str
    per_layer: bool = False


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One concrete HF tensor: its name, where it lives, and (for stacked params) which layer."""

    name: str
    path: tuple[str, ...]
    layout: str
    layer: int | None


def expand(table: list[TensorMap], cfg: LoopedConfig) -> list[HFTensor]:
    out = []
    for entry in table:
        if entry.per_layer:
            for i in range(cfg.num_layers):
                name = entry.hf_name.format(layer=i)
                out.append(HFTensor(name, entry.path, entry.layout, i))
        else:
            out.append(HFTensor(entry.hf_name, entry.path, entry.layout, None))
    return out


def to_param(x: np.ndarray, layout: str, param_shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor -> parameter slice (exact: only transposes and reshapes)."""
    if layout == "copy":
        return x
    if layout in ("linear", "heads_out", "heads_in"):
        return x.T.reshape(param_shape)
    if layout in ("row", "scalar"):
        return x.reshape(param_shape)
    raise ValueError(f"unknown layout {layout!r}")


def to_hf(x: np.ndarray, layout: str) -> np.ndarray:
    """Parameter slice -> HF tensor (inverse of to_param)."""
    if layout == "copy":
        return x
    if layout == "linear":
        return x.T
    if layout == "heads_out":
        return x.reshape(x.shape[0], -1).T
    if layout == "heads_in":
        return x.reshape(-1, x.shape[-1]).T
    if layout == "row":
        return x.reshape(1, -1)
    if layout == "scalar":
        return x.reshape(1)
    raise ValueError(f"unknown layout {layout!r}")


def hf_shape(layout: str, param_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape expected for a parameter slice of `param_shape`."""
    return tuple(to_hf(np.empty(param_shape, np.uint8), layout).shape)


def iter_hf_tensors(model, table: list[TensorMap]) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, numpy array in the parameter dtype) for every tensor of `model`, in table order.

    A layer of a stacked parameter is sliced on its devices before it comes to the host, so a
    sharded model reaches the host one HF tensor at a time (never a whole stacked parameter, and
    no host copy cached on the device array)."""
    for t in expand(table, model.config):
        value = get_param(model, t.path)[...]
        if t.layer is not None:
            value = value[t.layer]
        yield t.name, np.ascontiguousarray(to_hf(np.asarray(value), t.layout))


def get_param(model, path: tuple[str, ...]):
    obj = model
    for part in path:
        obj = getattr(obj, part)
    return obj
