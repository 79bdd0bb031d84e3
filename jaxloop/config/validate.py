"""Validation of a loaded tree: every key against its domain, then the rules that span keys
(grpo needs groups, the mesh's one -1, ...); those that need the model or the device count in
validate_mesh()."""

from __future__ import annotations

import math
from pathlib import Path

import ml_collections

from jaxloop.config.schema import DOMAINS, base_config, flat_items
from jaxloop.errors import UsageError
from jaxloop.models.loop_budget import check_loop_budget, parse_loop_budget
from jaxloop.parallel.distributed import parse_resources
from jaxloop.parallel.mesh import resolve_axis_sizes
from jaxloop.rl.loop_credit import LOOP_CREDITS
from jaxloop.rollout.settings import ENGINES, RAY_ENGINES
from jaxloop.rollout.types import EARLY_EXIT_MODES


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Every rule of a loaded tree, in this order: the run's keys, the rollout's, the learner's
    and the data's, then every key against its domain and the mesh's one -1."""
    _check_run(cfg)
    _check_rollout(cfg)
    _check_learner_and_data(cfg)
    check_domains(cfg)
    if [cfg.mesh[axis] for axis in ("data", "fsdp", "tensor")].count(-1) > 1:
        raise UsageError(f"mesh {cfg.mesh.to_dict()}: at most one axis may be -1")


def _check_run(cfg: ml_collections.ConfigDict) -> None:
    """The algorithm, model source, batch sizes and cadences, SFT / warm start, critic steps."""
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
    if cfg.rollout.engine not in ENGINES:
        raise UsageError(f"rollout.engine={cfg.rollout.engine!r}; expected one of {ENGINES}")
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


def _check_rollout(cfg: ml_collections.ConfigDict) -> None:
    """Sampling (the full distribution), eval source, publication, engines and timeouts."""
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
            f"rollout.publish={cfg.rollout.publish} needs remote engines "
            "(rollout.engine=vllm or ray_jax): "
            "the embedded sampler takes the trainer's arrays without a copy, nothing is sent"
        )
    for key in ("num_engines", "publish_bucket_mb"):
        if cfg.rollout[key] < 1:
            raise UsageError(f"rollout.{key} must be >= 1 (got {cfg.rollout[key]})")
    for key in ("engine_timeout_s", "publish_timeout_s"):
        if not cfg.rollout[key] > 0:
            raise UsageError(f"rollout.{key} must be > 0 (got {cfg.rollout[key]})")
    try:
        engine_resources = parse_resources(cfg.rollout.engine_resources)
    except ValueError as e:
        raise UsageError(
            f"rollout.engine_resources={cfg.rollout.engine_resources!r}: {e}"
        ) from None
    if engine_resources and cfg.rollout.engine in RAY_ENGINES and not cfg.rollout.ray_address:
        raise UsageError(
            "rollout.engine_resources needs rollout.ray_address: the Ray cluster a run starts "
            "for itself has no custom resources"
        )


def _check_learner_and_data(cfg: ml_collections.ConfigDict) -> None:
    """Optimizer, loss, loop credit, packing, loop budget, early exit, log level, task."""
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


def mesh_axis_sizes(cfg: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """The mesh section resolved against the device count (-1 takes the remaining devices)."""
    try:
        return resolve_axis_sizes(cfg.mesh, num_devices)
    except ValueError as err:
        raise UsageError(str(err)) from None


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
    return sizes
