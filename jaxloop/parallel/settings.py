"""The mesh and dist sections of the run's config (jaxloop.config composes the sections; each
field's default, help, domain and resume policy are declared here, once)."""

from __future__ import annotations

import dataclasses

from jaxloop.settings import FREE, count, knob


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """device mesh ('data', 'fsdp', 'tensor') for training and the embedded sampler"""

    data: int = knob(
        1, "data-parallel axis size (-1: the remaining devices)", count(1, also=(-1,)), resume=FREE
    )
    fsdp: int = knob(
        -1,
        "fully-sharded data-parallel axis size (-1: the remaining devices)",
        count(1, also=(-1,)),
        resume=FREE,
    )
    tensor: int = knob(
        1,
        "tensor-parallel axis size (-1: the remaining devices)",
        count(1, also=(-1,)),
        resume=FREE,
    )


@dataclasses.dataclass(frozen=True)
class DistSection:
    """many processes (jax.distributed.initialize)"""

    coordinator_address: str = knob(
        "",
        "coordinator HOST:PORT; empty: one process (or what the cluster environment says)",
        resume=FREE,
    )
    num_processes: int | None = knob(
        None,
        "processes in the job (None: one, or what the cluster environment says)",
        count(1),
        resume=FREE,
        legacy_none=lambda value: value == 0,
    )
    process_id: int | None = knob(
        None,
        "this process's index (None: detected)",
        count(0),
        resume=FREE,
        legacy_none=lambda value: value == -1,
    )
