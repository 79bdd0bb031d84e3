"""Every engine and source implements its protocol (jaxloop.rollout.api) with the protocol's own
signatures, so the protocols cannot drift from their implementations again: one `publish(policy)`
for the embedded sampler, the vLLM engine, the producer and the Ray client. Imports only (no
engine is started; vLLM is imported inside a VLLMEngine, not by its module)."""

from __future__ import annotations

import inspect

import pytest

from jaxloop.rollout.api import RolloutEngine, RolloutSource, Sampler
from jaxloop.rollout.jax_sampler import JaxSamplerEngine
from jaxloop.rollout.producer import RolloutProducer
from jaxloop.rollout.ray.client import RayRolloutClient
from jaxloop.rollout.ray.group import EngineGroup
from jaxloop.rollout.vllm_engine import VLLMEngine

IMPLEMENTATIONS = {
    RolloutEngine: [JaxSamplerEngine, VLLMEngine],
    RolloutSource: [RolloutProducer, RayRolloutClient],
    Sampler: [JaxSamplerEngine, VLLMEngine, EngineGroup],
}


def _members(protocol) -> dict[str, object]:
    """The protocol's methods and properties (its own and those it inherits from protocols)."""
    names = {}
    for base in reversed(protocol.__mro__):
        if base is object or not getattr(base, "_is_protocol", False):
            continue
        for name, value in vars(base).items():
            if not name.startswith("_") and (callable(value) or isinstance(value, property)):
                names[name] = value
    return names


CASES = [(p, cls) for p, classes in IMPLEMENTATIONS.items() for cls in classes]


@pytest.mark.parametrize(("protocol", "cls"), CASES, ids=lambda x: x.__name__)
def test_implements_the_protocol_with_its_signatures(protocol, cls):
    members = _members(protocol)
    assert "generate" in members or "publish" in members  # the walk found the protocol's methods
    for name, want in members.items():
        got = inspect.getattr_static(cls, name, None)
        assert got is not None, f"{cls.__name__} has no {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{cls.__name__}.{name} is not a property"
            continue
        assert inspect.signature(got) == inspect.signature(want), (
            f"{cls.__name__}.{name}{inspect.signature(got)} != "
            f"{protocol.__name__}.{name}{inspect.signature(want)}"
        )


def test_one_publish_signature_for_engines_and_sources():
    engine = inspect.signature(RolloutEngine.publish)
    assert engine == inspect.signature(RolloutSource.publish)
    assert list(engine.parameters) == ["self", "policy"]
    assert engine.parameters["policy"].annotation == "Policy"
    assert engine.return_annotation == "PublishStats"
