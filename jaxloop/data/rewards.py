"""Verifiable rewards: `fn(response_text, label) -> float`, looked up by name.

- 'exact_match':  1.0 iff response.strip() == label.strip().
- 'prefix_match': 1.0 iff response.strip() starts with label.strip() (non-empty label); a lenient
  reward for policies that have not learned to stop yet.
- 'format':       partial credit for multi-token answers, so RL can start from random init:
  1.0 for an exact match, else 0.5 * (leading characters of the response that match the label) /
  len(label) (stripped strings): the right length alone earns nothing (credit for the format
  alone reinforces whatever digits the well-formed samples had and collapsed the policy onto a
  constant answer in our runs), a right prefix without the stop earns at most 0.5, so a mean
  above 0.5 needs exact answers.
- 'math_verify':  1.0 iff math_verify.verify(parse(label), parse(response)); never raises (0.0 on a
  parse/verify failure). A label math-verify cannot parse (e.g. "yes") falls back to exact_match.

`get_reward(name)` also accepts "package.module:function" for a user reward function. Such a
function may also take the example's whole row as a keyword, `fn(response, label, *, row)` (or
`**kwargs`), as TRL passes a dataset's extra columns to its reward functions: `row` is the data
file's row as read (a dict), or {prompt, label} for a built-in task. `with_row(fn)` decides which
call a function gets once, from its signature (docs/data.md, "Reward functions").
"""

from __future__ import annotations

import copy
import importlib
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

from jaxloop.registry import Registry

__all__ = ["REWARDS", "RewardFn", "get_reward", "register_reward", "takes_row", "with_row"]

RewardFn = Callable[[str, str], float]
REWARDS: Registry[RewardFn] = Registry("reward")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    return REWARDS.register(name)


def get_reward(name: str) -> RewardFn:
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except Exception as e:  # noqa: BLE001 - user code: a module may raise anything on import
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(
                f"cannot import reward function {name!r}: {type(e).__name__}: {text}"
            ) from e
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
        row = {"row": {}} if takes_row(fn) else {}
        try:
            inspect.signature(fn).bind("response", "label", **row)
        except TypeError as e:
            call = "fn(response, label, row=row)" if row else "fn(response, label)"
            raise ValueError(f"reward function {name!r} cannot be called as {call}: {e}") from None
        except ValueError:  # no signature (a builtin): the first call tells
            pass
        return fn
    raise ValueError(
        f"unknown reward {name!r}; choose one of {sorted(REWARDS)} or give 'module:function'"
    )


def takes_row(fn: Callable) -> bool:
    """Whether `fn` takes the row: a parameter `row` that can be passed by keyword, or
    `**kwargs`. A function without a signature (a builtin) is called as fn(response, label)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == "row" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        for p in params
    )


def with_row(fn: Callable) -> Callable[[str, str, Mapping[str, Any] | None], Any]:
    """`fn` as a call of (response, label, row): the row is handed on (a copy, so a function that
    changes it cannot change the data of later calls) when `fn` takes it, else dropped; decided
    here, once, never by trying the call."""
    if not takes_row(fn):
        return lambda response, label, row=None: fn(response, label)
    return lambda response, label, row=None: fn(response, label, row=copy.deepcopy(dict(row or {})))


@register_reward("exact_match")
def exact_match(response: str, label: str) -> float:
    return 1.0 if response.strip() == label.strip() else 0.0


@register_reward("prefix_match")
def prefix_match(response: str, label: str) -> float:
    label = label.strip()
    return 1.0 if label and response.strip().startswith(label) else 0.0


@register_reward("format")
def format_reward(response: str, label: str) -> float:
    response, label = response.strip(), label.strip()
    if response == label:
        return 1.0
    prefix = 0  # leading characters that are right: later ones count only after earlier ones
    for a, b in zip(response, label, strict=False):
        if a != b:
            break
        prefix += 1
    return 0.5 * prefix / max(len(label), 1)


@register_reward("math_verify")
def math_verify_reward(response: str, label: str) -> float:
    try:
        from math_verify import parse, verify

        # math-verify's timeouts use signal.alarm, which only works in the main thread.
        main = threading.current_thread() is threading.main_thread()
        ptimeout = 5 if main else None
        gold = parse(label, parsing_timeout=ptimeout)
        if not gold:
            return exact_match(response, label)
        pred = parse(response, parsing_timeout=ptimeout)
        if not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=5 if main else None) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never crash the run
        return 0.0
