"""The rollout contract: what the train loop sends to an engine and what comes back."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

# SamplingConfig.early_exit (and rollout.early_exit)
EarlyExit = Literal["none", "threshold", "sample"]
EARLY_EXIT_MODES: tuple[str, ...] = get_args(EarlyExit)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling for one generate call. Log-probs are of the processed distribution:
    log_softmax(logits / temperature) (top-p / top-k filtering is not reflected in them)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None: off
    max_new_tokens: int = 8
    stop_token_ids: tuple[int, ...] = ()
    greedy: bool = False
    num_loops: int = 0  # loop budget K of the model's loops (0: all); engines record it per sample
    # early exit (models with an exit gate): 'none' | 'threshold' | 'sample'; engines record each
    # response token's depth (extras['response_depths']) and the gate's log p of it
    # (extras['response_exit_logprobs'])
    early_exit: str = "none"
    exit_threshold: float = 0.5
    # per-loop credit (algo.loop_credit != last): the embedded sampler also records each response
    # token's log-prob under every loop's logits (extras['loop_logprobs'], [L][T]; loops past a
    # token's exit depth repeat its exit loop, as the trainer's replay does); vLLM records none
    loop_logprobs: bool = False


@dataclasses.dataclass(frozen=True)
class PromptRequest:
    prompt_ids: tuple[int, ...]
    seed: int  # per-sample seed: derived from (config seed, update, sample index)
    group_id: int
    sample_index: int
    label: str = ""
    prompt_text: str = ""


@dataclasses.dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]  # engine's selected-token log-probs (processed distribution)
    finish_reason: str  # 'stop' (hit a stop token, included in response_ids) or 'length'
    policy_version: int
    seed: int
    group_id: int
    sample_index: int
    label: str = ""
    prompt_text: str = ""
    response_text: str = ""
    reward: float | None = None
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_request(
        cls,
        request: PromptRequest,
        response_ids: list[int],
        response_logprobs: list[float],
        finish_reason: str,
        policy_version: int,
    ) -> Sample:
        return cls(
            prompt_ids=list(request.prompt_ids),
            response_ids=list(response_ids),
            response_logprobs=list(response_logprobs),
            finish_reason=finish_reason,
            policy_version=policy_version,
            seed=request.seed,
            group_id=request.group_id,
            sample_index=request.sample_index,
            label=request.label,
            prompt_text=request.prompt_text,
        )


@dataclasses.dataclass(frozen=True)
class PublishStats:
    """num_bytes: the whole version's tensor bytes; sent_bytes: what was shipped to the engines
    (None: num_bytes; a delta publication ships fewer, a zero-copy one none); fell_back: a delta
    was refused and the version was then published in full (sent_bytes counts both);
    breakdown: where the seconds went, by stage (the Ray client's: staging, manifest, send,
    commit), not compared."""

    version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    sent_bytes: int | None = None
    fell_back: bool = False
    breakdown: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.sent_bytes is None:
            object.__setattr__(self, "sent_bytes", self.num_bytes)

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9
