"""rl.group_stats: the share of reward groups that carry no GRPO signal."""

import pytest

from jaxloop.rl.group_stats import reward_group_stats


def test_equal_reward_groups_and_group_std():
    # groups 7 (all 1.0), 3 (0 and 1), 9 (all 0.5): two of three carry no signal
    rewards = [1.0, 1.0, 0.0, 1.0, 0.5, 0.5]
    stats = reward_group_stats(rewards, [7, 7, 3, 3, 9, 9])
    assert stats["equal_reward_groups"] == pytest.approx(2 / 3)
    assert stats["group_reward_std"] == pytest.approx(0.5 / 3)
    assert reward_group_stats([], []) == {}
