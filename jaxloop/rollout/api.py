"""What the train loop knows about rollouts: the engine and source protocols, the published
`Policy`, and every rollout error class (one place to import them from).

numpy-free and jax-free at import time: engine processes (vLLM workers) import the errors."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from jaxloop.rollout.types import PromptRequest, PublishStats, Sample, SamplingConfig

if TYPE_CHECKING:
    from jaxloop.models.config import LoopedConfig


class PublicationError(RuntimeError):
    """An engine refused a policy publication (it keeps serving the last committed version)."""


class NotPublishedError(RuntimeError):
    """generate() was called before any policy version was committed."""


class EngineFailedError(RuntimeError):
    """An engine actor kept dying (or could not be started) beyond the restart limit."""


class ManagerFailedError(RuntimeError):
    """The rollout manager actor died again right after it was replaced."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """What is published: the actor's parameters (an nnx.State of the trainer's LoopedLM, no
    copy), the policy version they are, and the model config (its `family` picks the HF name
    table remote engines receive the tensors under)."""

    params: Any  # nnx.State
    version: int
    config: LoopedConfig

    @property
    def family(self) -> str:
        return self.config.family


class Sampler(Protocol):
    """What a RolloutProducer samples from: an engine, or (inside the Ray manager) a group of
    engine actors, whose publications arrive staged from the trainer's client."""

    def generate(self, requests: list[PromptRequest], sampling: SamplingConfig) -> list[Sample]:
        """One Sample per request, in request order, tagged with the committed version."""

    @property
    def version(self) -> int | None:
        """The last committed policy version (None before the first publication)."""

    def close(self) -> None: ...


class RolloutEngine(Sampler, Protocol):
    """One engine: the embedded sampler or a vLLM engine. `publish` has the signature of
    every publisher (RolloutSource too): tests/rollout/test_protocols.py holds them to it."""

    def publish(self, policy: Policy) -> PublishStats:
        """Serve `policy` from now on (all-or-nothing; PublicationError keeps the old one)."""


class RolloutSource(Protocol):
    """What the Trainer uses: the embedded RolloutProducer, or the RayRolloutClient in front of
    engine actors. The trainer knows a source by these capabilities, never by its engine's name."""

    # generates on the learner's devices: the trainer's thread generates the batches ahead
    # (two programs at once on the same devices may deadlock on their collectives); False:
    # remote engines generate in the background while the learner trains
    shares_devices: bool
    # its samples carry the sampler's per-loop log-probs, checked against the trainer's per loop
    loop_logprobs: bool

    def publish(self, policy: Policy) -> PublishStats:
        """Serve `policy` from now on (all-or-nothing; PublicationError keeps the old one)."""

    def produce(self, update: int) -> tuple[list[Sample], dict[str, float]]:
        """The scored samples of `update` and their stats (the data cursor advances)."""

    def evaluate(self) -> float:
        """Mean greedy reward on the held-out prompts (NaN when there are none)."""

    def evaluate_samples(self) -> tuple[float, list[dict[str, Any]]]:
        """`evaluate`'s mean and a row per held-out prompt: prompt_text (the text the model saw,
        templates applied), response, label, reward."""

    def state(self) -> dict:
        """The data cursor (saved in checkpoints)."""

    def stats(self) -> dict[str, float]:
        """Counters that grow over the run (engine and manager restarts; none for the embedded
        sampler), as `produce` reports them: read again after the final evaluation, so a restart
        during it reaches the last row."""

    def restore(self, state: dict) -> None: ...

    @property
    def version(self) -> int | None:
        """The committed policy version (None before the first publication)."""

    def close(self) -> None: ...
