"""HF tensor name <-> parameter path tables, and the layout transforms between them (numpy only).

One table per family (nanbeige.py, ouro.py) serves HF import, HF export, policy publication to
rollout engines and the vLLM plugin's expected names and shapes; nothing else spells an HF
tensor name.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Layouts: how one HF tensor (PyTorch [out, in]) maps onto one parameter slice.
#   copy       same shape (norm weights, embedding [vocab, embed])
#   linear     HF [out, in]          -> [in, out]
#   heads_out  HF [heads*dim, embed] -> [embed, heads, dim]    (q/k/v projections)
#   heads_in   HF [embed, heads*dim] -> [heads, dim, embed]    (o projection)
#   row        HF [1, embed]         -> [embed]                (exit gate, value head)
#   scalar     HF [1]                -> []                     (their biases)
LAYOUTS = ("copy", "linear", "heads_out", "heads_in", "row", "scalar")

# The config dimensions an HF shape is written in (TensorMap.hf_dims).
#   v vocab_size, e hidden_size, m intermediate_size, q num_heads*head_dim,
#   kv num_kv_heads*head_dim, 1 a literal 1
HF_DIMS = ("v", "e", "m", "q", "kv", "1")


@dataclasses.dataclass(frozen=True)
class TensorMap:
    hf_name: str  # may contain '{layer}'
    path: tuple[str, ...]  # attribute path on LoopedLM
    layout: str
    hf_dims: tuple[str, ...]  # the HF shape in config dimensions, e.g. ('q', 'e')
    per_layer: bool = False

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"{self.hf_name}: unknown layout {self.layout!r}")
        unknown = [d for d in self.hf_dims if d not in HF_DIMS]
        if unknown:
            raise ValueError(f"{self.hf_name}: unknown dimensions {unknown}; expected {HF_DIMS}")


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One concrete HF tensor: its name, where it lives, and (for stacked params) which layer."""

    name: str
    path: tuple[str, ...]
    layout: str
    layer: int | None
    hf_dims: tuple[str, ...] = ()


# The heads every family shares: the actor's lm_head, or the critic's scalar value head (HF has
# no standard name for a token-level value head).
LM_HEAD = [TensorMap("lm_head.weight", ("lm_head",), "linear", ("v", "e"))]
VALUE_HEAD = [
    TensorMap("value_head.weight", ("value_head",), "row", ("1", "e")),
    TensorMap("value_head.bias", ("value_bias",), "scalar", ("1",)),
]


def expand(table: list[TensorMap], cfg) -> list[HFTensor]:
    """Concrete tensors of a table; `cfg` needs `num_layers` (LoopedConfig or the vLLM arch)."""
    out = []
    for entry in table:
        if entry.per_layer:
            for i in range(cfg.num_layers):
                name = entry.hf_name.format(layer=i)
                out.append(HFTensor(name, entry.path, entry.layout, i, entry.hf_dims))
        else:
            out.append(HFTensor(entry.hf_name, entry.path, entry.layout, None, entry.hf_dims))
    return out


def dim_sizes(cfg) -> dict[str, int]:
    """Sizes of HF_DIMS from any object with LoopedConfig's dimension attributes."""
    return {
        "v": cfg.vocab_size,
        "e": cfg.hidden_size,
        "m": cfg.intermediate_size,
        "q": cfg.num_heads * cfg.head_dim,
        "kv": cfg.num_kv_heads * cfg.head_dim,
        "1": 1,
    }


def table_hf_shapes(table: list[TensorMap], cfg) -> dict[str, tuple[int, ...]]:
    """HF name -> full HF shape of every tensor of `table`, from config dimensions alone."""
    sizes = dim_sizes(cfg)
    return {t.name: tuple(sizes[d] for d in t.hf_dims) for t in expand(table, cfg)}


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
