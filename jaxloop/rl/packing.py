"""Sequence packing for the learner: host-side (numpy) plans with static shapes.

The learner's micro-batches stay exactly those of the padded path (the same samples in the same
order, per forward pass and per optimizer step); only each micro-batch's model input changes:
its samples are packed first-fit-decreasing into `rows` rows of `pack_tokens` tokens. A segment
is one sample's input tokens (its attention-masked prefix of tokens[:, :-1]), with segment id =
its slot in the micro-batch + 1 (0 = padding) and positions restarting at 0; the target of each
packed token is the sample's next token. Every per-token result (log-prob, entropy, KL, value,
hidden state) is gathered back to the sample's own [T] positions through `index` (1 + the flat
position in its micro-batch's rows; 0 = not a token of the sample, which reads 0), so losses,
advantages, groups and normalisation see the same [N, T] arrays as the padded path.

Static shapes: the rows per micro-batch are bucketed (a multiple of the data-parallel size,
doubling: log2(micro / dp) + 1 distinct values at most), and the trainer gives every batch the
one sample length pack_tokens + 1, so the jitted learner compiles once per bucket.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import struct

from jaxloop.mathutil import round_up


@struct.dataclass
class PackedRows:
    """Micro-batches packed into rows, as the learner reads them (a pytree): tokens, targets,
    positions and segment_ids [G * R, P] int32 (micro-batch g owns rows g * R .. (g + 1) * R - 1;
    split by the learner into [..., R, P]) and index [N, T] int32 per sample (1 + the flat
    position of the sample's token in its micro-batch's rows, 0 = none; split like every
    per-sample field)."""

    tokens: jax.Array
    targets: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    index: jax.Array


def input_lengths(attention_mask: np.ndarray) -> np.ndarray:
    """Tokens of each sample's model input (attention_mask[:, :-1]), which must be a prefix."""
    inputs = np.asarray(attention_mask[:, :-1], np.bool_)
    lengths = inputs.sum(axis=1)
    prefix = np.arange(inputs.shape[1])[None, :] < lengths[:, None]
    if not np.array_equal(inputs, prefix):
        raise ValueError("packing needs right-padded samples (attention mask a prefix)")
    return lengths.astype(np.int64)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of positions into `lengths`) of total length <= capacity: longest first
    (ties by position, so the plan is deterministic), each into the first bin it fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        need = int(lengths[i])
        if need > capacity:
            raise ValueError(
                f"a sample of {need} tokens does not fit learner.pack_tokens={capacity}"
            )
        for b, free in enumerate(room):
            if need <= free:
                bins[b].append(i)
                room[b] -= need
                break
        else:
            bins.append([i])
            room.append(capacity - need)
    return bins


def row_bucket(needed: int, multiple: int, most: int) -> int:
    """Rows per micro-batch: `multiple` x the smallest power of two that holds `needed`, capped
    at `most` rounded up to `multiple`."""
    rows = multiple
    while rows < needed:
        rows *= 2
    return max(min(rows, round_up(most, multiple)), round_up(needed, multiple))


@dataclasses.dataclass
class PackedGroups:
    """Micro-batches packed into rows: [G * rows, P] arrays (micro-batch g owns rows
    g * rows .. (g + 1) * rows - 1), and index [N, T] per sample (see the module docstring)."""

    tokens: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    index: np.ndarray
    rows: int

    def packed_rows(self) -> PackedRows:
        return PackedRows(self.tokens, self.targets, self.positions, self.segment_ids, self.index)


def pack_groups(
    tokens: np.ndarray,
    attention_mask: np.ndarray,
    groups: np.ndarray,
    pack_tokens: int,
    row_multiple: int = 1,
) -> PackedGroups:
    """Pack each micro-batch of `groups` ([G, micro] sample indices; entries >= N are empty
    slots) into the same number of rows of `pack_tokens` tokens."""
    n, seq = tokens.shape
    lengths = input_lengths(attention_mask)
    plans = []
    for group in groups:
        slots = [j for j, i in enumerate(group) if i < n]
        bins = first_fit_decreasing(lengths[group[slots]], pack_tokens)
        plans.append([[slots[k] for k in b] for b in bins])
    needed = max((len(p) for p in plans), default=1)
    rows = row_bucket(max(needed, 1), row_multiple, groups.shape[1])
    shape = (len(groups) * rows, pack_tokens)
    packed = {
        k: np.zeros(shape, np.int32) for k in ("tokens", "targets", "positions", "segment_ids")
    }
    index = np.zeros((n, seq - 1), np.int32)
    for g, (group, bins) in enumerate(zip(groups, plans, strict=True)):
        for r, row_slots in enumerate(bins):
            row, start = g * rows + r, 0
            for slot in row_slots:
                i, length = int(group[slot]), int(lengths[group[slot]])
                cols = slice(start, start + length)
                packed["tokens"][row, cols] = tokens[i, :length]
                packed["targets"][row, cols] = tokens[i, 1 : length + 1]
                packed["positions"][row, cols] = np.arange(length)
                packed["segment_ids"][row, cols] = slot + 1
                index[i, :length] = 1 + r * pack_tokens + start + np.arange(length)
                start += length
    return PackedGroups(index=index, rows=rows, **packed)
