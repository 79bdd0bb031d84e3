"""Training checkpoints: the TrainState saved and restored via orbax, sharded, and the checks a
run dir passes before it is resumed or started afresh.

Layout of a run dir (io/run_dir.py owns it; shared with `conversion.from_hf` / `to_hf`):
  checkpoints/<step>/{actor_params, actor_opt, critic_params, critic_opt, ref_params, train_state}
  actor_config.json, critic_config.json, tokenizer/
<step> = number of finished updates. Orbax writes each step into a temporary directory and
renames it when complete, so a save killed half-way is never listed (and never resumed). Every
process writes the shards it owns; a restore reads onto the shardings of the current mesh, which
may differ from the one that saved (fsdp=8 -> data=2 x tensor=4, or one device).
`train_state` (JSON) holds the counters of the TrainState (update, policy_version, rng) and the
data cursor. After orbax commits a step, process 0 writes its per-item digests
(models/digests.py: `<step>/jaxloop_digests.json`, last, atomically); `restore` verifies them
first. Old steps are renamed into checkpoints/.deleted/ and removed there (never half-deleted in
place).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxloop.config import RESUME_FREE_KEYS, UsageError, upgrade_stored
from jaxloop.io import run_dir as layout
from jaxloop.io.orbax import (
    check_step,
    older_step_offer,
    read_config,
    write_config,
    write_text_atomic,
)
from jaxloop.io.run_dir import (
    ARRAY_ITEMS,
    CHECKPOINT_DIR,
    CONFIG_FILE,
    TRAIN_STATE,
    RunDirError,
    checkpoint_steps,
)
from jaxloop.metrics import METRICS_FILE, read_metrics
from jaxloop.models import digests
from jaxloop.parallel import mesh as shd
from jaxloop.rl.algorithms import get_algorithm
from jaxloop.rl.state import TrainState
from jaxloop.train.write_refusals import write_refusals_as_os_errors


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


BEST_FILE = "best_checkpoint.json"  # {"step", "eval_reward"}: keep_best_checkpoint's record


def best_checkpoint(run_dir: str | Path) -> dict | None:
    """The run's best-eval record (`keep_best_checkpoint`), or None when it has none."""
    path = Path(run_dir) / BEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_best_checkpoint(run_dir: str | Path, step: int, eval_reward: float) -> None:
    """Record `step` (a saved checkpoint) as the run's best by greedy eval reward."""
    record = {"step": int(step), "eval_reward": float(eval_reward)}
    write_text_atomic(Path(run_dir) / BEST_FILE, json.dumps(record) + "\n")


class _LatestAndBest:
    """Orbax preservation: the latest `keep` steps and the recorded best step (read at each
    deletion, so keep_checkpoints never deletes the best)."""

    def __init__(self, keep: int, run_dir: Path):
        self.latest, self.run_dir = ocp.checkpoint_managers.LatestN(n=keep), run_dir

    def should_preserve(self, checkpoints, *, context):
        keep = self.latest.should_preserve(checkpoints, context=context)
        best = (best_checkpoint(self.run_dir) or {}).get("step")
        return [k or c.step == best for k, c in zip(keep, checkpoints, strict=True)]


class TrainCheckpointer:
    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.run_dir = Path(run_dir).resolve()
        self.manager = ocp.CheckpointManager(
            self.run_dir / CHECKPOINT_DIR,
            options=ocp.CheckpointManagerOptions(
                preservation_policy=_LatestAndBest(keep, self.run_dir),
                create=True,
                enable_async_checkpointing=False,
                todelete_subdir=digests.TRASH_DIR,
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def write_configs(self, *models) -> None:
        for model in models:
            if model is not None:
                write_config(self.run_dir, model)

    @staticmethod
    def _arrays(state: TrainState) -> dict:
        return {
            item: getattr(state, field)
            for item, field in ARRAY_ITEMS.items()
            if getattr(state, field) is not None
        }

    def save(self, state: TrainState, extra: dict) -> None:
        """Save `state` at step = its update count; `extra` (JSON: data cursor, seed) is stored
        beside the counters."""
        args = {k: ocp.args.StandardSave(v) for k, v in self._arrays(state).items()}
        counters = {
            "update": state.update_count,
            "policy_version": state.version,
            "rng": shd.to_host(state.rng).tolist(),
            "consecutive_skips": int(state.consecutive_skips),
            "skipped_updates": int(state.skipped_updates),
        }
        args[TRAIN_STATE] = ocp.args.JsonSave({**counters, **extra})
        with write_refusals_as_os_errors(self.run_dir, state.update_count, self.latest_step()):
            self.manager.save(state.update_count, args=ocp.args.Composite(**args), force=True)
            self.manager.wait_until_finished()
        if jax.process_index() == 0:
            step_dir = self.run_dir / CHECKPOINT_DIR / str(state.update_count)
            self.digest_seconds = digests.write_digests(step_dir)
            digests.empty_trash(self.run_dir / CHECKPOINT_DIR)

    def restore(self, step: int, abstract: TrainState, shardings: TrainState, verify=True):
        """The TrainState of `step` placed on `shardings` (any mesh), and the JSON extras.
        `abstract` gives shapes and dtypes (e.g. `jax.eval_shape` of the state builder).
        verify: check the step's digests first (RunDirError when they differ; a warning when the
        step has none); False when the caller has just done so."""
        verified = check_step(self.run_dir, step, warn=False) if verify else True
        targets = {
            item: _abstract(tree, self._arrays(shardings)[item])
            for item, tree in self._arrays(abstract).items()
        }
        args = {k: ocp.args.StandardRestore(v) for k, v in targets.items()}
        args[TRAIN_STATE] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**args))
        extra = dict(restored[TRAIN_STATE])
        fields = {field: restored[item] for item, field in ARRAY_ITEMS.items() if item in targets}
        stored = {  # JSON name of `step` is "update"; skip counters are absent in older runs
            "step": np.int32(extra.pop("update")),
            "policy_version": np.int32(extra.pop("policy_version")),
            "rng": np.asarray(extra.pop("rng"), np.uint32),
            "consecutive_skips": np.int32(extra.pop("consecutive_skips", 0)),
            "skipped_updates": np.int32(extra.pop("skipped_updates", 0)),
        }
        counters = {k: shd.put_global(v, getattr(shardings, k)) for k, v in stored.items()}
        if not verified and jax.process_index() == 0:
            digests.warn_unverified(step, self.run_dir)
        return abstract.replace(**fields, **counters), extra

    def close(self) -> None:
        self.manager.close()
        if jax.process_index() == 0:  # what a kill left in checkpoints/.deleted/
            digests.empty_trash(self.run_dir / CHECKPOINT_DIR)


# ---- resuming a run dir ----
# Keys a resume may change: where and how the run executes, how often it evaluates, checkpoints
# and logs, when it stops. They leave what an update computes alone: micro_batch_size splits the
# same sums into other partial sums (equal up to float rounding; bitwise only when unchanged),
# remat / attention_impl / logits_chunk / scan_layers compute the same values, learner.seq_multiple
# only adds padding columns that every sum masks out, a mesh or an offload places
# them, model.hf_dir / model.init_checkpoint only gave the first weights (the architecture they
# give is compared through actor_config.json), rollout.engine samples the same policy. Every other
# key is the run's math (seed, algorithm, algo.*, optim.*, critic.* when the algorithm has a
# critic, model shape and dtypes, data.*, sampling, batch sizes, updates_per_rollout): a resume
# that changes one is refused. total_updates is free under optim.schedule=constant only (cosine
# and linear decay over it). Keys the run dir's config.json does not have (it predates them) are
# not compared.
# RESUME_FREE_KEYS: the keys whose knob says resume=FREE (jaxloop/*/settings.py, config/schema.py)
ARCHITECTURE_FIELDS = (
    "family",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_loops",
    "rope_theta",
    "rms_norm_eps",
    "sandwich_norm",
    "early_exit_gate",
    "norm_between_loops",
)


def flat_json(tree: dict, prefix: str = "") -> dict:
    """A JSON tree's leaves by their dotted keys (as config.flat_items names them)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_json(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_changes_math(cfg, key: str) -> bool:
    """Whether `key` may not change when a run dir resumes (see RESUME_FREE_KEYS)."""
    if key in RESUME_FREE_KEYS:
        return False
    if key == "total_updates":
        return cfg.optim.schedule != "constant"
    if key.startswith("critic."):
        return get_algorithm(cfg.algorithm).uses_critic
    return True


REFUSE = "(start a new run_dir to change it)"


def check_resume(cfg, run_dir: Path, setup) -> None:
    """Before a checkpoint is restored: refuse to resume `run_dir` with a config whose math
    differs from the one it was started with (its config.json), a model of another architecture
    (its actor_config.json; `setup`: the run's train.setup.TrainSetup), or a checkpoint that holds
    another algorithm's state, arrays of other shapes, or is incomplete. Reads only; without a
    checkpoint nothing is checked (the run starts afresh)."""
    step = resume_from(cfg, run_dir)
    if step is None:
        return
    check_resume_config(cfg, run_dir)
    _check_architecture(run_dir, setup.model_cfg)
    # the checkpoint itself: the items of this algorithm, the shapes of this model
    ckpt = layout.step_dir(run_dir, step)
    abstract = setup.abstract_state()
    want = {item for item, field in ARRAY_ITEMS.items() if getattr(abstract, field) is not None}
    fallback = "pass --config.resume_step={step} to resume from it"
    if cfg.resume_step is None:
        fallback = f"move {ckpt} out of checkpoints/ or {fallback}"
    delete = older_step_offer(
        run_dir, step, fallback=fallback
    )  # the newest older step that verifies
    _check_items(cfg, run_dir, step, want, delete)
    for item, field in ARRAY_ITEMS.items():
        if item in want and field.endswith("_params"):
            _check_stored_shapes(run_dir, step, item, getattr(abstract, field), delete)
    # the bytes: every item against the digests written at save (a same-size corruption too)
    verified = check_step(run_dir, step, fallback=fallback, warn=False)
    if (run_dir / METRICS_FILE).is_file():
        read_metrics(run_dir)  # MetricsFileError (one line) when it is damaged
    if not verified and jax.process_index() == 0:  # restored as before, with one warning
        digests.warn_unverified(step, run_dir)


def resume_from(cfg, run_dir: str | Path) -> int | None:
    """The step a run resumes from: `resume_step` (which must be one of the run dir's
    checkpoints: a UsageError otherwise), else the newest; None without a checkpoint (a fresh
    start). Reads only."""
    steps = checkpoint_steps(run_dir)
    if cfg.resume_step is None:
        return steps[-1] if steps else None
    if cfg.resume_step not in steps:
        have = ", ".join(map(str, steps)) or "none"
        raise UsageError(
            f"resume_step={cfg.resume_step}: run dir {run_dir} has no checkpoint "
            f"{cfg.resume_step} (its checkpoints: {have})"
        )
    return cfg.resume_step


def resumed_update(cfg) -> int | None:
    """Updates finished by the checkpoint the run resumes from (`resume_from`; its train
    state's "update", the step number when that cannot be read), None for a fresh start."""
    step = resume_from(cfg, cfg.run_dir)
    if step is None:
        return None
    try:
        return int(layout.read_train_state(cfg.run_dir, step)["update"])
    except (OSError, ValueError, KeyError, TypeError):
        return step


DISCARDED_DIR = "checkpoints.discarded"  # resume_step's newer steps, moved here, never deleted


def discard_newer_steps(cfg, run_dir: Path) -> list[str]:
    """`resume_step`, once check_resume has verified it: move the checkpoints newer than it (and
    best_checkpoint.json when it names one of them) into <run_dir>/checkpoints.discarded/, each
    under its own name or, when that is taken there, with a suffix (.1, .2, ...): nothing is
    deleted or overwritten. One line on stderr says what moved. Process 0 moves; the others
    wait for it. Returns the names given in checkpoints.discarded/."""
    if cfg.resume_step is None:
        return []
    newer = [s for s in checkpoint_steps(run_dir) if s > cfg.resume_step]
    moved: list[str] = []
    if newer and jax.process_index() == 0:
        dest = run_dir / DISCARDED_DIR
        dest.mkdir(exist_ok=True)
        sources = [layout.step_dir(run_dir, s) for s in newer]
        best = best_checkpoint(run_dir)
        if best is not None and best.get("step") in newer:
            sources.append(run_dir / BEST_FILE)  # it names a step that is no longer resumable
        for source in sources:
            name, n = source.name, 0
            while (dest / name).exists() or (dest / name).is_symlink():
                n += 1
                name = f"{source.name}.{n}"
            os.rename(source, dest / name)  # same file system: atomic, never a copy
            moved.append(name)
        renamed = [
            f"{s.name} as {m}" if s.name != m else m for s, m in zip(sources, moved, strict=True)
        ]
        print(
            f"resume_step={cfg.resume_step}: moved checkpoints newer than it aside into "
            f"{dest}/ ({', '.join(renamed)}; nothing deleted); resuming from checkpoint "
            f"{cfg.resume_step}",
            file=sys.stderr,
        )
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxloop resume_step")
    return moved


def _check_architecture(run_dir: Path, model_cfg) -> None:
    """The run dir's actor_config.json (when it has one) against this run's model."""
    if not (run_dir / layout.config_file("actor")).is_file():
        return
    before = read_config(run_dir, "actor")  # RunDirError when it is not a model config
    for name in ARCHITECTURE_FIELDS:
        old, new = getattr(before, name), getattr(model_cfg, name)
        if old != new:
            raise UsageError(
                f"run dir {run_dir} was started with a model of {name}={old!r}; this run's "
                f"model has {name}={new!r} {REFUSE}"
            )


def _check_items(cfg, run_dir: Path, step: int, want: set[str], delete) -> None:
    """The step holds exactly the array items `want` and a readable train state."""
    have = layout.step_items(run_dir, step)
    extra = sorted(have - want - {TRAIN_STATE})
    if extra:
        raise UsageError(
            f"run dir {run_dir}: checkpoint {step} holds {', '.join(extra)}, which a "
            f"{cfg.algorithm} run does not have (written by another algorithm or config) {REFUSE}"
        )
    lacking = sorted((want | {TRAIN_STATE}) - have)
    if lacking:
        raise RunDirError(
            f"run dir {run_dir}: checkpoint {step} is incomplete: it lacks "
            f"{', '.join(lacking)} ({delete})"
        )
    try:
        layout.read_train_state(run_dir, step)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RunDirError(
            f"run dir {run_dir}: checkpoint {step} is corrupt: its {TRAIN_STATE} is unreadable "
            f"({type(err).__name__}) ({delete})"
        ) from None


def _stored_config(run_dir: Path) -> dict | None:
    """The run dir's config.json flattened, in this version's spelling (`upgrade_stored`; None
    without one; RunDirError when unreadable)."""
    stored_path = run_dir / CONFIG_FILE
    if not stored_path.is_file():
        return None
    try:
        return upgrade_stored(flat_json(json.loads(stored_path.read_text())))
    except (ValueError, AttributeError, UnicodeDecodeError) as err:
        raise RunDirError(f"{stored_path} is unreadable ({type(err).__name__}: {err})") from None


def config_conflict(cfg, stored: dict, changes_math=None) -> tuple[str, object, object] | None:
    """The first key of the run's math (`changes_math(cfg, key)`, default resume_changes_math)
    whose value in `stored` (a flattened config.json) differs from cfg's: (key, stored, new)."""
    from jaxloop.config import flat_items

    changes_math = changes_math or resume_changes_math
    for key, value in flat_items(cfg):
        value = json.loads(json.dumps(value))
        if key in stored and stored[key] != value and changes_math(cfg, key):
            return key, stored[key], value
    return None


def check_resume_config(cfg, run_dir: Path) -> None:
    """A run dir with a checkpoint resumes only with the math it was started with (config.json),
    and from a `resume_step` it holds; reads only, needs no model (a dry run makes it too)."""
    if resume_from(cfg, run_dir) is None:
        return
    stored = _stored_config(run_dir)
    conflict = None if stored is None else config_conflict(cfg, stored)
    if conflict:
        key, old, new = conflict
        raise UsageError(
            f"run dir {run_dir} was started with {key}={old!r}; this run has {key}={new!r} "
            "(start a new run_dir to change it)"
        )


# What a run writes at the top of its run dir besides checkpoints/: a fresh start (no checkpoint
# to resume) over them would replace another run's files.
RUN_FILES = (
    CONFIG_FILE,
    layout.config_file("actor"),
    layout.config_file("critic"),
    "metrics.jsonl",
    "curves.png",
    "tb",
    "samples",
    "draft_features",
)


def check_fresh_start(cfg, run_dir: Path, changes_math=None) -> None:
    """A run dir without a checkpoint starts afresh, writing RUN_FILES. Refuse (naming the file)
    when it already holds one of them and they are not this run's: its config.json is missing,
    not a jaxloop config, or differs in a key of the run's math (the same run restarted before its
    first checkpoint may start again). Reads only."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or checkpoint_steps(run_dir):
        return
    present = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not present:
        return
    why = "no config.json"
    try:
        stored = _stored_config(run_dir)
    except RunDirError:
        stored, why = None, "an unreadable config.json"
    if stored is not None:
        conflict = None
        if not {"algorithm", "seed", "run_dir"} <= set(stored):
            why = "a config.json that is not a jaxloop run's"
        elif conflict := config_conflict(cfg, stored, changes_math):
            key, old, new = conflict
            why = f"config.json with {key}={old!r} (this run has {new!r})"
        else:
            return  # this run's own files: it was started before and stopped before a checkpoint
    raise UsageError(
        f"run dir {run_dir} holds {present[0]} of another run ({why}) and no checkpoint to "
        "resume: starting here would overwrite it; move it away or choose another run_dir"
    )


class FreshStartCleanup:
    """What a fresh start creates (the run dir and its parents, or new entries in an existing run
    dir), removed again when the start fails with a user error before its first checkpoint: a
    refused run leaves no skeleton behind (run dir, checkpoints/, config.json, metrics.jsonl)."""

    def __init__(self, run_dir):
        self.run_dir = Path(run_dir).resolve()
        self.active = not checkpoint_steps(self.run_dir)
        self.top, parent = None, self.run_dir
        while not parent.exists():
            self.top, parent = parent, parent.parent
        self.parent, self.times = parent, parent.stat()
        self.before = set(os.listdir(self.run_dir)) if self.top is None else set()

    def undo(self, err=None) -> None:
        if not self.active or checkpoint_steps(self.run_dir) or jax.process_index() != 0:
            return
        if self.top is not None:
            if self.top.exists():
                shutil.rmtree(self.top, ignore_errors=True)
        elif self.run_dir.is_dir():
            for name in sorted(set(os.listdir(self.run_dir)) - self.before):
                path = self.run_dir / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the directory's times as they were
            os.utime(self.parent, ns=(self.times.st_atime_ns, self.times.st_mtime_ns))


def _check_stored_shapes(run_dir: Path, step: int, item: str, abstract, delete) -> None:
    """The shapes and dtypes in an orbax item's metadata against the model's (metadata only)."""
    try:
        stored = layout.item_leaf_metadata(run_dir, step, item)
    except Exception as err:  # noqa: BLE001 - orbax / tensorstore raise many kinds
        raise RunDirError(
            f"run dir {run_dir}: checkpoint {step} is corrupt: {item} metadata is "
            f"unreadable ({type(err).__name__}) ({delete})"
        ) from None
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        key = jax.tree_util.keystr(path)
        got = stored.get(key)
        if got is None:
            raise RunDirError(
                f"run dir {run_dir}: checkpoint {step} lacks {item}{key}: it is corrupt "
                f"or was written for another model ({delete})"
            )
        if tuple(got.shape) != tuple(leaf.shape) or jnp.dtype(got.dtype) != jnp.dtype(leaf.dtype):
            raise UsageError(
                f"run dir {run_dir}: checkpoint {step} holds {item}{key} of shape "
                f"{tuple(got.shape)} {jnp.dtype(got.dtype)}; this model has {tuple(leaf.shape)} "
                f"{jnp.dtype(leaf.dtype)} (start a new run_dir to change it)"
            )
