"""Learning, not just running (a short version of scripts/learning_check.py): every algorithm,
with its own config (configs/ALG.py: `reverse` of 3 digits after a supervised warm start that
stops at a validation reward of 0.45), lifts the greedy eval reward on the held-out prompts by at
least MARGIN within the recipe's LIFT_UPDATES RL updates.

The runs see one CPU device, as the default job and learning_check.py do on a CPU machine (the
session's 8 fake devices cost a quarter more CPU; tests/train/test_mesh.py checks that a mesh
trains as one device does). Greedy decoding on fixed prompts and a bitwise-deterministic run make
the lift a fixed number for a fixed program and processor (XLA's CPU code, and so the last bits
of every number, depend on the processor): a lift under MARGIN means the learning got worse, not
noise. The runs compile with XLA's default optimisation, as a user's do (not the session's fast
compile, tests/xla.py): their cost is execution.

Measured with the recipe's learning-rate warm-up, cosine decay and interleaved step split on a
2-core Intel Xeon (seed 0): the warm start stops after 64 steps at 0.417; at update 60 PPO stood
at 0.96, GRPO 0.97, DPPO 0.90, Flow-DPPO 0.96, and all four end at 1.00. Before the warm-up the
same GRPO command stood at 0.42-0.52 until update 60 on this processor; the runs train the
recipe's whole length (150 updates), so the test checks where the recipe ends, not where a
trajectory turns."""

import pytest

from tests.train.helpers import run_train
from tests.xla import with_default_compiler

USES_REAL_ENGINES = False  # trainer processes only: its own xdist group (conftest)
MARGIN = 0.15
LIFT_UPDATES = 150  # configs/*.py's total_updates (learning_recipe)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "dppo", "flow_dppo"])
def test_warm_started_reverse_is_lifted_by_rl(tmp_path, algorithm, one_device_env):
    rows = run_train(
        tmp_path / algorithm,
        f"{algorithm}.py",
        f"--config.total_updates={LIFT_UPDATES}",
        f"--config.eval_every={LIFT_UPDATES}",
        "--config.checkpoint_every=None",
        "--config.progress=false",
        "--config.curves=false",  # no test here reads curves.png
        env=with_default_compiler(one_device_env),
        timeout=1200,
    )
    assert len(rows) == LIFT_UPDATES
    start, final = rows[0]["eval_reward"], rows[-1]["final_eval_reward"]
    assert rows[0]["warm_start_eval_after"] == start  # update 0 evaluates the warm-started actor
    assert start <= 0.5, start  # the warm start leaves room: RL does the lifting
    assert final >= start + MARGIN, (algorithm, start, final)


def test_best_checkpoint_is_kept_and_evaluated(tmp_path, capsys):
    """keep_best_checkpoint: the step of the best eval is recorded and survives keep_checkpoints=1
    (every other older step is deleted); `evaluate --step best` restores it and gives the same
    greedy reward; the per-update rows carry the group diagnostics."""
    import json

    from jaxloop.evaluate import main as evaluate
    from jaxloop.io.run_dir import checkpoint_steps
    from jaxloop.train.checkpoint import best_checkpoint
    from tests.train.helpers import TINY

    run_dir = tmp_path / "run"
    rows = run_train(
        run_dir,
        "grpo.py",
        *TINY,
        "--config.data.task=reverse",
        "--config.data.num_digits=3",
        "--config.rollout.max_new_tokens=4",
        "--config.data.reward=format",  # partial credit: the groups' rewards differ
        "--config.eval_prompts=16",
        "--config.total_updates=4",
        "--config.eval_every=1",
        "--config.checkpoint_every=1",
        "--config.keep_checkpoints=1",
        "--config.keep_best_checkpoint=true",
        "--config.optim.lr=3e-2",  # large steps: the evals move
    )
    evals = [r["eval_reward"] for r in rows] + [rows[-1]["final_eval_reward"]]
    best = best_checkpoint(run_dir)
    first_best = max(range(len(evals)), key=lambda i: (evals[i], -i))
    assert best == {"step": first_best, "eval_reward": evals[first_best]}, evals
    assert checkpoint_steps(run_dir) == sorted({first_best, 4}), evals
    assert all(0.0 <= r["equal_reward_groups"] <= 1.0 for r in rows)
    assert evaluate(["--checkpoint", str(run_dir), "--step", "best"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == first_best and result["greedy_reward"] == best["eval_reward"]
