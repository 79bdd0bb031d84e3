"""Policy publication cost, stage by stage, for a configurable-size looped model.

    python scripts/bench_publish.py [--layers 2] [--vocab 32000] [--bucket-mb 64] [--repeats 3]
    python scripts/bench_publish.py --full nanbeige4.2-3b --ray      # GPU machine: 8.3 GB

Stages (the same code path the trainer and engines use): trainer params -> HF-named host tensors
through the family mapping table, naively (`hf_tensors`: one pageable `np.asarray` per tensor,
then `tensor_hashes` in the manifest) and through `HostStaging` (the publisher's reused host
buffers, bucketed, each bucket hashed while the next copies): its first publication (buffers
allocated) and later ones (reused; its device -> host copy and the wait for the last digests);
bucketed serialisation; receiving engine: deserialise + verify count / shapes / dtypes / digest;
transports: Ray object store to an actor on this node (with --ray), safetensors files on disk.
Repeated stages report the median of --repeats. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxloop.families import hf_tensor_shapes  # noqa: E402
from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config  # noqa: E402
from jaxloop.rollout.api import Policy  # noqa: E402
from jaxloop.rollout.publication.policy import hf_tensors  # noqa: E402
from jaxloop.rollout.publication.staging import HostStaging  # noqa: E402
from jaxloop.rollout.publication.transaction import (  # noqa: E402
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


def staging_backend(staged) -> str:
    return staged.stats["staging_backend"]


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
    ap.add_argument("--bucket-mb", type=int, default=64, help="rollout.publish_bucket_mb")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each repeated stage")
    ap.add_argument("--backend", default="auto", choices=("auto", "numpy", "torch", "torch_pinned"))
    ap.add_argument("--ray", action="store_true", help="also time the Ray object-store path")
    args = ap.parse_args()
    if args.repeats < 1:
        print(f"--repeats {args.repeats}: must be at least 1", file=sys.stderr)
        return 2

    model = build_model(args)
    cfg = model.config
    jax.block_until_ready(nnx.state(model))
    expected = {
        name: (shape, dtype_name(jax.numpy.dtype("bfloat16")))
        for name, shape in hf_tensor_shapes(cfg).items()
    }
    policy = Policy(nnx.state(model), 1, cfg)
    engine_dtypes = {name: dtype for name, (_, dtype) in expected.items()}
    rows = {}

    def median_of_runs(fn):
        runs = [timed(fn) for _ in range(args.repeats)]
        return runs[-1][0], statistics.median(sec for _, sec in runs)

    naive, rows["naive_hf_tensors"] = median_of_runs(lambda: hf_tensors(policy, engine_dtypes))
    nbytes = sum(a.nbytes for _, a in naive)
    manifest, rows["naive_manifest_digest"] = median_of_runs(lambda: Manifest.build(1, naive))
    rows["naive_total"] = rows["naive_hf_tensors"] + rows["naive_manifest_digest"]
    naive.clear()  # the naive host copies go before the staging buffers come

    staging = HostStaging(args.bucket_mb * 2**20, backend=args.backend)
    staged, rows["staged_first"] = timed(lambda: staging.stage(policy, engine_dtypes))
    reused = [staging.stage(policy, engine_dtypes).stats for _ in range(args.repeats)]
    for row, key in (
        ("staged_reused", "stage_s"),
        ("staged_device_to_host", "stage_device_to_host_s"),
        ("staged_digest_wait", "stage_digest_wait_s"),
    ):
        rows[row] = statistics.median(stats[key] for stats in reused)
    staged = staging.stage(policy, engine_dtypes)
    tensors = staged.tensors
    if Manifest.build(1, tensors, hashes=staged.hashes).digest != manifest.digest:
        raise SystemExit("staged tensors differ from hf_tensors: a bug in HostStaging")
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
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

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
        rows["staged_reused"]  # host tensors and their digests, as RayRolloutClient.publish
        + rows["serialize_buckets"]
        + rows.get("ray_object_store_to_actor", rows["engine_receive_verify"])
    )
    rows["end_to_end"] = end_to_end
    gb_per_s = {stage: nbytes / max(sec, 1e-9) / 1e9 for stage, sec in rows.items()}
    ratio = rows["naive_total"] / max(rows["staged_reused"], 1e-9)
    print(
        f"model: {cfg.family} {cfg.num_layers} layers, {len(tensors)} tensors, "
        f"{nbytes / 1e9:.3f} GB bf16, buckets of {args.bucket_mb} MiB ({len(chunks)}); "
        f"staging backend {staging_backend(staged)}, median of {args.repeats} where repeated"
    )
    print(f"{'stage':<28} {'seconds':>9} {'GB/s':>8}")
    for stage, sec in rows.items():
        print(f"{stage:<28} {sec:>9.3f} {gb_per_s[stage]:>8.2f}")
    print(f"naive_total / staged_reused: {ratio:.2f}x")
    print(
        json.dumps(
            {
                "bench_publish": {
                    "bytes": nbytes,
                    "tensors": len(tensors),
                    "buckets": len(chunks),
                    "seconds": rows,
                    "gb_per_s": gb_per_s,
                    "naive_over_staged_reused": ratio,
                    "staging_backend": staging_backend(staged),
                    "staging_allocations": staging.allocations,
                    "repeats": args.repeats,
                    "device": str(jax.devices()[0]),
                }
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
