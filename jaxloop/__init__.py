"""jaxloop: RL post-training of looped (recurrent-depth) language models in JAX / Flax NNX."""

__version__ = "0.1.0"
