"""How a config key is declared: `knob(default, help, domain, resume=)` in a section dataclass,
and the `Domain` of values it may take. Each layer declares its own section with these (e.g.
jaxloop/rollout/settings.py); jaxloop.config composes them into the run's config."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# ---- value domains: the values every key may take ----
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
    (values outside the range with a meaning, e.g. -1: off; `off_below_zero`: any negative
    number, off); a string among `choices` (any
    string when empty; `any_case`: compared upper-cased), non-empty when `nonempty`. The value's
    type is base_config()'s (an int key takes ints, a float key ints or floats, never a bool);
    every float is finite in float32."""

    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    also: tuple = ()
    choices: tuple[str, ...] = ()
    nonempty: bool = False
    any_case: bool = False
    off_below_zero: bool = False  # any negative number is accepted too (it means: off)

    def describe(self) -> str:
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
        if self.off_below_zero:
            text += " or < 0 (off)"
        return text

    def contains(self, value) -> bool:
        if isinstance(value, str):
            v = value.upper() if self.any_case else value
            return (not self.choices or v in self.choices) and (bool(value) or not self.nonempty)
        if isinstance(value, bool):
            return True
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            return False
        if value in self.also or (self.off_below_zero and value < 0):
            return True
        if self.lo is not None and (value < self.lo or (self.open_lo and value == self.lo)):
            return False
        return self.hi is None or not (value > self.hi or (self.open_hi and value == self.hi))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def count(lo: int = 0, hi: int = INT32_MAX, also: tuple = ()) -> Domain:
    """An integer in [lo, hi] (or one of `also`)."""
    return Domain(lo, hi, also=also)


def positive(hi: float = FLOAT32_MAX, off_below_zero: bool = False) -> Domain:
    """A number > 0 (and <= hi); `off_below_zero`: or any negative number (off)."""
    return Domain(0, hi, open_lo=True, off_below_zero=off_below_zero)


NON_NEGATIVE = Domain(0, FLOAT32_MAX)

ANY = Domain()  # bools, and strings checked where they are used (paths, specs)


def one_of(*choices: str) -> Domain:
    return Domain(choices=choices)


# ---- keys ----
FREE = "free"  # a resume may change it: it does not change the run's math
MATH = "math"  # part of the run's math: a resume that changes it is refused (train/checkpoint.py)


def knob(default: Any, help: str, domain: Domain = ANY, *, resume: str = MATH) -> Any:
    """One config key: its default, its one-line `--help` text, the values it may take and its
    resume policy (FREE or MATH)."""
    return dataclasses.field(
        default=default, metadata={"help": help, "domain": domain, "resume": resume}
    )


def section(cls: type) -> Any:
    """A sub-section of the tree (its docstring is its `--help` heading)."""
    return dataclasses.field(default_factory=cls)
