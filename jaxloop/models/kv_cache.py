"""Per-(loop, layer) KV cache: every loop keeps its own attention history over shared weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxloop.mathutil import ceil_div
from jaxloop.models.config import LoopedConfig


@struct.dataclass
class KVCache:
    """k: [loops, layers, B, kv_heads, T, head_dim], v: [loops, layers, B, kv_heads, head_dim, T];
    valid: [B, T] slots holding a real token; index: the next slot to write (shared by the batch:
    prompts are left-padded). The layouts are the ones XLA's dots want for attention (the
    contracted dimension last: head_dim for q.k, T for p.v), so a decode step needs no transposing
    copy; token-major [B, T, kv_heads, head_dim], XLA copied both slots into these layouts at
    every layer of every step, the bulk of a long response's decode time
    (scripts/bench_peers.py --workload long; scripts/profile_decode.py counts the copies: what is
    left is one slice of each (loop, layer) slot out of the stacked array).

    read_length (static): attention reads only the first read_length slots of each (loop, layer)
    slot (0: all T). The caller keeps it >= index + the positions of the call: the slots past it
    are then empty, and masked for every row, so the result is the whole cache's. The sampler
    steps through read_lengths(T), so early decode steps do not read the empty rest."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    index: jax.Array
    read_length: int = struct.field(pytree_node=False, default=0)

    @property
    def max_length(self) -> int:
        return self.k.shape[4]

    @property
    def attended_length(self) -> int:
        return self.read_length or self.max_length

    def token_major(self) -> tuple[jax.Array, jax.Array]:
        """(k, v) as [loops, layers, B, T, kv_heads, head_dim], for inspection and tests."""
        return jnp.swapaxes(self.k, 3, 4), jnp.moveaxis(self.v, 5, 3)


def read_lengths(max_length: int) -> tuple[int, ...]:
    """The read lengths a sampler steps through (ascending, the last is the whole cache): a
    quarter of the cache at a time, rounded up to 8, for caches of 32 slots and more."""
    if max_length < 32:
        return (max_length,)
    quarters = {min(max_length, ceil_div(max_length * i, 4 * 8) * 8) for i in (1, 2, 3)}
    return (*sorted(quarters - {max_length}), max_length)


def read_length_for(max_length: int, filled: int) -> int:
    """The shortest of read_lengths(max_length) that holds `filled` slots."""
    return next(n for n in read_lengths(max_length) if n >= filled)


def grow_cache(cache: KVCache, max_length: int) -> KVCache:
    """`cache` with room for `max_length` slots (empty ones appended), read whole (read_length 0).
    The sampler grows its cache with each of read_lengths(T) instead of reading a prefix of a
    T-slot cache: a prefix of every (row, head)'s block is not contiguous, and XLA copied it out
    for attention at every layer of every step; a whole (loop, layer) slot is one block."""
    extra = max_length - cache.max_length
    if extra < 0:
        raise ValueError(f"grow_cache: {max_length} < the cache's {cache.max_length} slots")
    if extra:
        cache = cache.replace(
            k=jnp.pad(cache.k, [(0, 0)] * 4 + [(0, extra), (0, 0)]),
            v=jnp.pad(cache.v, [(0, 0)] * 5 + [(0, extra)]),
            valid=jnp.pad(cache.valid, [(0, 0), (0, extra)]),
        )
    return cache.replace(read_length=0)


def init_cache(cfg: LoopedConfig, batch: int, max_length: int, dtype=None) -> KVCache:
    dtype = jnp.dtype(dtype or cfg.compute_dtype)
    slot = (cfg.num_loops, cfg.num_layers, batch, cfg.num_kv_heads)
    return KVCache(
        k=jnp.zeros((*slot, max_length, cfg.head_dim), dtype),
        v=jnp.zeros((*slot, cfg.head_dim, max_length), dtype),
        valid=jnp.zeros((batch, max_length), jnp.bool_),
        index=jnp.zeros((), jnp.int32),
    )
