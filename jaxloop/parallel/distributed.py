"""Many hosts: `jax.distributed.initialize` from the `dist` config section.

Every process runs the same SPMD program; process 0 alone writes metrics, draws progress and
talks to remote engines; every process writes its own checkpoint shards.
"""

from __future__ import annotations

import jax

_started = False


def initialize(dist) -> None:
    """Start JAX's distributed runtime once: from dist.coordinator_address / num_processes /
    process_id when set, else nothing (one process) unless the cluster environment is one JAX
    detects by itself (SLURM, Open MPI...), which `jax.distributed.initialize()` handles."""
    global _started
    if _started or not dist.coordinator_address:
        return
    # CPU collectives across processes (tests, single-node multi-process runs); GPUs use NCCL
    # whatever this says. Set before the backends start: nothing may touch devices before here.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=dist.coordinator_address,
        num_processes=dist.num_processes,
        process_id=dist.process_id,
    )
    _started = True


def is_main_process() -> bool:
    return jax.process_index() == 0
