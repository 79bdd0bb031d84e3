"""The tiny looped model on 8 fake CPU devices (fsdp=2 x tensor=4) equals the unsharded model."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.parallel.mesh import (
    batch_sharding,
    logical_to_spec,
    make_mesh,
    resolve_axis_sizes,
    shard_model,
    shardings_for,
)

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


def test_shardings_for_module_state_and_variable_agree():
    """One helper, three forms: a module's pure dict, a State's tree and one variable's sharding
    all come from the same logical axes."""
    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config())
    model = nnx.eval_shape(lambda: LoopedLM(cfg, rngs=nnx.Rngs(0)))
    as_dict = shardings_for(model, mesh)
    assert as_dict == nnx.to_pure_dict(shardings_for(nnx.state(model), mesh))
    embed = model.embed
    want = logical_to_spec(embed.logical_axes, embed.shape, mesh)
    assert shardings_for(embed, mesh).spec == want == as_dict["embed"].spec


def test_resolve_axis_sizes():
    sizes = {"data": 2, "fsdp": -1, "tensor": 2}
    assert resolve_axis_sizes(sizes, 8) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert resolve_axis_sizes({"data": 1, "fsdp": 2, "tensor": 1}, 8, use_all=False)["fsdp"] == 2
    for bad, match in [
        ({"data": -1, "fsdp": -1, "tensor": 1}, "at most one may be -1"),
        ({"data": 3, "fsdp": -1, "tensor": 1}, "does not divide 8 devices"),
        ({"data": 1, "fsdp": 3, "tensor": 1}, "= 3 devices, but 8 are available"),
        ({"data": 0, "fsdp": 1, "tensor": 1}, "each axis is >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            resolve_axis_sizes(bad, 8)
