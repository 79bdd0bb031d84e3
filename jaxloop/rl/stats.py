"""Model statistics of one `ModelInputs` (pure, jit-friendly): per target position the selected
token's log-prob, the entropy and Flow-DPPO's full-vocabulary KL to the old policy
(`token_stats`), per loop the same (`loop_stats`), and the critic's values (`token_values`).

Padded samples and packed rows (jaxloop.rl.packing) are the same inputs to each function: packed
inputs carry `unpack_index`, and every result is gathered back to the micro-batch's samples.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxloop.models.looped import project
from jaxloop.rl.losses import categorical_kl
from jaxloop.rl.packing import PackedRows


class ModelInputs(NamedTuple):
    """One micro-batch as the model reads it, all [B, T] (B samples, or packed rows): input ids,
    target ids, attention mask, positions and segment ids (packed rows, else None), the depth
    each position runs (early-exit rollouts, else None), where the exit choice is an action
    (else None), and for packed rows the index that gathers results back to samples."""

    input_ids: jax.Array
    targets: jax.Array
    attention_mask: jax.Array
    positions: jax.Array | None = None
    segment_ids: jax.Array | None = None
    depths: jax.Array | None = None
    exit_mask: jax.Array | None = None
    unpack_index: jax.Array | None = None

    @classmethod
    def padded(cls, tokens, attention_mask, depths=None, exit_mask=None) -> ModelInputs:
        """Samples [B, T + 1]: each position predicts the next token."""
        return cls(
            tokens[:, :-1],
            tokens[:, 1:],
            attention_mask[:, :-1],
            depths=depths,
            exit_mask=exit_mask,
        )

    @classmethod
    def packed(cls, rows: PackedRows) -> ModelInputs:
        """The packed rows of a micro-batch (jaxloop.rl.packing)."""
        segments = rows.segment_ids
        return cls(
            rows.tokens,
            rows.targets,
            segments > 0,
            rows.positions,
            segments,
            unpack_index=rows.index,
        )


def unpack_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """[R, P, ...] results of packed rows -> [micro, T, ...] by `index` (1 + flat row position;
    0 reads 0)."""
    flat = x.reshape((-1,) + x.shape[2:])
    flat = jnp.concatenate([jnp.zeros((1,) + flat.shape[1:], flat.dtype), flat], axis=0)
    return flat[index]


def selected_and_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The targets' log-probs under log_softmax(logits) and that distribution's entropy."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    selected = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return selected, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def exit_logprobs(exit_probs: jax.Array, depths: jax.Array, mask: jax.Array) -> jax.Array:
    """log p_d [B, T] of the exit distribution exit_probs [L, B, T] at each position's depth d
    (0 where mask is 0, without a log of 0 there)."""
    p = jnp.take_along_axis(exit_probs, (depths - 1)[None], axis=0)[0]
    return jnp.where(mask > 0, jnp.log(jnp.where(mask > 0, p, 1.0)), 0.0)


def _to_chunks(x, axis: int, n: int, size: int):
    """The length axis of `x` -> a leading axis of n chunks of `size`, zero-padded at the end."""
    if x is None:
        return None
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n * size - x.shape[axis])
    x = jnp.pad(x, pad)
    return jnp.moveaxis(x.reshape(x.shape[:axis] + (n, size) + x.shape[axis + 1 :]), axis, 0)


def _from_chunks(x, axis: int, length: int):
    """The inverse of `_to_chunks` for a result whose length axis is the last."""
    if x is None:
        return None
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,))[..., :length]


def _head(model, cdt):
    return model.lm_head[...].astype(cdt)


def token_stats(
    graphdef,
    params,
    inputs: ModelInputs,
    temperature,
    chunk: int | None = None,
    old_params=None,
    num_loops: int | None = None,
) -> tuple:
    """Per target position: the selected token's log-prob under log_softmax(logits / T), the
    entropy of that distribution and, with `old_params`, Flow-DPPO's exact full-vocabulary
    D_t = KL(pi_old || pi); plus the LM-head input hidden states [B, T, E].

    chunk: the LM head is applied to `chunk` positions at a time under remat, so only one
    chunk's [B, chunk, V] logits exist at once, in the forward and in the backward pass (the
    gradient recomputes them); chunk None (or >= T): the whole sequence at once.

    depths (early-exit rollouts): each input position runs that many loops (depth replay);
    exit_mask: where it is 1 the gate's log p of the position's exit depth is added to the
    selected log-prob (the exit choice is part of the action, algo.depth_as_action).
    num_loops: the loop budget K (static; None: all loops), for the old parameters too."""
    x = inputs
    common = dict(head=False, segment_ids=x.segment_ids, depths=x.depths, num_loops=num_loops)
    model = nnx.merge(graphdef, params)
    # return_loops with head=False: only the exit distribution
    out = model.forward(
        x.input_ids, x.positions, x.attention_mask, return_loops=x.exit_mask is not None, **common
    )
    cdt = jnp.dtype(model.config.compute_dtype)
    lm_head = _head(model, cdt)
    old_hidden = old_head = None
    if old_params is not None:
        old = nnx.merge(graphdef, old_params)
        hidden = old.forward(x.input_ids, x.positions, x.attention_mask, **common)
        old_hidden = jax.lax.stop_gradient(hidden.hidden)
        old_head = jax.lax.stop_gradient(_head(old, cdt))

    def stats(h, t, oh):
        logits = project(h, lm_head) / temperature
        selected, entropy = selected_and_entropy(logits, t)
        kl = None if oh is None else categorical_kl(project(oh, old_head) / temperature, logits)
        return selected, entropy, kl

    length = out.hidden.shape[1]
    if chunk is None or chunk >= length:
        selected, entropy, kl = stats(out.hidden, x.targets, old_hidden)
    else:
        n = -(-length // chunk)
        parts = (out.hidden, x.targets, old_hidden)
        one = jax.checkpoint(lambda xs: stats(*xs))
        chunks = jax.lax.map(one, tuple(_to_chunks(p, 1, n, chunk) for p in parts))
        selected, entropy, kl = (_from_chunks(c, 1, length) for c in chunks)
    if x.exit_mask is not None:
        selected = selected + x.exit_mask * exit_logprobs(out.exit_probs, x.depths, x.exit_mask)
    result = (selected, entropy, kl, out.hidden)
    if x.unpack_index is None:
        return result
    return tuple(None if r is None else unpack_rows(r, x.unpack_index) for r in result)


def actor_token_stats(
    graphdef,
    params,
    tokens,
    attention_mask,
    temperature,
    chunk=None,
    old_params=None,
    depths=None,
    exit_mask=None,
):
    """`token_stats` of padded samples tokens [B, T + 1]."""
    inputs = ModelInputs.padded(tokens, attention_mask, depths, exit_mask)
    return token_stats(graphdef, params, inputs, temperature, chunk, old_params)


def token_values(graphdef, params, inputs: ModelInputs, num_loops: int | None = None) -> jax.Array:
    """The critic's value at every position (after `num_loops` loops; None: all)."""
    x = inputs
    model = nnx.merge(graphdef, params)
    values = model.forward(
        x.input_ids,
        x.positions,
        x.attention_mask,
        segment_ids=x.segment_ids,
        depths=x.depths,
        num_loops=num_loops,
    ).values
    return values if x.unpack_index is None else unpack_rows(values, x.unpack_index)


class LoopStats(NamedTuple):
    """Per loop t of the model, each [L, B, T]: the selected token's log-prob, the entropy and
    (with old parameters) Flow-DPPO's D_t = KL(pi_old_t || pi_t) of loop t's distribution, and
    KL(pi_last || pi_t); the exit distribution (models with an exit gate, else None) and the last
    loop's LM-head inputs [B, T, E]."""

    logprobs: jax.Array
    entropy: jax.Array
    old_kl: jax.Array | None
    kl_to_last: jax.Array
    exit_probs: jax.Array | None
    hidden: jax.Array

    @property
    def sample_major_logprobs(self) -> jax.Array:
        """[B, L, T]: the log-probs laid out as the learner's batch fields (sample axis first,
        `TrainBatch.old_logprobs`); the one place the model's loop-major layout is turned."""
        return jnp.moveaxis(self.logprobs, 0, 1)


def loop_stats(
    graphdef,
    params,
    inputs: ModelInputs,
    temperature,
    chunk: int | None = None,
    old_params=None,
    num_loops: int | None = None,
) -> LoopStats:
    """`LoopStats` of model inputs: loop t's logits are the LM head applied to the state after
    the norm that ends loop t (`ModelOutput.loop_hidden`).

    Only one loop's logits exist at a time (plus the last loop's, for the KL to it): per chunk of
    `chunk` positions (chunk None: the whole sequence), each loop's statistics are computed in
    turn under remat, so the backward pass recomputes them loop by loop as well; with a chunk
    no [B, T, V] array exists, for any loop. num_loops: the loop budget K (L = K; None: all)."""
    x = inputs

    def loops_of(p):  # the model of `p` and its per-loop LM-head inputs
        m = nnx.merge(graphdef, p)
        kwargs = dict(head=False, return_loops=True, segment_ids=x.segment_ids, depths=x.depths)
        kwargs["num_loops"] = num_loops
        return m, m.forward(x.input_ids, x.positions, x.attention_mask, **kwargs)

    model, out = loops_of(params)
    cdt = jnp.dtype(model.config.compute_dtype)
    lm_head = _head(model, cdt)
    old_hidden = old_head = None
    if old_params is not None:
        old, old_out = loops_of(old_params)
        old_hidden = jax.lax.stop_gradient(old_out.loop_hidden)
        old_head = jax.lax.stop_gradient(_head(old, cdt))

    def one_loop(h, t, oh, last_logits):  # one loop's [B, c, E] -> four [B, c]
        logits = project(h, lm_head) / temperature
        selected, entropy = selected_and_entropy(logits, t)
        kl = None if oh is None else categorical_kl(project(oh, old_head) / temperature, logits)
        return selected, entropy, kl, categorical_kl(last_logits, logits)

    def one_chunk(xs):  # [L, B, c, E], [B, c], [L, B, c, E] or None -> four [L, B, c]
        h, t, oh = xs
        last_logits = jax.lax.stop_gradient(project(h[-1], lm_head) / temperature)
        per_loop = jax.checkpoint(lambda ys: one_loop(ys[0], t, ys[1], last_logits))
        return jax.lax.map(per_loop, (h, oh))

    length = out.loop_hidden.shape[2]
    size = length if chunk is None or chunk >= length else chunk
    n = -(-length // size)
    body = one_chunk if n == 1 else jax.checkpoint(one_chunk)
    parts = ((out.loop_hidden, 2), (x.targets, 1), (old_hidden, 2))
    chunks = jax.lax.map(body, tuple(_to_chunks(p, axis, n, size) for p, axis in parts))
    selected, entropy, kl, kl_to_last = (_from_chunks(c, 2, length) for c in chunks)
    stats = LoopStats(selected, entropy, kl, kl_to_last, out.exit_probs, out.hidden)
    if x.unpack_index is None:
        return stats
    per_loop = jax.vmap(lambda r: unpack_rows(r, x.unpack_index))
    gathered = (None if r is None else per_loop(r) for r in stats[:-1])
    return LoopStats(*gathered, unpack_rows(stats.hidden, x.unpack_index))
