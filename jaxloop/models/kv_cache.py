"""Per-(loop, layer) KV cache: every loop keeps its own attention history over shared weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxloop.models.config import LoopedConfig


@struct.dataclass
class KVCache:
    """k, v: [loops, layers, B, T, kv_heads, head_dim]; valid: [B, T] slots holding a real token;
    index: the next slot to write (shared by the batch: prompts are left-padded)."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    index: jax.Array

    @property
    def max_length(self) -> int:
        return self.k.shape[3]


def init_cache(cfg: LoopedConfig, batch: int, max_length: int, dtype=None) -> KVCache:
    dtype = jnp.dtype(dtype or cfg.compute_dtype)
    shape = (cfg.num_loops, cfg.num_layers, batch, max_length, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        valid=jnp.zeros((batch, max_length), jnp.bool_),
        index=jnp.zeros((), jnp.int32),
    )
