"""`python -m jaxloop.train` with early-exit rollouts on the Ouro family: the trainer replays the
sampled depths (engine vs trainer log-probs <= 3e-6 fp32, on the 8-device mesh) and reports
depth_mean, depth_hist_<t> and saved_compute."""

import pytest

from tests.train.helpers import TINY, run_train

LOOPS = 3
OURO = (
    *TINY,
    "--config.model.family=ouro",
    f"--config.model.num_loops={LOOPS}",
    "--config.rollout.max_new_tokens=4",  # responses of several tokens: later ones see exits
    "--config.total_updates=2",
    "--config.eval_every=100",
)


@pytest.mark.parametrize(
    "algorithm, mode",
    [
        ("grpo", ("--config.rollout.early_exit=threshold", "--config.rollout.exit_threshold=0.6")),
        # sampled exits, the exit choice in the ratio; PPO: the critic replays the depths too
        ("ppo", ("--config.rollout.early_exit=sample", "--config.algo.depth_as_action=true")),
    ],
    ids=["threshold-grpo", "sample-depth-as-action-ppo"],
)
def test_train_with_early_exit(tmp_path, algorithm, mode):
    rows = run_train(tmp_path / "run", f"{algorithm}.py", *OURO, *mode)
    updates = [r for r in rows if "update" in r]
    assert len(updates) == 2
    for row in updates:
        hist = [row[f"depth_hist_{t}"] for t in range(1, LOOPS + 1)]
        assert abs(sum(hist) - 1.0) <= 1e-9
        mean = sum(t * h for t, h in zip(range(1, LOOPS + 1), hist, strict=True))
        assert abs(row["depth_mean"] - mean) <= 1e-9
        assert abs(row["saved_compute"] - (1.0 - row["depth_mean"] / LOOPS)) <= 1e-9
        assert 1.0 <= row["depth_mean"] < LOOPS  # some tokens exit before the last loop
        assert row["logprob_diff_max"] <= 3e-6, row["logprob_diff_max"]
