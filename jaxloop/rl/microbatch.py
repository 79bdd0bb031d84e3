"""Micro-batches and optimizer steps: the batch split into micro-batches (the micro axis the
sharded one), each optimizer step's part of the batch, gradients accumulated over micro-batches
with one scan, and a step applied only when it leaves everything finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxloop.mathutil import round_up
from jaxloop.parallel import mesh as shd
from jaxloop.rl.packing import PackedRows, pack_groups


@struct.dataclass
class MicroBatch:
    """What one pass over micro-batches reads (a pytree; the fields a pass does not read are
    None). Per sample [micro, ...]; before the split the same with leading [K] (the per-sample
    passes, the critic) or [steps, K] (the policy steps) axes.

    The model input, padded samples (tokens [micro, S], attention_mask [micro, S], depths and
    exit_mask [micro, T] of early-exit rollouts) or packed rows (`rows`: [R, P] rows, index
    [micro, T]). The loss fields, [micro, T] float32 unless said otherwise: mask (response
    targets), behav_logprobs, old_logprobs ([micro, L, T] with per-loop credit; None in a fused
    update: the step's own forward is the old policy), advantages, ref_logprobs (laid out as
    old_logprobs), old_values and returns (the critic), sample_mask [micro]."""

    tokens: jax.Array | None = None
    attention_mask: jax.Array | None = None
    depths: jax.Array | None = None
    exit_mask: jax.Array | None = None
    rows: PackedRows | None = None
    mask: jax.Array | None = None
    behav_logprobs: jax.Array | None = None
    old_logprobs: jax.Array | None = None
    advantages: jax.Array | None = None
    ref_logprobs: jax.Array | None = None
    old_values: jax.Array | None = None
    returns: jax.Array | None = None
    sample_mask: jax.Array | None = None


def micro_axes(x: jax.Array, micro_axis: int) -> tuple:
    axes = [None] * x.ndim
    axes[micro_axis] = "batch"
    return tuple(axes)


def split_micro(batch, micro: int):
    """Each [N, ...] leaf of the pytree `batch` -> [K, micro, ...], padding N with zero rows
    (mask 0: no loss, no metrics); the micro axis is the sharded one."""
    n = jax.tree.leaves(batch)[0].shape[0]
    total = round_up(n, micro)

    def pad(x):
        if total != n:
            x = jnp.concatenate([x, jnp.zeros((total - n,) + x.shape[1:], x.dtype)], axis=0)
        x = x.reshape((total // micro, micro) + x.shape[1:])
        return shd.constrain(x, micro_axes(x, 1))

    return jax.tree.map(pad, batch)


def split_rows(packed: PackedRows, leading: tuple, index: jax.Array) -> PackedRows:
    """Packed rows [prod(leading) * R, P] -> [*leading, R, P], the rows axis sharded (each
    micro-batch's rows spread over the data-parallel devices), with `index` the per-sample index
    already split like the other per-sample fields."""

    def split(x):
        x = x.reshape(leading + (-1,) + x.shape[1:])
        return shd.constrain(x, micro_axes(x, len(leading)))

    rows = (packed.tokens, packed.targets, packed.positions, packed.segment_ids)
    return PackedRows(*(split(x) for x in rows), index=index)


def step_plan(n: int, steps: int, micro: int, split: str = "contiguous") -> np.ndarray:
    """Row indices [steps, P] of each optimizer step's part of the batch, each part padded to a
    multiple of `micro` with index n (an all-zero row). split 'contiguous': np.array_split order
    (whole groups per step); 'interleaved': row i to step i mod steps (part of every group)."""
    if split == "contiguous":
        parts = np.array_split(np.arange(n), steps)
    elif split == "interleaved":
        parts = [np.arange(i, n, steps) for i in range(steps)]
    else:
        raise ValueError(f"step split {split!r}; valid: contiguous, interleaved")
    width = round_up(max(len(p) for p in parts), micro)
    plan = np.full((steps, width), n, np.int32)
    for i, p in enumerate(parts):
        plan[i, : len(p)] = p
    return plan


def pack_plan(
    tokens: np.ndarray,
    attention_mask: np.ndarray,
    micro: int,
    steps: int,
    pack_tokens: int,
    row_multiple: int,
    split: str = "contiguous",
) -> tuple[PackedRows, PackedRows]:
    """The packing of one batch (host arrays, deterministic): the rows of the per-sample passes
    and the critic (micro-batches of consecutive samples, `split_micro`) and of the policy steps
    (each step's micro-batches, `step_plan`). Each micro-batch's samples fill rows of
    `pack_tokens` tokens; the rows, like the padded path's samples, are split over the
    data-parallel devices, so packing saves work when a micro-batch holds several samples per
    device."""
    n = tokens.shape[0]
    whole = np.arange(round_up(n, micro)).reshape(-1, micro)
    per_step = step_plan(n, steps, micro, split).reshape(-1, micro)
    return tuple(
        pack_groups(tokens, attention_mask, groups, pack_tokens, row_multiple).packed_rows()
        for groups in (whole, per_step)
    )


def accumulate(micro_loss, params, batch, with_outputs: bool = False):
    """Sum loss, gradients and metric sums of `micro_loss(params, x) -> (loss, sums)` over the
    leading micro-batch axis of `batch` with one scan (one compiled body for any count).
    with_outputs: `micro_loss` returns (loss, (sums, outputs)) and the per-micro-batch outputs
    come back stacked as a fourth result."""
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    first = jax.tree.map(lambda v: v[0], batch)
    aux_shapes = jax.eval_shape(lambda: micro_loss(params, first)[1])
    sum_shapes = aux_shapes[0] if with_outputs else aux_shapes

    def step(carry, x):
        grads, loss, sums = carry
        (micro, aux), g = grad_fn(params, x)
        micro_sums, outputs = aux if with_outputs else (aux, None)
        return (
            jax.tree.map(jnp.add, grads, g),
            loss + micro,
            jax.tree.map(jnp.add, sums, micro_sums),
        ), outputs

    init = (
        jax.tree.map(jnp.zeros_like, params),
        jnp.float32(0.0),
        jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), sum_shapes),
    )
    if jax.tree.leaves(batch)[0].shape[0] == 1:
        # one micro-batch: no loop (a while loop of one trip still keeps XLA from fusing across
        # its boundary and adds the zero accumulators); the same sums
        totals, outputs = step(init, first)
        outputs = None if outputs is None else jax.tree.map(lambda x: x[None], outputs)
    else:
        totals, outputs = jax.lax.scan(step, init, batch)
    return (*totals, outputs) if with_outputs else totals


def all_finite(tree) -> jax.Array:
    """One boolean: every floating-point leaf of `tree` is finite."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return jnp.bool_(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def apply_if(ok, tx, grads, params, opt_state):
    """One optimizer step when `ok` and the step leaves the parameters and the optimizer state
    finite (a non-finite learning rate or hyper-parameter, or an overflow, would commit NaN / inf
    with a finite loss and gradient norm); else params and state unchanged (a cond, not a select:
    no second copy of either). The step is computed once into that check (elementwise work fused
    into its reductions) and once more, identically, in the cond. Returns (params, opt_state,
    applied)."""

    def step(grads, params, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ok = ok & all_finite(step(grads, params, opt_state))

    def apply(operands):
        return step(*operands)

    params, opt_state = jax.lax.cond(
        ok, apply, lambda ops: (ops[1], ops[2]), (grads, params, opt_state)
    )
    return params, opt_state, ok
