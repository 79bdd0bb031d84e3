"""A RolloutProducer over the embedded sampler and a tiny random model, for rollout tests."""

from flax import nnx

from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.rollout.api import Policy
from jaxloop.rollout.jax_sampler import JaxSamplerEngine
from jaxloop.rollout.producer import RolloutProducer
from jaxloop.train.setup import producer_settings


def embedded_producer(cfg) -> RolloutProducer:
    """The producer of `cfg` (a grpo config) with a tiny nanbeige model (seed 0) published."""
    settings = producer_settings(cfg, requires_groups=True)
    model_cfg = LoopedConfig.from_hf_dict(
        tiny_hf_config("nanbeige", vocab_size=settings.vocab_size)
    )
    model = LoopedLM(model_cfg, rngs=nnx.Rngs(0))
    producer = RolloutProducer(settings, JaxSamplerEngine(model))
    producer.publish(Policy(nnx.state(model), 0, model.config))
    return producer
