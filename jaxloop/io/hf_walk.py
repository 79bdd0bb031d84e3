"""The one walk between a model's parameters and its HF tensors.

Every HF tensor of a model is one `HFTensor` of its family's table (`hf_entries`, in table
order): a parameter path, a layer of a stacked parameter or none, and a layout. Both directions
go through the same two views of a parameter:

- `hf_view(param, t)`: the HF tensor `t` as a view of (a layer of) `param` (numpy or jax; only
  transposes and reshapes), read by export, publication and staging, and written into by import
  (load_hf, the sampler's `fill_from_hf`), since a view of a contiguous numpy buffer is writable.
- `expected_hf_shape(param_shape, t)`: the HF shape a parameter of that shape gives `t`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from jaxloop import families
from jaxloop.families.tables import HFTensor, expand, hf_shape, to_hf

ParamLookup = Callable[[tuple[str, ...]], Any]


def hf_entries(cfg, role: str = "actor") -> list[HFTensor]:
    """Every HF tensor of a `role` model of `cfg`, in table order (the order all writers use)."""
    return expand(families.hf_table(cfg.family, role), cfg)


def hf_targets(cfg, role: str = "actor") -> dict[str, HFTensor]:
    """HF name -> HFTensor of a `role` model of `cfg` (what import looks names up in)."""
    return {t.name: t for t in hf_entries(cfg, role)}


def expected_hf_shape(param_shape: tuple[int, ...], t: HFTensor) -> tuple[int, ...]:
    """The HF shape of tensor `t` cut from a parameter of `param_shape`."""
    param_shape = tuple(param_shape)
    return hf_shape(t.layout, param_shape[1:] if t.layer is not None else param_shape)


def hf_view(param, t: HFTensor):
    """HF tensor `t` as a view of `param` (its layer of a stacked parameter, re-laid-out)."""
    return to_hf(param if t.layer is None else param[t.layer], t.layout)


def writable_hf_view(buffer: np.ndarray, t: HFTensor) -> np.ndarray:
    """hf_view of a host buffer, checked to share its memory (import writes through it)."""
    view = hf_view(buffer, t)
    if not np.may_share_memory(view, buffer):
        raise RuntimeError(f"layout {t.layout} of {t.name} gave a copy, not a view")
    return view


def param_lookup(params) -> ParamLookup:
    """path -> parameter value of a model (attribute path), an nnx.State, a flat mapping of
    variables or arrays, or a path -> value function (returned as it is)."""
    from flax import nnx

    if isinstance(params, Mapping) and not isinstance(params, nnx.State):
        return lambda path: params[path][...]
    if callable(params) and not isinstance(params, nnx.Module):
        return params
    if isinstance(params, nnx.State):
        flat = dict(nnx.to_flat_state(params))
        return lambda path: flat[path][...]

    def from_model(path):
        obj = params
        for part in path:
            obj = getattr(obj, part)
        return obj[...]

    return from_model


def iter_hf(
    params,
    cfg,
    role: str = "actor",
    dtypes: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, contiguous host array) of every tensor, in table order. `params`: a model, an
    nnx.State, a flat path mapping or a path -> value function (param_lookup). A layer of a
    stacked parameter is sliced where it lives before it comes to the host, so a sharded model
    reaches the host one HF tensor at a time. A tensor named in `dtypes` (dtype names) is cast
    to that dtype on the host (numpy's cast)."""
    lookup = param_lookup(params)
    dtypes = dtypes or {}
    for t in hf_entries(cfg, role):
        value = lookup(t.path)
        if t.layer is not None:
            value = value[t.layer]
        arr = np.ascontiguousarray(to_hf(np.asarray(value), t.layout))
        want = dtypes.get(t.name)
        if want is not None and str(np.dtype(arr.dtype)) != want:
            arr = arr.astype(_np_dtype(want))
        yield t.name, arr


def fill_from_hf(
    tensors: Iterable[tuple[str, np.ndarray]],
    param_specs: Mapping[tuple[str, ...], Any],
    cfg,
    role: str = "actor",
    error: type[Exception] = ValueError,
) -> tuple[dict[tuple[str, ...], np.ndarray], int]:
    """Host parameter buffers (path -> array of the spec's shape and dtype) filled from named
    HF tensors; every tensor of the table must come, each with its expected shape, else `error`
    naming it. `param_specs`: path -> anything with .shape and .dtype. Returns (buffers, count)."""
    targets = hf_targets(cfg, role)
    buffers: dict[tuple[str, ...], np.ndarray] = {}
    seen = set()
    for name, arr in tensors:
        t = targets.get(name)
        if t is None:
            raise error(f"unknown tensor {name}")
        spec = param_specs[t.path]
        want = expected_hf_shape(spec.shape, t)
        if tuple(np.shape(arr)) != want:
            raise error(f"tensor {name} has shape {tuple(np.shape(arr))}, expected {want}")
        if t.path not in buffers:
            buffers[t.path] = np.empty(tuple(spec.shape), spec.dtype)
        writable_hf_view(buffers[t.path], t)[...] = np.asarray(arr)
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise error(f"publication is missing tensor {missing[0]}")
    return buffers, len(seen)


def _np_dtype(name: str) -> np.dtype:
    import jax.numpy as jnp  # bfloat16 and the other ml_dtypes names

    return np.dtype(jnp.dtype(name))
