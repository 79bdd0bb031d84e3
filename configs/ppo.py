"""ppo: PPO with a separate critic.

The tiny looped Nanbeige-family model from random init, the embedded sampler.

The learning recipe (the same in ppo.py, grpo.py, dppo.py, flow_dppo.py): `reverse` with 3
digits ("123:" -> "321", the `format` reward, up to 4 new tokens: the answer and EOS), a warm
start of 60 supervised steps on the task's train split (greedy eval ~0.4 after it), then 150 RL
updates of 32 prompts x 8 samples in 2 optimizer steps each. The critic algorithms warm their
critic up for 5 updates at critic.lr 5e-3. README "Learning" has the measured curves.
"""

from jaxloop.config import base_config


def get_config():
    config = base_config()
    config.algorithm = "ppo"
    config.run_dir = "runs/ppo"
    config.data.task = "reverse"
    config.data.num_digits = 3
    config.data.reward = "format"  # partial credit for a right prefix of the answer
    config.rollout.max_new_tokens = 4  # the answer and EOS
    config.warm_start.sft_steps = 60
    config.total_updates = 150
    config.updates_per_rollout = 2
    config.critic.lr = 5e-3
    config.critic.warmup_updates = 5
    return config
