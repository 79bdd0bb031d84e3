"""Per-(loop, layer) KV cache: every loop keeps its own attention history over shared weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxloop.mathutil import ceil_div
from jaxloop.models.config import LoopedConfig


@struct.dataclass
class KVCache:
    """k, v: [loops, layers, B, T, kv_heads, head_dim]; valid: [B, T] slots holding a real token;
    index: the next slot to write (shared by the batch: prompts are left-padded).

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
        return self.k.shape[3]

    @property
    def attended_length(self) -> int:
        return self.read_length or self.max_length


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


def init_cache(cfg: LoopedConfig, batch: int, max_length: int, dtype=None) -> KVCache:
    dtype = jnp.dtype(dtype or cfg.compute_dtype)
    shape = (cfg.num_loops, cfg.num_layers, batch, max_length, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        valid=jnp.zeros((batch, max_length), jnp.bool_),
        index=jnp.zeros((), jnp.int32),
    )
