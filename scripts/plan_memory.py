"""Per-device memory of the real-shape update step, planned ahead of time on fake CPU devices.

    python scripts/plan_memory.py --config nanbeige-3b --algorithm ppo --mesh fsdp=8
    python scripts/plan_memory.py --config nanbeige-3b --algorithm all --mesh fsdp=1 \\
        --micro-batch 1 --seq 2048

Builds the trainer's own learner (`jaxloop.train.setup.TrainSetup`) on a mesh of fake CPU devices,
then lowers and compiles its jitted `update(state, batch)` (and `old_logprobs`) from abstract inputs
(`jax.ShapeDtypeStruct` with the train state's shardings): nothing is allocated. Prints, per
algorithm, the per-device argument, output, alias (donated), temporary and total bytes from
`compiled.memory_analysis()` (total = arguments + outputs - aliased + temporaries), as a table
and one JSON line (last line of stdout).

The figures are XLA's CPU plan: the GPU compiler fuses differently, so treat them as an estimate
of what an accelerator of that many devices needs, not as a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ALGORITHMS = ("ppo", "grpo", "dppo", "flow_dppo")


def parse_mesh(text: str) -> dict[str, int]:
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in sizes or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"error: --mesh {text!r}: expected e.g. fsdp=8 or data=2,tensor=4")
        sizes[name] = int(value)
    return sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="nanbeige-3b", help="nanbeige-3b | ouro-1.4b | tiny")
    p.add_argument("--algorithm", default="ppo", choices=[*ALGORITHMS, "all"])
    p.add_argument("--mesh", default="fsdp=8", help="e.g. fsdp=8, data=2,tensor=4, fsdp=1")
    p.add_argument("--micro-batch", type=int, default=0, help="0: one sequence per device")
    p.add_argument("--samples", type=int, default=0, help="samples per update; 0: 2 micro-batches")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--compute-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--remat", default="full", choices=["none", "full", "dots"])
    p.add_argument("--kl-coef", type=float, default=0.0, help="> 0 adds the reference params")
    p.add_argument(
        "--offload",
        default="",
        help="comma list of critic, optimizer, reference (the offload.* keys): plans the update "
        "as its three phases, each with only what it uses on the device",
    )
    p.add_argument("--gen-rows", type=int, default=32, help="rows generated at once (KV cache)")
    return p.parse_args(argv)


def _bytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _total(m) -> int:
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + (m.temp_size_in_bytes)
    )


def plan_phases(learner, state, batch, off: set[str], model_cfg, gen_rows: int, seq: int):
    """Per-device peak of each phase of an offloaded update, plus generation: the phase's own
    compiled memory and whatever else of the state stays on the device meanwhile."""
    import jax

    resting = {  # state fields in host memory between phases
        "critic_params": "critic" in off,
        "critic_opt": "critic" in off,
        "actor_opt": "optimizer" in off,
        "ref_params": "reference" in off,
    }

    def resident(*in_use: str) -> int:
        fields = ("actor_params", "actor_opt", "critic_params", "critic_opt", "ref_params")
        return sum(
            _bytes(getattr(state, f))
            for f in fields
            if f not in in_use and not resting.get(f, False) and getattr(state, f) is not None
        )

    full = batch.replace(old_logprobs=batch.response_mask)
    prep = learner._prepare.lower(state.ref_params, state.critic_params, full).compile()
    prepared = jax.eval_shape(learner._prepare_impl, state.ref_params, state.critic_params, full)[0]
    actor = learner._actor_phase.lower(state.actor_params, state.actor_opt, full, prepared)
    phases = {
        "prepare": (prep.memory_analysis(), resident("ref_params", "critic_params")),
        "actor": (actor.compile().memory_analysis(), resident("actor_params", "actor_opt")),
    }
    if state.critic_params is not None:
        critic = learner._critic_phase.lower(state.critic_params, state.critic_opt, full, prepared)
        phases["critic"] = (
            critic.compile().memory_analysis(),
            resident("critic_params", "critic_opt"),
        )
    out = {}
    for name, (m, other) in phases.items():
        out[name] = {"phase_gb": _total(m) / 1e9, "resident_gb": other / 1e9}
        out[name]["total_gb"] = out[name]["phase_gb"] + out[name]["resident_gb"]
    # generation (estimate): the actor parameters, what else stays on the device, the KV cache
    # of gen_rows x seq tokens in the compute dtype (loops x layers x 2 (k, v) per token) and,
    # with parameters in another dtype, their compute-dtype copy the decode program makes
    c = model_cfg
    cache = 2 * c.num_loops * c.num_layers * gen_rows * seq * c.num_kv_heads * c.head_dim
    itemsize = jax.numpy.dtype(c.compute_dtype).itemsize
    cache *= itemsize
    if c.compute_dtype != c.param_dtype:  # the decode program's copy (compute_dtype_state)
        cache += sum(math.prod(x.shape) for x in jax.tree.leaves(state.actor_params)) * itemsize
    out["generate"] = {"phase_gb": cache / 1e9, "resident_gb": resident() / 1e9}
    out["generate"]["total_gb"] = out["generate"]["phase_gb"] + out["generate"]["resident_gb"]
    return out


def plan(args, algorithm: str, mesh_sizes: dict[str, int]) -> dict:
    import jax

    from jaxloop.config import base_config, validate_mesh
    from jaxloop.models import LoopedConfig, tiny_hf_config
    from jaxloop.models.presets import FULL_SIZE
    from jaxloop.parallel import mesh as shd
    from jaxloop.rl.train_batch import TrainBatch
    from jaxloop.train.setup import TrainSetup

    hf = tiny_hf_config("nanbeige") if args.config == "tiny" else dict(FULL_SIZE[args.config])
    model_cfg = LoopedConfig.from_hf_dict(hf).replace(
        param_dtype=args.param_dtype, compute_dtype=args.compute_dtype, remat=args.remat
    )
    dp = mesh_sizes["data"] * mesh_sizes["fsdp"]
    micro = args.micro_batch or dp
    samples = args.samples or 2 * micro
    cfg = base_config()
    cfg.algorithm = algorithm
    cfg.micro_batch_size = micro
    cfg.prompts_per_update = samples
    cfg.n_samples_per_prompt = 1 if algorithm != "grpo" else 2
    cfg.prompts_per_update = samples // cfg.n_samples_per_prompt
    cfg.algo.kl_coef = args.kl_coef
    off = set(filter(None, args.offload.split(",")))
    for name in off:
        cfg.offload[name] = True
    for axis, size in mesh_sizes.items():
        cfg.mesh[axis] = size
    validate_mesh(cfg, jax.device_count(), model_cfg)
    mesh = shd.make_mesh(**mesh_sizes)
    training = TrainSetup(cfg, model_cfg, mesh)
    learner = training.learner
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        training.abstract_state(),
        training.shardings,
    )
    rows = learner.batch_sharding
    n, s = samples, args.seq
    spec = {
        "tokens": ((n, s), "int32"),
        "attention_mask": ((n, s), "bool"),
        "response_mask": ((n, s - 1), "float32"),
        "behav_logprobs": ((n, s - 1), "float32"),
        "scores": ((n,), "float32"),
        "group_ids": ((n,), "int32"),
        "sample_mask": ((n,), "float32"),
    }
    batch = TrainBatch(
        **{k: jax.ShapeDtypeStruct(shape, dt, sharding=rows) for k, (shape, dt) in spec.items()}
    )
    out = {"algorithm": algorithm, "devices": jax.device_count(), **mesh_sizes}
    out.update(micro_batch=micro, samples=samples, seq=s, remat=args.remat)
    if off:
        out["offload"] = sorted(off)
        with jax.set_mesh(mesh):
            t0 = time.perf_counter()
            out["phases"] = plan_phases(
                learner, state, batch, off, model_cfg, args.gen_rows, args.seq
            )
            out["compile_s"] = round(time.perf_counter() - t0, 1)
        return out
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        old = (
            learner._old_logprobs.lower(state.actor_params, batch, False)
            .compile()
            .memory_analysis()
        )
        full = batch.replace(old_logprobs=batch.response_mask)
        upd = learner._update.lower(state, full).compile().memory_analysis()
        out["compile_s"] = round(time.perf_counter() - t0, 1)
    for name, m in (("update", upd), ("old_logprobs", old)):
        total = _total(m)
        out[name] = {
            "argument_gb": m.argument_size_in_bytes / 1e9,
            "output_gb": m.output_size_in_bytes / 1e9,
            "alias_gb": m.alias_size_in_bytes / 1e9,
            "temp_gb": m.temp_size_in_bytes / 1e9,
            "total_gb": total / 1e9,
        }
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    mesh_sizes = parse_mesh(args.mesh)
    devices = mesh_sizes["data"] * mesh_sizes["fsdp"] * mesh_sizes["tensor"]
    # fake CPU devices: set before jax starts (this script never runs on an accelerator)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jaxloop.config import UsageError

    algorithms = ALGORITHMS if args.algorithm == "all" else (args.algorithm,)
    try:
        results = [plan(args, a, mesh_sizes) for a in algorithms]
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    head = (
        f"{'algorithm':<10} {'step':<13} {'args GB':>9} {'out GB':>8} {'alias GB':>9} "
        f"{'temp GB':>8} {'total GB':>9}"
    )
    print(f"{args.config}, mesh {args.mesh} ({devices} devices), per device:")
    if args.offload:
        print(f"offload: {args.offload}; per phase: its compiled memory + the state left on device")
        print(f"{'algorithm':<10} {'phase':<9} {'phase GB':>9} {'resident GB':>12} {'peak GB':>8}")
        for r in results:
            for phase, m in r["phases"].items():
                print(
                    f"{r['algorithm']:<10} {phase:<9} {m['phase_gb']:>9.2f} "
                    f"{m['resident_gb']:>12.2f} {m['total_gb']:>8.2f}"
                )
        results_only = True
    else:
        results_only = False
        print(head)
    for r in [] if results_only else results:
        for step in ("update", "old_logprobs"):
            m = r[step]
            print(
                f"{r['algorithm']:<10} {step:<13} {m['argument_gb']:>9.2f} {m['output_gb']:>8.2f} "
                f"{m['alias_gb']:>9.2f} {m['temp_gb']:>8.2f} {m['total_gb']:>9.2f}"
            )
    summary = {
        "config": args.config,
        "mesh": args.mesh,
        "param_dtype": args.param_dtype,
        "compute_dtype": args.compute_dtype,
        "results": results,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
