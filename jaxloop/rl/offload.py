"""Memory offload of the train state: the parts an update phase does not use rest in host memory
(`memory_kind='pinned_host'`), and the update runs as its phases with the moves between them.

The moves' times and sizes come back as values (`offload_{part}_{to_host|to_device}_{s|gb}`),
merged into the update's metrics; nothing is kept on an object between calls.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxloop.rl.state import TrainState
from jaxloop.rl.train_batch import TrainBatch


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """What rests in host memory (`memory_kind='pinned_host'`) while the phase at work does not
    use it: the critic and its optimizer state (outside the value / critic phases), the actor's
    optimizer state (outside the actor phase: during generation and the critic phase), the
    reference (outside the reference log-prob phase). Any flag on runs the update as three
    jitted phases with the moves between them; all off runs it as one fused program."""

    critic: bool = False
    optimizer: bool = False
    reference: bool = False

    @property
    def any(self) -> bool:
        return self.critic or self.optimizer or self.reference


class Phases(NamedTuple):
    """The jitted phases of one update (the learner's `prepare`, `actor_steps`, `critic_steps`
    and `count`)."""

    prepare: Callable
    actor: Callable
    critic: Callable
    counters: Callable


def offloaded_fields(offload: OffloadConfig, state: TrainState) -> dict[str, tuple[str, ...]]:
    """The state fields each offload flag keeps in host memory (those the state has)."""
    fields = {
        "critic": ("critic_params", "critic_opt") if offload.critic else (),
        "optimizer": ("actor_opt",) if offload.optimizer else (),
        "reference": ("ref_params",) if offload.reference else (),
    }
    return {k: tuple(f for f in v if getattr(state, f) is not None) for k, v in fields.items()}


def move(name: str, tree, memory_kind: str, delete_source: bool) -> tuple[Any, dict[str, float]]:
    """`tree` copied to `memory_kind` (same shardings otherwise), and the move's time and size as
    {offload_{name}_{to_host|to_device}_{s|gb}}."""
    start = time.perf_counter()
    moved = jax.tree.map(
        lambda x: jax.device_put(x, x.sharding.with_memory_kind(memory_kind)), tree
    )
    jax.block_until_ready(moved)
    if delete_source:
        jax.tree.map(lambda x: x.delete(), tree)
    key = f"offload_{name}_{'to_host' if memory_kind == 'pinned_host' else 'to_device'}"
    gb = sum(x.nbytes for x in jax.tree.leaves(tree)) / 1e9
    return moved, {f"{key}_s": time.perf_counter() - start, f"{key}_gb": gb}


def add_moves(total: dict[str, float], stats: dict[str, float]) -> dict[str, float]:
    """The sums of two move records."""
    return {**total, **{k: total.get(k, 0.0) + v for k, v in stats.items()}}


def rest(offload: OffloadConfig, state: TrainState) -> TrainState:
    """`state` with every offloaded part in host memory (after init or restore)."""
    moves = {}
    for name, fields in offloaded_fields(offload, state).items():
        for field in fields:
            value = getattr(state, field)
            kinds = {x.sharding.memory_kind for x in jax.tree.leaves(value)}
            if kinds - {"pinned_host"}:
                moves[field] = move(name, value, "pinned_host", delete_source=True)[0]
    return state.replace(**moves)


def run_phases(
    phases: Phases, offload: OffloadConfig, state: TrainState, batch: TrainBatch, critic_only: bool
):
    """The update as its phases, each with only what it uses on the device. Returns (trained:
    actor params, actor opt, critic params, critic opt; counted: the counters and whether the
    update was skipped; metrics with the moves' times and sizes; the fused old log-probs or
    None)."""
    off, moves = offloaded_fields(offload, state), {}

    def to(name, tree, memory_kind, delete_source):
        nonlocal moves
        moved, stats = move(name, tree, memory_kind, delete_source)
        moves = add_moves(moves, stats)
        return moved

    fetch = lambda name, field: to(name, getattr(state, field), "device", False)  # noqa: E731
    ref, critic = state.ref_params, state.critic_params
    if "ref_params" in off["reference"]:
        ref = fetch("reference", "ref_params")
    if "critic_params" in off["critic"]:
        critic = fetch("critic", "critic_params")
    prepared, metrics = phases.prepare(ref, critic, batch)
    jax.block_until_ready(prepared)
    for on_host, copy in ((off["reference"], ref), (off["critic"], critic)):
        if on_host:  # the host copy is unchanged; the device copy goes
            jax.tree.map(lambda x: x.delete(), copy)

    actor_params, actor_opt = state.actor_params, state.actor_opt
    first_ok, actor_ok = jnp.bool_(False), jnp.bool_(True)  # critic_only: nothing applied
    old_lp = None
    if not critic_only:
        if off["optimizer"]:
            actor_opt = fetch("optimizer", "actor_opt")
        actor_params, actor_opt, first_ok, actor_ok, actor_metrics, old_lp = phases.actor(
            state.actor_params, actor_opt, batch, prepared
        )
        metrics.update(actor_metrics)
        if off["optimizer"]:
            actor_opt = to("optimizer", actor_opt, "pinned_host", True)

    critic_params, critic_opt, critic_ok = state.critic_params, state.critic_opt, True
    if critic_params is not None:
        if off["critic"]:
            critic_params = fetch("critic", "critic_params")
            critic_opt = fetch("critic", "critic_opt")
        critic_params, critic_opt, critic_ok, critic_metrics = phases.critic(
            critic_params, critic_opt, batch, prepared
        )
        metrics.update(critic_metrics)
        if off["critic"]:
            critic_params = to("critic", critic_params, "pinned_host", True)
            critic_opt = to("critic", critic_opt, "pinned_host", True)
    counted = phases.counters(state.counters, first_ok, actor_ok, critic_ok)
    metrics.update(moves)
    return (actor_params, actor_opt, critic_params, critic_opt), counted, metrics, old_lp
