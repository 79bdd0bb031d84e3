"""Time a jitted forward + backward of the looped model (mean token log-likelihood loss).

    python scripts/bench_model.py --config tiny --batch 2 --seq 64 --steps 5 --dtype float32
    python scripts/bench_model.py --config nanbeige-3b --batch 4 --seq 2048 --remat full \\
        --attention cudnn                                               # GPU only

    python scripts/bench_model.py --config tiny --packing --batch 64 --seq 256 --repeats 5

--packing: the learner's padded vs packed layout (learner.pack_tokens) in one run, on one batch
of --batch samples whose lengths are drawn from a long-tailed distribution (log-normal, median
--seq / 8, clipped to 8..--seq, seeded): padded = [batch, longest] with an attention mask;
packed = the same samples first-fit-decreasing in rows of --seq tokens (jaxloop.rl.packing,
segment ids). Each timed --steps forward + backward passes of the mean log-likelihood of the real
tokens, --repeats times; tokens/s = real tokens / median step time, for both layouts, and the two
losses (they must agree).

--config: tiny | tiny-ouro | nanbeige-3b | ouro-1.4b, an HF model dir, or a config.json path.
Parameters are random (no checkpoint is read). Prints a table, then one JSON line (last line of
stdout) with tokens/s, TFLOP/s, step time, compile time, peak device memory (GPU) and the
remat / attention settings, so every number travels with the settings that produced it.

FLOPs per step (same accounting as the shared looped_anchor.py yardstick, so figures compare):
  matmul params per layer  P = E*H*D*2 (q, o) + E*KV*D*2 (k, v) + 3*E*M (gate, up, down)
  dense   = 6 * tokens * (P * layers * loops + E * V)           # 2 fwd + 4 bwd per MAC; lm_head
  attn    = 6 * tokens * seq * H * D * layers * loops           # QK^T and PV: 2 matmuls x
                                                                # 2 flops/MAC x 3 (fwd+bwd),
                                                                # causal: half of seq^2
  total   = dense + attn      (embedding lookup, norms, RoPE, softmax not counted)
tokens = batch * seq. Remat recomputation is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxloop.models import ConfigError, LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.models.presets import FULL_SIZE
from jaxloop.parallel import mesh as shd

TINY = {"tiny": "nanbeige", "tiny-ouro": "ouro"}


def hf_config(name: str) -> dict:
    if name in TINY:
        return tiny_hf_config(TINY[name])
    if name in FULL_SIZE:
        return dict(FULL_SIZE[name])
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        choices = ", ".join([*TINY, *FULL_SIZE])
        raise ConfigError(f"--config {name!r} is neither one of {choices} nor a config.json")
    return json.loads(path.read_text())


def flops_per_step(cfg: LoopedConfig, batch: int, seq: int) -> tuple[float, int]:
    """Model FLOPs of one forward + backward (formula in the module docstring)."""
    e, m, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = e * h * d * 2 + e * kv * d * 2 + 3 * e * m
    depth = cfg.num_layers * cfg.num_loops
    tokens = batch * seq
    dense = 6 * tokens * (per_layer * depth + e * v)
    attn = 6 * tokens * seq * h * d * depth
    return float(dense + attn), per_layer


def matmul_params_per_layer(model: LoopedLM) -> int:
    """The same count read off the parameter shapes (a check on the formula's P)."""
    b = model.blocks
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return sum(int(np.prod(getattr(b, n).shape[1:])) for n in names)


def build_model(cfg: LoopedConfig) -> LoopedLM:
    """Random parameters, created on the device inside one jit (no per-shape compiles)."""
    return nnx.jit(lambda: LoopedLM(cfg, rngs=nnx.Rngs(0), role="actor"))()


def make_step(model: LoopedLM):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, ids):
        # Next-token targets by rolling (the last position's target wraps around, as in
        # looped_anchor.py): the model sees all `seq` tokens.
        logits = nnx.merge(graphdef, params, rest)(ids)  # float32 [B, S, V]
        labels = jnp.roll(ids, -1, axis=1)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0])

    return jax.jit(jax.value_and_grad(loss_fn)), params


def peak_device_gib() -> float | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else round(peak / 2**30, 2)


def host_peak_rss_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the compiling one")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--remat", default="none", choices=["none", "full", "dots"])
    p.add_argument("--attention", default="xla", choices=["xla", "cudnn"])
    p.add_argument("--allow-cpu", action="store_true", help="run a full-size config on CPU")
    p.add_argument(
        "--path",
        default="plain",
        choices=["plain", "sharded"],
        help="sharded: the trainer's path (parameters on a mesh of all local devices by their "
        "logical axes, the batch over data x fsdp, activation constraints under jax.set_mesh)",
    )
    p.add_argument(
        "--packing",
        action="store_true",
        help="padded vs packed learner layout on long-tailed sample lengths (--seq: row tokens)",
    )
    p.add_argument("--repeats", type=int, default=3, help="--packing: timed repeats (median)")
    p.add_argument("--seed", type=int, default=0, help="--packing: seed of the sample lengths")
    return p.parse_args(argv)


def run(args) -> dict:
    cfg = LoopedConfig.from_hf_dict(hf_config(args.config))
    cfg = cfg.replace(
        param_dtype=args.dtype,
        compute_dtype=args.dtype,
        remat=args.remat,
        attention_impl=args.attention,
    )
    device = jax.local_devices()[0]
    if device.platform == "cpu" and args.config in FULL_SIZE and not args.allow_cpu:
        raise ConfigError(f"--config {args.config} is for GPUs; use --config tiny on CPU")
    if args.attention == "cudnn" and device.platform != "gpu":
        raise ConfigError("--attention cudnn needs a GPU")
    if min(args.batch, args.seq, args.steps) < 1:
        raise ConfigError("--batch, --seq and --steps must be positive")
    if args.packing:
        if args.path != "plain" or args.repeats < 1:
            raise ConfigError("--packing runs on --path plain with --repeats >= 1")
        return run_packing(args, cfg, build_model(cfg), device)
    model = build_model(cfg)
    n_params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    flops, per_layer = flops_per_step(cfg, args.batch, args.seq)
    assert per_layer == matmul_params_per_layer(model), (per_layer, matmul_params_per_layer(model))
    step, params = make_step(model)
    ids = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, cfg.vocab_size)
    context = contextlib.nullcontext()
    if args.path == "sharded":
        mesh = shd.make_mesh(fsdp=-1)
        params = jax.device_put(params, shd.shardings_for(params, mesh))
        ids = jax.device_put(ids, shd.batch_sharding(mesh))
        context = jax.set_mesh(mesh)
    with context:
        return _time(args, cfg, model, step, params, ids, n_params, flops, per_layer, device)


def _time(args, cfg, model, step, params, ids, n_params, flops, per_layer, device) -> dict:

    t0 = time.perf_counter()
    loss, grads = step(params, ids)
    jax.block_until_ready((loss, grads))
    first_step_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        jax.block_until_ready(step(params, ids))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss, grads = step(params, ids)
    jax.block_until_ready((loss, grads))
    step_s = (time.perf_counter() - t0) / args.steps
    tokens = args.batch * args.seq
    return {
        "config": args.config,
        "family": cfg.family,
        "device": f"{device.platform}:{device.device_kind}",
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "remat": args.remat,
        "attention": args.attention,
        "path": args.path,
        "layers_x_loops": f"{cfg.num_layers}x{cfg.num_loops}",
        "params": n_params,
        "matmul_params_per_layer": per_layer,
        "model_flops_per_step": flops,
        "loss": round(float(loss), 4),
        "first_step_s": round(first_step_s, 2),
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "tflops": round(flops / step_s / 1e12, 3),
        "peak_device_gib": peak_device_gib(),
        "host_peak_rss_gib": host_peak_rss_gib(),
        "steps": args.steps,
    }


def long_tailed_lengths(n: int, longest: int, seed: int) -> np.ndarray:
    """Sample lengths as RL responses come: most short, a few long (log-normal, sigma 1)."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(np.log(max(longest / 8, 1)), 1.0, n)
    return np.clip(np.round(lengths), min(8, longest), longest).astype(np.int64)


def run_packing(args, cfg: LoopedConfig, model: LoopedLM, device) -> dict:
    from jaxloop.rl.packing import pack_groups

    lengths = long_tailed_lengths(args.batch, args.seq, args.seed)
    longest, real = int(lengths.max()), int(lengths.sum())
    rng = np.random.default_rng(args.seed + 1)
    tokens = rng.integers(0, cfg.vocab_size, (args.batch, longest + 1)).astype(np.int32)
    attn = np.arange(longest + 1)[None, :] < lengths[:, None]
    plan = pack_groups(tokens, attn, np.arange(args.batch)[None], args.seq)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, ids, targets, positions, segment_ids, weights):
        m = nnx.merge(graphdef, params, rest)
        mask = weights > 0 if segment_ids is None else segment_ids > 0
        logits = m.forward(ids, positions, mask, segment_ids=segment_ids).logits
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return -jnp.sum(picked * weights) / jnp.sum(weights)

    step = jax.jit(jax.value_and_grad(loss_fn))
    padded_in = (tokens[:, :-1], tokens[:, 1:], None, None, attn[:, :-1].astype(np.float32))
    packed_in = (
        plan.tokens,
        plan.targets,
        plan.positions,
        plan.segment_ids,
        (plan.segment_ids > 0).astype(np.float32),
    )
    result = {
        "config": args.config,
        "device": f"{device.platform}:{device.device_kind}",
        "dtype": args.dtype,
        "samples": args.batch,
        "real_tokens": real,
        "length_median": int(np.median(lengths)),
        "length_max": longest,
        "padded_shape": f"{args.batch}x{longest}",
        "packed_shape": f"{plan.tokens.shape[0]}x{args.seq}",
        "padded_fill": round(real / (args.batch * longest), 3),
        "packed_fill": round(real / plan.tokens.size, 3),
    }
    for name, inputs in (("padded", padded_in), ("packed", packed_in)):
        inputs = tuple(None if x is None else jnp.asarray(x) for x in inputs)
        t0 = time.perf_counter()
        loss, grads = step(params, *inputs)
        jax.block_until_ready((loss, grads))
        result[f"{name}_first_step_s"] = round(time.perf_counter() - t0, 2)
        for _ in range(args.warmup):
            jax.block_until_ready(step(params, *inputs))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = step(params, *inputs)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / args.steps)
        result[f"{name}_loss"] = round(float(loss), 6)
        result[f"{name}_step_s"] = round(float(np.median(times)), 5)
        result[f"{name}_tokens_per_s"] = round(real / float(np.median(times)), 1)
    result["speedup"] = round(result["packed_tokens_per_s"] / result["padded_tokens_per_s"], 3)
    result.update(repeats=args.repeats, steps=args.steps, seed=args.seed)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
