"""grpo: tiny looped Nanbeige-family model from random init, built-in task, embedded sampler."""

from jaxloop.config import base_config


def get_config():
    config = base_config()
    config.algorithm = "grpo"
    config.run_dir = "runs/grpo"
    return config
