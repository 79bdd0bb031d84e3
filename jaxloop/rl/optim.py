"""The optimizer of a learner: schedule, optimizer and gradient clipping as one optax chain."""

from __future__ import annotations

import optax


def learning_rate_schedule(lr: float, schedule: str, warmup: int, total_steps: int):
    """`lr` after a linear warm-up from 0 over `warmup` steps: constant, or decayed to 0 at
    `total_steps` (cosine or linear). A run no longer than its warm-up is warm-up throughout:
    the rate at step t is lr x t / warmup, and the decay never starts."""
    total_steps, warmup = max(total_steps, 1), max(warmup, 0)
    if schedule not in ("constant", "cosine", "linear"):
        raise ValueError(f"unknown schedule {schedule!r}")
    ramp = optax.linear_schedule(0.0, lr, warmup)
    if warmup >= total_steps and schedule != "constant":
        return ramp
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, total_steps)
    rest = (
        optax.constant_schedule(lr)
        if schedule == "constant"
        else optax.linear_schedule(lr, 0.0, total_steps - warmup)
    )
    return optax.join_schedules([ramp, rest], [warmup]) if warmup else rest


def make_optimizer(
    name: str,
    lr: float,
    schedule: str,
    warmup: int,
    total_steps: int,
    weight_decay: float,
    b1: float,
    b2: float,
    grad_clip: float | None,
):
    sched = learning_rate_schedule(lr, schedule, warmup, total_steps)
    if name == "adamw":
        opt = optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay)
    elif name == "sgd":
        opt = optax.sgd(sched, momentum=None)
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    parts = [] if grad_clip is None else [optax.clip_by_global_norm(grad_clip)]
    return optax.chain(*parts, opt)
