"""Mesh construction and the one logical-axis -> mesh-axis rules table (MaxText style).

Every parameter carries `logical_axes` metadata ('vocab', 'embed', 'q_heads', ...); this module
turns those names into PartitionSpecs over a ('data', 'fsdp', 'tensor') mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),
    ("norm", None),
    ("length", None),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh; one axis may be -1 to take the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not divide into mesh {sizes}")
        sizes[sizes.index(-1)] = len(devices) // known
    total = int(np.prod(sizes))
    if total > len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {total} devices, "
            f"have {len(devices)}"
        )
    return Mesh(np.array(devices[:total]).reshape(sizes), MESH_AXES)


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules=DEFAULT_RULES,
) -> PartitionSpec:
    """PartitionSpec for one array. A dim whose size the mesh axes do not divide, or whose mesh
    axis is already used by an earlier dim, stays replicated (tiny test models, odd vocab sizes)."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, size in zip(axes, shape, strict=True):
        target = table.get(name) if name is not None else None
        if target is None:
            spec.append(None)
            continue
        mesh_axes = (target,) if isinstance(target, str) else tuple(target)
        mesh_axes = tuple(a for a in mesh_axes if a not in used and mesh.shape[a] > 1)
        n = int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1
        if not mesh_axes or size % n:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for every variable of an NNX state (parameters use their logical axes)."""

    def one(var):
        axes = getattr(var, "logical_axes", None) or (None,) * len(var.shape)
        return NamedSharding(mesh, logical_to_spec(axes, var.shape, mesh, rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
    """Place a model's parameters on the mesh according to their logical axes (in place)."""
    state = nnx.state(model)
    shardings = state_shardings(state, mesh, rules)
    sharded = jax.tree.map(
        lambda var, s: var.replace(jax.device_put(var[...], s)),
        state,
        shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    nnx.update(model, sharded)
    return model


def batch_sharding(mesh: Mesh, ndim: int = 2, rules=DEFAULT_RULES) -> NamedSharding:
    """Sharding for a [batch, ...] array: batch over the data-parallel axes."""
    target = dict(rules)["batch"]
    axes = tuple(a for a in ((target,) if isinstance(target, str) else target) if mesh.shape[a] > 1)
    first = axes if len(axes) > 1 else (axes[0] if axes else None)
    return NamedSharding(mesh, PartitionSpec(first, *([None] * (ndim - 1))))
