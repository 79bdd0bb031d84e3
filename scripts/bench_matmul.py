"""The machine's fp32 matmul rate: the limit scripts/bench_peers.py sets each system's achieved
model FLOP/s against.

    python scripts/bench_matmul.py --backend jax [--n 2048] [--repeats 5]
    /work/peers/trl-venv/bin/python scripts/bench_matmul.py --backend torch --threads 2

One [n, n] x [n, n] fp32 product (jnp.dot, jitted, block_until_ready; or torch.matmul with
torch.set_num_threads(--threads)), one warm-up call, then --repeats timed calls; the rate is
2 n^3 / the median time. JAX runs on the cores XLA's CPU client takes (all of the machine's, as
jaxloop and Tunix do); torch on --threads (bench_peers passes TRL's --trl-threads and the same
OMP_NUM_THREADS). Prints one JSON line. Only the chosen backend is imported, so the same file runs
in jaxloop's venv and in TRL's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def matmul_flops(n: int) -> float:
    """FLOPs of one [n, n] x [n, n] product (a multiply and an add per term)."""
    return 2.0 * n**3


def time_jax(n: int, repeats: int) -> list[float]:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()  # compile + first run
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dot(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return times


def time_torch(n: int, repeats: int, threads: int) -> list[float]:
    import torch

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen, dtype=torch.float32)
    b = torch.randn(n, n, generator=gen, dtype=torch.float32)
    torch.matmul(a, b)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - t)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("jax", "torch"), required=True)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (jax: XLA's own)")
    a = ap.parse_args(argv)
    if a.n < 1 or a.repeats < 1 or a.threads < 1:
        ap.error("need --n, --repeats and --threads >= 1")
    if a.backend == "jax":
        times = time_jax(a.n, a.repeats)
    else:
        times = time_torch(a.n, a.repeats, a.threads)
    median = statistics.median(times)
    out = {
        "bench": "bench_matmul",
        "backend": a.backend,
        "n": a.n,
        "threads": a.threads if a.backend == "torch" else None,
        "times_s": [round(t, 5) for t in times],
        "median_s": median,
        "gflop_per_s": matmul_flops(a.n) / median / 1e9,
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
