"""The engine interface: all the train loop knows about rollouts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

from jaxloop.rollout.types import PromptRequest, PublishStats, Sample, SamplingConfig


class PublicationError(RuntimeError):
    """An engine refused a policy publication (it keeps serving the last committed version)."""


class NotPublishedError(RuntimeError):
    """generate() was called before any policy version was committed."""


class RolloutEngine(Protocol):
    def publish(self, tensors: Iterable[tuple[str, np.ndarray]], version: int) -> PublishStats:
        """Install HF-named tensors as policy `version` (all-or-nothing)."""

    def generate(self, requests: list[PromptRequest], sampling: SamplingConfig) -> list[Sample]:
        """One Sample per request, in request order, tagged with the committed version."""

    @property
    def version(self) -> int | None:
        """The last committed policy version (None before the first publication)."""

    def close(self) -> None: ...
