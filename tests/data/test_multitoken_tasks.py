"""Multi-token built-in tasks (reverse, sort, add): answers checked against an independent
computation from the prompt text, determinism, train/eval split by prompt, and the `format`
reward's hand values."""

import pytest

from jaxloop.data.datasets import Example, make_eval_examples, make_source
from jaxloop.data.rewards import get_reward
from jaxloop.data.tasks import MULTI_TOKEN_TASKS, TASKS, BuiltinTask, prompt_split
from jaxloop.data.tokenizer import CharTokenizer


def reference_label(name: str, prompt: str) -> str:
    """The answer re-computed from the prompt string alone."""
    if name == "add":
        assert prompt.endswith("=") and prompt.count("+") == 1
        a, b = prompt[:-1].split("+")
        assert a == str(int(a)) and b == str(int(b))  # no leading zeros
        return str(int(a) + int(b))
    assert prompt.endswith(":")
    body = prompt[:-1]
    return body[::-1] if name == "reverse" else "".join(sorted(body))


def test_fixed_examples():
    assert BuiltinTask("reverse", 4).render([7, 2, 9, 4]) == Example("7294:", "4927")
    assert BuiltinTask("sort", 4).render([7, 2, 9, 4]) == Example("7294:", "2479")
    assert BuiltinTask("reverse", 3).render([0, 4, 0]) == Example("040:", "040")
    assert BuiltinTask("sort", 3).render([3, 0, 3]) == Example("303:", "033")
    assert BuiltinTask("add", 3).render([1, 2, 3, 0, 4, 5]) == Example("123+45=", "168")
    assert BuiltinTask("add", 3).render([9, 9, 9, 9, 9, 9]) == Example("999+999=", "1998")
    assert BuiltinTask("add", 3).render([0, 0, 0, 0, 0, 7]) == Example("0+7=", "7")
    assert BuiltinTask("add", 1).render([8, 6]) == Example("8+6=", "14")
    assert set(MULTI_TOKEN_TASKS) == {"reverse", "sort", "add"} <= set(TASKS)


@pytest.mark.parametrize(
    "name,num_digits", [("reverse", 3), ("reverse", 5), ("sort", 4), ("add", 1), ("add", 3)]
)
def test_answers_correct_and_tokenizable(name, num_digits):
    task = BuiltinTask(name, num_digits=num_digits, seed=3)
    tok = CharTokenizer()
    exs = [task.prompt("train", i) for i in range(300)] + task.eval_examples(100)
    for ex in exs:
        assert ex.label == reference_label(name, ex.prompt)
        assert task.answer(ex.prompt) == ex.label
        assert 1 <= len(ex.label) <= task.max_answer_tokens
        tok.encode(ex.prompt + ex.label)  # within the char alphabet
    assert len({ex.label for ex in exs}) >= 10  # prompt-dependent answers
    assert max(len(ex.label) for ex in exs) == task.max_answer_tokens
    if name != "add":
        assert all(len(ex.label) == num_digits for ex in exs)
    for bad in ("abc:", "12:", "1234567:", "1+2", "12+3:", "01+2=", "1+2+3=", "1234+5="):
        with pytest.raises(ValueError):
            task.answer(bad)


@pytest.mark.parametrize("name,num_digits", [("reverse", 3), ("sort", 4), ("add", 3)])
def test_determinism(name, num_digits):
    a, b = BuiltinTask(name, num_digits, seed=7), BuiltinTask(name, num_digits, seed=7)
    pa = [a.prompt(s, i) for s in ("train", "eval") for i in range(50)]
    assert pa == [b.prompt(s, i) for s in ("train", "eval") for i in range(50)]
    c = BuiltinTask(name, num_digits, seed=8)
    assert [c.prompt("train", i) for i in range(50)] != pa[:50]
    assert a.eval_examples(40) == c.eval_examples(40)  # held-out set: seed-independent
    # the data source and the held-out examples the trainer builds are the same functions
    cfg = {"source": "builtin", "task": name, "num_digits": num_digits, "seed": 7}
    assert make_source(cfg).next_batch(20) == pa[:20]
    assert make_eval_examples(cfg, 16) == a.eval_examples(16)


@pytest.mark.parametrize("name,num_digits", [("reverse", 3), ("sort", 3), ("add", 1), ("add", 3)])
def test_eval_disjoint_from_train(name, num_digits):
    task = BuiltinTask(name, num_digits=num_digits, seed=0)
    held_out = {e.prompt for e in task.eval_examples(2000)}
    assert all(prompt_split(p) == "eval" for p in held_out)
    if task.num_eval_prompts is not None:  # enumerable: all of them, ~1 in 10
        assert len(held_out) == task.num_eval_prompts
        assert 0.05 * task.num_prompts <= len(held_out) <= 0.15 * task.num_prompts
    else:
        assert len(held_out) == 2000
    for seed in (0, 1):
        train = {task.prompt("train", i, seed=seed).prompt for i in range(3000)}
        assert not train & held_out
        assert all(prompt_split(p) == "train" for p in train)


def test_sizes_and_bad_arguments():
    assert BuiltinTask("reverse", 3).num_prompts == 1000
    assert BuiltinTask("add", 2).num_prompts == 10**4  # (a, b) pairs, 0..99 each
    assert BuiltinTask("add", 3).num_eval_prompts is None  # 10**6: sampled, not enumerated
    assert [BuiltinTask(n, 3).max_answer_tokens for n in ("reverse", "sort", "add")] == [3, 3, 4]
    for name in ("reverse", "sort"):
        with pytest.raises(ValueError, match="num_digits >= 2"):
            BuiltinTask(name, num_digits=1)
    with pytest.raises(ValueError, match="add needs num_digits in 1..9"):
        BuiltinTask("add", num_digits=10)


def test_format_reward_hand_values():
    f = get_reward("format")
    # exact (whitespace stripped, as exact_match): full reward
    assert f("4927", "4927") == 1.0
    assert f(" 4927\n", "4927") == 1.0
    # the right prefix: 0.5 * (leading characters right) / len(label)
    assert f("4920", "4927") == pytest.approx(0.5 * 3 / 4)
    assert f("49", "4927") == pytest.approx(0.5 * 2 / 4)
    assert f("49270", "4927") == pytest.approx(0.5)  # all of it, but not stopped
    # a wrong first character: nothing after it counts, and the right length earns nothing
    assert f("0927", "4927") == 0.0
    assert f("1111", "4927") == 0.0
    assert f("", "4927") == 0.0
    assert f("7", "8") == 0.0
    # a wrong answer never scores above 0.5; a mean above 0.5 needs exact answers
    assert max(f(r, "4927") for r in ("4928", "4900", "492", "49277", "x927")) <= 0.5
    assert all(isinstance(f(r, "12"), float) for r in ("12", "1", ""))
    # agrees with exact_match on what counts as fully right
    exact = get_reward("exact_match")
    for r in ("12", "12 ", "21", "120", ""):
        assert (f(r, "12") == 1.0) == (exact(r, "12") == 1.0)
