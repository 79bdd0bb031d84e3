"""One rollout as learner input: plain arrays, built from token sequences (no rollout types).

T = S - 1 target positions: the token at j + 1 is predicted at j. Rows are samples; `pad_to`
appends empty rows (no tokens, `sample_mask` 0) so the sample axis divides the data-parallel
mesh axes; empty rows add nothing to any loss, gradient or metric.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

BATCH_FIELDS = (
    "tokens",
    "attention_mask",
    "response_mask",
    "behav_logprobs",
    "scores",
    "group_ids",
    "sample_mask",
)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass
class RolloutBatch:
    """Host arrays for one rollout (numpy)."""

    tokens: np.ndarray  # [N, S] int32, prompt + response, right-padded
    attention_mask: np.ndarray  # [N, S] bool
    response_mask: np.ndarray  # [N, T] float32: targets that are response tokens
    behav_logprobs: np.ndarray  # [N, T] engine log-probs at response targets
    scores: np.ndarray  # [N] float32 sequence rewards
    group_ids: np.ndarray  # [N] int32
    sample_mask: np.ndarray  # [N] float32: 1 for a real sample, 0 for padding rows

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_samples(self) -> int:
        """Real samples (padding rows excluded)."""
        return int(self.sample_mask.sum())

    @classmethod
    def from_sequences(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        response_logprobs: Sequence[Sequence[float]],
        scores: Sequence[float],
        group_ids: Sequence[int],
        seq_multiple: int = 16,
    ) -> RolloutBatch:
        n = len(prompts)
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
        seq = round_up(max(lengths) + 1, seq_multiple)
        tokens = np.zeros((n, seq), np.int32)
        attn = np.zeros((n, seq), np.bool_)
        resp = np.zeros((n, seq - 1), np.float32)
        behav = np.zeros((n, seq - 1), np.float32)
        for i, (p, r, lp) in enumerate(zip(prompts, responses, response_logprobs, strict=True)):
            np_, nr = len(p), len(r)
            tokens[i, : np_ + nr] = list(p) + list(r)
            attn[i, : np_ + nr] = True
            resp[i, np_ - 1 : np_ - 1 + nr] = 1.0
            behav[i, np_ - 1 : np_ - 1 + nr] = lp
        return cls(
            tokens=tokens,
            attention_mask=attn,
            response_mask=resp,
            behav_logprobs=behav,
            scores=np.asarray(scores, np.float32),
            group_ids=np.asarray(group_ids, np.int32),
            sample_mask=np.ones((n,), np.float32),
        )

    @classmethod
    def from_samples(cls, samples, scores=None, seq_multiple: int = 16) -> RolloutBatch:
        """From anything with prompt_ids, response_ids, response_logprobs, group_id and (unless
        `scores` is given) reward."""
        return cls.from_sequences(
            [s.prompt_ids for s in samples],
            [s.response_ids for s in samples],
            [s.response_logprobs for s in samples],
            [s.reward for s in samples] if scores is None else scores,
            [s.group_id for s in samples],
            seq_multiple,
        )

    def pad_to(self, multiple: int) -> RolloutBatch:
        """Append empty rows up to a multiple of `multiple` rows. Each padding row gets a group
        id of its own (a group of one has advantage 0; its mask is 0 anyway)."""
        n = self.num_rows
        extra = round_up(n, multiple) - n
        if extra == 0:
            return self
        fields = {}
        for name in BATCH_FIELDS:
            x = getattr(self, name)
            fields[name] = np.concatenate([x, np.zeros((extra,) + x.shape[1:], x.dtype)])
        first = int(self.group_ids.max(initial=0)) + 1
        fields["group_ids"][n:] = np.arange(first, first + extra, dtype=np.int32)
        return RolloutBatch(**fields)

    def with_length(self, seq: int) -> RolloutBatch:
        """The same samples in rows of exactly `seq` tokens (padding columns added or removed;
        learner.pack_tokens > 0 gives every batch one shape). A real token never is cut."""
        if self.attention_mask[:, seq:].any():
            longest = int(self.attention_mask.sum(axis=1).max())
            raise ValueError(f"a sample of {longest} tokens does not fit {seq} tokens")
        fields = {}
        for name in BATCH_FIELDS:
            x = getattr(self, name)
            if x.ndim == 2:
                width = seq if name in ("tokens", "attention_mask") else seq - 1
                x = np.pad(x[:, :width], ((0, 0), (0, max(width - x.shape[1], 0))))
            fields[name] = x
        return RolloutBatch(**fields)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in BATCH_FIELDS}
