"""Policy publication cost, stage by stage, for a configurable-size looped model.

    python scripts/bench_publish.py [--layers 2] [--vocab 32000] [--bucket-mb 256] [--ray]
    python scripts/bench_publish.py --full nanbeige4.2-3b --ray      # GPU machine: 8.3 GB

Stages (the same code path the trainer and engines use): trainer params -> HF-named host tensors
through the family mapping table; manifest digest; bucketed serialisation; receiving engine:
deserialise + verify count / shapes / dtypes / digest; transports: Ray object store to an actor
on this node (with --ray), safetensors files on disk. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config  # noqa: E402
from jaxloop.models.families import hf_table  # noqa: E402
from jaxloop.models.hf_io import hf_tensor_shapes  # noqa: E402
from jaxloop.models.hf_mapping import iter_hf_tensors  # noqa: E402
from jaxloop.rollout.publication import (  # noqa: E402
    Manifest,
    PublicationReceiver,
    dtype_name,
    make_chunks,
)

FIXTURES = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures"


def build_model(args) -> LoopedLM:
    if args.full:
        cfg = LoopedConfig.from_hf_dir(FIXTURES / args.full)
    else:
        hf = tiny_hf_config(
            "nanbeige",
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 3,
            num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 128,
            num_key_value_heads=max(1, args.hidden // 512),
            head_dim=128,
        )
        cfg = LoopedConfig.from_hf_dict(hf)
    cfg = cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    return LoopedLM(cfg, rngs=nnx.Rngs(0))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", default="", help="a fixture name, e.g. nanbeige4.2-3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--ray", action="store_true", help="also time the Ray object-store path")
    args = ap.parse_args()

    model = build_model(args)
    cfg = model.config
    jax.block_until_ready(nnx.state(model))
    expected = {
        name: (shape, dtype_name(jax.numpy.dtype("bfloat16")))
        for name, shape in hf_tensor_shapes(cfg).items()
    }
    rows = {}
    tensors, rows["to_hf_host_tensors"] = timed(lambda: list(iter_hf_tensors(model, hf_table(cfg))))
    nbytes = sum(a.nbytes for _, a in tensors)
    manifest, rows["manifest_digest"] = timed(lambda: Manifest.build(1, tensors))
    chunks, rows["serialize_buckets"] = timed(lambda: make_chunks(tensors, args.bucket_mb * 2**20))

    def receive(version, parts):
        receiver = PublicationReceiver(expected)
        receiver.begin(version, manifest)
        for part in parts:
            receiver.add_chunk(version, part)
        return receiver.finish(version, manifest.count, manifest.digest)

    _, rows["engine_receive_verify"] = timed(lambda: receive(1, chunks))

    with tempfile.TemporaryDirectory() as tmp:

        def disk():
            files = []
            for i, part in enumerate(chunks):
                path = Path(tmp) / f"chunk-{i:05d}.safetensors"
                path.write_bytes(part)
                files.append(path)
            return [f.read_bytes() for f in files]

        parts, rows["disk_write_read"] = timed(disk)

    if args.ray:
        import os

        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

        @ray.remote
        class Receiver:
            def run(self, expected, manifest, version, *parts):
                receiver = PublicationReceiver(expected)
                receiver.begin(version, manifest)
                for part in parts:
                    receiver.add_chunk(version, part)
                return len(receiver.finish(version, manifest["count"], manifest["digest"]))

        actor = Receiver.remote()
        ray.get(actor.__ray_ready__.remote())

        def via_ray():
            refs = [ray.put(part) for part in chunks]
            return ray.get(actor.run.remote(expected, manifest.to_dict(), 1, *refs))

        _, rows["ray_object_store_to_actor"] = timed(via_ray)
        ray.shutdown()

    end_to_end = (
        rows["to_hf_host_tensors"]
        + rows["manifest_digest"]
        + rows["serialize_buckets"]
        + rows.get("ray_object_store_to_actor", rows["engine_receive_verify"])
    )
    rows["end_to_end"] = end_to_end
    print(
        f"model: {cfg.family} {cfg.num_layers} layers, {len(tensors)} tensors, "
        f"{nbytes / 1e9:.3f} GB bf16, buckets of {args.bucket_mb} MiB ({len(chunks)})"
    )
    print(f"{'stage':<28} {'seconds':>9} {'GB/s':>8}")
    for stage, sec in rows.items():
        print(f"{stage:<28} {sec:>9.3f} {nbytes / max(sec, 1e-9) / 1e9:>8.2f}")
    print(
        json.dumps(
            {
                "bench_publish": {
                    "bytes": nbytes,
                    "tensors": len(tensors),
                    "buckets": len(chunks),
                    "seconds": rows,
                    "device": str(jax.devices()[0]),
                }
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
