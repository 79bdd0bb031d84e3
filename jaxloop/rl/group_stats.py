"""Per-update statistics of a rollout's reward groups (host side, numpy): what a diagnosis of a
group-relative update needs beside the mean reward.

    equal_reward_groups  the share of groups whose rewards are all equal: GRPO gives every sample
                         of such a group advantage 0, so they carry no learning signal (DAPO's
                         dynamic sampling drops them and draws more)
    group_reward_std     the mean over groups of the rewards' standard deviation within the group
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def reward_group_stats(rewards: Sequence[float], group_ids: Sequence[int]) -> dict[str, float]:
    """The statistics above for samples with `rewards` in groups `group_ids` (empty: none)."""
    rewards = np.asarray(rewards, np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.size == 0:
        return {}
    _, dense = np.unique(group_ids, return_inverse=True)
    groups = [rewards[dense == g] for g in range(int(dense.max()) + 1)]
    return {
        "equal_reward_groups": float(np.mean([np.ptp(g) == 0.0 for g in groups])),
        "group_reward_std": float(np.mean([g.std() for g in groups])),
    }
