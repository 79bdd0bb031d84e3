"""Dynamic sampling (rollout.dynamic_sampling_rounds, DAPO): groups whose rewards are all equal
give way to further draws whose rewards differ; the batch keeps prompts_per_update groups. The
producer runs the real embedded sampler on a tiny random-init model."""

from __future__ import annotations

import pytest

from jaxloop.config import parse_args, unit_overrides
from jaxloop.rollout.dynamic_sampling import groups_in_order, is_informative, select_groups
from jaxloop.rollout.producer import RolloutProducer
from jaxloop.rollout.types import Sample
from tests.rollout.producers import embedded_producer

HERE = "tests.rollout.test_dynamic_sampling"
PROMPTS, SAMPLES = 4, 4


def by_prompt(response: str, label: str) -> float:
    """Every sample of a prompt gets the same reward: no group is informative."""
    return float(len(label))


def by_response(response: str, label: str) -> float:
    """The response's first character decides: groups of a random-init model mostly differ."""
    return float(ord(response[0]) % 2) if response else 0.5


def _producer(reward: str, rounds: int) -> RolloutProducer:
    cfg = parse_args(
        [
            "--config",
            "grpo.py",
            *unit_overrides(),
            f"--config.prompts_per_update={PROMPTS}",
            f"--config.n_samples_per_prompt={SAMPLES}",
            "--config.eval_prompts=4",
            "--config.rollout.max_new_tokens=2",
            f"--config.data.reward={HERE}:{reward}",
            f"--config.rollout.dynamic_sampling_rounds={rounds}",
        ]
    )
    producer = embedded_producer(cfg)
    return producer


def _sample(group: int, reward: float) -> Sample:
    return Sample([1], [2], [0.0], "stop", 0, 0, group, 0, reward=reward)


def test_select_groups_takes_informative_groups_first_in_draw_order():
    samples = [
        _sample(g, r) for g, rs in enumerate([(1, 1), (0, 1), (2, 2), (1, 0), (0, 1)]) for r in rs
    ]
    chosen, informative = select_groups(samples, 3)
    assert [s.group_id for s in chosen] == [1, 1, 3, 3, 4, 4] and informative == 3
    chosen, informative = select_groups(samples[:6], 3)  # groups 0, 1, 2: one informative
    assert [s.group_id for s in chosen] == [0, 0, 1, 1, 2, 2] and informative == 1
    assert not is_informative([_sample(0, 1.0)])  # one sample is no group


def test_equal_groups_draw_every_round_and_fill_the_batch():
    producer = _producer("by_prompt", rounds=2)
    samples, stats = producer.produce(0)
    assert stats["dynamic_sampling_draws"] == 3  # no draw has an informative group
    assert stats["dynamic_informative_groups"] == 0
    groups = groups_in_order(samples)
    assert len(groups) == PROMPTS and all(len(g) == SAMPLES for g in groups)
    assert producer.state()["position"] == 3 * PROMPTS  # every draw advanced the cursor


def test_informative_groups_replace_equal_ones():
    plain, plain_stats = _producer("by_response", rounds=0).produce(0)
    dynamic, stats = _producer("by_response", rounds=4).produce(0)
    assert "dynamic_sampling_draws" not in plain_stats
    plain_informative = sum(is_informative(g) for g in groups_in_order(plain))
    groups = groups_in_order(dynamic)
    assert len(groups) == PROMPTS and all(len(g) == SAMPLES for g in groups)
    informative = sum(is_informative(g) for g in groups)
    assert informative == stats["dynamic_informative_groups"] * PROMPTS
    if plain_informative < PROMPTS:  # equal groups were there to replace
        assert informative > plain_informative and stats["dynamic_sampling_draws"] > 1
    # draw 0 is the draw of a run without dynamic sampling: same seeds, same responses
    first = {(s.seed, tuple(s.response_ids)) for s in plain}
    kept_first = [s for s in dynamic if s.group_id < PROMPTS]
    assert kept_first and all((s.seed, tuple(s.response_ids)) in first for s in kept_first)


def test_dynamic_sampling_needs_groups():
    from jaxloop.config.validate import validate
    from jaxloop.errors import UsageError

    args = ["--config", "ppo.py", "--config.n_samples_per_prompt=1"]
    with pytest.raises(UsageError, match="needs n_samples_per_prompt >= 2"):
        validate(parse_args([*args, "--config.rollout.dynamic_sampling_rounds=2"]))
