"""Mesh construction and the one logical-axis -> mesh-axis rules table (MaxText style).

Every parameter carries `logical_axes` metadata ('vocab', 'embed', 'q_heads', ...) and the model
marks its activations with the same kind of names (`constrain`); this module turns both into
PartitionSpecs over a ('data', 'fsdp', 'tensor') mesh. Weights: embed/vocab over 'fsdp' (vocab
over 'tensor' when 'tensor' > 1), heads and MLP over 'tensor'. Activations: batch over
('data', 'fsdp'), heads / MLP / vocab over 'tensor', the hidden width replicated. KV caches: batch
and kv_heads. A dimension a mesh axis does not divide (KV heads fewer than 'tensor', odd vocab
sizes) stays replicated over it, as vLLM and MaxText do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
    # activations only: the hidden width of [batch, length, embed] stays whole on each device
    ("act_embed", None),
    ("loops", None),
)


def resolve_axis_sizes(
    sizes: Mapping[str, int], num_devices: int, *, use_all: bool = True
) -> dict[str, int]:
    """The ('data', 'fsdp', 'tensor') sizes with the one -1 axis (if any) resolved to take the
    devices the others leave. use_all: the product must be exactly `num_devices` (else at most
    that). Raises ValueError with a one-line message naming the sizes."""
    sizes = {axis: int(sizes[axis]) for axis in MESH_AXES}
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1 or any(size == 0 or size < -1 for size in sizes.values()):
        raise ValueError(f"mesh {sizes}: each axis is >= 1, and at most one may be -1")
    known = int(np.prod([size for size in sizes.values() if size != -1]))
    if free:
        if num_devices % known:
            raise ValueError(f"mesh {sizes} does not divide {num_devices} devices")
        sizes[free[0]] = num_devices // known
    total = int(np.prod(list(sizes.values())))
    if total > num_devices or (use_all and total != num_devices):
        raise ValueError(
            f"mesh data={sizes['data']} x fsdp={sizes['fsdp']} x tensor={sizes['tensor']} = "
            f"{total} devices, but {num_devices} are available"
        )
    return sizes


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh over the first devices; one axis may be -1 to take the
    remaining devices (resolve_axis_sizes)."""
    devices = list(devices if devices is not None else jax.devices())
    wanted = {"data": data, "fsdp": fsdp, "tensor": tensor}
    sizes = resolve_axis_sizes(wanted, len(devices), use_all=False)
    total = int(np.prod(list(sizes.values())))
    shape = [sizes[axis] for axis in MESH_AXES]
    return Mesh(np.array(devices[:total]).reshape(shape), MESH_AXES)


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


def shardings_for(abstract, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings from the logical axes of every variable of `abstract` (which may be
    abstract: `nnx.eval_shape`); a variable without logical axes is replicated.

    - an nnx.Module: a pure dict, the layout of `nnx.to_pure_dict(nnx.state(module))` (how the
      train state and orbax items hold parameters);
    - an nnx.State: the same State with a NamedSharding in place of each variable;
    - one nnx.Variable: its NamedSharding.
    """
    if isinstance(abstract, nnx.Variable):
        return _variable_sharding(abstract, mesh, rules)
    if isinstance(abstract, nnx.Module):
        return nnx.to_pure_dict(shardings_for(nnx.state(abstract), mesh, rules))
    return jax.tree.map(
        lambda var: _variable_sharding(var, mesh, rules),
        abstract,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def _variable_sharding(var, mesh: Mesh, rules) -> NamedSharding:
    axes = getattr(var, "logical_axes", None) or (None,) * len(var.shape)
    return NamedSharding(mesh, logical_to_spec(axes, var.shape, mesh, rules))


def shard_model(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
    """Place a model's parameters on the mesh according to their logical axes (in place)."""
    state = nnx.state(model)
    shardings = shardings_for(state, mesh, rules)
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


# ---- activations ---------------------------------------------------------------------------------
def constrain(x: jax.Array, axes: Sequence[str | None], rules=DEFAULT_RULES) -> jax.Array:
    """with_sharding_constraint from logical axis names, under the mesh set by `jax.set_mesh`;
    a no-op outside one (single-device code paths stay exactly as they were)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh, rules=DEFAULT_RULES) -> int:
    """How many ways the batch axis is split (the product of its mesh axes)."""
    target = dict(rules)["batch"]
    axes = (target,) if isinstance(target, str) else tuple(target)
    return int(np.prod([mesh.shape[a] for a in axes]))


def put_global(x, sharding: NamedSharding) -> jax.Array:
    """A host array (the same on every process) as a global jax.Array: each process builds only
    the shards of its own devices, so this works across hosts as well as on one."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly multi-host) array on this host."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def metrics_to_host(metrics: dict) -> dict[str, float]:
    """Device scalars -> floats: one transfer for all of them (a multi-host array whose value
    is not all on this host goes through `to_host`)."""
    local = {k: v for k, v in metrics.items() if getattr(v, "is_fully_addressable", True)}
    fetched = jax.device_get(local)
    return {k: float(fetched[k]) if k in fetched else float(to_host(v)) for k, v in metrics.items()}


def on_mesh(tree, mesh: Mesh) -> bool:
    """Whether every leaf of `tree` is an array with a NamedSharding over `mesh`."""
    return all(
        isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
        for x in jax.tree.leaves(tree)
    )


def per_device_bytes(tree) -> dict:
    """Bytes each device holds of the arrays in `tree` (addressable shards only)."""
    held: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def assert_params_sharded(tree, num_shards: int, replicated_allowance: int | None = None) -> None:
    """No device holds more than 1/num_shards of the parameter bytes plus the small replicated
    tensors (norm scales, biases: by default every fully replicated leaf of at most 1% of the
    bytes). Raises AssertionError naming the worst device otherwise (the MaxText check, on the
    train state's parameters)."""
    leaves = jax.tree.leaves(tree)
    total = sum(leaf.nbytes for leaf in leaves)
    if replicated_allowance is None:
        replicated_allowance = sum(
            leaf.nbytes
            for leaf in leaves
            if leaf.sharding.is_fully_replicated and leaf.nbytes <= 0.01 * total
        )
    limit = total / num_shards + replicated_allowance
    held = per_device_bytes(tree)
    worst = max(held, key=held.get)
    if held[worst] > limit:
        raise AssertionError(
            f"device {worst} holds {held[worst]:,} of {total:,} parameter bytes; "
            f"limit {limit:,.0f} (1/{num_shards} + {replicated_allowance:,} replicated)"
        )
