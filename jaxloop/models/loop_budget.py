"""The loop budget: a schedule of how many loops (K <= num_loops) the model runs at each update.

`model.loop_budget = "K@N,..."` parses to ((N, K), ...); the budget of an update is a function of
the update number alone, so a resumed run continues the schedule where it stopped. The rollout
producer, the trainer and the config's validation all read it from here.
"""

from __future__ import annotations

from jaxloop.errors import UsageError

__all__ = ["check_loop_budget", "loop_budget_at", "parse_loop_budget"]


def parse_loop_budget(spec: str) -> tuple[tuple[int, int], ...]:
    """model.loop_budget "K@N,..." -> ((N, K), ...) in update order; "" -> () (full depth).
    Each K >= 1, the first N is 0 and the N increase (UsageError otherwise)."""
    spec = spec.strip()
    if not spec:
        return ()
    schedule = []
    for part in spec.split(","):
        loops, at, start = part.strip().partition("@")
        try:
            item = (int(start), int(loops))
        except ValueError:
            item = None
        if not at or item is None:
            raise UsageError(f"model.loop_budget={spec!r}: {part.strip()!r} is not K@N (ints)")
        schedule.append(item)
    starts = [n for n, _ in schedule]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        raise UsageError(f"model.loop_budget={spec!r}: the updates N must start at 0 and increase")
    if any(k < 1 for _, k in schedule):
        raise UsageError(f"model.loop_budget={spec!r}: every K must be >= 1")
    return tuple(schedule)


def check_loop_budget(schedule: tuple[tuple[int, int], ...], num_loops: int) -> None:
    """Every K of the schedule within the model's 1..num_loops."""
    for _, loops in schedule:
        if loops > num_loops:
            raise UsageError(
                f"model.loop_budget: K={loops} exceeds the model's num_loops={num_loops}"
            )


def loop_budget_at(schedule: tuple[tuple[int, int], ...], update: int) -> int | None:
    """The loops of `update` under the schedule (None: no schedule, full depth). A function of
    the update number alone, so a resumed run continues the schedule where it stopped."""
    loops = None
    for start, k in schedule:
        if update >= start:
            loops = k
    return loops
