"""dppo at the Nanbeige4.2-3B shape (4.17B parameters, 22 layers x 2 loops, vocab 166,144),
random init unless model.hf_dir is set, on one H200: fp32 master weights, bf16 compute, full remat,
the LM head over chunks of 1024 positions, the parts the phase at work does not use offloaded to
pinned host memory (scripts/plan_memory.py --offload critic,optimizer,reference: every phase of
every algorithm under 141 GB), embedded sampler, 8 prompts x 4 samples of up to 256 tokens."""

from jaxloop.config import base_config


def get_config():
    config = base_config()
    config.algorithm = "dppo"
    config.run_dir = "runs/nanbeige_3b_dppo"
    config.model.preset = "nanbeige-3b"
    config.model.param_dtype = "float32"
    config.model.compute_dtype = "bfloat16"
    config.model.remat = "full"
    config.model.logits_chunk = 1024
    config.offload.critic = True
    config.offload.optimizer = True
    config.offload.reference = True
    config.prompts_per_update = 8
    config.n_samples_per_prompt = 4
    config.micro_batch_size = 4
    config.eval_prompts = 8
    config.eval_every = 1000
    config.rollout.max_new_tokens = 256
    config.data.max_prompt_tokens = 64
    config.total_updates = 2
    config.checkpoint_every = 1000
    config.optim.lr = 1e-6
    config.critic.lr = 1e-6
    return config
