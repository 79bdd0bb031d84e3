"""The schema: every config key, declared once, with its default, its `--help` line, the values it
may take and whether a resume may change it.

Each section is a frozen dataclass whose fields are `knob(...)`s; `RunConfig` composes them.
`base_config()` is the ml_collections tree `configs/*.py` start from (the user's surface), and the
side tables the rest of the package reads (`DESCRIPTIONS`, `DOMAINS`, `RESUME_FREE_KEYS`,
`SECTIONS`) are derived from the fields, so a key cannot have a default without a description
or a domain. `run_config(cfg)` turns a loaded tree into a frozen, typed `RunConfig`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Literal

import ml_collections

from jaxloop.data.settings import DataSection
from jaxloop.models.settings import ModelSection
from jaxloop.parallel.settings import DistSection, MeshSection
from jaxloop.rl.settings import (
    AlgoSection,
    CriticSection,
    LearnerSection,
    OffloadSection,
    OptimSection,
)
from jaxloop.rollout.settings import RolloutSection
from jaxloop.settings import (
    FREE,
    Domain,
    KeyType,
    count,
    field_types,
    key_type,
    knob,
    positive,
    section,
)


def _zero(value) -> bool:  # an older jaxloop's "off" (legacy_none)
    return value == 0


# Engine vs trainer selected log-prob bound when rollout.max_logprob_diff is None. The embedded
# sampler in fp32 (in the trainer or in Ray engine actors) runs the trainer's own model (measured
# ~5e-7); bf16 compute (measured ~2.4e-3
# on the tiny model) and vLLM (other kernels) get the bound of the reference PyTorch stack.
def default_logprob_diff(engine: str, compute_dtype: str) -> float:
    return 1e-3 if engine in ("jax", "ray_jax") and compute_dtype == "float32" else 0.03


@dataclasses.dataclass(frozen=True)
class SftSection:
    """supervised fine-tuning (python -m jaxloop.sft, and warm_start)"""

    steps: int = knob(
        300,
        (
            "jaxloop.sft: optimizer steps of the run (eval_every / checkpoint_every count "
            "these steps)"
        ),
        count(1),
    )
    source: str = knob(
        "",
        (
            "a JSONL / Parquet file of SFT rows: {prompt, response} (the prompt a string or chat "
            "messages, at data.prompt_key) or {messages} (the last, an assistant message, is the "
            "target); empty: data.source's {prompt, label} rows"
        ),
    )
    batch_size: int = knob(
        64, "rows per SFT step (loss on the response / label tokens and EOS)", count(1)
    )
    lr: float = knob(
        0.003,
        (
            "SFT learning rate (constant; optim.name / b1 / b2 / grad_clip / weight_decay "
            "shared with the actor's optimizer)"
        ),
        positive(),
    )


@dataclasses.dataclass(frozen=True)
class WarmStartSection:
    """supervised steps before the first RL update of a fresh run"""

    sft_steps: int = knob(
        0,
        (
            ">0: this many SFT steps (sft.batch_size, sft.lr) on sft.source (else data.source) "
            "before update 0 of a fresh run (recorded in the checkpoint: a resume never "
            "repeats it); the critic and reference copy the warm-started actor"
        ),
        count(0),
    )
    stop_at_reward: float | None = knob(
        None,
        (
            "end the warm start after the first step whose mean reward on "
            "warm_start.probe_prompts validation prompts (answered as warm_start.probe_sampling "
            "says) reaches this (sft_steps is then the "
            "most it runs): RL starts from a partly right model whatever the seed; None: all "
            "sft_steps"
        ),
        positive(),
        legacy_none=_zero,
    )
    probe_sampling: Literal["greedy", "rollout"] = knob(
        "greedy",
        (
            "how the probe behind stop_at_reward answers: greedy (as evaluations do) | rollout "
            "(one sample per prompt at rollout.temperature / top_p / top_k, seeded per prompt: "
            "the reward RL's first groups see; a warm start whose greedy answer is right before "
            "its samples are stops later)"
        ),
    )
    probe_prompts: int = knob(
        64,
        (
            "validation prompts the warm start's stop_at_reward is measured on after every "
            "step: held-out prompts past the eval_prompts that evaluations report (where none "
            "are left: a fixed draw of train prompts)"
        ),
        count(1),
    )


@dataclasses.dataclass(frozen=True)
class DraftFeaturesSection:
    """saving LM-head input hidden states for draft-model training"""

    enabled: bool = knob(
        False, "save features to <run_dir>/draft_features/ every update", resume=FREE
    )
    max_tokens_per_update: int = knob(
        4096, "feature rows per update at most", count(1), resume=FREE
    )
    max_bytes: int = knob(
        256 * 2**20, "feature bytes of the whole run at most", count(1, 2**62), resume=FREE
    )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every key jaxloop reads, with defaults: a tiny looped Nanbeige-family model from random
    init, the built-in task and the embedded sampler on CPU. the run: the top-level keys."""

    # "" would train in (and overwrite) the current directory
    run_dir: str = knob(
        "runs/default",
        (
            "run directory (checkpoints, metrics.jsonl, tb/, curves.png); one with a "
            "checkpoint resumes"
        ),
        Domain(nonempty=True),
        resume=FREE,
    )
    # numpy SeedSequence and jax.random.key take non-negative seeds
    seed: int = knob(
        0,
        (
            "seed of the model init, the data order and the per-sample sampling seeds (0 .. "
            "2^31 - 1)"
        ),
        count(0),
    )
    algorithm: Literal["ppo", "grpo", "dppo", "flow_dppo"] = knob(
        "flow_dppo", "ppo | grpo | dppo | flow_dppo"
    )
    total_updates: int = knob(
        100, "updates of the whole run (raise it to continue a finished run)", count(1)
    )
    stop_after: int | None = knob(
        None,
        "stop after this many updates of this process (rerun to resume); None: off",
        count(1),
        resume=FREE,
        legacy_none=_zero,
    )
    prompts_per_update: int = knob(32, "prompts per rollout batch", count(1))
    n_samples_per_prompt: int = knob(8, "samples per prompt (one group; grpo needs >= 2)", count(1))
    micro_batch_size: int = knob(
        64, "samples per forward/backward pass (gradients are accumulated)", count(1), resume=FREE
    )
    updates_per_rollout: int | None = knob(
        None,
        (
            "optimizer steps per rollout batch (its mini-batches); None: the algorithm's "
            "default (flow_dppo 2, else 1)"
        ),
        count(1),
        legacy_none=_zero,
    )
    checkpoint_every: int | None = knob(
        10,
        (
            "checkpoint every N updates (and after this process's last update); None: only "
            "after the last"
        ),
        count(1),
        resume=FREE,
        legacy_none=_zero,
    )
    # 0 would keep none: a resume would delete every checkpoint
    keep_checkpoints: int = knob(
        2, "checkpoints kept (>= 1; older ones are deleted)", count(1), resume=FREE
    )
    keep_best_checkpoint: bool = knob(
        False,
        (
            "also keep the checkpoint of the best greedy eval_reward so far (saved when an "
            "evaluation beats it, never deleted by keep_checkpoints), recorded in "
            "<run_dir>/best_checkpoint.json; `jaxloop.evaluate --step best` reads it"
        ),
        resume=FREE,
    )
    # a step, never 0: a trainer's first checkpoint is after update 1
    resume_step: int | None = knob(
        None,
        (
            "resume from checkpoint N (verified first) instead of the newest: the newer steps "
            "are moved into <run_dir>/checkpoints.discarded/ (never deleted), so drop the key "
            "for later restarts; None: the newest checkpoint"
        ),
        count(1),
        resume=FREE,
    )
    eval_every: int | None = knob(
        10,
        (
            "greedy evaluation on held-out prompts every N updates (and after the last); "
            "None: only after the last"
        ),
        count(1),
        resume=FREE,
        legacy_none=_zero,
    )
    eval_prompts: int = knob(64, "held-out prompts per evaluation", count(1), resume=FREE)
    progress: bool = knob(
        True, "progress bar on a terminal (not a terminal: one line at the end)", resume=FREE
    )
    curves: bool = knob(
        True,
        "write <run_dir>/curves.png when the run ends (matplotlib: about 2 s of CPU)",
        resume=FREE,
    )
    verbose: bool = knob(
        False,
        "show every engine, Ray and vLLM log line (overrides rollout.engine_log_level)",
        resume=FREE,
    )

    model: ModelSection = section(ModelSection)
    data: DataSection = section(DataSection)
    rollout: RolloutSection = section(RolloutSection)
    optim: OptimSection = section(OptimSection)
    offload: OffloadSection = section(OffloadSection)
    learner: LearnerSection = section(LearnerSection)
    critic: CriticSection = section(CriticSection)
    algo: AlgoSection = section(AlgoSection)
    # Device mesh for training and the embedded sampler: ('data', 'fsdp', 'tensor'); -1 takes the
    # remaining devices (at most one axis). Default: every device on fsdp.
    mesh: MeshSection = section(MeshSection)
    # Many hosts: jax.distributed.initialize. An empty coordinator = one process (or whatever
    # the cluster environment JAX detects says).
    dist: DistSection = section(DistSection)
    # supervised fine-tuning: `python -m jaxloop.sft` and the warm start of a training run
    sft: SftSection = section(SftSection)
    warm_start: WarmStartSection = section(WarmStartSection)
    draft_features: DraftFeaturesSection = section(DraftFeaturesSection)


def _is_section(field: dataclasses.Field) -> bool:
    factory = field.default_factory
    return factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory)


@dataclasses.dataclass(frozen=True)
class Key:
    """One key as the schema declares it: the field (default, help, resume policy) and its
    type, with the domain completed by the type (a Literal's choices, None when optional)."""

    field: dataclasses.Field
    type: KeyType

    @property
    def domain(self) -> Domain:
        domain = self.field.metadata["domain"]
        if self.type.choices:
            domain = dataclasses.replace(domain, choices=self.type.choices)
        return dataclasses.replace(domain, optional=self.type.optional)


def schema_keys(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every key, in declaration order (the top level first)."""
    out = []
    for field in dataclasses.fields(cls):
        if _is_section(field):
            out.extend(schema_keys(field.default_factory, f"{prefix}{field.name}."))
        else:
            out.append((f"{prefix}{field.name}", field))
    return out


def _keys(cls: type = RunConfig, prefix: str = "") -> dict[str, Key]:
    hints, out = field_types(cls), {}
    for field in dataclasses.fields(cls):
        if _is_section(field):
            out.update(_keys(field.default_factory, f"{prefix}{field.name}."))
        else:
            out[f"{prefix}{field.name}"] = Key(field, key_type(hints[field.name]))
    return out


def _heading(cls: type) -> str:
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split())


KEYS: dict[str, Key] = _keys()
SECTIONS = {"": "the run"} | {
    f.name: _heading(f.default_factory) for f in dataclasses.fields(RunConfig) if _is_section(f)
}
DESCRIPTIONS = {key: k.field.metadata["help"] for key, k in KEYS.items()}
DOMAINS: dict[str, Domain] = {key: k.domain for key, k in KEYS.items()}
TYPES: dict[str, KeyType] = {key: k.type for key, k in KEYS.items()}
RESUME_FREE_KEYS = frozenset(key for key, k in KEYS.items() if k.field.metadata["resume"] == FREE)


def upgrade_stored(flat: dict[str, Any]) -> dict[str, Any]:
    """A run dir's stored config (flattened config.json) in today's spelling: a value an older
    jaxloop wrote for "off" / "detected" / "the default" (-1, 0: the knob's `legacy_none`) is
    None, as this version writes it."""
    out = dict(flat)
    for key, value in flat.items():
        legacy = KEYS[key].field.metadata["legacy_none"] if key in KEYS else None
        if legacy is not None and isinstance(value, int | float) and legacy(value):
            out[key] = None
    return out


def _tree(obj: Any) -> ml_collections.ConfigDict:
    tree = ml_collections.ConfigDict()
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        tree[field.name] = _tree(value) if dataclasses.is_dataclass(value) else value
    return tree


def base_config() -> ml_collections.ConfigDict:
    """Every key jaxloop reads, with defaults (RunConfig's): a tiny looped Nanbeige-family model
    from random init, the built-in task and the embedded sampler on CPU."""
    return _tree(RunConfig())


def run_config(cfg: ml_collections.ConfigDict, cls: type = RunConfig) -> Any:
    """A loaded (validated) tree as a frozen, typed RunConfig."""
    kwargs = {}
    for field in dataclasses.fields(cls):
        value = cfg[field.name]
        kwargs[field.name] = (
            run_config(value, field.default_factory) if _is_section(field) else value
        )
    return cls(**kwargs)


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
