"""Learning, not just running (short version of scripts/learning_check.py): GRPO from random
init on the built-in task lifts the greedy eval reward from <= 0.2 to >= 0.8."""

from tests.train.helpers import run_train


def test_grpo_learns_builtin_task(tmp_path):
    rows = run_train(
        tmp_path / "grpo",
        "grpo.py",
        "--config.total_updates=60",
        "--config.eval_every=20",
        "--config.progress=false",
        "--config.checkpoint_every=1000",
        timeout=1200,
    )
    assert len(rows) == 60
    assert rows[0]["eval_reward"] <= 0.2
    assert rows[-1]["final_eval_reward"] >= 0.8, [r.get("eval_reward") for r in rows]
    assert rows[-1]["reward_mean"] > rows[0]["reward_mean"]
