"""Turns prompts into scored samples for one update: data cursor, per-sample seeds, engine calls,
rewards, NaN dropping and group completeness. The same object runs in the trainer process
(embedded engine) or inside the Ray RolloutManager actor (vLLM engines)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import numpy as np

from jaxloop.data.datasets import DataError, encode_prompts, make_eval_examples, make_source
from jaxloop.data.rewards import get_reward, with_row
from jaxloop.data.tokenizer import CharTokenizer, HFTokenizer
from jaxloop.data.types import Prompt
from jaxloop.models.loop_budget import loop_budget_at
from jaxloop.rollout.api import Policy, Sampler
from jaxloop.rollout.dynamic_sampling import count_informative, select_groups
from jaxloop.rollout.types import PromptRequest, PublishStats, Sample, SamplingConfig


class PromptTooLongError(DataError):
    """A prompt does not fit in data.max_prompt_tokens."""


class RewardError(DataError):
    """A reward function returned something that is not a number."""


def derive_seed(*parts: int) -> int:
    """A per-sample seed from (config seed, update, sample index): no global RNG state."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class ProducerSettings:
    """Everything a producer needs, as plain values (it crosses process boundaries)."""

    seed: int
    data: dict[str, Any]  # source, task, num_digits, seed
    tokenizer: str  # 'char' or a local HF tokenizer dir
    vocab_size: int
    reward: str
    prompts_per_update: int
    n_samples_per_prompt: int
    max_prompt_tokens: int
    eval_prompts: int
    requires_groups: bool
    sampling: SamplingConfig
    # model.loop_budget parsed ((first update, K), ...); () = full depth. The loops of update u
    # are a function of u alone (models.loop_budget), so a resume continues the schedule.
    loop_budget: tuple[tuple[int, int], ...] = ()
    dynamic_sampling_rounds: int = 0  # rollout.dynamic_sampling_rounds (0: off)


def build_tokenizer(spec: str, vocab_size: int):
    """'char' (ids spanning `vocab_size`) or the HF tokenizer in the directory `spec`."""
    return CharTokenizer(vocab_size=vocab_size) if spec == "char" else HFTokenizer(spec)


def tokens_checksum(samples: list[Sample]) -> int:
    h = hashlib.sha256()
    for s in samples:
        h.update(np.asarray(s.response_ids, np.int64).tobytes() + b"|")
    return int.from_bytes(h.digest()[:6], "little")


def length_stats(samples: list[Sample]) -> dict[str, float]:
    """The spread of the response lengths (EOS included) and the tokens generated and prompted:
    how much work a rollout was (scripts/bench_peers.py compares it across systems)."""
    lengths = np.array([len(x.response_ids) for x in samples], np.float64)
    if not len(lengths):
        return {}
    return {
        "response_tokens": float(lengths.sum()),
        "response_length_min": float(lengths.min()),
        "response_length_median": float(np.median(lengths)),
        "response_length_max": float(lengths.max()),
        "response_at_cap": float(np.mean([x.finish_reason == "length" for x in samples])),
        "prompt_tokens": float(sum(len(x.prompt_ids) for x in samples)),
    }


class RolloutProducer:
    """The RolloutSource of the embedded engine (and, inside the Ray manager, over an engine
    group: there publications reach the group staged, never through `publish`)."""

    # capabilities (RolloutSource), as the trainer's embedded source
    shares_devices = True
    loop_logprobs = True

    def __init__(self, settings: ProducerSettings, engine: Sampler):
        self.settings = settings
        self.engine = engine
        self.tokenizer = build_tokenizer(settings.tokenizer, settings.vocab_size)
        try:
            self.source = make_source(settings.data)
            # (response, label, row): the row reaches a user function that takes it
            self.reward_fn = with_row(get_reward(settings.reward))
        except DataError:
            raise
        except ValueError as err:  # unknown task or reward name: a usage error, one line
            raise DataError(str(err)) from None
        if len(self.source) == 0:
            raise DataError(f"data source {settings.data.get('source')!r} is empty")
        self.eval_examples = make_eval_examples(settings.data, settings.eval_prompts)
        # fail before anything is written: every known prompt must render and fit the context
        # (an error names the file and row)
        known = getattr(self.source, "examples", []) + self.eval_examples
        encode_prompts(self.tokenizer, known, settings.max_prompt_tokens)
        self.check_reward(known)
        self.sampling = dataclasses.replace(
            settings.sampling, stop_token_ids=self.tokenizer.eos_ids
        )
        # evaluation runs every loop, as jaxloop.evaluate measures a checkpoint, and needs no
        # per-loop log-probs
        self.eval_sampling = dataclasses.replace(
            self.sampling, greedy=True, early_exit="none", loop_logprobs=False
        )

    # ---- engine pass-through ----
    def publish(self, policy: Policy) -> PublishStats:
        return self.engine.publish(policy)

    @property
    def version(self) -> int | None:
        return self.engine.version

    def close(self) -> None:
        self.engine.close()

    def stats(self) -> dict[str, float]:
        return {}  # the embedded sampler cannot die apart from the trainer: nothing to count

    # ---- data cursor ----
    def state(self) -> dict:
        return self.source.state()

    def restore(self, state: dict) -> None:
        self.source.restore(state)

    # ---- samples ----
    def encode(self, prompt: str) -> tuple[int, ...]:
        ids = self.tokenizer.encode_prompt(prompt)
        if len(ids) > self.settings.max_prompt_tokens:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens is longer than data.max_prompt_tokens="
                f"{self.settings.max_prompt_tokens}: {prompt[:40]!r}"
            )
        return tuple(ids)

    def check_reward(self, examples, tries: int = 4) -> None:
        """Before anything is written: the reward returns a number for the first examples' labels
        and for an empty and a wrong response (RewardError otherwise), and not a non-finite one
        for all of them (occasional NaN / inf rewards are dropped and counted; always NaN would
        drop every sample)."""
        responses = [(e.label, e) for e in examples[:tries]]
        responses += [(wrong, e) for e in examples[:1] for wrong in ("", e.label + "?")]
        values = [self.score(response, e.label, e.reward_row()) for response, e in responses]
        if values and not any(math.isfinite(v) for v in values):
            raise RewardError(
                f"reward function {self.settings.reward!r} returned a non-finite value "
                f"({values[0]}) for every one of {len(values)} test responses (labels, empty and "
                "wrong answers): every sample would be dropped"
            )

    def score(self, response: str, label: str, row: dict | None = None) -> float:
        """The reward as a float (NaN / inf pass: `produce` drops and counts them); a reward
        function that raises, or returns something that is not a number, raises RewardError
        naming the function and what it did (user code: one line, exit code 2). `row`: the
        example's row (Example.reward_row), for a reward function that takes it."""
        try:
            if row is None:
                value = self.reward_fn(response, label)
            else:
                value = self.reward_fn(response, label, row)
        except Exception as err:  # noqa: BLE001 - user code: any exception is reported
            raise RewardError(
                f"reward function {self.settings.reward!r} raised {type(err).__name__}: "
                f"{str(err).strip()[:200]} (for response {response[:20]!r}, label {label[:20]!r})"
            ) from err
        try:
            if isinstance(value, str | bytes) or value is None:
                raise TypeError
            return float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond a float
            raise RewardError(
                f"reward function {self.settings.reward!r} returned {repr(value)[:40]} "
                f"({type(value).__name__}) for response {response[:20]!r}; a reward must be a "
                "number"
            ) from None

    def response_text(self, sample: Sample) -> str:
        ids = sample.response_ids[:-1] if sample.finish_reason == "stop" else sample.response_ids
        return self.tokenizer.decode(ids)

    def evaluate(self) -> float:
        """Mean reward of greedy responses to the held-out prompts (NaN when there are none)."""
        return self.evaluate_samples()[0]

    def evaluate_samples(self) -> tuple[float, list[dict[str, Any]]]:
        """`evaluate`'s mean and its responses, one row per held-out prompt: prompt_text (the
        text the model saw), response, label, reward (the samples files, train/samples.py)."""
        rewards, rows = self.eval_samples()
        return (float(np.mean(rewards)) if self.eval_examples else float("nan")), rows

    def eval_rewards(
        self,
        samples_per_prompt: int = 1,
        sampling: SamplingConfig | None = None,
        examples: list | None = None,
    ) -> np.ndarray:
        """Rewards [prompts, samples_per_prompt] of responses to the held-out prompts (or to
        `examples`): greedy (the default `sampling`, what `evaluate` averages) or sampled with
        `sampling` (sample j of prompt i is seeded by (config seed, i, j))."""
        return self.eval_samples(samples_per_prompt, sampling, examples)[0]

    def eval_samples(
        self,
        samples_per_prompt: int = 1,
        sampling: SamplingConfig | None = None,
        examples: list | None = None,
    ) -> tuple[np.ndarray, list[dict[str, Any]]]:
        """`eval_rewards` and a row per response (prompt i's samples at rows i*k..i*k+k-1)."""
        examples = self.eval_examples if examples is None else examples
        k = int(samples_per_prompt)
        if k < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {k}")
        sampling = self.eval_sampling if sampling is None else sampling
        sampling = dataclasses.replace(sampling, stop_token_ids=self.tokenizer.eos_ids)
        requests = [
            PromptRequest(
                self.encode(ex.prompt),
                seed=i if k == 1 and sampling.greedy else derive_seed(self.settings.seed, i, j),
                group_id=i,
                sample_index=i if k == 1 else i * k + j,
                label=ex.label,
                prompt_text=ex.prompt,
            )
            for i, ex in enumerate(examples)
            for j in range(k)
        ]
        if not requests:
            return np.zeros((0, k), np.float64), []
        samples = self.engine.generate(requests, sampling)
        rows = []
        for sample in samples:
            example = examples[sample.group_id]
            response = self.response_text(sample)
            reward = self.score(response, sample.label, example.reward_row())
            rows.append(
                {
                    "prompt_text": self.prompt_text(example.prompt),
                    "response": response,
                    "label": sample.label,
                    "reward": reward,
                }
            )
        rewards = np.asarray([row["reward"] for row in rows], np.float64)
        return rewards.reshape(len(examples), k), rows

    def prompt_text(self, prompt: Prompt) -> str:
        """The text the model sees for `prompt`: the tokenizer's format (its chat template),
        which `encode` tokenizes (after a BOS token, where the tokenizer has one)."""
        return self.tokenizer.format_prompt(prompt)

    def requests(self, update: int) -> list[PromptRequest]:
        return self._requests(update, self.source.next_batch(self.settings.prompts_per_update))

    def _requests(self, update: int, examples: list, draw: int = 0) -> list[PromptRequest]:
        """The requests of `examples`; `draw` > 0: a further batch of dynamic sampling (its own
        seeds and group ids; draw 0 is what a run without dynamic sampling draws)."""
        s = self.settings
        n = s.n_samples_per_prompt
        first_group = (update * (s.dynamic_sampling_rounds + 1) + draw) * s.prompts_per_update
        out = []
        for p, ex in enumerate(examples):
            ids = self.encode(ex.prompt)
            for j in range(n):
                index = p * n + j
                out.append(
                    PromptRequest(
                        ids,
                        seed=derive_seed(s.seed, update, index)
                        if draw == 0
                        else derive_seed(s.seed, update, index, draw),
                        group_id=first_group + p,
                        sample_index=index,
                        label=ex.label,
                        prompt_text=ex.prompt,
                    )
                )
        return out

    def produce(self, update: int) -> tuple[list[Sample], dict[str, float]]:
        """Samples of one update with rewards attached; non-finite rewards are dropped and
        counted (and, for group algorithms, groups left with fewer than 2 samples). With
        dynamic sampling, further batches are drawn while fewer than prompts_per_update groups
        have rewards that differ (rollout/dynamic_sampling.py)."""
        sampling = self.sampling
        loops = loop_budget_at(self.settings.loop_budget, update)
        if loops is not None:
            sampling = dataclasses.replace(sampling, num_loops=loops)
        kept, dropped, drawn = self._draw(update, 0, sampling)
        rounds, wanted = self.settings.dynamic_sampling_rounds, self.settings.prompts_per_update
        draw = 0
        while draw < rounds and count_informative(kept) < wanted:
            draw += 1
            more_kept, more_dropped, more_drawn = self._draw(update, draw, sampling)
            kept, dropped, drawn = kept + more_kept, dropped + more_dropped, drawn + more_drawn
        # the sampled reward of the policy: every finite reward drawn, chosen or not
        rewards = np.array([x.reward for x in kept], np.float64)
        extra: dict[str, float] = {}
        if rounds:
            kept, informative = select_groups(kept, wanted)
            extra = {
                "dynamic_sampling_draws": float(draw + 1),
                "dynamic_informative_groups": informative / wanted,
            }
        stats = {
            "reward_mean": float(rewards.mean()) if len(rewards) else float("nan"),
            "reward_std": float(rewards.std()) if len(rewards) else float("nan"),
            "response_length": float(np.mean([len(x.response_ids) for x in drawn])),
            **length_stats(drawn),
            "dropped_samples": float(dropped),
            "num_samples": float(len(kept)),
            "tokens_checksum": float(tokens_checksum(drawn)),
            **extra,
        }
        stats.update(getattr(self.engine, "stats", lambda: {})())
        return kept, stats

    def _draw(
        self, update: int, draw: int, sampling: SamplingConfig
    ) -> tuple[list[Sample], int, list[Sample]]:
        """One batch of prompts generated and scored: (kept samples, dropped count, all
        samples)."""
        n = self.settings.n_samples_per_prompt
        examples = self.source.next_batch(self.settings.prompts_per_update)
        samples = self.engine.generate(self._requests(update, examples, draw), sampling)
        kept, dropped = [], 0
        for sample in samples:  # the rows stay here: only the requests go to the engines
            row = examples[sample.sample_index // n].reward_row()
            sample.response_text = self.response_text(sample)
            sample.reward = self.score(sample.response_text, sample.label, row)
            if math.isfinite(sample.reward):
                kept.append(sample)
            else:
                dropped += 1
        if self.settings.requires_groups:
            sizes: dict[int, int] = {}
            for sample in kept:
                sizes[sample.group_id] = sizes.get(sample.group_id, 0) + 1
            complete = [x for x in kept if sizes[x.group_id] >= 2]
            dropped += len(kept) - len(complete)
            kept = complete
        return kept, dropped, samples
