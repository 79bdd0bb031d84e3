"""Counting the programs JAX lowers (jax.monitoring's lowering event): a test that asserts no
recompilation reads the count before and after the work it checks."""

import contextlib

import jax
from jax._src import dispatch

LOWERING_EVENT = dispatch.JAXPR_TO_MLIR_MODULE_EVENT


@contextlib.contextmanager
def counting_lowerings():
    """Yields a one-element list whose item is the number of programs lowered so far."""
    lowered = [0]

    def count(event, _duration, **_kwargs):
        if event == LOWERING_EVENT:
            lowered[0] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield lowered
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
