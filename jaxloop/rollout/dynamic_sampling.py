"""Dynamic sampling (DAPO): a group whose rewards are all equal has zero group-relative advantage
and only dilutes the update, so up to `rollout.dynamic_sampling_rounds` further batches of prompts
are drawn and the update trains on the groups whose rewards differ, in the order they were drawn.
When the rounds run out first, equal groups (first drawn first) fill the batch back to
`prompts_per_update` groups, so every update trains on the same number of groups."""

from __future__ import annotations

from collections.abc import Sequence

from jaxloop.rollout.types import Sample


def groups_in_order(samples: Sequence[Sample]) -> list[list[Sample]]:
    """The samples' groups (by group_id), in the order their first sample appears."""
    groups: dict[int, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    return list(groups.values())


def is_informative(group: Sequence[Sample]) -> bool:
    """Two or more samples whose rewards are not all equal (a non-zero advantage somewhere)."""
    return len(group) >= 2 and len({s.reward for s in group}) > 1


def count_informative(samples: Sequence[Sample]) -> int:
    return sum(is_informative(g) for g in groups_in_order(samples))


def select_groups(samples: Sequence[Sample], groups_wanted: int) -> tuple[list[Sample], int]:
    """`groups_wanted` groups of `samples`: the informative ones in draw order, then equal ones
    in draw order; and how many of the chosen are informative."""
    groups = groups_in_order(samples)
    informative = [g for g in groups if is_informative(g)][:groups_wanted]
    filler = [g for g in groups if not is_informative(g)][: groups_wanted - len(informative)]
    chosen = {id(g) for g in informative + filler}
    # keep the draw order of the chosen groups: the batch reads as it was generated
    return [s for g in groups if id(g) in chosen for s in g], len(informative)
