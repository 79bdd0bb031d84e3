"""grpo at the Nanbeige4.2-3B shape (4.17B parameters, 22 layers x 2 loops, vocab 166,144),
random init unless model.hf_dir is set, on one H200 (settings: jaxloop.config.official_config)."""

from jaxloop.config import official_config


def get_config():
    return official_config("grpo")
