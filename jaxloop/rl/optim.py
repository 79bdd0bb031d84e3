"""The optimizer of a learner: schedule, optimizer and gradient clipping as one optax chain."""

from __future__ import annotations

import optax


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
    total_steps = max(total_steps, 1)
    if schedule == "constant":
        sched = optax.constant_schedule(lr)
    elif schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 0), total_steps)
    elif schedule == "linear":
        sched = optax.linear_schedule(lr, 0.0, total_steps)
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    if schedule == "constant" and warmup > 0:
        sched = optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
        )
    if name == "adamw":
        opt = optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay)
    elif name == "sgd":
        opt = optax.sgd(sched, momentum=None)
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    parts = [] if grad_clip is None else [optax.clip_by_global_norm(grad_clip)]
    return optax.chain(*parts, opt)
