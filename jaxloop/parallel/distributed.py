"""Many hosts: `jax.distributed.initialize` from the `dist` config section.

Every process runs the same SPMD program; process 0 alone writes metrics, draws progress and
talks to remote engines; every process writes its own checkpoint shards.
"""

from __future__ import annotations

import math

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


def parse_resources(text: str) -> dict[str, float]:
    """Ray resources from `NAME=AMOUNT[,NAME=AMOUNT]`: `engine_slot=1,mem_slot=0.5` ->
    {"engine_slot": 1.0, "mem_slot": 0.5} (empty text: none). ValueError naming the bad item."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = float("nan")
        if not name.strip() or not (value > 0 and math.isfinite(value)):
            raise ValueError(f"expected NAME=AMOUNT with AMOUNT > 0, got {item!r}")
        out[name.strip()] = value
    return out


class LeaderFailedError(RuntimeError):
    """Process 0 failed with an error its followers cannot rebuild as such (its line is kept)."""


def _rebuild(kind: tuple[str, str], message: str) -> BaseException:
    """The error process 0 raised, as its class with its message where the class takes one
    string (every jaxloop error does), else LeaderFailedError with the same text."""
    import importlib

    module, name = kind
    try:
        cls = getattr(importlib.import_module(module), name)
        if isinstance(cls, type) and issubclass(cls, Exception):
            err = cls(message)
            if str(err) == message:
                return err
    except Exception:  # noqa: BLE001 - any failure to rebuild: the generic error below
        pass
    return LeaderFailedError(f"process 0: {name}: {message}")


class LeaderChannel:
    """Values that process 0 alone can compute (what remote engines return), handed to every
    process: `share(key, compute)` runs `compute` on process 0 and returns its value everywhere;
    an error it raises is raised on every process (same class and message, so the same one-line
    error and exit code). Through jax.distributed's key-value store, not a device collective: it
    may run on a rollout thread while the learner's collectives run. Every process must share
    the same keys; each key once. The last process to read a value deletes it."""

    def __init__(self, poll_s: float = 60.0):
        from jax._src.distributed import global_state

        self.client = global_state.client
        if self.client is None:
            raise RuntimeError("LeaderChannel needs jax.distributed (dist.num_processes > 1)")
        self.is_leader = jax.process_index() == 0
        self.followers = jax.process_count() - 1
        self.poll_ms = int(poll_s * 1000)

    def share(self, key: str, compute):
        import pickle

        key = f"jaxloop/{key}"
        if self.is_leader:
            try:
                value = compute()
                payload = pickle.dumps(("ok", value))
            except BaseException as err:
                kind = (type(err).__module__, type(err).__qualname__)
                self.client.key_value_set_bytes(key, pickle.dumps(("error", (kind, str(err)))))
                raise
            self.client.key_value_set_bytes(key, payload)
            return value
        while True:  # process 0's own timeouts bound what it computes; a lost process 0 ends here
            try:
                raw = self.client.blocking_key_value_get_bytes(key, self.poll_ms)
                break
            except Exception as err:  # noqa: BLE001 - jaxlib raises its own status errors
                if "DEADLINE_EXCEEDED" not in str(err) and "timed out" not in str(err).lower():
                    raise LeaderFailedError(f"process 0 is gone ({err})") from None
        if self.client.key_value_increment(f"{key}/read", 1) == self.followers:
            self.client.key_value_delete(key)  # and its /read counter below it
        status, value = pickle.loads(raw)
        if status == "error":
            raise _rebuild(*value)
        return value
