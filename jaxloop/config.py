"""The one config tree (ml_collections), loading from `configs/*.py`, overrides and validation.

`python -m jaxloop.train --config flow_dppo.py --config.optim.lr=3e-3`: a bare name resolves in
the repository's `configs/`, a path works too. Unknown keys and values of the wrong type are
errors (UsageError: one line, exit code 2).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import math
import textwrap
from pathlib import Path
from typing import Any

import ml_collections

from jaxloop.data.tasks import DEFAULT_TASK
from jaxloop.rl.loop_credit import LOOP_CREDITS
from jaxloop.rollout.types import EARLY_EXIT_MODES

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


class UsageError(ValueError):
    """Bad command line or config: reported as one line on stderr with exit code 2."""


class UserCodeError(UsageError):
    """User code (a config file, a reward function) failed or returned the wrong thing: one line
    naming the file or function and the exception, exit code 2 (jaxloop/errors.py)."""


# Engine vs trainer selected log-prob bound when rollout.max_logprob_diff is 0. The embedded
# sampler in fp32 runs the trainer's own model (measured ~5e-7); bf16 compute (measured ~2.4e-3
# on the tiny model) and vLLM (other kernels) get the bound of the reference PyTorch stack.
def default_logprob_diff(engine: str, compute_dtype: str) -> float:
    return 1e-3 if engine == "jax" and compute_dtype == "float32" else 0.03


def base_config() -> ml_collections.ConfigDict:
    """Every key jaxloop reads, with defaults: a tiny looped Nanbeige-family model from random
    init, the built-in task and the embedded sampler on CPU."""
    c = ml_collections.ConfigDict()
    c.run_dir = "runs/default"
    c.seed = 0
    c.algorithm = "flow_dppo"
    c.total_updates = 100
    c.stop_after = 0  # >0: stop (as if killed) after this many updates of this process
    c.prompts_per_update = 32
    c.n_samples_per_prompt = 8
    c.micro_batch_size = 64
    c.updates_per_rollout = 0  # 0: the algorithm's default
    c.checkpoint_every = 10
    c.keep_checkpoints = 2
    c.eval_every = 10
    c.eval_prompts = 64
    c.progress = True
    c.verbose = False

    c.model = ml_collections.ConfigDict()
    c.model.hf_dir = ""  # empty: the built-in tiny model from random init; else load_hf(hf_dir)
    c.model.init_checkpoint = ""  # a run dir written by `conversion.from_hf`
    c.model.preset = ""  # a released model's shape (models/presets.py), random init
    c.model.family = "nanbeige"
    c.model.vocab_size = 64
    c.model.hidden_size = 64
    c.model.intermediate_size = 128
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.model.num_loops = 2
    c.model.rope_theta = 10000.0
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "float32"
    c.model.remat = "none"
    c.model.attention_impl = "xla"
    c.model.logits_chunk = 0
    c.model.scan_layers = False  # the full-size configs scan (official_config)
    c.model.loop_budget = ""  # empty: full depth; "2@0,3@40": K loops from update N

    c.data = ml_collections.ConfigDict()
    c.data.source = "builtin"  # or a JSONL / Parquet file of {prompt, label}
    c.data.eval_source = ""  # held-out {prompt, label} file for evaluation
    c.data.task = DEFAULT_TASK
    c.data.num_digits = 4
    c.data.tokenizer = "char"  # 'char' or a local HF tokenizer dir
    c.data.reward = "exact_match"
    c.data.max_prompt_tokens = 32

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "jax"  # 'jax' (embedded) or 'vllm' (Ray + vLLM engines)
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = -1
    c.rollout.max_new_tokens = 1  # built-in task answers are one character
    # early-exit rollouts (Ouro exit gate): each generated token stops at a loop chosen from the
    # gate's exit distribution; 'none': every token runs every loop
    c.rollout.early_exit = "none"  # or 'threshold' | 'sample'
    c.rollout.exit_threshold = 0.5  # threshold: exit where the cumulative exit probability >= it
    # engine vs trainer selected log-prob bound; 0 = the default (default_logprob_diff)
    c.rollout.max_logprob_diff = 0.0
    c.rollout.num_engines = 1
    c.rollout.ray_address = ""
    c.rollout.publish_bucket_mb = 64
    c.rollout.transport = "object_store"  # or 'disk'
    # or 'delta': only the tensors that changed since the last version; 'delta_xor': those as
    # compressed xor payloads over the last version (the trainer keeps one model copy on the host)
    c.rollout.publish = "full"
    # Ray engines: seconds an engine may take to answer its part of a generate call; one that does
    # not is killed, restarted with the committed policy and its part regenerated (health checks:
    # min(120, this))
    c.rollout.engine_timeout_s = 600.0
    c.rollout.publish_timeout_s = 600.0  # the same for an engine's part of a publication
    c.rollout.engine_log_level = "WARNING"  # engine actors (vLLM, Ray); verbose=True: INFO
    # batches generated ahead by up to this many policy versions while the learner trains
    # (0: synchronous; jaxloop/rollout/pipeline.py)
    c.rollout.max_staleness = 0

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"  # 'adamw' or 'sgd' (no momentum)
    c.optim.lr = 1e-3
    c.optim.schedule = "constant"  # 'constant', 'cosine', 'linear'
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.99
    c.optim.grad_clip = 1.0
    c.optim.max_skipped_updates = 3

    c.offload = ml_collections.ConfigDict()
    c.offload.critic = False
    c.offload.optimizer = False
    c.offload.reference = False

    c.learner = ml_collections.ConfigDict()
    c.learner.seq_multiple = 16
    c.learner.pack_tokens = 0  # >0: each micro-batch's samples packed into rows of this many

    c.critic = ml_collections.ConfigDict()
    c.critic.lr = 1e-3
    c.critic.steps_per_rollout = 1
    c.critic.loss_scale = 1.0  # value loss = loss_scale * max((V_clip - R)^2, (V - R)^2)
    # the first N updates train only the critic (slime --num-critic-only-steps, verl
    # trainer.critic_warmup): the actor, its optimizer state and the policy version stay
    c.critic.warmup_updates = 0

    c.algo = ml_collections.ConfigDict()
    c.algo.clip_eps = 0.2
    c.algo.clip_eps_high = -1.0  # <0: same as clip_eps
    c.algo.dual_clip = -1.0  # <0: off
    c.algo.kl_coef = 0.0
    c.algo.kl_estimator = "k3"
    c.algo.behav_weight_min = 0.5
    c.algo.behav_weight_max = 2.0
    c.algo.behav_drop_cap = -1.0  # <0: clamp; >0: drop tokens whose weight exceeds it
    c.algo.flow_delta = 0.01
    c.algo.value_clip = 0.2
    c.algo.gamma = 1.0
    c.algo.lam = 1.0  # slime --lambd 1.0, verl lam 1.0
    c.algo.whiten_advantages = False  # slime: --normalize-advantages off
    c.algo.grpo_use_std = True
    # per-loop credit: the policy loss is sum_t w_t loss_t over loop t's logits (last: the last
    # loop only)
    c.algo.loop_credit = "last"  # or 'uniform' | 'progressive' | 'exit_pdf'
    c.algo.reduction = "seq_mean_token_mean"
    c.algo.entropy_coef = 0.0  # policy loss - entropy_coef x entropy (exploration bonus)
    c.algo.depth_as_action = False  # rollout.early_exit=sample: the exit choice joins the ratio

    # Device mesh for training and the embedded sampler: ('data', 'fsdp', 'tensor'); -1 takes the
    # remaining devices (at most one axis). Default: every device on fsdp.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1

    # Many hosts: jax.distributed.initialize. Empty coordinator and num_processes 0 = one process
    # (or whatever the cluster environment JAX detects says).
    c.dist = ml_collections.ConfigDict()
    c.dist.coordinator_address = ""
    c.dist.num_processes = 0
    c.dist.process_id = -1

    # supervised fine-tuning: `python -m jaxloop.sft` and the warm start of a training run
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 300  # jaxloop.sft: optimizer steps of the whole run
    c.sft.batch_size = 64  # {prompt, label} examples per step
    c.sft.lr = 3e-3  # constant (optim.name, b1, b2, grad_clip, weight_decay are shared)

    c.warm_start = ml_collections.ConfigDict()
    c.warm_start.sft_steps = 0  # >0: this many SFT steps on the train split before update 0
    c.warm_start.stop_at_reward = 0.0  # >0: stop once the probe prompts' greedy reward reaches it
    c.warm_start.probe_prompts = 64  # train-split prompts stop_at_reward is measured on

    c.draft_features = ml_collections.ConfigDict()
    c.draft_features.enabled = False
    c.draft_features.max_tokens_per_update = 4096
    c.draft_features.max_bytes = 256 * 2**20
    return c


# One line per section and per key of base_config(): the source of `--help` (and of the README's
# pointer to it). tests/test_config.py checks that every key has one and that none is stale.
SECTIONS = {
    "": "the run",
    "model": "the policy model (the critic copies its architecture and backbone)",
    "data": "prompts, tokenizer and reward",
    "rollout": "sampling engines (jax: embedded sampler; vllm: vLLM engine actors on Ray)",
    "optim": "the actor's optimizer",
    "critic": "the value model (ppo, dppo, flow_dppo)",
    "algo": "loss and advantage hyper-parameters",
    "mesh": "device mesh ('data', 'fsdp', 'tensor') for training and the embedded sampler",
    "dist": "many processes (jax.distributed.initialize)",
    "offload": "what rests in pinned host memory while the phase of an update at work does not "
    "use it",
    "learner": "how the learner lays out a batch for its forward and backward passes",
    "sft": "supervised fine-tuning (python -m jaxloop.sft, and warm_start)",
    "warm_start": "supervised steps before the first RL update of a fresh run",
    "draft_features": "saving LM-head input hidden states for draft-model training",
}

DESCRIPTIONS = {
    "run_dir": "run directory (checkpoints, metrics.jsonl, tb/, curves.png); one with a "
    "checkpoint resumes",
    "seed": "seed of the model init, the data order and the per-sample sampling seeds "
    "(0 .. 2^31 - 1)",
    "algorithm": "ppo | grpo | dppo | flow_dppo",
    "total_updates": "updates of the whole run (raise it to continue a finished run)",
    "stop_after": ">0: stop after this many updates of this process (rerun to resume); 0: off",
    "prompts_per_update": "prompts per rollout batch",
    "n_samples_per_prompt": "samples per prompt (one group; grpo needs >= 2)",
    "micro_batch_size": "samples per forward/backward pass (gradients are accumulated)",
    "updates_per_rollout": "optimizer steps per rollout batch (its mini-batches); 0: the "
    "algorithm's default (flow_dppo 2, else 1)",
    "checkpoint_every": (
        "checkpoint every N updates (and after this process's last update); 0: only after the last"
    ),
    "keep_checkpoints": "checkpoints kept (>= 1; older ones are deleted)",
    "eval_every": (
        "greedy evaluation on held-out prompts every N updates (and after the last); 0: only after "
        "the last"
    ),
    "eval_prompts": "held-out prompts per evaluation",
    "progress": "progress bar on a terminal (not a terminal: one line at the end)",
    "verbose": "show every engine, Ray and vLLM log line (overrides rollout.engine_log_level)",
    "model.hf_dir": "start from this HF checkpoint dir; empty: the built-in model below from "
    "random init",
    "model.init_checkpoint": "start from a run dir written by `conversion.from_hf`",
    "model.family": "built-in model: nanbeige (pre-norm) | ouro (sandwich norm, exit gate)",
    "model.vocab_size": "built-in model: vocabulary size (the char tokenizer uses it)",
    "model.hidden_size": "built-in model: hidden size",
    "model.intermediate_size": "built-in model: MLP size",
    "model.num_layers": "built-in model: physical layers (shared by every loop)",
    "model.num_heads": "built-in model: attention heads",
    "model.num_kv_heads": "built-in model: key/value heads (grouped-query attention)",
    "model.head_dim": "built-in model: head dimension (even; vLLM on CPU needs >= 32)",
    "model.num_loops": "built-in model: loops over the layer stack (ouro: total_ut_steps)",
    "model.rope_theta": "built-in model: RoPE base",
    "model.param_dtype": "parameter dtype: float32 | bfloat16",
    "model.compute_dtype": "compute dtype: float32 | bfloat16",
    "model.remat": "activation rematerialisation: none | full | dots",
    "model.attention_impl": "attention kernel: xla | cudnn (GPU)",
    "model.scan_layers": "true: lax.scan over the layers and over the loops (one compiled body "
    "each: short compiles for deep models, the full-size configs); false: both unrolled (XLA "
    "fuses across layers: faster for small models)",
    "offload.critic": "keep the critic and its optimizer state in pinned host memory outside "
    "the value and critic phases of an update",
    "offload.optimizer": "keep the actor's optimizer state in pinned host memory outside the "
    "actor phase (during generation and the critic phase)",
    "offload.reference": "keep the reference policy in pinned host memory outside its log-prob "
    "phase",
    "learner.seq_multiple": "the learner's rows are the longest sample rounded up to a "
    "multiple of this (fewer distinct shapes to compile), at most the longest prompt + "
    "rollout.max_new_tokens",
    "learner.pack_tokens": "0: pad every sample to the longest; > 0: pack each micro-batch's "
    "samples into rows of this many tokens (>= data.max_prompt_tokens + rollout.max_new_tokens)",
    "model.preset": "a released model's shape with random weights (nanbeige-3b, ouro-1.4b; "
    "empty: the tiny keys below); hf_dir / init_checkpoint take precedence",
    "model.logits_chunk": "sequence positions per LM-head chunk in the learner (0: whole "
    "sequence); bounds the [B, chunk, V] logits held at once",
    "model.loop_budget": "loops per update, K@N,...: K loops (1..num_loops) from update N (starts "
    "at 0, N increasing), in the sampler (vllm engines: eagerly), recompute, loss and critic; "
    "empty: full depth",
    "data.source": "builtin (the built-in task) or a JSONL / Parquet file of {prompt, label}",
    "data.eval_source": "a JSONL / Parquet file of held-out {prompt, label} to evaluate on; "
    "empty: the built-in task's held-out split (a file data.source then has no evaluation)",
    "data.task": "built-in task: copy_first | copy_last | max_digit | min_digit | sum_mod10 | "
    "reverse | sort | add (multi-token answers)",
    "data.num_digits": "built-in task: digits per prompt",
    "data.tokenizer": "char (one token per character) or a local HF tokenizer dir",
    "data.reward": "exact_match | prefix_match | format (partial credit for a right prefix of "
    "the answer) | math_verify | module:function",
    "data.max_prompt_tokens": "longest allowed prompt in tokens (checked before training)",
    "rollout.engine": "jax (embedded KV-cache sampler) | vllm (vLLM engine actors on Ray)",
    "rollout.temperature": "sampling temperature (> 0); log-probs are of the tempered policy",
    "rollout.top_p": "nucleus sampling threshold (1: off)",
    "rollout.top_k": "top-k sampling (-1: off)",
    "rollout.max_new_tokens": "response length limit in tokens",
    "rollout.early_exit": "Ouro (exit gate): none | threshold (a token exits at the first "
    "loop whose cumulative exit probability reaches exit_threshold) | sample (at a loop drawn "
    "from the gate's distribution); the prompt runs every loop, the trainer replays the depths; "
    "vllm engines run eagerly without prefix caching then",
    "rollout.exit_threshold": "early_exit=threshold: cumulative exit probability in (0, 1]",
    "rollout.max_logprob_diff": "stop (exit 3) when engine and trainer log-probs differ by more; "
    "0: 1e-3 (jax, fp32) or 0.03 (vllm or bf16)",
    "rollout.num_engines": "vllm: engine actors (one placement-group bundle each)",
    "rollout.ray_address": "vllm: join this Ray cluster (HOST:PORT); empty: start a local one",
    "rollout.publish_bucket_mb": "vllm: policy publication bucket size in MB",
    "rollout.transport": "vllm: publication transport object_store | disk",
    "rollout.publish": "vllm: full | delta (send only the tensors whose bytes changed since the "
    "engines' committed version; a refused delta is sent in full) | delta_xor (delta, each changed "
    "tensor sent as zlib(new xor committed bytes) where that is smaller; the trainer keeps the "
    "committed version's tensors: one more model copy in host memory)",
    "rollout.engine_timeout_s": "vllm: seconds an engine may take for its part of a generate "
    "call; past it, it is restarted and its part regenerated",
    "rollout.publish_timeout_s": "vllm: seconds an engine may take for its part of a policy "
    "publication; past it, it is restarted with the committed policy and the publication resent",
    "rollout.engine_log_level": "vllm: log level in the engine actors: DEBUG | INFO | WARNING | "
    "ERROR",
    "rollout.max_staleness": "generate the batches of the next k updates while the learner trains "
    "(the batch of update u comes from the policy of update u-k; 0: synchronous)",
    "optim.name": "adamw | sgd (no momentum)",
    "optim.lr": "actor learning rate (peak)",
    "optim.schedule": "constant | cosine | linear (over total_updates x updates_per_rollout)",
    "optim.warmup_steps": "linear warm-up steps",
    "optim.weight_decay": "AdamW weight decay",
    "optim.b1": "Adam beta1",
    "optim.b2": "Adam beta2",
    "optim.grad_clip": "global gradient-norm clip of actor and critic (0: off)",
    "optim.max_skipped_updates": "consecutive updates skipped for a non-finite loss or gradient "
    "norm before the run stops (exit 3)",
    "critic.lr": "critic learning rate (constant)",
    "critic.steps_per_rollout": "critic optimizer steps per rollout batch",
    "critic.loss_scale": "factor of the clipped squared value error (0.5: the 1/2 convention)",
    "critic.warmup_updates": "the first N updates train only the critic (actor, its optimizer "
    "state and the policy version unchanged; samples still generated); slime "
    "--num-critic-only-steps, verl trainer.critic_warmup",
    "algo.clip_eps": "PPO ratio clip (both sides unless clip_eps_high)",
    "algo.clip_eps_high": "upper ratio clip (clip-higher); <0: clip_eps",
    "algo.dual_clip": "dual-clip bound (> 1) for negative advantages; <0: off",
    "algo.kl_coef": "grpo: KL-to-reference loss coefficient (0: no reference model)",
    "algo.kl_estimator": "KL estimator: k1 | k2 | k3",
    "algo.behav_weight_min": "dppo: lower clamp of the behaviour weight exp(prox - behav)",
    "algo.behav_weight_max": "dppo: upper clamp of the behaviour weight",
    "algo.behav_drop_cap": "dppo: >0: tokens whose behaviour weight exceeds it get weight 0 "
    "(instead of the clamp); <0: off",
    "algo.flow_delta": "flow_dppo: trust region; tokens with D = KL(pi_old || pi) > delta are "
    "blocked",
    "algo.value_clip": "critic: clip of the new values around the old ones; <0: off",
    "algo.gamma": "GAE discount",
    "algo.lam": "GAE lambda (default 1.0: slime --lambd, verl)",
    "algo.whiten_advantages": "whiten GAE advantages over the batch (default off: slime "
    "--normalize-advantages)",
    "algo.grpo_use_std": "grpo: divide advantages by the group std (false: Dr.GRPO)",
    "algo.loop_credit": "policy loss over loops, sum_t w_t loss_t of loop t's logits: last (the "
    "last loop only) | uniform (w_t = 1/L) | progressive (w_t ~ t + 1) | exit_pdf (Ouro's exit "
    "distribution per token, no gradient through it; needs the exit gate)",
    "algo.reduction": "loss reduction: seq_mean_token_mean | token_mean",
    "algo.entropy_coef": "exploration bonus: entropy_coef x the policy's entropy is subtracted "
    "from every token's policy loss (>= 0; 0: off)",
    "algo.depth_as_action": "rollout.early_exit=sample: add the exit choice's log-probability "
    "(the gate's log p at the exit loop) to the token's in every ratio, training the gate",
    "mesh.data": "data-parallel axis size (-1: the remaining devices)",
    "mesh.fsdp": "fully-sharded data-parallel axis size (-1: the remaining devices)",
    "mesh.tensor": "tensor-parallel axis size (-1: the remaining devices)",
    "dist.coordinator_address": "coordinator HOST:PORT; empty: one process (or what the cluster "
    "environment says)",
    "dist.num_processes": "processes in the job (0: one, or detected)",
    "dist.process_id": "this process's index (-1: detected)",
    "sft.steps": "jaxloop.sft: optimizer steps of the run (eval_every / checkpoint_every count "
    "these steps)",
    "sft.batch_size": "{prompt, label} examples per SFT step (loss on the answer tokens and EOS)",
    "sft.lr": "SFT learning rate (constant; optim.name / b1 / b2 / grad_clip / weight_decay "
    "shared with the actor's optimizer)",
    "warm_start.sft_steps": ">0: this many SFT steps (sft.batch_size, sft.lr) on the task's "
    "train split before update 0 of a fresh run (recorded in the checkpoint: a resume never "
    "repeats it); the critic and reference copy the warm-started actor",
    "warm_start.stop_at_reward": ">0: end the warm start after the first step whose greedy mean "
    "reward on warm_start.probe_prompts train-split prompts reaches this (sft_steps is then the "
    "most it runs): RL starts from a partly right model whatever the seed; 0: all sft_steps",
    "warm_start.probe_prompts": "train-split prompts (their own fixed draw, never the held-out "
    "ones) the warm start's stop_at_reward is measured on, after every step",
    "draft_features.enabled": "save features to <run_dir>/draft_features/ every update",
    "draft_features.max_tokens_per_update": "feature rows per update at most",
    "draft_features.max_bytes": "feature bytes of the whole run at most",
}

# ---- value domains: the values every key may take, declared once ----
# validate() checks every key against its Domain (in a dry run as in a real one) before anything
# else: a value outside it is a one-line UsageError naming the key, the value and the domain.
# Cross-key rules (grpo needs >= 2 samples, top_p must be 1, the mesh's one -1, ...) follow in
# validate(); those that need the model's shape or the device count in validate_mesh().
INT32_MAX = 2**31 - 1  # counters, sizes and seeds reach jitted int32 code
FLOAT32_MAX = 3.4028234663852886e38  # every float key is used in float32: finite there


@dataclasses.dataclass(frozen=True)
class Domain:
    """A number in [lo, hi] (`open_lo` / `open_hi`: that bound excluded), or one of `also`
    (values outside the range with a meaning, e.g. -1: off; `off_below_zero`: any negative
    number, off); a string among `choices` (any
    string when empty; `any_case`: compared upper-cased), non-empty when `nonempty`. The value's
    type is base_config()'s (an int key takes ints, a float key ints or floats, never a bool);
    every float is finite in float32."""

    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    also: tuple = ()
    choices: tuple[str, ...] = ()
    nonempty: bool = False
    any_case: bool = False
    off_below_zero: bool = False  # any negative number is accepted too (it means: off)

    def describe(self) -> str:
        if self.choices:
            return "one of " + "/".join(repr(c) for c in self.choices)
        if self.nonempty:
            return "a non-empty string"
        if self.lo is None and self.hi is None:
            return "any value of its type"
        if self.hi is not None and self.hi < FLOAT32_MAX and self.lo is not None:
            brackets = ("(" if self.open_lo else "[", ")" if self.open_hi else "]")
            text = f"in {brackets[0]}{_num(self.lo)}, {_num(self.hi)}{brackets[1]}"
        else:
            text = f"{'>' if self.open_lo else '>='} {_num(self.lo)}"
        if self.also:
            text += "".join(f" or {_num(a)}" for a in self.also)
        if self.off_below_zero:
            text += " or < 0 (off)"
        return text

    def contains(self, value) -> bool:
        if isinstance(value, str):
            v = value.upper() if self.any_case else value
            return (not self.choices or v in self.choices) and (bool(value) or not self.nonempty)
        if isinstance(value, bool):
            return True
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            return False
        if value in self.also or (self.off_below_zero and value < 0):
            return True
        if self.lo is not None and (value < self.lo or (self.open_lo and value == self.lo)):
            return False
        return self.hi is None or not (value > self.hi or (self.open_hi and value == self.hi))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def count(lo: int = 0, hi: int = INT32_MAX, also: tuple = ()) -> Domain:
    """An integer in [lo, hi] (or one of `also`)."""
    return Domain(lo, hi, also=also)


def positive(hi: float = FLOAT32_MAX, off_below_zero: bool = False) -> Domain:
    """A number > 0 (and <= hi); `off_below_zero`: or any negative number (off)."""
    return Domain(0, hi, open_lo=True, off_below_zero=off_below_zero)


NON_NEGATIVE = Domain(0, FLOAT32_MAX)
ANY = Domain()  # bools, and strings checked where they are used (paths, specs)


def one_of(*choices: str) -> Domain:
    return Domain(choices=choices)


DOMAINS: dict[str, Domain] = {
    "run_dir": Domain(nonempty=True),  # "" would train in (and overwrite) the current directory
    "seed": count(0),  # numpy SeedSequence and jax.random.key take non-negative seeds
    "algorithm": one_of("ppo", "grpo", "dppo", "flow_dppo"),
    "total_updates": count(1),
    "stop_after": count(0),  # 0: off
    "prompts_per_update": count(1),
    "n_samples_per_prompt": count(1),
    "micro_batch_size": count(1),
    "updates_per_rollout": count(0),  # 0: the algorithm's default
    "checkpoint_every": count(0),  # 0: only after the last update
    "keep_checkpoints": count(1),  # 0 would keep none: a resume would delete every checkpoint
    "eval_every": count(0),  # 0: only after the last update
    "eval_prompts": count(1),
    "progress": ANY,
    "verbose": ANY,
    "model.hf_dir": ANY,
    "model.init_checkpoint": ANY,
    "model.preset": one_of("", "nanbeige-3b", "ouro-1.4b"),
    "model.family": one_of("nanbeige", "ouro"),
    "model.vocab_size": count(1),
    "model.hidden_size": count(1),
    "model.intermediate_size": count(1),
    "model.num_layers": count(1),
    "model.num_heads": count(1),
    "model.num_kv_heads": count(1),  # a divisor of num_heads (checked with the model)
    "model.head_dim": count(2),  # even (rotary embeddings; checked with the model)
    "model.num_loops": count(1),
    "model.rope_theta": positive(),
    "model.param_dtype": one_of("float32", "bfloat16"),
    "model.compute_dtype": one_of("float32", "bfloat16"),
    "model.remat": one_of("none", "full", "dots"),
    "model.attention_impl": one_of("xla", "cudnn"),
    "model.logits_chunk": count(0),  # 0: the whole sequence
    "model.scan_layers": ANY,
    "model.loop_budget": ANY,  # parsed by parse_loop_budget
    "data.source": Domain(nonempty=True),
    "data.eval_source": ANY,
    "data.task": one_of(
        "copy_last", "copy_first", "max_digit", "min_digit", "sum_mod10", "reverse", "sort", "add"
    ),
    "data.num_digits": count(1),
    "data.tokenizer": Domain(nonempty=True),
    "data.reward": Domain(nonempty=True),
    "data.max_prompt_tokens": count(1),
    "rollout.engine": one_of("jax", "vllm"),
    "rollout.temperature": positive(),
    "rollout.top_p": Domain(0, 1, open_lo=True),  # and 1 in training (validate)
    "rollout.top_k": count(1, also=(-1,)),  # -1: off (and off in training: validate)
    "rollout.max_new_tokens": count(1),
    "rollout.early_exit": one_of("none", "threshold", "sample"),
    "rollout.exit_threshold": Domain(0, 1, open_lo=True),
    "rollout.max_logprob_diff": NON_NEGATIVE,  # 0: default_logprob_diff
    "rollout.num_engines": count(1),
    "rollout.ray_address": ANY,
    "rollout.publish_bucket_mb": count(1),
    "rollout.transport": one_of("object_store", "disk"),
    "rollout.publish": one_of("full", "delta", "delta_xor"),
    "rollout.engine_timeout_s": positive(),
    "rollout.publish_timeout_s": positive(),
    "rollout.engine_log_level": Domain(
        choices=("DEBUG", "INFO", "WARNING", "ERROR"), any_case=True
    ),
    "rollout.max_staleness": count(0),
    "optim.name": one_of("adamw", "sgd"),
    "optim.lr": positive(),
    "optim.schedule": one_of("constant", "cosine", "linear"),
    "optim.warmup_steps": count(0),
    "optim.weight_decay": NON_NEGATIVE,
    "optim.b1": Domain(0, 1, open_hi=True),
    "optim.b2": Domain(0, 1, open_hi=True),
    "optim.grad_clip": NON_NEGATIVE,  # 0: off
    "optim.max_skipped_updates": count(1),  # 0 would stop after any update
    "offload.critic": ANY,
    "offload.optimizer": ANY,
    "offload.reference": ANY,
    "learner.seq_multiple": count(1),
    "learner.pack_tokens": count(0),  # 0: off; else >= the longest sample (validate)
    "critic.lr": positive(),
    "critic.steps_per_rollout": count(1),
    "critic.loss_scale": positive(),
    "critic.warmup_updates": count(0),
    "algo.clip_eps": positive(),
    "algo.clip_eps_high": positive(off_below_zero=True),  # < 0: clip_eps
    "algo.dual_clip": Domain(1, FLOAT32_MAX, open_lo=True, off_below_zero=True),
    "algo.kl_coef": NON_NEGATIVE,
    "algo.kl_estimator": one_of("k1", "k2", "k3"),
    "algo.behav_weight_min": NON_NEGATIVE,
    "algo.behav_weight_max": positive(),
    "algo.behav_drop_cap": positive(off_below_zero=True),
    "algo.flow_delta": NON_NEGATIVE,
    "algo.value_clip": positive(off_below_zero=True),
    "algo.gamma": Domain(0, 1),
    "algo.lam": Domain(0, 1),
    "algo.whiten_advantages": ANY,
    "algo.grpo_use_std": ANY,
    "algo.loop_credit": one_of("last", "uniform", "progressive", "exit_pdf"),
    "algo.reduction": one_of("seq_mean_token_mean", "token_mean"),
    "algo.entropy_coef": NON_NEGATIVE,
    "algo.depth_as_action": ANY,
    "mesh.data": count(1, also=(-1,)),  # -1: the remaining devices
    "mesh.fsdp": count(1, also=(-1,)),
    "mesh.tensor": count(1, also=(-1,)),
    "dist.coordinator_address": ANY,
    "dist.num_processes": count(0),  # 0: one, or detected
    "dist.process_id": count(0, also=(-1,)),  # -1: detected
    "sft.steps": count(1),
    "sft.batch_size": count(1),
    "sft.lr": positive(),
    "warm_start.sft_steps": count(0),
    "warm_start.stop_at_reward": NON_NEGATIVE,  # 0: off
    "warm_start.probe_prompts": count(1),
    "draft_features.enabled": ANY,
    "draft_features.max_tokens_per_update": count(1),
    "draft_features.max_bytes": count(1, 2**62),
}

HELP_WIDTH = 100
USAGE = "usage: python -m jaxloop.train --config NAME_OR_PATH [--config.key=value ...] [--dry-run]"


def flat_items(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf, in the order the keys were defined."""
    out = []
    for key in getattr(cfg, "_fields", None) or cfg.keys():  # keys() sorts
        value, name = cfg[key], f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            out.extend(flat_items(value, f"{name}."))
        else:
            out.append((name, value))
    return out


def _by_section(cfg) -> dict[str, list[tuple[str, Any]]]:
    sections: dict[str, list[tuple[str, Any]]] = {}
    for key, value in flat_items(cfg):
        section = key.rsplit(".", 1)[0] if "." in key else ""
        sections.setdefault(section, []).append((key, value))
    return sections


def format_help(cfg: ml_collections.ConfigDict | None = None, config_name: str = "") -> str:
    """Usage, the flags and every key by section with its value in `cfg` (default:
    base_config()) and its description."""
    cfg = base_config() if cfg is None else cfg
    source = config_name or "base_config(); configs/*.py change some"
    lines = [
        USAGE,
        "",
        "  --config NAME_OR_PATH   a config file (a bare name resolves in configs/)",
        "  --config.KEY=VALUE      override one key (also --config.KEY VALUE)",
        "  --dry-run               load, override and validate; print the resolved config; "
        "write nothing",
        "  -h, --help              this list",
        "",
        f"keys (values of {source}):",
    ]
    for section, items in _by_section(cfg).items():
        lines.append("")
        lines.append(f"[{section or 'top level'}] {SECTIONS.get(section, '')}".rstrip())
        cells = [(f"{key}={value!r}", DESCRIPTIONS.get(key, "")) for key, value in items]
        width = min(max(len(c) for c, _ in cells) + 2, 44)
        for cell, text in cells:
            wrapped = textwrap.wrap(text, max(40, HELP_WIDTH - width - 2)) or [""]
            if len(cell) > width - 2:  # a long value: the description starts on the next line
                lines.append(f"  {cell}")
                wrapped_first = []
            else:
                lines.append(f"  {cell:<{width}}{wrapped[0]}".rstrip())
                wrapped_first = wrapped[:1]
            lines.extend(" " * (width + 2) + w for w in wrapped[len(wrapped_first) :])
    return "\n".join(lines)


def format_tree(cfg: ml_collections.ConfigDict, base: ml_collections.ConfigDict | None = None):
    """The resolved config by section, `key = value`; values that differ from `base`
    (default: base_config()) are marked with the default."""
    base = dict(flat_items(base_config() if base is None else base))
    lines = []
    for section, items in _by_section(cfg).items():
        lines.append(f"{section or 'top level'}:")
        for key, value in items:
            name = key.rsplit(".", 1)[-1]
            mark = f"  # default {base[key]!r}" if key in base and base[key] != value else ""
            lines.append(f"  {name} = {value!r}{mark}")
    return "\n".join(lines)


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
    """The tiny model's multi-token recipe that configs/{ppo,grpo,dppo,flow_dppo}.py share (README
    "Learning"): `reverse` of 3 digits with the `format` reward; a supervised warm start that
    stops once the greedy reward on held-out validation prompts reaches 0.45 (at most 400 steps;
    a fixed step count left seed-dependent starting points, 0.3-0.95), then 150 updates of 2
    optimizer steps each; a critic trains alone for 5 updates at lr 5e-3."""
    from jaxloop.rl.algorithms import get_algorithm

    config.data.task = "reverse"
    config.data.num_digits = 3
    config.data.reward = "format"  # partial credit for a right prefix of the answer
    config.rollout.max_new_tokens = 4  # the answer and EOS
    config.warm_start.sft_steps = 400  # at most; reverse of 3 digits stops after 45-65
    config.warm_start.stop_at_reward = 0.45
    config.total_updates = 150
    config.updates_per_rollout = 2
    if get_algorithm(config.algorithm).uses_critic:
        config.critic.lr = 5e-3
        config.critic.warmup_updates = 5
    return config


ALGORITHM_CONFIGS = ("ppo.py", "grpo.py", "dppo.py", "flow_dppo.py")


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


def resolve_config_path(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (CONFIGS_DIR / name, CONFIGS_DIR / f"{name}.py"):
        if candidate.is_file():
            return candidate
    raise UsageError(f"config file {name!r} not found (looked in . and {CONFIGS_DIR})")


def load_config_file(name: str) -> ml_collections.ConfigDict:
    path = resolve_config_path(name)
    spec = importlib.util.spec_from_file_location(f"jaxloop_config_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"config file {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:  # user code: whatever it raises is reported in one line naming the file
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise UsageError(f"config file {path} has no get_config()")
        cfg = module.get_config()
    except UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - SyntaxError included
        raise UserCodeError(f"config file {path}: {_exception_text(err)}") from err
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise UserCodeError(
            f"config file {path}: get_config() returned {type(cfg).__name__}, not a "
            "ml_collections.ConfigDict (start from jaxloop.config.base_config())"
        )
    missing = _missing_keys(cfg)
    if missing:
        raise UserCodeError(
            f"config file {path}: get_config() lacks key(s) {', '.join(missing[:5])} (start "
            "from jaxloop.config.base_config())"
        )
    cfg.lock()
    return cfg


def _exception_text(err: BaseException) -> str:
    """`Type: first line of the message` (SyntaxError: with its line number)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if isinstance(err, SyntaxError) and err.lineno is not None:
        text = f"{err.msg} (line {err.lineno})"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _parse_value(raw: str, current: Any, key: str) -> Any:
    if isinstance(current, bool):
        low = raw.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise UsageError(f"--config.{key}: expected a boolean, got {raw!r}")
    if isinstance(current, int):
        try:
            return int(raw)
        except ValueError:
            raise UsageError(f"--config.{key}: expected an integer, got {raw!r}") from None
    if isinstance(current, float):
        try:
            return float(raw)
        except ValueError:
            raise UsageError(f"--config.{key}: expected a number, got {raw!r}") from None
    if isinstance(current, str):
        return raw
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        raise UsageError(f"--config.{key}: cannot parse {raw!r}") from None
    if not isinstance(value, type(current)):
        raise UsageError(f"--config.{key}: expected {type(current).__name__}, got {raw!r}")
    return value


def apply_override(cfg: ml_collections.ConfigDict, key: str, raw: str) -> None:
    parts = key.split(".")
    node = cfg
    for i, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise UsageError(f"unknown config key {'.'.join(parts[: i + 1])!r}")
        if i < len(parts) - 1:
            node = node[part]
    current = node[parts[-1]]
    if isinstance(current, ml_collections.ConfigDict):
        raise UsageError(f"--config.{key} is a section, not a value")
    with node.unlocked():
        node[parts[-1]] = _parse_value(raw, current, key)


@dataclasses.dataclass
class Command:
    """A parsed command line: the validated config (None with --help), and the flags."""

    cfg: ml_collections.ConfigDict | None
    dry_run: bool = False
    help: str = ""  # with -h / --help: the text to print (nothing else is done)


def parse_args(argv: list[str]) -> ml_collections.ConfigDict:
    """`--config NAME` then any number of `--config.key=value` / `--config.key value`."""
    command = parse_command(argv)
    if command.help:
        raise UsageError(USAGE)
    return command.cfg


def parse_command(argv: list[str]) -> Command:
    """parse_args plus `--dry-run` and `-h` / `--help` (help wins over everything else; with
    `--config NAME` it shows that config's values)."""
    if "-h" in argv or "--help" in argv:
        name = _config_name(argv)
        cfg = load_config_file(name) if name else None
        return Command(None, help=format_help(cfg, name or ""))
    dry_run = "--dry-run" in argv
    return Command(_parse_config(argv), dry_run=dry_run)


def _config_name(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _parse_config(argv: list[str]) -> ml_collections.ConfigDict:
    config_name = None
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--dry-run":
            i += 1
            continue
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                config_name = arg.split("=", 1)[1]
            else:
                if i + 1 >= len(argv):
                    raise UsageError("--config needs a value")
                config_name = argv[i + 1]
                i += 1
        elif arg.startswith("--config."):
            body = arg[len("--config.") :]
            if "=" in body:
                key, value = body.split("=", 1)
            else:
                if i + 1 >= len(argv):
                    raise UsageError(f"{arg} needs a value")
                key, value = body, argv[i + 1]
                i += 1
            overrides.append((key, value))
        else:
            raise UsageError(f"unexpected argument {arg!r}")
        i += 1
    if config_name is None:
        raise UsageError("missing --config (e.g. --config flow_dppo.py)")
    cfg = load_config_file(config_name)
    for key, value in overrides:
        apply_override(cfg, key, value)
    validate(cfg)
    return cfg


def validate(cfg: ml_collections.ConfigDict) -> None:
    from jaxloop.rl.algorithms import ALGORITHMS

    if cfg.algorithm not in ALGORITHMS:
        raise UsageError(f"algorithm={cfg.algorithm!r}; expected one of {sorted(ALGORITHMS)}")
    if ALGORITHMS[cfg.algorithm].requires_groups and cfg.n_samples_per_prompt < 2:
        raise UsageError(
            f"{cfg.algorithm} needs n_samples_per_prompt >= 2 (got {cfg.n_samples_per_prompt}): "
            "group-normalised advantages are undefined for one sample"
        )
    if cfg.critic.warmup_updates > 0 and not ALGORITHMS[cfg.algorithm].uses_critic:
        raise UsageError(
            f"critic.warmup_updates={cfg.critic.warmup_updates} with {cfg.algorithm}: it has no "
            "critic to warm up"
        )
    if cfg.rollout.engine not in ("jax", "vllm"):
        raise UsageError(f"rollout.engine={cfg.rollout.engine!r}; expected 'jax' or 'vllm'")
    if cfg.model.preset:
        from jaxloop.models.presets import FULL_SIZE

        if cfg.model.preset not in FULL_SIZE:
            raise UsageError(
                f"model.preset={cfg.model.preset!r}; expected one of {sorted(FULL_SIZE)} or ''"
            )
    if cfg.model.hf_dir and not Path(cfg.model.hf_dir).is_dir():
        raise UsageError(f"model.hf_dir={cfg.model.hf_dir!r} is not a directory")
    if cfg.model.init_checkpoint and not Path(cfg.model.init_checkpoint).is_dir():
        raise UsageError(f"model.init_checkpoint={cfg.model.init_checkpoint!r} does not exist")
    for key in ("total_updates", "prompts_per_update", "micro_batch_size", "n_samples_per_prompt"):
        if cfg[key] < 1:
            raise UsageError(f"{key} must be >= 1 (got {cfg[key]})")
    for key in ("eval_every", "checkpoint_every"):
        if cfg[key] < 0:
            raise UsageError(f"{key} must be >= 0 (got {cfg[key]}; 0: only after the last update)")
    if cfg.updates_per_rollout < 0:
        raise UsageError(f"updates_per_rollout must be >= 0 (got {cfg.updates_per_rollout})")
    for key in ("steps", "batch_size"):
        if cfg.sft[key] < 1:
            raise UsageError(f"sft.{key} must be >= 1 (got {cfg.sft[key]})")
    if not (cfg.sft.lr > 0 and math.isfinite(cfg.sft.lr)):
        raise UsageError(f"sft.lr must be a finite number > 0 (got {cfg.sft.lr})")
    if cfg.warm_start.sft_steps < 0:
        raise UsageError(f"warm_start.sft_steps must be >= 0 (got {cfg.warm_start.sft_steps})")
    if cfg.warm_start.sft_steps > 0 and cfg.rollout.engine != "jax":
        raise UsageError(
            "warm_start.sft_steps needs rollout.engine=jax (the warm start evaluates with the "
            "embedded sampler); run python -m jaxloop.sft and pass its run dir as "
            "model.init_checkpoint instead"
        )
    if cfg.critic.warmup_updates < 0:
        raise UsageError(f"critic.warmup_updates must be >= 0 (got {cfg.critic.warmup_updates})")
    if cfg.critic.steps_per_rollout < 1:
        raise UsageError(
            f"critic.steps_per_rollout must be >= 1 (got {cfg.critic.steps_per_rollout})"
        )
    if cfg.rollout.temperature <= 0:
        raise UsageError("rollout.temperature must be > 0")
    if cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0:
        raise UsageError(
            f"rollout.top_p={cfg.rollout.top_p:g} / rollout.top_k={cfg.rollout.top_k}: training "
            "rollouts must sample the full distribution (the log-probs are of the unfiltered one, "
            "so every ratio would be biased); use top_p=1 and top_k=-1"
        )
    if cfg.data.eval_source and not Path(cfg.data.eval_source).is_file():
        raise UsageError(f"data.eval_source={cfg.data.eval_source!r} is not a file")
    if not cfg.critic.loss_scale > 0:
        raise UsageError(f"critic.loss_scale must be > 0 (got {cfg.critic.loss_scale})")
    if cfg.rollout.transport not in ("object_store", "disk"):
        raise UsageError(
            f"rollout.transport={cfg.rollout.transport!r}; expected 'object_store' or 'disk'"
        )
    if cfg.rollout.max_staleness < 0:
        raise UsageError(f"rollout.max_staleness must be >= 0 (got {cfg.rollout.max_staleness})")
    if cfg.rollout.publish not in ("full", "delta", "delta_xor"):
        raise UsageError(
            f"rollout.publish={cfg.rollout.publish!r}; expected 'full', 'delta' or 'delta_xor'"
        )
    if cfg.rollout.publish != "full" and cfg.rollout.engine == "jax":
        raise UsageError(
            f"rollout.publish={cfg.rollout.publish} needs remote engines (rollout.engine=vllm): "
            "the embedded sampler takes the trainer's arrays without a copy, nothing is sent"
        )
    for key in ("num_engines", "publish_bucket_mb"):
        if cfg.rollout[key] < 1:
            raise UsageError(f"rollout.{key} must be >= 1 (got {cfg.rollout[key]})")
    for key in ("engine_timeout_s", "publish_timeout_s"):
        if not cfg.rollout[key] > 0:
            raise UsageError(f"rollout.{key} must be > 0 (got {cfg.rollout[key]})")
    if cfg.optim.schedule not in ("constant", "cosine", "linear"):
        raise UsageError(f"optim.schedule={cfg.optim.schedule!r}; expected constant/cosine/linear")
    if cfg.optim.name not in ("adamw", "sgd"):
        raise UsageError(f"optim.name={cfg.optim.name!r}; expected 'adamw' or 'sgd'")
    if cfg.algo.reduction not in ("seq_mean_token_mean", "token_mean"):
        raise UsageError(f"algo.reduction={cfg.algo.reduction!r}")
    if not cfg.algo.entropy_coef >= 0:
        raise UsageError(f"algo.entropy_coef must be >= 0 (got {cfg.algo.entropy_coef})")
    check_loop_credit(cfg)
    pack, longest = cfg.learner.pack_tokens, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if pack < 0 or 0 < pack < longest:
        raise UsageError(
            f"learner.pack_tokens={pack}: 0 (off) or >= the longest sample, data.max_prompt_tokens "
            f"+ rollout.max_new_tokens = {longest}"
        )
    schedule = parse_loop_budget(cfg.model.loop_budget)
    if schedule and not (cfg.model.hf_dir or cfg.model.init_checkpoint or cfg.model.preset):
        check_loop_budget(schedule, cfg.model.num_loops)
    check_early_exit(cfg)
    if cfg.rollout.engine_log_level.upper() not in LOG_LEVELS:
        raise UsageError(
            f"rollout.engine_log_level={cfg.rollout.engine_log_level!r}; expected one of "
            f"{'/'.join(LOG_LEVELS)}"
        )
    if cfg.data.task not in DOMAINS["data.task"].choices:  # the data module's wording
        raise UsageError(
            f"data.task={cfg.data.task!r}: unknown builtin task; choose one of "
            f"{'/'.join(DOMAINS['data.task'].choices)}"
        )
    check_domains(cfg)
    if [cfg.mesh[axis] for axis in ("data", "fsdp", "tensor")].count(-1) > 1:
        raise UsageError(f"mesh {cfg.mesh.to_dict()}: at most one axis may be -1")


def _missing_keys(cfg: ml_collections.ConfigDict) -> list[str]:
    """base_config()'s keys (or sections) that `cfg` lacks, in definition order."""
    have = set()
    for key, _ in flat_items(cfg):
        parts = key.split(".")
        have.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    out = []
    for key, _ in flat_items(base_config()):
        section = key.split(".")[0]
        name = section if section not in have else key
        if name not in have and name not in out:
            out.append(name)
    return out


def _type_ok(value, base) -> bool:
    if isinstance(base, bool):
        return isinstance(value, bool)
    if isinstance(base, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(base, float):
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, type(base))


def check_domains(cfg: ml_collections.ConfigDict) -> None:
    """Every key's value against its DOMAINS entry and base_config()'s type (UsageError naming
    the first that is not)."""
    base = dict(flat_items(base_config()))
    items = flat_items(cfg)
    missing = _missing_keys(cfg)
    if missing:
        raise UsageError(
            f"the config lacks key(s) {', '.join(missing[:5])} (a config file starts from "
            "jaxloop.config.base_config())"
        )
    for key, value in items:
        if key not in base:
            raise UsageError(f"unknown config key {key!r}")
        if not _type_ok(value, base[key]):
            raise UsageError(
                f"{key} must be of type {type(base[key]).__name__} (got {value!r}, "
                f"{type(value).__name__})"
            )
        domain = DOMAINS[key]
        if not domain.contains(value):
            raise UsageError(f"{key} must be {domain.describe()} (got {value!r})")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def has_exit_gate(cfg: ml_collections.ConfigDict, model_config=None) -> bool | None:
    """Whether the model has Ouro's exit gate: from `model_config` once known, from the family of
    the built-in model before; None while an HF / checkpoint / preset model is not read yet."""
    if model_config is not None:
        return model_config.early_exit_gate
    if cfg.model.hf_dir or cfg.model.init_checkpoint or cfg.model.preset:
        return None
    return cfg.model.family == "ouro"


def check_early_exit(cfg: ml_collections.ConfigDict, model_config=None) -> None:
    """rollout.early_exit, rollout.exit_threshold and algo.depth_as_action. The exit gate is
    checked on the built-in family here and on `model_config` (an HF / preset model) once known."""
    mode, threshold = cfg.rollout.early_exit, cfg.rollout.exit_threshold
    if mode not in EARLY_EXIT_MODES:
        raise UsageError(
            f"rollout.early_exit={mode!r}; expected one of {'/'.join(EARLY_EXIT_MODES)}"
        )
    if not 0 < threshold <= 1:
        raise UsageError(f"rollout.exit_threshold={threshold:g} must be in (0, 1]")
    if cfg.algo.depth_as_action and mode != "sample":
        raise UsageError(
            f"algo.depth_as_action needs rollout.early_exit=sample (got {mode!r}): only a sampled "
            "exit is an action with a probability"
        )
    if mode == "none":
        return
    if cfg.learner.pack_tokens > 0:
        raise UsageError(
            f"rollout.early_exit={mode} with learner.pack_tokens > 0 is not supported: the packed "
            "rows carry no per-token depths"
        )
    if has_exit_gate(cfg, model_config) is False:
        raise UsageError(
            f"rollout.early_exit={mode} needs a model with an exit gate (Ouro); this model has none"
        )


def parse_loop_budget(spec: str) -> tuple[tuple[int, int], ...]:
    """model.loop_budget "K@N,..." -> ((N, K), ...) in update order; "" -> () (full depth).
    Each K >= 1, the first N is 0 and the N increase (UsageError otherwise)."""
    spec = spec.strip()
    if not spec:
        return ()
    schedule = []
    for part in spec.split(","):
        loops, at, start = part.strip().partition("@")
        try:
            item = (int(start), int(loops))
        except ValueError:
            item = None
        if not at or item is None:
            raise UsageError(f"model.loop_budget={spec!r}: {part.strip()!r} is not K@N (ints)")
        schedule.append(item)
    starts = [n for n, _ in schedule]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        raise UsageError(f"model.loop_budget={spec!r}: the updates N must start at 0 and increase")
    if any(k < 1 for _, k in schedule):
        raise UsageError(f"model.loop_budget={spec!r}: every K must be >= 1")
    return tuple(schedule)


def check_loop_budget(schedule: tuple[tuple[int, int], ...], num_loops: int) -> None:
    """Every K of the schedule within the model's 1..num_loops."""
    for _, loops in schedule:
        if loops > num_loops:
            raise UsageError(
                f"model.loop_budget: K={loops} exceeds the model's num_loops={num_loops}"
            )


def loop_budget_at(schedule: tuple[tuple[int, int], ...], update: int) -> int | None:
    """The loops of `update` under the schedule (None: no schedule, full depth). A function of
    the update number alone, so a resumed run continues the schedule where it stopped."""
    loops = None
    for start, k in schedule:
        if update >= start:
            loops = k
    return loops


def check_loop_credit(cfg: ml_collections.ConfigDict, model_config=None) -> None:
    """algo.loop_credit. exit_pdf needs the Ouro exit gate: checked on the built-in family here
    and on `model_config` (an HF / preset model) once known."""
    credit = cfg.algo.loop_credit
    if credit not in LOOP_CREDITS:
        raise UsageError(f"algo.loop_credit={credit!r}; expected one of {'/'.join(LOOP_CREDITS)}")
    if credit == "last":
        return
    if cfg.algo.depth_as_action:
        raise UsageError(
            f"algo.loop_credit={credit} with algo.depth_as_action is not supported: the exit "
            "choice's log-probability belongs to no single loop"
        )
    if credit != "exit_pdf":
        return
    if has_exit_gate(cfg, model_config) is False:
        raise UsageError(
            "algo.loop_credit=exit_pdf needs a model with an exit gate (Ouro); this model has none"
        )


def engine_log_level(cfg) -> str:
    """The engine actors' log level: rollout.engine_log_level, or INFO with verbose=True."""
    level = cfg.rollout.engine_log_level.upper()
    return "INFO" if cfg.verbose and level != "DEBUG" else level


def mesh_axis_sizes(cfg: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """The mesh section resolved against the device count (-1 takes the remaining devices)."""
    sizes = {axis: int(cfg.mesh[axis]) for axis in ("data", "fsdp", "tensor")}
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1 or any(size == 0 or size < -1 for size in sizes.values()):
        raise UsageError(f"mesh {sizes}: each axis is >= 1, and at most one may be -1")
    known = 1
    for size in sizes.values():
        known *= size if size != -1 else 1
    if free:
        if num_devices % known:
            raise UsageError(f"mesh {sizes} does not divide {num_devices} devices")
        sizes[free[0]] = num_devices // known
    total = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
    if total != num_devices:
        raise UsageError(
            f"mesh data={sizes['data']} x fsdp={sizes['fsdp']} x tensor={sizes['tensor']} = "
            f"{total} devices, but {num_devices} are available"
        )
    return sizes


def validate_mesh(cfg: ml_collections.ConfigDict, num_devices: int, model_config) -> dict:
    """Mesh checks that need the device count and the model's shape (so they run once both are
    known, before anything is built or written). Returns the resolved axis sizes."""
    sizes = mesh_axis_sizes(cfg, num_devices)
    tensor, data_parallel = sizes["tensor"], sizes["data"] * sizes["fsdp"]
    for name, value in (
        ("query heads", model_config.num_heads),
        ("MLP width (intermediate_size)", model_config.intermediate_size),
    ):
        if value % tensor:
            raise UsageError(f"mesh.tensor={tensor} does not divide the model's {name} ({value})")
    samples = cfg.prompts_per_update * cfg.n_samples_per_prompt
    for name, value in (
        ("micro_batch_size", cfg.micro_batch_size),
        ("samples per update", samples),
    ):
        if value % data_parallel:
            raise UsageError(
                f"{name}={value} is not divisible by mesh data x fsdp = {data_parallel}"
            )
    check_loop_credit(cfg, model_config)
    check_loop_budget(parse_loop_budget(cfg.model.loop_budget), model_config.num_loops)
    check_early_exit(cfg, model_config)
    if cfg.rollout.engine != "jax" and cfg.dist.num_processes > 1:
        raise UsageError(
            "rollout.engine=vllm with dist.num_processes > 1 is not supported: remote engines "
            "are fed by a single trainer process"
        )
    return sizes
