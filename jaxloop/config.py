"""The one config tree (ml_collections), loading from `configs/*.py`, overrides and validation.

`python -m jaxloop.train --config flow_dppo.py --config.optim.lr=3e-3`: a bare name resolves in
the repository's `configs/`, a path works too. Unknown keys and values of the wrong type are
errors (UsageError: one line, exit code 2).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import ml_collections

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


class UsageError(ValueError):
    """Bad command line or config: reported as one line on stderr with exit code 2."""


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

    c.model = ml_collections.ConfigDict()
    c.model.hf_dir = ""  # empty: the built-in tiny model from random init; else load_hf(hf_dir)
    c.model.init_checkpoint = ""  # a run dir written by `conversion.from_hf`
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

    c.data = ml_collections.ConfigDict()
    c.data.source = "builtin"  # or a JSONL / Parquet file of {prompt, label}
    c.data.task = "copy_first"
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
    # engine vs trainer selected log-prob bound; 0 = the default (default_logprob_diff)
    c.rollout.max_logprob_diff = 0.0
    c.rollout.num_engines = 1
    c.rollout.ray_address = ""
    c.rollout.publish_bucket_mb = 64
    c.rollout.transport = "object_store"  # or 'disk'
    # Ray engines: seconds an engine may take to answer its part of a generate call; one that does
    # not is killed, restarted with the committed policy and its part regenerated (health checks:
    # min(120, this))
    c.rollout.engine_timeout_s = 600.0

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"  # 'adamw' or 'sgd' (no momentum)
    c.optim.lr = 1e-3
    c.optim.schedule = "constant"  # 'constant', 'cosine', 'linear'
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.99
    c.optim.grad_clip = 1.0

    c.critic = ml_collections.ConfigDict()
    c.critic.lr = 1e-3
    c.critic.steps_per_rollout = 1

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
    c.algo.lam = 0.95
    c.algo.whiten_advantages = True
    c.algo.grpo_use_std = True
    c.algo.reduction = "seq_mean_token_mean"

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

    c.draft_features = ml_collections.ConfigDict()
    c.draft_features.enabled = False
    c.draft_features.max_tokens_per_update = 4096
    c.draft_features.max_bytes = 256 * 2**20
    return c


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
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise UsageError(f"{path} has no get_config()")
    cfg = module.get_config()
    cfg.lock()
    return cfg


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


def parse_args(argv: list[str]) -> ml_collections.ConfigDict:
    """`--config NAME` then any number of `--config.key=value` / `--config.key value`."""
    config_name = None
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            raise UsageError(
                "usage: python -m jaxloop.train --config NAME_OR_PATH [--config.key=value ...]"
            )
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
    if cfg.rollout.engine not in ("jax", "vllm"):
        raise UsageError(f"rollout.engine={cfg.rollout.engine!r}; expected 'jax' or 'vllm'")
    if cfg.model.hf_dir and not Path(cfg.model.hf_dir).is_dir():
        raise UsageError(f"model.hf_dir={cfg.model.hf_dir!r} is not a directory")
    if cfg.model.init_checkpoint and not Path(cfg.model.init_checkpoint).is_dir():
        raise UsageError(f"model.init_checkpoint={cfg.model.init_checkpoint!r} does not exist")
    for key in ("total_updates", "prompts_per_update", "micro_batch_size", "n_samples_per_prompt"):
        if cfg[key] < 1:
            raise UsageError(f"{key} must be >= 1 (got {cfg[key]})")
    if cfg.rollout.temperature <= 0:
        raise UsageError("rollout.temperature must be > 0")
    if cfg.rollout.transport not in ("object_store", "disk"):
        raise UsageError(
            f"rollout.transport={cfg.rollout.transport!r}; expected 'object_store' or 'disk'"
        )
    for key in ("num_engines", "publish_bucket_mb"):
        if cfg.rollout[key] < 1:
            raise UsageError(f"rollout.{key} must be >= 1 (got {cfg.rollout[key]})")
    if not cfg.rollout.engine_timeout_s > 0:
        raise UsageError(
            f"rollout.engine_timeout_s must be > 0 (got {cfg.rollout.engine_timeout_s})"
        )
    if cfg.optim.schedule not in ("constant", "cosine", "linear"):
        raise UsageError(f"optim.schedule={cfg.optim.schedule!r}; expected constant/cosine/linear")
    if cfg.optim.name not in ("adamw", "sgd"):
        raise UsageError(f"optim.name={cfg.optim.name!r}; expected 'adamw' or 'sgd'")
    if cfg.algo.reduction not in ("seq_mean_token_mean", "token_mean"):
        raise UsageError(f"algo.reduction={cfg.algo.reduction!r}")
