"""Shared helpers for the model tests: jitted forwards (one compile per config), batches."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from tests.models.torch_reference import rel_err

FP32_REL_TOL = 1e-5  # max|a-b| / max|b| for fp32 logits vs the float64 reference


def jit_forward(model):
    """f(ids, mask) -> ModelOutput with return_loops=True; compiled once per input shape."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, ids, mask):
        return nnx.merge(graphdef, state).forward(ids, attention_mask=mask, return_loops=True)

    return functools.partial(fwd, state)


def jit_cached_forward(model):
    """f(ids, mask, cache) -> ModelOutput (with .cache), return_loops=True."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, ids, mask, cache):
        m = nnx.merge(graphdef, state)
        return m.forward(ids, attention_mask=mask, cache=cache, return_loops=True)

    return functools.partial(fwd, state)


def random_ids(vocab: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def padded_mask(batch: int, seq: int, left_pad: list[int], right_pad: list[int]) -> np.ndarray:
    """int32 [batch, seq] mask; row r: left_pad[r] zeros on the left, right_pad[r] on the right."""
    mask = np.ones((batch, seq), np.int32)
    for r in range(batch):
        mask[r, : left_pad[r]] = 0
        if right_pad[r]:
            mask[r, seq - right_pad[r] :] = 0
    return mask


def check_rel(name: str, got, want, tol: float) -> float:
    """Assert finite `got` and rel_err(got, want) <= tol; print the measured error (pytest -s)."""
    err = rel_err(got, want)
    print(f"[{name}] rel err {err:.2e} (tol {tol:g})")
    assert np.all(np.isfinite(np.asarray(got))), name
    assert err <= tol, f"{name}: rel err {err:.3e} > {tol:g}"
    return err
