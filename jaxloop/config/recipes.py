"""Recipes the config files share: the full-size settings of configs/nanbeige_3b_*.py, the tiny
model's learning recipe of configs/{ppo,grpo,dppo,flow_dppo}.py, and the overrides that undo it."""

from __future__ import annotations

import ml_collections

from jaxloop.config.load import load_config_file
from jaxloop.config.schema import base_config, flat_items


def official_config(algorithm: str, preset: str = "nanbeige-3b") -> ml_collections.ConfigDict:
    """`algorithm` at a released model's shape on one H200 (configs/nanbeige_3b_*.py): fp32
    master weights, bf16 compute, full remat, the LM head over chunks of 1024 positions, what the
    phase at work does not use offloaded to pinned host memory (scripts/plan_memory.py --offload
    critic,optimizer,reference: every phase of every algorithm under 141 GB), the embedded
    sampler, 8 prompts x 4 samples of up to 256 tokens, 2 updates."""
    c = base_config()
    c.algorithm = algorithm
    c.run_dir = f"runs/{preset.replace('-', '_')}_{algorithm}"
    c.model.preset = preset
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "bfloat16"
    c.model.remat = "full"
    c.model.logits_chunk = 1024
    c.model.scan_layers = True  # 22 layers x 2 loops: one compiled layer body, not 44
    c.offload.critic = c.offload.optimizer = c.offload.reference = True
    c.prompts_per_update = 8
    c.n_samples_per_prompt = 4
    c.micro_batch_size = 4
    c.eval_prompts = 8
    c.eval_every = 1000
    c.rollout.max_new_tokens = 256
    c.data.max_prompt_tokens = 64
    c.total_updates = 2
    c.checkpoint_every = 1000
    c.optim.lr = 1e-6
    c.critic.lr = 1e-6
    return c


def learning_recipe(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The tiny model's multi-token recipe that configs/{ppo,grpo,dppo,flow_dppo}.py share
    (docs/learning.md): `reverse` of 3 digits with the `format` reward; a supervised warm start that
    stops once the greedy reward on held-out validation prompts reaches 0.45 (at most 400 steps;
    a fixed step count left seed-dependent starting points, 0.3-0.95), then 150 updates of 2
    optimizer steps each (each step on part of every group: learner.step_split=interleaved), the
    actor's learning rate warmed up from 0 over 20 steps and then cosine-decayed; a critic trains
    alone for 5 updates at lr 5e-3.

    The warm-up: a fresh Adam's first step is lr x sign(gradient) on every weight, whatever the
    gradient's size; right after the warm start that one step moved the policy by a KL of
    0.12-7 nats (0.01 an update later) and cost the sampled reward a third. The cosine decay:
    at a constant rate the last updates shook solved policies (docs/learning.md)."""
    from jaxloop.rl.algorithms import get_algorithm

    config.data.task = "reverse"
    config.data.num_digits = 3
    config.data.reward = "format"  # partial credit for a right prefix of the answer
    config.rollout.max_new_tokens = 4  # the answer and EOS
    config.warm_start.sft_steps = 400  # at most; reverse of 3 digits stops after 45-65
    config.warm_start.stop_at_reward = 0.45
    config.total_updates = 150
    config.updates_per_rollout = 2
    # Each optimizer step sees part of every group (TRL's shuffled split has the same effect);
    # whole groups per step lagged it on the grid (docs/learning.md).
    config.learner.step_split = "interleaved"
    config.optim.warmup_steps = 20  # optimizer steps: the first 10 updates
    config.optim.schedule = "cosine"
    if get_algorithm(config.algorithm).uses_critic:
        config.critic.lr = 5e-3
        config.critic.warmup_updates = 5
    return config


ALGORITHM_CONFIGS = ("ppo.py", "grpo.py", "dppo.py", "flow_dppo.py")

# The smallest model and batch the tests and test tools train (the batch divides 8 devices).
TINY_MODEL_OVERRIDES = (
    "--config.model.hidden_size=32",
    "--config.model.intermediate_size=64",
    "--config.model.num_layers=1",
    "--config.model.head_dim=16",
    "--config.prompts_per_update=4",
    "--config.n_samples_per_prompt=2",
    "--config.micro_batch_size=8",
    "--config.eval_prompts=8",
)


def unit_overrides(names=ALGORITHM_CONFIGS) -> tuple[str, ...]:
    """`--config.KEY=VALUE` overrides that put base_config()'s value back for every key the
    given config files change (except algorithm, run_dir, total_updates): the one-token unit
    setting of tests and scripts/chaos.py, whatever learning recipe the configs carry."""
    base = dict(flat_items(base_config()))
    keys = set()
    for name in names:
        for key, value in flat_items(load_config_file(name)):
            if key not in ("algorithm", "run_dir", "total_updates") and base[key] != value:
                keys.add(key)
    return tuple(f"--config.{key}={base[key]}" for key in sorted(keys))
