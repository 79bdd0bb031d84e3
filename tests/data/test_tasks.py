"""Built-in tasks: determinism, train/eval disjointness, answers checked against an independent
computation from the prompt text."""

import subprocess
import sys
from collections import Counter

import pytest

from jaxloop.data.datasets import Example
from jaxloop.data.tasks import DEFAULT_TASK, MULTI_TOKEN_TASKS, TASKS, BuiltinTask, prompt_split
from jaxloop.data.tokenizer import CharTokenizer

# one-character answers (the multi-token tasks: tests/data/test_multitoken_tasks.py)
SINGLE_TOKEN_TASKS = [t for t in TASKS if t not in MULTI_TOKEN_TASKS]


def reference_label(name: str, prompt: str) -> str:
    """Independent re-computation of the answer from the prompt string."""
    if name == "sum_mod10":
        assert prompt[1] == "+" and prompt[3] == "=" and len(prompt) == 4
        return str((int(prompt[0]) + int(prompt[2])) % 10)
    assert prompt.endswith(":")
    digits = [int(c) for c in prompt[:-1]]
    return str(
        {
            "copy_first": digits[0],
            "copy_last": digits[-1],
            "max_digit": max(digits),
            "min_digit": min(digits),
        }[name]
    )


def test_fixed_examples():
    assert BuiltinTask("copy_first").render([7, 2, 9, 4]) == Example("7294:", "7")
    assert BuiltinTask("copy_last").render([7, 2, 9, 4]) == Example("7294:", "4")
    assert BuiltinTask("max_digit").render([7, 2, 9, 4]) == Example("7294:", "9")
    assert BuiltinTask("min_digit").render([7, 2, 9, 4]) == Example("7294:", "2")
    assert BuiltinTask("sum_mod10").render([3, 5]) == Example("3+5=", "8")
    assert BuiltinTask("sum_mod10").render([7, 8]) == Example("7+8=", "5")
    assert BuiltinTask("copy_last", num_digits=6).render([1, 2, 3, 4, 5, 0]).label == "0"
    assert DEFAULT_TASK in TASKS and BuiltinTask().name == DEFAULT_TASK


@pytest.mark.parametrize("name", SINGLE_TOKEN_TASKS)
def test_answers_correct_and_tokenizable(name):
    task = BuiltinTask(name, num_digits=4, seed=3)
    tok = CharTokenizer()
    exs = [task.prompt("train", i) for i in range(300)] + task.eval_examples(100)
    for ex in exs:
        assert ex.label == reference_label(name, ex.prompt)
        assert task.answer(ex.prompt) == ex.label
        assert len(ex.label) == 1
        tok.encode(ex.prompt + ex.label)  # within the char alphabet
    # prompt-dependent: several different answers occur
    assert len({ex.label for ex in exs}) >= 5
    with pytest.raises(ValueError):
        task.answer("abc:")


def test_train_answer_distribution_is_not_degenerate():
    labels = Counter(BuiltinTask("copy_last").prompt("train", i).label for i in range(2000))
    assert set(labels) == set("0123456789")
    assert max(labels.values()) < 2000 * 0.15  # ~uniform: 10% each


@pytest.mark.parametrize("name", TASKS)
def test_determinism(name):
    a, b = BuiltinTask(name, seed=7), BuiltinTask(name, seed=7)
    pa = [a.prompt(s, i) for s in ("train", "eval") for i in range(50)]
    assert pa == [b.prompt(s, i) for s in ("train", "eval") for i in range(50)]
    assert a.prompt("train", 123) == a.prompt("train", 123)
    c = BuiltinTask(name, seed=8)
    assert [c.prompt("train", i) for i in range(50)] != pa[:50]
    assert [a.prompt("train", i, seed=8) for i in range(50)] == [
        c.prompt("train", i) for i in range(50)
    ]


def test_determinism_across_processes():
    code = (
        "from jaxloop.data.tasks import BuiltinTask\n"
        "t = BuiltinTask('copy_last', 4, seed=11)\n"
        "print('|'.join(t.prompt('train', i).prompt for i in range(40)) + '#'"
        " + '|'.join(e.prompt for e in t.eval_examples(20)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    t = BuiltinTask("copy_last", 4, seed=11)
    here = "|".join(t.prompt("train", i).prompt for i in range(40))
    here += "#" + "|".join(e.prompt for e in t.eval_examples(20))
    assert out == here


@pytest.mark.parametrize("name,num_digits", [("copy_last", 4), ("max_digit", 3), ("sum_mod10", 2)])
def test_eval_disjoint_from_train(name, num_digits):
    task = BuiltinTask(name, num_digits=num_digits, seed=0)
    all_eval = {e.prompt for e in task.eval_examples(10**6)}
    assert len(all_eval) == task.num_eval_prompts
    # about 1 in 10 prompts is held out
    assert 0.05 * task.num_prompts <= len(all_eval) <= 0.15 * task.num_prompts
    for seed in (0, 1, 2):
        train = {task.prompt("train", i, seed=seed).prompt for i in range(3000)}
        assert not train & all_eval
    # every prompt of the space is in exactly one split, decided by the prompt alone
    for p in all_eval:
        assert prompt_split(p) == "eval"
    for i in range(200):
        assert prompt_split(task.prompt("eval", i).prompt) == "eval"


def test_eval_examples_distinct_fixed_and_seed_independent():
    a, b = BuiltinTask("copy_first", seed=0), BuiltinTask("copy_first", seed=99)
    ea = a.eval_examples(64)
    assert len(ea) == 64 and len({e.prompt for e in ea}) == 64
    assert ea == b.eval_examples(64)
    assert a.eval_examples(10) == ea[:10]
    assert a.eval_examples(0) == []
    # small space: fewer eval prompts than asked -> all of them
    small = BuiltinTask("sum_mod10")
    assert len(small.eval_examples(1000)) == small.num_eval_prompts < 100


def test_eval_examples_large_space():
    task = BuiltinTask("copy_last", num_digits=8)
    assert task.num_eval_prompts is None
    exs = task.eval_examples(300)
    assert len({e.prompt for e in exs}) == 300
    assert all(prompt_split(e.prompt) == "eval" for e in exs)
    train = {task.prompt("train", i).prompt for i in range(1000)}
    assert not train & {e.prompt for e in exs}


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown builtin task"):
        BuiltinTask("nope")
    with pytest.raises(ValueError, match="num_digits"):
        BuiltinTask("copy_last", num_digits=0)
    with pytest.raises(ValueError, match="num_digits >= 2"):
        BuiltinTask("max_digit", num_digits=1)
    with pytest.raises(ValueError, match="split"):
        BuiltinTask().prompt("test", 0)
    with pytest.raises(ValueError, match="index"):
        BuiltinTask().prompt("train", -1)
