"""Validation of a loaded tree: every key against its domain, then the rules that span keys
(grpo needs groups, the mesh's one -1, ...); those that need the model or the device count in
validate_mesh()."""

from __future__ import annotations

from pathlib import Path

import ml_collections

from jaxloop.config.schema import DOMAINS, TYPES, base_config, flat_items
from jaxloop.errors import UsageError
from jaxloop.models.loop_budget import check_loop_budget, parse_loop_budget
from jaxloop.parallel.distributed import parse_resources
from jaxloop.parallel.mesh import resolve_axis_sizes
from jaxloop.rl.loop_credit import LOOP_CREDITS
from jaxloop.rollout.settings import LOG_LEVELS, RAY_ENGINES

__all__ = [
    "LOG_LEVELS",
    "LOOP_CREDITS",
    "check_domains",
    "check_early_exit",
    "check_loop_credit",
    "has_exit_gate",
    "mesh_axis_sizes",
    "validate",
    "validate_mesh",
]


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Every rule of a loaded tree: each key against its type and domain (the schema's: one
    place per key), then the rules that span keys, in this order: the run's, the rollout's, the
    learner's and the data's, and the mesh's one -1."""
    check_domains(cfg)
    _check_run(cfg)
    _check_rollout(cfg)
    _check_learner_and_data(cfg)
    if [cfg.mesh[axis] for axis in ("data", "fsdp", "tensor")].count(-1) > 1:
        raise UsageError(f"mesh {cfg.mesh.to_dict()}: at most one axis may be -1")


def _check_run(cfg: ml_collections.ConfigDict) -> None:
    """The algorithm against the batch and the critic, the model source, the warm start."""
    from jaxloop.rl.algorithms import ALGORITHMS

    algorithm = ALGORITHMS[cfg.algorithm]
    if algorithm.requires_groups and cfg.n_samples_per_prompt < 2:
        raise UsageError(
            f"{cfg.algorithm} needs n_samples_per_prompt >= 2 (got {cfg.n_samples_per_prompt}): "
            "group-normalised advantages are undefined for one sample"
        )
    if cfg.critic.warmup_updates > 0 and not algorithm.uses_critic:
        raise UsageError(
            f"critic.warmup_updates={cfg.critic.warmup_updates} with {cfg.algorithm}: it has no "
            "critic to warm up"
        )
    if cfg.model.hf_dir and not Path(cfg.model.hf_dir).is_dir():
        raise UsageError(f"model.hf_dir={cfg.model.hf_dir!r} is not a directory")
    if cfg.model.init_checkpoint and not Path(cfg.model.init_checkpoint).is_dir():
        raise UsageError(f"model.init_checkpoint={cfg.model.init_checkpoint!r} does not exist")


def _check_rollout(cfg: ml_collections.ConfigDict) -> None:
    """Sampling (the full distribution), eval source, publication, engine placement."""
    if cfg.rollout.top_p < 1 or cfg.rollout.top_k is not None:
        raise UsageError(
            f"rollout.top_p={cfg.rollout.top_p:g} / rollout.top_k={cfg.rollout.top_k}: training "
            "rollouts must sample the full distribution (the log-probs are of the unfiltered one, "
            "so every ratio would be biased); use top_p=1 and top_k=None"
        )
    if cfg.data.eval_source and not Path(cfg.data.eval_source).is_file():
        raise UsageError(f"data.eval_source={cfg.data.eval_source!r} is not a file")
    if cfg.rollout.publish != "full" and cfg.rollout.engine == "jax":
        raise UsageError(
            f"rollout.publish={cfg.rollout.publish} needs remote engines "
            "(rollout.engine=vllm or ray_jax): "
            "the embedded sampler takes the trainer's arrays without a copy, nothing is sent"
        )
    if cfg.rollout.dynamic_sampling_rounds and cfg.n_samples_per_prompt < 2:
        raise UsageError(
            f"rollout.dynamic_sampling_rounds={cfg.rollout.dynamic_sampling_rounds} needs "
            f"n_samples_per_prompt >= 2 (got {cfg.n_samples_per_prompt}): one sample is no "
            "group whose rewards could differ"
        )
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
    """Loop credit, packing, loop budget, early exit."""
    check_loop_credit(cfg)
    pack, longest = cfg.learner.pack_tokens, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if pack is not None and pack < longest:
        raise UsageError(
            f"learner.pack_tokens={pack}: None (off) or >= the longest sample, "
            f"data.max_prompt_tokens + rollout.max_new_tokens = {longest}"
        )
    schedule = parse_loop_budget(cfg.model.loop_budget)
    if schedule and not (cfg.model.hf_dir or cfg.model.init_checkpoint or cfg.model.preset):
        check_loop_budget(schedule, cfg.model.num_loops)
    check_early_exit(cfg)


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


def check_domains(cfg: ml_collections.ConfigDict) -> None:
    """Every key's value against its declared type and domain (TYPES, DOMAINS: UsageError naming
    the first that is not)."""
    missing = _missing_keys(cfg)
    if missing:
        raise UsageError(
            f"the config lacks key(s) {', '.join(missing[:5])} (a config file starts from "
            "jaxloop.config.base_config())"
        )
    for key, value in flat_items(cfg):
        if key not in TYPES:
            raise UsageError(f"unknown config key {key!r}")
        if not TYPES[key].accepts(value):
            raise UsageError(
                f"{key} must be of type {TYPES[key].name} (got {value!r}, {type(value).__name__})"
            )
        domain = DOMAINS[key]
        if not domain.contains(value):
            raise UsageError(f"{key} must be {domain.describe()} (got {value!r})")


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
    mode = cfg.rollout.early_exit
    if cfg.algo.depth_as_action and mode != "sample":
        raise UsageError(
            f"algo.depth_as_action needs rollout.early_exit=sample (got {mode!r}): only a sampled "
            "exit is an action with a probability"
        )
    if mode == "none":
        return
    if cfg.learner.pack_tokens is not None:
        raise UsageError(
            f"rollout.early_exit={mode} with learner.pack_tokens is not supported: the packed "
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
