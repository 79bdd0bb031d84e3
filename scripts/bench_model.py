"""Time a jitted forward + backward of the looped model (mean token log-likelihood loss).

    python scripts/bench_model.py --config tiny --batch 2 --seq 64 --steps 5 --dtype float32
    python scripts/bench_model.py --config nanbeige-3b --batch 4 --seq 2048 --remat full \\
        --attention cudnn                                               # GPU only

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
    model = build_model(cfg)
    n_params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    flops, per_layer = flops_per_step(cfg, args.batch, args.seq)
    assert per_layer == matmul_params_per_layer(model), (per_layer, matmul_params_per_layer(model))
    step, params = make_step(model)
    ids = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, cfg.vocab_size)
    context = contextlib.nullcontext()
    if args.path == "sharded":
        mesh = shd.make_mesh(fsdp=-1)
        params = jax.device_put(params, shd.state_shardings(params, mesh))
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
