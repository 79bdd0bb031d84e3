"""Training checkpoints of the TrainState, via orbax, sharded.

Layout of a run dir (shared with `conversion.from_hf` / `to_hf`, see io/orbax.py):
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

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxloop.io.orbax import CHECKPOINT_DIR, check_step, params_item, write_config
from jaxloop.models import digests
from jaxloop.parallel import mesh as shd
from jaxloop.rl.state import TrainState

TRAIN_STATE = "train_state"
ARRAY_ITEMS = {
    params_item("actor"): "actor_params",
    "actor_opt": "actor_opt",
    params_item("critic"): "critic_params",
    "critic_opt": "critic_opt",
    "ref_params": "ref_params",
}


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


class TrainCheckpointer:
    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.run_dir = Path(run_dir).resolve()
        self.manager = ocp.CheckpointManager(
            self.run_dir / CHECKPOINT_DIR,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
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
