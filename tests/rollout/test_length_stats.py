"""The producer's per-update length statistics (response_tokens, min / median / max length, share
at the cap, prompt_tokens): what scripts/bench_peers.py compares across systems as the work done."""

from __future__ import annotations

import pytest

from jaxloop.config import parse_args, unit_overrides
from jaxloop.rollout.producer import length_stats
from jaxloop.rollout.types import Sample
from tests.rollout.producers import embedded_producer


def _sample(prompt_len: int, response_len: int, reason: str) -> Sample:
    return Sample([1] * prompt_len, [5] * response_len, [0.0] * response_len, reason, 0, 0, 0, 0)


def test_length_stats_of_known_rows():
    rows = [_sample(3, 2, "stop"), _sample(3, 9, "length"), _sample(4, 4, "stop")]
    assert length_stats(rows) == {
        "response_tokens": 15.0,
        "response_length_min": 2.0,
        "response_length_median": 4.0,
        "response_length_max": 9.0,
        "response_at_cap": pytest.approx(1 / 3),
        "prompt_tokens": 10.0,
    }
    assert length_stats([]) == {}


def test_produce_reports_the_lengths_of_its_samples():
    cfg = parse_args(
        [
            "--config",
            "grpo.py",
            *unit_overrides(),
            "--config.prompts_per_update=2",
            "--config.n_samples_per_prompt=4",
            "--config.eval_prompts=2",
            "--config.rollout.max_new_tokens=6",
        ]
    )
    producer = embedded_producer(cfg)
    samples, stats = producer.produce(0)
    lengths = sorted(len(s.response_ids) for s in samples)
    assert stats["response_tokens"] == sum(lengths)
    assert stats["response_tokens"] == pytest.approx(stats["response_length"] * len(samples))
    assert (stats["response_length_min"], stats["response_length_max"]) == (lengths[0], lengths[-1])
    at_cap = sum(s.finish_reason == "length" for s in samples) / len(samples)
    assert stats["response_at_cap"] == pytest.approx(at_cap)
    assert all(n == 6 for n in lengths[len(lengths) - round(at_cap * len(samples)) :])
    assert stats["prompt_tokens"] == sum(len(s.prompt_ids) for s in samples)
