"""What runs around an update without being its math: evaluation, the engine-vs-trainer log-prob
check, draft features, metrics and checkpoints. Each is a `Hook(fn, at=, every=)` the trainer runs
at a named point of every update, in list order.

Points of an update (`at`):
  "start"      before its rollout is taken (eval_reward: the policy that samples it)
  "forward"    inside the timed old-log-prob forward, with its hidden states (draft features)
  "logprobs"   once the old log-probs are known (fused: after the optimizer step)
  "end"        after the publish (final evaluation, the metrics row and progress bar)
  "saved"      after the update returned (checkpoints)

`every`: due when the updates finished so far (`Step.finished`: the update's index at "start",
one more from "end" on) are a multiple of it; None: never. `last`: also due when that many are
finished.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

POINTS = ("start", "forward", "logprobs", "end", "saved")


@dataclasses.dataclass
class Step:
    """One update as the hooks see it; the trainer fills the fields as the update proceeds."""

    update: int
    metrics: dict[str, float]
    bar: Any = None  # the run's progress bar
    samples: list | None = None
    batch: Any = None  # the host RolloutBatch
    old_lp: Any = None  # log-probs of the sampled loop, [N, T] (host; fused: device)
    loop_old_lp: Any = None  # device per-loop log-probs, [L, N, T] (per-loop credit)
    hidden: Any = None  # the forward's hidden states (draft features)
    finished: int = 0


@dataclasses.dataclass(frozen=True)
class Hook:
    fn: Callable[[Step], None]
    at: str = "end"
    every: int | None = 1
    last: int | None = None

    def __post_init__(self):
        if self.at not in POINTS:
            raise ValueError(f"hook point {self.at!r}; expected one of {POINTS}")
        if self.every is not None and self.every < 1:
            raise ValueError(f"hook every={self.every}; expected >= 1 or None (never)")

    def due(self, finished: int) -> bool:
        return (self.every is not None and finished % self.every == 0) or finished == self.last


class Hooks:
    def __init__(self, hooks: list[Hook]):
        self.hooks = list(hooks)

    def run(self, at: str, step: Step) -> None:
        step.finished = step.update + (at not in ("start", "forward", "logprobs"))
        for hook in self.hooks:
            if hook.at == at and hook.due(step.finished):
                hook.fn(step)
