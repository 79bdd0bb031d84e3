"""One rollout as learner input: plain arrays, built from token sequences (no rollout types).

T = S - 1 target positions: the token at j + 1 is predicted at j. Rows are samples; `pad_to`
appends empty rows (no tokens, `sample_mask` 0) so the sample axis divides the data-parallel
mesh axes; empty rows add nothing to any loss, gradient or metric.

Early-exit rollouts add `depths` (each input position's loop count, the prompt and padding at
full depth) and, when the exit choice is an action, `exit_mask` (the targets whose position's
exit was drawn by the gate: response tokens predicted by a response token); both are None
otherwise, so a full-depth batch is what it always was.

Samples of the embedded sampler asked for per-loop log-probs add `loop_behav_logprobs` (each
response target's log-prob under every loop's logits, padded like `behav_logprobs`): a host-only
field for the engine-vs-trainer check of every loop, not sent to the learner (`train_batch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxloop.mathutil import round_up
from jaxloop.rl.train_batch import TrainBatch

BATCH_FIELDS = (
    "tokens",
    "attention_mask",
    "response_mask",
    "behav_logprobs",
    "scores",
    "group_ids",
    "sample_mask",
)
OPTIONAL_FIELDS = ("depths", "exit_mask", "loop_behav_logprobs")
HOST_FIELDS = ("loop_behav_logprobs",)  # read by the trainer's checks, not by the learner


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
    depths: np.ndarray | None = None  # [N, T] int32: loops run at input position t
    exit_mask: np.ndarray | None = None  # [N, T] float32: targets whose exit was an action
    loop_behav_logprobs: np.ndarray | None = None  # [N, L, T] float32: per-loop engine log-probs

    def _fields(self) -> tuple[str, ...]:
        return BATCH_FIELDS + tuple(f for f in OPTIONAL_FIELDS if getattr(self, f) is not None)

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
        response_depths: Sequence[Sequence[int]] | None = None,
        num_loops: int = 0,
        exit_logprobs: Sequence[Sequence[float]] | None = None,
        loop_logprobs: Sequence[Sequence[Sequence[float]]] | None = None,
        max_length: int | None = None,
    ) -> RolloutBatch:
        """Rows hold the longest sample rounded up to `seq_multiple` tokens (fewer distinct
        shapes, fewer compilations), but never more than `max_length` (the longest prompt plus
        the token budget: a round-up past it would only add padding).
        response_depths (with num_loops, the full depth of the prompt): each response token's
        loop count. exit_logprobs: the gate's log p of each response token's exit, an action
        together with the next token: added to that token's behaviour log-prob (the first
        response token is predicted by the prompt, which exits at no sampled loop).
        loop_logprobs: per sample [L][len(response)], each response token's log-prob under each
        loop's logits (the token's alone: exit log-probs are not added)."""
        n = len(prompts)
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
        seq = round_up(max(lengths), seq_multiple)
        if max_length is not None:
            seq = max(min(seq, max_length), max(lengths))
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
        depths = exit_mask = None
        if response_depths is not None:
            depths = np.full((n, seq - 1), num_loops, np.int32)
            for i, (p, d) in enumerate(zip(prompts, response_depths, strict=True)):
                # input positions only: a row of exactly the sample's length has no input
                # position for its last token (it predicts nothing)
                d = list(d)[: seq - 1 - len(p)]
                depths[i, len(p) : len(p) + len(d)] = d
        loop_behav = None
        if loop_logprobs is not None:
            loops = {len(x) for x in loop_logprobs}
            if len(loops) != 1:
                raise ValueError(f"samples carry per-loop log-probs of {sorted(loops)} loops")
            loop_behav = np.zeros((n, loops.pop(), seq - 1), np.float32)
            for i, (p, r, x) in enumerate(zip(prompts, responses, loop_logprobs, strict=True)):
                np_, nr = len(p), len(r)
                loop_behav[i, :, np_ - 1 : np_ - 1 + nr] = x
        if exit_logprobs is not None:
            exit_mask = np.zeros((n, seq - 1), np.float32)
            for i, (p, r, e) in enumerate(zip(prompts, responses, exit_logprobs, strict=True)):
                np_, nr = len(p), len(r)
                exit_mask[i, np_ : np_ + nr - 1] = 1.0
                behav[i, np_ : np_ + nr - 1] += np.asarray(e[: nr - 1], np.float32)
        return cls(
            tokens=tokens,
            attention_mask=attn,
            response_mask=resp,
            behav_logprobs=behav,
            scores=np.asarray(scores, np.float32),
            group_ids=np.asarray(group_ids, np.int32),
            sample_mask=np.ones((n,), np.float32),
            depths=depths,
            exit_mask=exit_mask,
            loop_behav_logprobs=loop_behav,
        )

    @classmethod
    def from_samples(
        cls,
        samples,
        scores=None,
        seq_multiple: int = 16,
        num_loops: int = 0,
        depth_as_action: bool = False,
        max_new_tokens: int | None = None,
    ) -> RolloutBatch:
        """From anything with prompt_ids, response_ids, response_logprobs, group_id and (unless
        `scores` is given) reward. num_loops > 0 (early-exit rollouts): the depths of
        extras['response_depths']; depth_as_action: the exit log-probs
        extras['response_exit_logprobs'] join the behaviour log-probs. Per-loop log-probs
        (extras['loop_logprobs']) are carried when every sample has them. max_new_tokens (the
        rollout's token budget): rows are at most the longest prompt plus it."""
        depths = exit_lps = None
        if num_loops > 0:
            depths = [s.extras["response_depths"] for s in samples]
        if depth_as_action:
            exit_lps = [s.extras["response_exit_logprobs"] for s in samples]
        loop_lps = None
        if samples and all("loop_logprobs" in s.extras for s in samples):
            loop_lps = [s.extras["loop_logprobs"] for s in samples]
        return cls.from_sequences(
            [s.prompt_ids for s in samples],
            [s.response_ids for s in samples],
            [s.response_logprobs for s in samples],
            [s.reward for s in samples] if scores is None else scores,
            [s.group_id for s in samples],
            seq_multiple,
            response_depths=depths,
            num_loops=num_loops,
            exit_logprobs=exit_lps,
            loop_logprobs=loop_lps,
            max_length=None
            if max_new_tokens is None or not samples
            else max(len(s.prompt_ids) for s in samples) + max_new_tokens,
        )

    def pad_to(self, multiple: int) -> RolloutBatch:
        """Append empty rows up to a multiple of `multiple` rows. Each padding row gets a group
        id of its own (a group of one has advantage 0; its mask is 0 anyway)."""
        n = self.num_rows
        extra = round_up(n, multiple) - n
        if extra == 0:
            return self
        fields = {}
        for name in self._fields():
            x = getattr(self, name)
            # padding rows run at full depth (any depth would do: nothing reads them)
            fill = x.max(initial=1) if name == "depths" else 0
            fields[name] = np.concatenate([x, np.full((extra,) + x.shape[1:], fill, x.dtype)])
        first = int(self.group_ids.max(initial=0)) + 1
        fields["group_ids"][n:] = np.arange(first, first + extra, dtype=np.int32)
        return RolloutBatch(**fields)

    def with_length(self, seq: int) -> RolloutBatch:
        """The same samples in rows of exactly `seq` tokens (padding columns added or removed;
        learner.pack_tokens gives every batch one shape). A real token never is cut."""
        if self.attention_mask[:, seq:].any():
            longest = int(self.attention_mask.sum(axis=1).max())
            raise ValueError(f"a sample of {longest} tokens does not fit {seq} tokens")
        fields = {}
        for name in self._fields():
            x = getattr(self, name)
            if x.ndim >= 2:  # the length axis is the last
                width = seq if name in ("tokens", "attention_mask") else seq - 1
                fill = x.max(initial=1) if name == "depths" else 0
                pad = ((0, 0),) * (x.ndim - 1) + ((0, max(width - x.shape[-1], 0)),)
                x = np.pad(x[..., :width], pad, constant_values=fill)
            fields[name] = x
        return RolloutBatch(**fields)

    def train_batch(self) -> TrainBatch:
        """The learner's input, host arrays (host-only fields left out)."""
        return TrainBatch(
            **{name: getattr(self, name) for name in self._fields() if name not in HOST_FIELDS}
        )
