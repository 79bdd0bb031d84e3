"""train/hooks.py: which hooks run at which point of an update, and when `every` / `last` make
one due."""

import pytest

from jaxloop.train.hooks import Hook, Hooks, Step


def test_every_counts_finished_updates():
    # at "start" the updates finished so far are the update's index; from "end" on, one more
    ran = []
    hooks = Hooks(
        [
            Hook(lambda s: ran.append(("eval", s.update)), at="start", every=2),
            Hook(lambda s: ran.append(("save", s.update)), at="saved", every=2, last=5),
            Hook(lambda s: ran.append(("final", s.update)), at="end", every=None, last=5),
            Hook(lambda s: ran.append(("never", s.update)), at="end", every=None),
        ]
    )
    for update in range(5):
        step = Step(update, {})
        for point in ("start", "forward", "logprobs", "end", "saved"):
            hooks.run(point, step)
    assert ran == [
        ("eval", 0),
        ("save", 1),
        ("eval", 2),
        ("save", 3),
        ("eval", 4),
        ("final", 4),
        ("save", 4),
    ]


def test_hooks_of_one_point_run_in_list_order():
    ran = []
    hooks = Hooks([Hook(lambda s, name=name: ran.append(name)) for name in "abc"])
    hooks.run("end", Step(0, {}))
    hooks.run("start", Step(1, {}))  # none at this point
    assert ran == ["a", "b", "c"]


def test_unknown_point_is_refused():
    with pytest.raises(ValueError, match="hook point 'after'"):
        Hook(lambda s: None, at="after")


def test_every_below_one_is_refused():  # None is never; 0 is no interval
    with pytest.raises(ValueError, match="every=0"):
        Hook(lambda s: None, every=0)
