"""A Policy as the HF-named tensors remote engines load (names from the family table)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxloop.rollout.api import Policy


def hf_tensors(
    policy: Policy, dtypes: Mapping[str, str] | None = None
) -> list[tuple[str, np.ndarray]]:
    """(HF name, host array) of every actor tensor of `policy`, in table order; a tensor whose
    name is in `dtypes` (an engine's expected dtype names) is cast to that dtype. A stacked
    parameter comes to the host one layer at a time (see iter_hf_tensors)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxloop.models.families import hf_table
    from jaxloop.models.hf_mapping import expand, to_hf
    from jaxloop.rollout.publication import dtype_name

    flat = dict(nnx.to_flat_state(policy.params))
    dtypes = dtypes or {}
    out = []
    for t in expand(hf_table(policy.config, "actor"), policy.config):
        value = flat[t.path][...]
        if t.layer is not None:
            value = value[t.layer]
        arr = np.ascontiguousarray(to_hf(np.asarray(value), t.layout))
        want = dtypes.get(t.name)
        if want is not None and dtype_name(arr.dtype) != want:
            arr = arr.astype(np.dtype(jnp.dtype(want)))
        out.append((t.name, arr))
    return out
