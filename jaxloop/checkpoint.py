"""Training checkpoints: actor and critic (params + optimizer) and the train state, via orbax.

Layout of a run dir (shared with `conversion.from_hf` / `to_hf`, see models/orbax_io.py):
  checkpoints/<step>/{actor_params, actor_opt, critic_params, critic_opt, train_state}
  actor_config.json, critic_config.json, tokenizer/
<step> = number of finished updates. Orbax writes each step into a temporary directory and
renames it when complete, so a save killed half-way is never listed (and never resumed).
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxloop.models.orbax_io import CHECKPOINT_DIR, params_item, write_config
from jaxloop.rl.learner import Learner

TRAIN_STATE = "train_state"


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class TrainCheckpointer:
    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.run_dir = Path(run_dir)
        self.manager = ocp.CheckpointManager(
            self.run_dir / CHECKPOINT_DIR,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def write_configs(self, learner: Learner) -> None:
        for model in (learner.actor_model(), learner.critic_model()):
            if model is not None:
                write_config(self.run_dir, model)

    def _items(self, learner: Learner):
        items = {
            params_item("actor"): learner.actor_params,
            "actor_opt": learner.actor_opt_state,
        }
        if learner.critic_params is not None:
            items[params_item("critic")] = learner.critic_params
            items["critic_opt"] = learner.critic_opt_state
        return items

    def save(self, step: int, learner: Learner, train_state: dict) -> None:
        args = {k: ocp.args.StandardSave(v) for k, v in self._items(learner).items()}
        args[TRAIN_STATE] = ocp.args.JsonSave(train_state)
        self.manager.save(step, args=ocp.args.Composite(**args), force=True)
        self.manager.wait_until_finished()

    def restore(self, step: int, learner: Learner) -> dict:
        """Load every item of `step` into `learner`; returns the train state dict."""
        args = {k: ocp.args.StandardRestore(_abstract(v)) for k, v in self._items(learner).items()}
        args[TRAIN_STATE] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**args))
        learner.actor_params = restored[params_item("actor")]
        learner.actor_opt_state = restored["actor_opt"]
        if learner.critic_params is not None:
            learner.critic_params = restored[params_item("critic")]
            learner.critic_opt_state = restored["critic_opt"]
        return dict(restored[TRAIN_STATE])

    def close(self) -> None:
        self.manager.close()
