"""flow_dppo: tiny looped Nanbeige-family model, random init, built-in task, embedded sampler."""

from jaxloop.config import base_config


def get_config():
    config = base_config()
    config.algorithm = "flow_dppo"
    config.run_dir = "runs/flow_dppo"
    return config
