"""Plain reference forms of the learner's statistics, for tests to check against."""

import jax
import jax.numpy as jnp
from flax import nnx


def token_logprobs(graphdef, params, tokens, attention_mask, temperature):
    """Selected-token log-probs of log_softmax(logits / T) at every target position and the
    scaled logits, whole: the plain reference form of `jaxloop.rl.stats.token_stats`."""
    model = nnx.merge(graphdef, params)
    out = model.forward(tokens[:, :-1], attention_mask=attention_mask[:, :-1])
    logits = out.logits / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0], logits
