"""Non-finite guard: an update whose loss or gradient norm is not finite is not applied, it is
counted, and after optim.max_skipped_updates in a row the run stops (exit 3) naming the update,
with the last checkpoint intact."""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from tests.rl.test_learner import _arrays, _Run
from tests.train.helpers import TINY, read_rows


def test_nan_batch_is_not_applied():
    run = _Run("ppo", 8)
    before = jax.tree.map(np.array, run.state.actor_params)
    critic_before = jax.tree.map(np.array, run.state.critic_params)
    arrays = _arrays()
    arrays.scores[3] = np.nan  # reaches the advantages, the loss and the gradients
    metrics = run.update(arrays)
    assert metrics["skipped"] == 1.0
    assert not np.isfinite(metrics["policy_loss"])
    same = jax.tree.map(
        lambda a, b: np.array_equal(a, np.asarray(b)), before, run.state.actor_params
    )
    assert all(jax.tree.leaves(same))
    same = jax.tree.map(
        lambda a, b: np.array_equal(a, np.asarray(b)), critic_before, run.state.critic_params
    )
    assert all(jax.tree.leaves(same))
    assert run.state.update_count == 1 and run.state.version == 0
    assert int(run.state.consecutive_skips) == 1 and int(run.state.skipped_updates) == 1
    # a finite batch afterwards is applied and resets the run of skips
    metrics = run.update(_arrays())
    assert metrics["skipped"] == 0.0 and run.state.version == 1
    assert int(run.state.consecutive_skips) == 0 and int(run.state.skipped_updates) == 1


def test_run_stops_after_consecutive_skips(tmp_path, capsys):
    from jaxloop.train.cli import main

    run_dir = tmp_path / "run"
    code = main(
        [
            "--config",
            "grpo.py",
            f"--config.run_dir={run_dir}",
            *TINY,
            "--config.total_updates=5",
            "--config.checkpoint_every=1",
            "--config.optim.max_skipped_updates=2",
            "--config.data.reward=tests.train.rewards:overflow_reward",
        ]
    )
    err = capsys.readouterr().err
    assert code == 3
    line = next(x for x in err.splitlines() if x.startswith("error: "))
    assert "update 1: non-finite loss or gradient norm in 2 consecutive updates" in line, err
    # update 0 was skipped and saved (parameters untouched); update 1 stopped the run unsaved
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1"]
    rows = read_rows(run_dir)
    assert [r["update"] for r in rows] == [0] and rows[0]["skipped_updates"] == 1.0
    state = ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / "1" / "actor_params")
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
