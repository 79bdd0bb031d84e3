"""optim.schedule and optim.warmup_steps (jaxloop/rl/optim.py) against the formulas written out
here: a linear warm-up from 0, then constant, or a cosine / linear decay to 0 at the run's last
optimizer step; a run no longer than its warm-up is warm-up throughout (the setting is honoured,
never dropped)."""

import math

import pytest

from jaxloop.rl.optim import learning_rate_schedule

LR = 1e-3


def expected(schedule: str, warmup: int, total: int, t: int) -> float:
    if t < warmup:
        return LR * t / warmup
    if schedule == "constant" or warmup >= total:
        return LR if schedule == "constant" else LR * min(t, warmup) / warmup
    frac = min((t - warmup) / (total - warmup), 1.0)
    if schedule == "linear":
        return LR * (1 - frac)
    return LR * 0.5 * (1 + math.cos(math.pi * frac))


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 50), (20, 300), (20, 4), (5, 5)])
def test_schedule_follows_the_formula(schedule, warmup, total):
    sched = learning_rate_schedule(LR, schedule, warmup, total)
    for t in range(total + 1):
        assert float(sched(t)) == pytest.approx(expected(schedule, warmup, total, t), abs=1e-9)


def test_the_first_step_after_a_warm_up_is_zero():
    # the recipe's point: Adam's first update (lr x sign(gradient)) is taken at rate 0
    assert float(learning_rate_schedule(LR, "cosine", 20, 300)(0)) == 0.0


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        learning_rate_schedule(LR, "step", 0, 10)
