"""Per-loop credit with the embedded sampler: every loop's engine-vs-trainer log-prob difference
is written (loop<t>_logprob_diff_max) and held to rollout.max_logprob_diff, early exits included
(the sampler's loops past a token's exit are its exit loop, as the trainer's replay)."""

import numpy as np
import pytest

from jaxloop.rl.batch import RolloutBatch
from jaxloop.train.cli import main
from jaxloop.train.consistency import LogprobMismatchError, check_engine_logprobs
from tests.train.helpers import UNIT, read_rows
from tests.train.test_early_exit_train import LOOPS, OURO


def test_every_loop_is_checked_against_the_engine(tmp_path):
    args = [
        "--config",
        "grpo.py",
        *UNIT,
        *OURO,
        "--config.rollout.early_exit=threshold",
        "--config.rollout.exit_threshold=0.6",
        "--config.algo.loop_credit=uniform",
        f"--config.run_dir={tmp_path / 'run'}",
    ]
    assert main(args) == 0
    rows = [r for r in read_rows(tmp_path / "run") if "update" in r]
    assert len(rows) == 2
    for row in rows:
        diffs = [row[f"loop{t}_logprob_diff_max"] for t in range(1, LOOPS + 1)]
        assert max(diffs) <= 3e-6, diffs  # fp32: the replay's bound
        assert diffs[-1] == row["logprob_diff_max"]  # the sampled loop is the last
        assert row["depth_mean"] < LOOPS  # some tokens exited: their deeper loops were compared


def _batch():
    loop_lps = [[[-1.0, -2.0], [-3.0, -4.0]], [[-5.0], [-6.0]]]  # [L=2][len] per sample
    return RolloutBatch.from_sequences(
        [[3, 4], [5]],
        [[6, 7], [8]],
        [[-3.0, -4.0], [-6.0]],
        [1.0, 0.0],
        [0, 0],
        seq_multiple=8,
        loop_logprobs=loop_lps,
    ).pad_to(4)


def test_batch_carries_per_loop_logprobs_padded_like_the_behaviour_logprobs():
    batch = _batch()
    assert batch.loop_behav_logprobs.shape == (4, 2, 7)
    np.testing.assert_array_equal(batch.loop_behav_logprobs[:, -1], batch.behav_logprobs)
    np.testing.assert_array_equal(batch.loop_behav_logprobs[0, 0, 1:3], [-1.0, -2.0])
    assert batch.loop_behav_logprobs[2:].max() == 0.0  # padding rows
    longer = batch.with_length(12)
    assert longer.loop_behav_logprobs.shape == (4, 2, 11)
    np.testing.assert_array_equal(longer.loop_behav_logprobs[..., :7], batch.loop_behav_logprobs)
    # host-only: the learner never sees it
    assert not hasattr(batch.train_batch(), "loop_behav_logprobs")


def test_a_loop_beyond_the_bound_is_refused_by_name():
    batch = _batch()
    trainer = batch.loop_behav_logprobs.copy()  # [N, L, T]: all agree
    stats = check_engine_logprobs(3, batch, trainer[:, -1], 1e-3, trainer)
    assert stats["loop1_logprob_diff_max"] == stats["loop2_logprob_diff_max"] == 0.0
    trainer[1, 0, 0] += 0.01  # loop 1 of the second sample's only response token (prompt 1)
    trainer[3, 0, :] += 1.0  # a padding row: masked
    with pytest.raises(LogprobMismatchError, match="difference of loop 1 0.01 exceeds"):
        check_engine_logprobs(3, batch, trainer[:, -1], 1e-3, trainer)
    assert (
        check_engine_logprobs(3, batch, trainer[:, -1], 0.02, trainer)["loop1_logprob_diff_max"] > 0
    )
    assert "loop1_logprob_diff_max" not in check_engine_logprobs(3, batch, trainer[:, -1], 1e-3)
