"""Embedded-sampler decode speed, side by side with transformers `generate` in one run.

    python scripts/bench_decode.py                      # CPU: small Llama weights, num_loops=1
    python scripts/bench_decode.py --config nanbeige-3b --batch 64 --context 1024   # GPU

CPU mode builds one random LlamaForCausalLM, saves it, loads the same weights into jaxloop
(model_type 'llama' = Nanbeige block, one loop) and times greedy decoding of the same prompts in
both; the greedy tokens are compared as a sanity check. GPU mode times a decode step of the
full-size looped model (random bf16 weights, per-loop KV cache) at the given batch and context.
Per-step time = (time for N2 new tokens - time for N1) / (N2 - N1), so prefill cancels out.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxloop.models import LoopedConfig, LoopedLM, load_hf  # noqa: E402
from jaxloop.rollout.jax_sampler import JaxSamplerEngine  # noqa: E402
from jaxloop.rollout.types import PromptRequest, SamplingConfig  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures"


def _time(fn, repeats: int) -> float:
    fn()  # compile / warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


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


def bench_cpu(args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    hf_cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    hf_model = LlamaForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp, safe_serialization=True)
        model = load_hf(tmp, dtype="float32")
    engine = JaxSamplerEngine(model, min_prompt_bucket=args.prompt_len)
    engine.publish(nnx.state(model), 0)
    requests = _requests(args.batch, args.prompt_len, args.vocab)
    jax_step, samples = jax_step_time(engine, requests, args.n1, args.n2, args.repeats)

    ids = torch.tensor([list(r.prompt_ids) for r in requests])

    def hf_generate(n):
        def go():
            with torch.no_grad():
                return hf_model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=0,
                )

        return go

    t1 = _time(hf_generate(args.n1), args.repeats)
    t2 = _time(hf_generate(args.n2), args.repeats)
    hf_step = (t2 - t1) / (args.n2 - args.n1)
    hf_tokens = hf_generate(args.n2)()[:, args.prompt_len :].tolist()
    same = sum(s.response_ids == h for s, h in zip(samples, hf_tokens, strict=True))
    return {
        "mode": "cpu",
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "jaxloop_ms_per_step": jax_step * 1e3,
        "transformers_ms_per_step": hf_step * 1e3,
        "jaxloop_tokens_per_s": args.batch / jax_step,
        "transformers_tokens_per_s": args.batch / hf_step,
        "speedup_vs_transformers": hf_step / jax_step,
        "greedy_rows_identical": f"{same}/{args.batch}",
    }


def bench_full(args) -> dict:
    name = {"nanbeige-3b": "nanbeige4.2-3b", "ouro-1.4b": "ouro-1.4b"}[args.config]
    cfg = LoopedConfig.from_hf_dir(FIXTURES / name).replace(
        param_dtype="bfloat16", compute_dtype="bfloat16"
    )
    model = LoopedLM(cfg, rngs=nnx.Rngs(0))
    engine = JaxSamplerEngine(model, min_prompt_bucket=args.context)
    engine.publish(nnx.state(model), 0)
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
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--n1", type=int, default=8)
    ap.add_argument("--n2", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
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
