"""Reward functions and the registry."""

import threading

import pytest

from jaxloop.data.rewards import REWARDS, get_reward, register_reward


def test_registry():
    assert {"exact_match", "prefix_match", "math_verify"} <= set(REWARDS)
    assert get_reward("exact_match") is REWARDS["exact_match"]
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("nope")
    # user functions by import path
    fn = get_reward("jaxloop.data.rewards:prefix_match")
    assert fn("42 and more", "42") == 1.0
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("jaxloop.data.rewards:no_such_fn")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("exact_match")(lambda r, lab: 0.0)


def test_exact_match():
    f = get_reward("exact_match")
    assert f("7", "7") == 1.0
    assert f("  7\n", "7 ") == 1.0
    assert f("77", "7") == 0.0
    assert f("", "7") == 0.0
    assert f("7 ", "") == 0.0
    assert isinstance(f("7", "7"), float)


def test_prefix_match():
    f = get_reward("prefix_match")
    assert f("7", "7") == 1.0
    assert f(" 7x?", "7") == 1.0
    assert f("x7", "7") == 0.0
    assert f("anything", "") == 0.0


@pytest.mark.parametrize(
    "response,expected",
    [
        ("0.5", 1.0),
        ("The answer is $\\boxed{1/2}$", 1.0),
        ("$\\frac{2}{4}$", 1.0),
        ("0.6", 0.0),
        ("The answer is $\\boxed{2}$", 0.0),
        ("", 0.0),
        ("no numbers here", 0.0),
        ("}{$$\\frac{\\boxed{", 0.0),
    ],
)
def test_math_verify_half(response, expected):
    assert get_reward("math_verify")(response, "\\frac{1}{2}") == expected


def test_math_verify_other_labels():
    f = get_reward("math_verify")
    assert f("so x = 42", "42") == 1.0
    assert f("41", "42") == 0.0
    # unparsable label: falls back to an exact string match
    assert f("yes", "yes") == 1.0
    assert f("no", "yes") == 0.0
    assert f("0.5", "$$\\frac{") == 0.0


def test_math_verify_in_a_thread():
    """math-verify's signal-based timeout only works in the main thread; the reward must still
    work (not silently return 0.0) from worker threads."""
    out = []
    t = threading.Thread(
        target=lambda: out.append(get_reward("math_verify")("$\\boxed{1/2}$", "\\frac{1}{2}"))
    )
    t.start()
    t.join(60)
    assert out == [1.0]
