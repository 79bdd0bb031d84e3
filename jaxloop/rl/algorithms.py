"""Named RL algorithms: which policy loss, which advantage estimator, and what the learner must
provide (critic, reference model, old-policy logits, prompt groups)."""

from __future__ import annotations

import dataclasses

from jaxloop.registry import Registry
from jaxloop.rl.advantages import ADVANTAGE_ESTIMATORS
from jaxloop.rl.losses import POLICY_LOSSES

__all__ = ["ALGORITHMS", "Algorithm", "get_algorithm"]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """name: algorithm name; policy_loss: key of ``POLICY_LOSSES``; advantage: key of
    ``ADVANTAGE_ESTIMATORS``; uses_critic: trains a value model (GAE + ``value_loss``);
    uses_reference: has a KL-to-frozen-reference loss term (the reference is only needed when
    ``LossHParams.kl_coef > 0``); needs_old_policy_logits: the loss needs D_t = full-vocab
    KL(pi_old || pi_theta) (Flow-DPPO); default_updates_per_rollout: optimizer steps per rollout
    (Flow-DPPO: 2, each on half the completions); requires_groups: several samples per prompt
    (GRPO; the config validation refuses n_samples_per_prompt < 2)."""

    name: str
    policy_loss: str
    advantage: str
    uses_critic: bool
    uses_reference: bool
    needs_old_policy_logits: bool
    default_updates_per_rollout: int
    requires_groups: bool

    def __post_init__(self):
        POLICY_LOSSES.get(self.policy_loss)  # ValueError naming the registered ones
        ADVANTAGE_ESTIMATORS.get(self.advantage)
        if self.default_updates_per_rollout < 1:
            raise ValueError("default_updates_per_rollout must be >= 1")


ALGORITHMS: Registry[Algorithm] = Registry("algorithm")
for _algorithm in (
    Algorithm(
        name="ppo",
        policy_loss="ppo",
        advantage="gae",
        uses_critic=True,
        uses_reference=False,
        needs_old_policy_logits=False,
        default_updates_per_rollout=1,
        requires_groups=False,
    ),
    Algorithm(
        name="grpo",
        policy_loss="grpo",
        advantage="grpo",
        uses_critic=False,
        uses_reference=True,
        needs_old_policy_logits=False,
        default_updates_per_rollout=1,
        requires_groups=True,
    ),
    Algorithm(
        name="dppo",
        policy_loss="decoupled_ppo",
        advantage="gae",
        uses_critic=True,
        uses_reference=False,
        needs_old_policy_logits=False,
        default_updates_per_rollout=1,
        requires_groups=False,
    ),
    Algorithm(
        name="flow_dppo",
        policy_loss="flow_dppo",
        advantage="gae",
        uses_critic=True,
        uses_reference=False,
        needs_old_policy_logits=True,
        default_updates_per_rollout=2,
        requires_groups=False,
    ),
):
    ALGORITHMS.add(_algorithm.name, _algorithm)
del _algorithm


def get_algorithm(name: str) -> Algorithm:
    """The ``Algorithm`` registered as ``name``; ValueError listing the valid names otherwise."""
    return ALGORITHMS.get(name)
