"""How a config key is declared: a typed field `name: TYPE = knob(default, help, domain,
resume=)` of a section dataclass, and the `Domain` of values it may take. Each layer declares its
own section with these (e.g. jaxloop/rollout/settings.py); jaxloop.config composes them into the
run's config.

The field's type is part of the declaration: `Literal["a", "b"]` gives a string key its choices
(no second list in the domain), and `X | None` makes None a value of the key, where the help
text says what None means (off, detected, the algorithm's default): no number stands for "off"."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

# ---- value domains: the values every key may take, declared once ----
# validate() checks every key against its Domain (in a dry run as in a real one) before anything
# else: a value outside it is a one-line UsageError naming the key, the value and the domain.
# Cross-key rules (grpo needs >= 2 samples, top_p must be 1, the mesh's one -1, ...) follow in
# validate(); those that need the model's shape or the device count in validate_mesh().
INT32_MAX = 2**31 - 1  # counters, sizes and seeds reach jitted int32 code

FLOAT32_MAX = 3.4028234663852886e38  # every float key is used in float32: finite there


@dataclasses.dataclass(frozen=True)
class Domain:
    """A number in [lo, hi] (`open_lo` / `open_hi`: that bound excluded), or one of `also`
    (values outside the range with a meaning: mesh axes' -1, the remaining devices); a string
    among `choices` (any string when empty; `any_case`: compared upper-cased), non-empty when
    `nonempty`; None when `optional`. The schema fills `choices` from a `Literal` type and
    `optional` from `X | None` (`KeyType`). The value's type is the field's (an int key takes
    ints, a float key ints or floats, never a bool); every float is finite in float32."""

    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    also: tuple = ()
    choices: tuple[str, ...] = ()
    nonempty: bool = False
    any_case: bool = False
    optional: bool = False  # None is a value too (its meaning: the key's help text)

    def describe(self) -> str:
        return self._describe() + (" or None" if self.optional else "")

    def _describe(self) -> str:
        if self.choices:
            return "one of " + "/".join(repr(c) for c in self.choices)
        if self.nonempty:
            return "a non-empty string"
        if self.lo is None and self.hi is None:
            return "any value of its type"
        if self.hi is not None and self.hi < FLOAT32_MAX and self.lo is not None:
            brackets = ("(" if self.open_lo else "[", ")" if self.open_hi else "]")
            text = f"in {brackets[0]}{_num(self.lo)}, {_num(self.hi)}{brackets[1]}"
        else:
            text = f"{'>' if self.open_lo else '>='} {_num(self.lo)}"
        if self.also:
            text += "".join(f" or {_num(a)}" for a in self.also)
        return text

    def contains(self, value) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, str):
            v = value.upper() if self.any_case else value
            return (not self.choices or v in self.choices) and (bool(value) or not self.nonempty)
        if isinstance(value, bool):
            return True
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            return False
        if value in self.also:
            return True
        if self.lo is not None and (value < self.lo or (self.open_lo and value == self.lo)):
            return False
        return self.hi is None or not (value > self.hi or (self.open_hi and value == self.hi))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def count(lo: int = 0, hi: int = INT32_MAX, also: tuple = ()) -> Domain:
    """An integer in [lo, hi] (or one of `also`)."""
    return Domain(lo, hi, also=also)


def positive(hi: float = FLOAT32_MAX) -> Domain:
    """A number > 0 (and <= hi)."""
    return Domain(0, hi, open_lo=True)


NON_NEGATIVE = Domain(0, FLOAT32_MAX)

ANY = Domain()  # bools, and strings checked where they are used (paths, specs)


def one_of(*choices: str) -> Domain:
    return Domain(choices=choices)


# ---- the type of a key, read off its field's annotation ----
@dataclasses.dataclass(frozen=True)
class KeyType:
    """What a key's annotation says: its base type (bool, int, float or str), whether None is a
    value (`X | None`), and a `Literal`'s choices."""

    base: type
    optional: bool = False
    choices: tuple[str, ...] = ()

    def accepts(self, value) -> bool:
        """`value` is of this type (an int key takes ints, a float key ints or floats; never a
        bool where a number is meant); None only when optional."""
        if value is None:
            return self.optional
        if self.base is bool:
            return isinstance(value, bool)
        if isinstance(value, bool):
            return False
        if self.base is float:
            return isinstance(value, int | float)
        return isinstance(value, self.base)

    @property
    def name(self) -> str:
        return self.base.__name__ + (" or None" if self.optional else "")


def key_type(annotation: Any) -> KeyType:
    """The KeyType of a resolved annotation: bool, int, float, str, Literal["a", ...] or one of
    them `| None`."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]  # one type besides None
        return dataclasses.replace(key_type(inner), optional=type(None) in args)
    if typing.get_origin(annotation) is Literal:
        return KeyType(str, choices=tuple(args))
    if annotation in (bool, int, float, str):
        return KeyType(annotation)
    raise TypeError(f"a config key is bool, int, float, str or a Literal (got {annotation!r})")


def field_types(cls: type) -> dict[str, Any]:
    """`cls`'s fields' resolved annotations (sections declare theirs as strings)."""
    return typing.get_type_hints(cls)


# ---- keys ----
FREE = "free"  # a resume may change it: it does not change the run's math
MATH = "math"  # part of the run's math: a resume that changes it is refused (train/checkpoint.py)


def knob(
    default: Any,
    help: str,
    domain: Domain = ANY,
    *,
    resume: str = MATH,
    legacy_none: Callable[[Any], bool] | None = None,
) -> Any:
    """One config key: its default, its one-line `--help` text, the values it may take and its
    resume policy (FREE or MATH). `legacy_none`: for a key whose None was once spelled as a
    number (-1, 0), which stored numbers mean None (a run dir's config.json of an older jaxloop
    reads as today's)."""
    metadata = {"help": help, "domain": domain, "resume": resume, "legacy_none": legacy_none}
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type) -> Any:
    """A sub-section of the tree (its docstring is its `--help` heading)."""
    return dataclasses.field(default_factory=cls)
