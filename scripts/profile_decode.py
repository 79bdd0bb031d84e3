"""Where the embedded sampler's time goes as responses get long: one decode step, the bench_peers
shape, timed at each cache length the sampler reads.

    python scripts/profile_decode.py                    # model A, 64 rows, cache 48 and 272
    python scripts/profile_decode.py --models A,B --lengths 48,72,136,208,272 --repeats 40

A decode step is the sampler's while-loop body without the token draw: one token per row
through every loop and layer, writing its keys / values into the cache and attending over the
slots the step reads. The sampler reads a cache of prompt + max_new_tokens slots in quarters
(`kv_cache.read_lengths`: 272 slots -> 72, 136, 208, 272); each length here is one such phase,
timed on a cache of exactly that many slots as the sampler grows it (`kv_cache.grow_cache`; a
checkout before that change reads a prefix of the whole cache: `--whole 272`). The fixed cost is
the step at the shortest length, the rest grows with the slots read; `--hlo` adds the compiled
step's copies of cache-sized arrays (what made long responses slow: a copy of every (loop, layer)
slot into the dots' layout at every layer of every step); `--trace` the step's XLA operations
by kind (fusion names without their number: ynn_fusion = XNNPACK/YNNPACK matmul fusions,
slice_bitcast_fusion = slices materialised as copies), ms per step from jax.profiler. Medians
of --repeats steps after a warm-up; a table, then one JSON line. Run it on a quiet machine;
compare within one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peers  # noqa: E402  (scripts/, stdlib only)

from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config  # noqa: E402
from jaxloop.models.kv_cache import init_cache  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def model_config(model: str) -> LoopedConfig:
    """The bench_peers model (`bench_peers.SHAPE`, `bench_peers.MODELS`), layers unrolled."""
    shape = {**bench_peers.SHAPE, **bench_peers.MODELS[model]}
    hf = tiny_hf_config(
        "nanbeige",
        vocab_size=shape["model.vocab_size"],
        hidden_size=shape["model.hidden_size"],
        intermediate_size=shape["model.intermediate_size"],
        num_attention_heads=shape["model.num_heads"],
        num_key_value_heads=shape["model.num_kv_heads"],
        head_dim=shape["model.head_dim"],
        num_hidden_layers=shape["model.num_layers"],
    )
    cfg = LoopedConfig.from_hf_dict(hf)
    return cfg.replace(num_loops=shape["model.num_loops"], scan_layers=False)


def cache_copies(hlo: str, cache_elems: int) -> int:
    """Instructions of compiled HLO text that copy, transpose or slice out (a slice fusion: XLA
    materialises a slice) an f32 array of at least a quarter of one (loop, layer) cache slot."""
    count = 0
    copy = r"(?:=\s*f32\[([\d,]+)\]\S*\s+(?:copy|transpose)\()"
    sliced = r"(?:%slice[\w-]*fusion[.\d]*\s*=\s*f32\[([\d,]+)\])"
    for m in re.finditer(f"{copy}|{sliced}", hlo):
        n = 1
        for d in (m.group(1) or m.group(2)).split(","):
            n *= int(d)
        count += n * 4 >= cache_elems
    return count


def op_kinds(step, args, steps: int = 20) -> dict[str, float]:
    """ms per step of each kind of XLA operation of `step(*args) -> (logits, cache)` (the
    cache is args[2], donated), from a jax.profiler trace of `steps` calls."""
    import collections
    import gzip
    import tempfile

    state, token, cache = args
    index = int(cache.index)
    with tempfile.TemporaryDirectory() as out:
        jax.profiler.start_trace(out, create_perfetto_trace=True)
        for _ in range(steps):
            logits, cache = step(state, token, cache.replace(index=jnp.int32(index)))
            logits.block_until_ready()
        jax.profiler.stop_trace()
        trace = next(Path(out).rglob("*.trace.json.gz"))
        events = json.load(gzip.open(trace))["traceEvents"]
    total: collections.Counter = collections.Counter()
    host = ("$", "Thunk", "Pjit", "Slinky", "Common", "end: ", "Parse", "Handle", "Allocate")
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(host):
            total[re.sub(r"\.\d+$", "", e["name"])] += e["dur"] / 1000 / steps
    return {k: round(v, 3) for k, v in total.most_common(8)}


def profile(
    model: str, batch: int, lengths: list[int], whole: int, repeats: int, hlo: bool, trace: bool
):
    cfg = model_config(model)
    graphdef, state = nnx.split(LoopedLM(cfg, rngs=nnx.Rngs(0)))

    @functools.partial(jax.jit, donate_argnums=2)
    def step(state, token, cache):
        out = nnx.merge(graphdef, state).forward(
            token, attention_mask=jnp.ones_like(token, jnp.bool_), cache=cache
        )
        return out.logits, out.cache

    rows = []
    token = jnp.ones((batch, 1), jnp.int32)
    for length in lengths:
        cache = init_cache(cfg, batch, whole or length)
        cache = cache.replace(read_length=length if whole else 0, index=jnp.int32(length // 2))
        copies = None
        if hlo:
            text = step.lower(state, token, cache).compile().as_text()
            copies = cache_copies(text, batch * cfg.num_kv_heads * length * cfg.head_dim)
        logits, cache = step(state, token, cache)
        logits.block_until_ready()
        times = []
        for _ in range(repeats):
            cache = cache.replace(index=jnp.int32(length // 2))
            start = time.perf_counter()
            logits, cache = step(state, token, cache)
            logits.block_until_ready()
            times.append(time.perf_counter() - start)
        rows.append(
            {
                "model": model,
                "slots_read": length,
                "cache_slots": whole or length,
                "ms_per_step": round(1000 * statistics.median(times), 3),
                "cache_copies": copies,
            }
        )
        if trace:
            rows[-1]["ops_ms"] = op_kinds(step, (state, token, cache))
        print(f"{model} {length}: {rows[-1]['ms_per_step']} ms", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="A", help="A, B or A,B (scripts/bench_peers.py's)")
    p.add_argument("--batch", type=int, default=64, help="rows (bench_peers: 8 x 8)")
    p.add_argument("--lengths", default="48,272", help="slots read per step, comma list")
    p.add_argument("--whole", type=int, default=0, help="read a prefix of a cache this long")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--hlo", action="store_true", help="count cache-sized copies in the step")
    p.add_argument("--trace", action="store_true", help="ms per step by kind of XLA operation")
    a = p.parse_args(argv)
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths {a.lengths!r}: a comma list of integers")
    if any(n < 1 or (a.whole and n > a.whole) for n in lengths) or a.repeats < 1:
        p.error("lengths must be >= 1 (and <= --whole), --repeats >= 1")
    for m in a.models.split(","):
        if m not in bench_peers.MODELS:
            p.error(f"unknown model {m!r} (A, B)")
    rows = []
    for m in a.models.split(","):
        rows += profile(m, a.batch, lengths, a.whole, a.repeats, a.hlo, a.trace)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print("| model | slots read | cache slots | ms per step | cache-sized copies |")
    print("|---|---|---|---|---|")
    for r in rows:
        copies = "-" if r["cache_copies"] is None else r["cache_copies"]
        print(
            f"| {r['model']} | {r['slots_read']} | {r['cache_slots']} | {r['ms_per_step']:.2f} "
            f"| {copies} |"
        )
    for r in rows:
        if "ops_ms" in r:
            ops = ", ".join(f"{k} {v:.2f}" for k, v in r["ops_ms"].items())
            print(f"{r['model']} {r['slots_read']} slots, ms per step by operation: {ops}")
    print(json.dumps({"bench": "profile_decode", "batch": a.batch, "commit": commit, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
