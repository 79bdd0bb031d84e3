"""HostStaging (reused host buffers for publication) gives hf_tensors' tensors and tensor_hashes'
digests bit for bit, on sharded parameters, reusing its buffers; what a publisher retains across
publications survives the next one; the publication benchmark runs."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.parallel.mesh import make_mesh, shard_model
from jaxloop.rollout.api import Policy
from jaxloop.rollout.publication.policy import hf_tensors
from jaxloop.rollout.publication.staging import HostStaging, device_cast_is_exact
from jaxloop.rollout.publication.transaction import tensor_hashes

ROOT = Path(__file__).resolve().parents[2]


def tiny_policy(family: str, version: int = 1, seed: int = 0, sharded: bool = True) -> Policy:
    """A 2-layer policy, its parameters over the 8 devices' 'fsdp' axis or on one device."""
    cfg = LoopedConfig.from_hf_dict(
        tiny_hf_config(family, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    )
    model = LoopedLM(cfg, rngs=nnx.Rngs(seed))
    if sharded:
        shard_model(model, make_mesh())
    return Policy(nnx.state(model), version, cfg)


def assert_same(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name


@pytest.mark.parametrize(
    ("backend", "cast_on_device"), [("numpy", None), ("torch", None), ("numpy", False)]
)
def test_staging_equals_hf_tensors_and_reuses_its_buffers(backend, cast_on_device):
    policy = tiny_policy("nanbeige")
    variables = jax.tree.leaves(policy.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    sharded = [v[...] for v in variables]
    assert any(len(x.sharding.device_set) == 8 for x in sharded)  # the copy gathers shards
    names = [n for n, _ in hf_tensors(policy)]
    dtypes = {names[0]: "bfloat16", names[3]: "bfloat16"}  # a cast on device
    # several buckets; cast_on_device=False: the engine's dtype cast on the host
    staging = HostStaging(bucket_bytes=20_000, backend=backend, cast_on_device=cast_on_device)
    staged = staging.stage(policy, dtypes)
    want = hf_tensors(policy, dtypes)
    assert_same(staged.tensors, want)
    assert staged.hashes == tensor_hashes(want)
    assert staged.stats["stage_buckets"] > 2 and staged.stats["stage_allocated"] == 1
    assert staged.stats["staging_backend"] == backend
    assert staged.stats["stage_host_casts"] == (0 if cast_on_device is None else 2)
    first = dict(staged.tensors)
    again = staging.stage(policy, dtypes)
    assert staging.allocations == 1 and again.stats["stage_allocated"] == 0
    assert all(np.shares_memory(first[n], a) for n, a in again.tensors)  # the same buffers
    assert_same(again.tensors, want)
    staging.stage(policy)  # another layout (no casts): allocated anew
    assert staging.allocations == 2


def test_device_cast_to_bfloat16_is_bitwise_numpys():
    """The cast on device is used only where it equals ml_dtypes' round-to-nearest-even bitwise:
    it does on CPU, for every bf16 pattern with the tie and NaN-payload neighbours."""
    device = jax.devices()[0]
    assert device_cast_is_exact(np.float32, ml_dtypes.bfloat16, device)
    bits = np.array([0x3F808000, 0x3F818000, 0x7F800001, 0xFFC00123, 0x00000001], np.uint32)
    x = bits.view(np.float32)
    on_device = np.asarray(jnp.asarray(x).astype(jnp.bfloat16))
    with np.errstate(invalid="ignore"):  # the NaNs
        assert on_device.tobytes() == x.astype(ml_dtypes.bfloat16).tobytes()


def test_what_a_publisher_retains_survives_the_next_publication():
    """Version 1's tensors, copied as RayRolloutClient copies its delta_xor base, still hold
    version 1's bytes after version 2 went through the same (reused) buffers (the torch backend
    on unsharded parameters: the other backend and sharding are covered above)."""
    from jaxloop.rollout.ray.client import retained_copies

    staging = HostStaging(bucket_bytes=1 << 20, backend="torch")
    one = tiny_policy("ouro", version=1, seed=0, sharded=False)
    v1_bytes = {n: a.tobytes() for n, a in hf_tensors(one)}
    kept = retained_copies(staging.stage(one).tensors)
    two = tiny_policy("ouro", version=2, seed=1, sharded=False)
    staged_two = staging.stage(two)
    assert staging.allocations == 1
    assert_same(staged_two.tensors, hf_tensors(two))
    changed = [n for n, a in staged_two.tensors if a.tobytes() != v1_bytes[n]]
    assert changed  # the buffers now hold version 2 ...
    assert {n: a.tobytes() for n, a in kept.items()} == v1_bytes  # ... the copies version 1


def test_bench_publish_runs_and_prints_its_json_line():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_publish.py")]
    cmd += ["--layers", "1", "--hidden", "128", "--vocab", "512", "--repeats", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])["bench_publish"]
    seconds = row["seconds"]
    for stage in ("naive_hf_tensors", "staged_first", "staged_reused", "staged_digest_wait"):
        assert seconds[stage] >= 0 and stage in row["gb_per_s"], stage
    assert row["staging_backend"] == "numpy" and row["bytes"] > 0
