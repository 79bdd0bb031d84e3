"""ppo: PPO with a separate critic.

The tiny looped Nanbeige-family model from random init, the embedded sampler, and the learning
recipe the four algorithm configs share (jaxloop.config.learning_recipe): `reverse` of 3 digits
after a supervised warm start that stops at a validation reward of 0.45, 150 updates.
docs/learning.md has the measured curves.
"""

from jaxloop.config import base_config, learning_recipe


def get_config():
    config = base_config()
    config.algorithm = "ppo"
    config.run_dir = "runs/ppo"
    return learning_recipe(config)
