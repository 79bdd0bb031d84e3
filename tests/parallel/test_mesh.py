"""The tiny looped model on 8 fake CPU devices (fsdp=2 x tensor=4) equals the unsharded model."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.parallel.mesh import batch_sharding, logical_to_spec, make_mesh, shard_model

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
)


@pytest.mark.parametrize("family", ["nanbeige", "ouro"])
def test_sharded_logits_equal_unsharded(family):
    hf = tiny_hf_config(family, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    cfg = LoopedConfig.from_hf_dict(hf)
    model = LoopedLM(cfg, rngs=nnx.Rngs(3))
    ids = jax.random.randint(jax.random.key(0), (4, 12), 0, cfg.vocab_size)
    expected = np.asarray(model(ids))

    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    shard_model(model, mesh)
    q = model.blocks.q_proj[...]
    assert q.sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (2, 16, 2, 16)
    ids = jax.device_put(ids, batch_sharding(mesh))

    @nnx.jit
    def forward(m, x):
        return m(x)

    got = np.asarray(forward(model, ids))
    rel = np.abs(got - expected).max() / np.abs(expected).max()
    assert rel <= 1e-5, rel


def test_rules_replicate_when_not_divisible():
    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    # kv_heads=2 cannot split over tensor=4: replicated; embed 32 over fsdp=2: sharded.
    spec = logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (2, 32, 2, 16), mesh)
    assert spec == PartitionSpec(None, "fsdp", None, None)
    spec = logical_to_spec(("vocab", "embed"), (64, 32), mesh)
    assert spec == PartitionSpec("tensor", "fsdp")
