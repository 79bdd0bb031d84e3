"""Built-in verifiable tasks over digit strings, small enough to learn by RL from random init.

Answers of the first five are one character; those of 'reverse', 'sort' and 'add' have several
(`max_answer_tokens`); a policy has to emit `label` then EOS. Prompts are generated
deterministically from (seed, split, index). The train/eval split is a function of the prompt
string alone (sha256 of the prompt, 1 in 10 goes to 'eval'), so held-out eval prompts are
never training prompts, whatever the seed.

Variants (prompt -> label), with num_digits=4:

- 'copy_first': "7294:" -> "7"  (default, also of the config's data.task)
- 'copy_last':  "7294:" -> "4"  (previous-token attention: the easiest pattern)
- 'max_digit':  "7294:" -> "9"
- 'min_digit':  "7294:" -> "2"
- 'sum_mod10':  "3+5="  -> "8"  (always two digits; num_digits is ignored)
- 'reverse':    "7294:" -> "4927"
- 'sort':       "7294:" -> "2479"
- 'add':        "123+45=" -> "168"  (two numbers of up to num_digits digits each, no leading zeros)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from jaxloop.data.types import Example

__all__ = [
    "DEFAULT_TASK",
    "EVAL_FRACTION",
    "MULTI_TOKEN_TASKS",
    "SPLITS",
    "TASKS",
    "Task",
    "BuiltinTask",
    "prompt_split",
]

Task = Literal[
    "copy_last", "copy_first", "max_digit", "min_digit", "sum_mod10", "reverse", "sort", "add"
]
TASKS: tuple[str, ...] = get_args(Task)
MULTI_TOKEN_TASKS = ("reverse", "sort", "add")
DEFAULT_TASK = "copy_first"  # the default job's task (jaxloop.config takes it from here)
SPLITS = ("train", "eval")
EVAL_FRACTION = 10  # 1 prompt in EVAL_FRACTION is held out for eval
_ENUMERATE_MAX = 100_000  # prompt spaces up to this size are enumerated for eval_examples
_EVAL_STREAM_SEED = 0x5EED  # eval examples do not depend on the task seed


def prompt_split(prompt: str) -> str:
    """'eval' for ~1/EVAL_FRACTION of prompt strings (by sha256), else 'train'."""
    h = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big")
    return "eval" if h % EVAL_FRACTION == 0 else "train"


def _hash_order(prompt: str) -> bytes:
    return hashlib.sha256(b"order|" + prompt.encode("utf-8")).digest()


@dataclass(frozen=True)
class BuiltinTask:
    """`BuiltinTask(name, num_digits, seed)`; `.prompt(split, index)`, `.eval_examples(n)`."""

    name: str = DEFAULT_TASK
    num_digits: int = 4
    seed: int = 0
    _eval_cache: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.name not in TASKS:
            raise ValueError(f"unknown builtin task {self.name!r}; choose one of {TASKS}")
        if self.name != "sum_mod10" and not 1 <= int(self.num_digits) <= 18:
            raise ValueError(f"num_digits must be in 1..18, got {self.num_digits}")
        if self.name in ("max_digit", "min_digit", "reverse", "sort") and self.num_digits < 2:
            raise ValueError(f"{self.name} needs num_digits >= 2, got {self.num_digits}")
        if self.name == "add" and not 1 <= int(self.num_digits) <= 9:
            raise ValueError(f"add needs num_digits in 1..9, got {self.num_digits}")

    # ----- the task -----------------------------------------------------------------------
    @property
    def digits_per_prompt(self) -> int:
        if self.name == "sum_mod10":
            return 2
        return 2 * int(self.num_digits) if self.name == "add" else int(self.num_digits)

    @property
    def max_answer_tokens(self) -> int:
        """Longest label in characters (char-tokenizer tokens), EOS not counted."""
        if self.name == "add":
            return int(self.num_digits) + 1
        return int(self.num_digits) if self.name in ("reverse", "sort") else 1

    @property
    def num_prompts(self) -> int:
        """Size of the prompt space (train + eval)."""
        return 10**self.digits_per_prompt

    def render(self, digits: list[int] | tuple[int, ...]) -> Example:
        """The prompt and its label for a digit sequence of length `digits_per_prompt`."""
        if len(digits) != self.digits_per_prompt:
            raise ValueError(f"{self.name} takes {self.digits_per_prompt} digits, got {digits}")
        d = [int(x) for x in digits]
        if self.name == "sum_mod10":
            return Example(f"{d[0]}+{d[1]}=", str((d[0] + d[1]) % 10))
        if self.name == "add":
            n = int(self.num_digits)
            a, b = int("".join(map(str, d[:n]))), int("".join(map(str, d[n:])))
            return Example(f"{a}+{b}=", str(a + b))
        prompt = "".join(map(str, d)) + ":"
        if self.name in ("reverse", "sort"):
            out = d[::-1] if self.name == "reverse" else sorted(d)
            return Example(prompt, "".join(map(str, out)))
        answer = {
            "copy_last": d[-1],
            "copy_first": d[0],
            "max_digit": max(d),
            "min_digit": min(d),
        }[self.name]
        return Example(prompt, str(answer))

    def answer(self, prompt: str) -> str:
        """The label of a prompt string of this task (ValueError if it is not one)."""
        body = prompt[:-1]
        if self.name == "add":
            numbers = body.split("+")
            n = int(self.num_digits)
            if len(numbers) != 2 or not all(x.isdigit() and len(x) <= n for x in numbers):
                raise ValueError(f"{prompt!r} is not a {self.name} prompt")
            digits = list("".join(x.zfill(n) for x in numbers))
        else:
            digits = body.split("+") if self.name == "sum_mod10" else list(body)
        if not all(len(x) == 1 and x.isdigit() for x in digits):
            raise ValueError(f"{prompt!r} is not a {self.name} prompt")
        ex = self.render([int(x) for x in digits])
        if ex.prompt != prompt:
            raise ValueError(f"{prompt!r} is not a {self.name} prompt")
        return ex.label

    # ----- deterministic sampling ----------------------------------------------------------
    def prompt(self, split: str, index: int, *, seed: int | None = None) -> Example:
        """Example number `index` of `split`, a pure function of (seed, split, index).

        Train examples are drawn uniformly (with replacement) from train prompts.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        seed = self.seed if seed is None else seed
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, SPLITS.index(split), int(index)])
        k = self.digits_per_prompt
        for _ in range(10_000):
            ex = self.render(rng.integers(0, 10, size=k).tolist())
            if prompt_split(ex.prompt) == split:
                return ex
        raise RuntimeError(f"no {split} prompt found for {self}")  # pragma: no cover

    def eval_examples(self, n: int) -> list[Example]:
        """`n` distinct held-out examples in a fixed order (independent of the task seed).

        Small prompt spaces are enumerated; if fewer than `n` eval prompts exist, all of them are
        returned (see `num_eval_prompts`).
        """
        if n <= 0:
            return []
        if self.num_prompts <= _ENUMERATE_MAX:
            return list(self._all_eval()[:n])
        seen: set[str] = set()
        out: list[Example] = []
        i = 0
        while len(out) < n:
            ex = self.prompt("eval", i, seed=_EVAL_STREAM_SEED)
            i += 1
            if ex.prompt not in seen:
                seen.add(ex.prompt)
                out.append(ex)
        return out

    @property
    def num_eval_prompts(self) -> int | None:
        """Number of held-out prompts (None if the space is too large to enumerate)."""
        return len(self._all_eval()) if self.num_prompts <= _ENUMERATE_MAX else None

    def _all_eval(self) -> list[Example]:
        if not self._eval_cache:
            k = self.digits_per_prompt
            exs = []
            for v in range(self.num_prompts):
                ex = self.render([int(c) for c in str(v).zfill(k)])
                if prompt_split(ex.prompt) == "eval":
                    exs.append(ex)
            exs.sort(key=lambda e: _hash_order(e.prompt))
            self._eval_cache.extend(exs)
        return self._eval_cache
