"""Fresh-process resume is bitwise: 3 updates straight == 2 updates, then a new process for the
third. Params, optimizer states, critic, sampled tokens and losses are compared bit for bit."""

import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.train.helpers import TINY, read_rows, run_train, stable

RESUME = (
    *TINY,
    "--config.micro_batch_size=4",
    # micro-batches of 4 over data x fsdp = 4 (and tensor = 2): resume is bitwise on a mixed mesh
    "--config.mesh.data=2",
    "--config.mesh.fsdp=2",
    "--config.mesh.tensor=2",
    "--config.rollout.max_new_tokens=3",
    "--config.eval_every=2",
    "--config.checkpoint_every=1",
    "--config.keep_checkpoints=5",
    "--config.total_updates=3",
    "--config.data.reward=tests.train.rewards:char_code_reward",
)


def _train(run_dir, algorithm, *extra, env):
    run_train(run_dir, f"{algorithm}.py", *RESUME, *extra, env=env)


def _metrics(run_dir):
    return stable(read_rows(run_dir))


def _checkpoint_arrays(run_dir, step):
    path = os.path.join(run_dir, "checkpoints", str(step))
    out = {}
    for item in sorted(os.listdir(path)):
        if item == "train_state" or not os.path.isdir(os.path.join(path, item)):
            continue
        tree = ocp.StandardCheckpointer().restore(os.path.join(path, item))
        for key, leaf in _flatten(tree, item):
            out[key] = np.asarray(leaf)
    return out


def _flatten(tree, prefix):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}/{i}")
    elif tree is not None:
        yield prefix, tree


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "dppo", "flow_dppo"])
def test_fresh_process_resume_is_bitwise(tmp_path, algorithm, env):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(straight, algorithm, env=env)
    _train(resumed, algorithm, "--config.stop_after=2", env=env)
    assert len(_metrics(resumed)) == 2
    assert sorted(os.listdir(resumed / "checkpoints")) == ["1", "2"]
    _train(resumed, algorithm, env=env)

    a, b = _metrics(straight), _metrics(resumed)
    assert len(a) == len(b) == 3
    assert a == b  # losses, rewards, token checksums, KL ... identical
    ca, cb = _checkpoint_arrays(straight, 3), _checkpoint_arrays(resumed, 3)
    assert ca.keys() == cb.keys()
    assert any(k.startswith("actor_opt") for k in ca)
    if algorithm != "grpo":
        assert any(k.startswith("critic_params") for k in ca)
        assert any(k.startswith("critic_opt") for k in ca)
    for key in ca:
        assert ca[key].dtype == cb[key].dtype and ca[key].tobytes() == cb[key].tobytes(), key
    # and training moved the parameters (the comparison is not between two untouched inits)
    c1 = _checkpoint_arrays(straight, 1)
    assert any(c1[k].tobytes() != ca[k].tobytes() for k in ca if k.startswith("actor_params"))


def test_resume_across_a_loop_budget_change_is_bitwise(tmp_path, env):
    """model.loop_budget 1@0,2@2 (PPO: sampler, recompute, loss and critic at K loops): stopping
    after update 2, just before the budget changes, and resuming equals the straight run bit for
    bit; the engine-vs-trainer log-prob check passes at every K (the run stops otherwise)."""
    budget = "--config.model.loop_budget=1@0,2@2"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(straight, "ppo", budget, env=env)
    _train(resumed, "ppo", budget, "--config.stop_after=2", env=env)
    _train(resumed, "ppo", budget, env=env)
    a, b = _metrics(straight), _metrics(resumed)
    assert [row["loop_budget"] for row in a] == [1.0, 1.0, 2.0]
    assert a == b
    assert all(row["logprob_diff_max"] <= 1e-5 for row in a)
    ca, cb = _checkpoint_arrays(straight, 3), _checkpoint_arrays(resumed, 3)
    assert ca.keys() == cb.keys() and any(k.startswith("critic_params") for k in ca)
    for key in ca:
        assert ca[key].tobytes() == cb[key].tobytes(), key
