"""sft: supervised fine-tuning of the tiny looped model on the default job's task (python -m
jaxloop.sft --config sft.py); its run dir is a model.init_checkpoint for jaxloop.train."""

from jaxloop.config import base_config


def get_config():
    config = base_config()
    config.run_dir = "runs/sft"
    config.data.task = "reverse"
    config.data.num_digits = 3
    config.rollout.max_new_tokens = 4  # the answer and EOS (greedy eval)
    config.sft.steps = 300
    config.eval_every = 50
    config.checkpoint_every = 100
    return config
