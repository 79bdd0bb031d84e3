"""The JAX-side half of the HF tables: reading a model's parameters as HF tensors.

The tables, layouts and transforms are jax-free and live in jaxloop/families/tables.py; they are
re-exported here for the model code.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxloop.families.tables import (  # noqa: F401 (re-exported)
    LAYOUTS,
    HFTensor,
    TensorMap,
    expand,
    hf_shape,
    to_hf,
    to_param,
)


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
