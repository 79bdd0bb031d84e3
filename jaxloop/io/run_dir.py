"""The layout of a run directory, in one place (trainer, SFT, conversion, summary, evaluation):

    run_dir/
      checkpoints/<step>/     one orbax CheckpointManager step, <step> = finished updates:
        actor_params, actor_opt, critic_params, critic_opt, ref_params   arrays (orbax items)
        train_state           JSON: the TrainState's counters and the data cursor
      actor_config.json       LoopedConfig.to_hf_dict() (critic_config.json: the critic's)
      config.json             the run's resolved config
      tokenizer/              tokenizer files, if any

Orbax writes a step into a temporary directory and renames it to the bare number when complete,
so a finished step is a directory named by digits. Everything here reads only (nothing creates a
directory); only `item_leaf_metadata` opens orbax.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxloop.errors import UsageError

CHECKPOINT_DIR = "checkpoints"
TOKENIZER_DIR = "tokenizer"
CONFIG_FILE = "config.json"
TRAIN_STATE = "train_state"  # JSON item of a training step


class RunDirError(UsageError):
    """A run directory is missing, holds no checkpoint, or lacks the asked-for role or step."""


def params_item(role: str) -> str:
    """Name of the composite item holding a role's weights."""
    _check_role(role)
    return f"{role}_params"


def config_file(role: str) -> str:
    """File name (inside the run dir) of a role's HF config dict."""
    _check_role(role)
    return f"{role}_config.json"


def _check_role(role: str) -> None:
    from jaxloop.models.looped import ROLES

    if role not in ROLES:
        raise RunDirError(f"role={role!r}; expected one of {ROLES}")


# the array items of a training step and the TrainState field each holds
ARRAY_ITEMS = {
    "actor_params": "actor_params",
    "actor_opt": "actor_opt",
    "critic_params": "critic_params",
    "critic_opt": "critic_opt",
    "ref_params": "ref_params",
}


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / str(step)


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Steps of the finished checkpoints (orbax renames a step's temporary directory to the bare
    number only when it is complete)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


def step_items(run_dir: str | Path, step: int) -> set[str]:
    """The items (directories) a step holds."""
    return {p.name for p in step_dir(run_dir, step).iterdir() if p.is_dir()}


def read_train_state(run_dir: str | Path, step: int) -> dict:
    """The JSON train state of `step` (counters and data cursor) as orbax stored it; OSError,
    ValueError, KeyError or TypeError when it is missing or damaged (no integer "update")."""
    meta = step_dir(run_dir, step) / TRAIN_STATE / "metadata"
    state = json.loads(meta.read_text())
    int(state["update"])
    return state


def completed_update(run_dir: str | Path) -> int | None:
    """Updates finished by the latest checkpoint (its train state's "update"; the step number
    when that cannot be read), None without a checkpoint. Reads only."""
    steps = checkpoint_steps(run_dir)
    if not steps:
        return None
    try:
        return int(read_train_state(run_dir, steps[-1])["update"])
    except (OSError, ValueError, KeyError, TypeError):
        return steps[-1]


def item_leaf_metadata(run_dir: str | Path, step: int, item: str) -> dict:
    """An array item's stored leaves (shape, dtype) by their `jax.tree_util.keystr` path, read
    from orbax's metadata only; raises what orbax raises on a damaged item."""
    import logging

    import jax
    import orbax.checkpoint as ocp

    item_dir = step_dir(run_dir, step).resolve() / item
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that an item dir has no step metadata of its own
    try:
        if (item_dir / "_METADATA").is_file():  # orbax's tree metadata: JSON, damaged or not
            json.loads((item_dir / "_METADATA").read_text())
        meta = ocp.StandardCheckpointer().metadata(item_dir)
    finally:
        absl.setLevel(level)
    leaves = jax.tree_util.tree_leaves_with_path(meta.item_metadata)
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}
