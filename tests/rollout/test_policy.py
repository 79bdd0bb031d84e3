"""A Policy's HF export equals the HF checkpoint writer's tensors (io.hf.iter_hf), byte for byte,
for both families; an engine's dtype is applied."""

import pytest
from flax import nnx

from jaxloop.io.hf_walk import iter_hf
from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.rollout.api import Policy
from jaxloop.rollout.publication.policy import hf_tensors


@pytest.mark.parametrize("family", ["nanbeige", "ouro"])
def test_policy_export_equals_the_checkpoint_writer(family):
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config(family))
    model = LoopedLM(cfg, rngs=nnx.Rngs(0))
    policy = Policy(nnx.state(model), 3, cfg)
    assert policy.family == family
    got = hf_tensors(policy)
    want = list(iter_hf(model, cfg, "actor"))
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    name = got[0][0]
    cast = dict(hf_tensors(policy, {name: "bfloat16"}))
    assert str(cast[name].dtype) == "bfloat16" and str(cast[got[1][0]].dtype) == "float32"
