"""Ray rollout classes with the hooks only tests need: an engine that sleeps or leaves a marker
file at chosen points (so a test can kill it mid-generate / mid-publication, or let it hang past
a timeout), a manager whose timeouts and restart limit can be changed, and `debug_client`: a
RayRolloutClient given both. Importable by the actor processes (the client's runtime env puts
the repo root on PYTHONPATH)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import ray

from jaxloop.rollout.api import Policy
from jaxloop.rollout.publication.policy import hf_tensors as policy_hf_tensors
from jaxloop.rollout.ray.actor import EngineProcess
from jaxloop.rollout.ray.client import RayRolloutClient
from jaxloop.rollout.ray.manager import RolloutManagerProcess


class DebugEngineProcess(EngineProcess):
    """set_debug: sleep before each generate (or health reply, or inside a publication, after
    its first bucket is read), and touch `marker_dir/generate-<pid>` (holding the number of
    requests) when a generate call starts, `publish-<pid>` at that point of a publication."""

    def __init__(self, spec, index: int = 0):
        super().__init__(spec, index)
        self.set_debug()
        self._buckets_read = 0

    def set_debug(
        self,
        generate_delay_s: float = 0.0,
        marker_dir: str = "",
        health_delay_s: float = 0.0,
        publish_delay_s: float = 0.0,
    ) -> None:
        self._generate_delay = float(generate_delay_s)
        self._health_delay = float(health_delay_s)
        self._publish_delay = float(publish_delay_s)
        self._marker_dir = marker_dir

    def health(self):
        time.sleep(self._health_delay)
        return super().health()

    def generate(self, requests, sampling):
        if self._marker_dir:
            Path(self._marker_dir, f"generate-{os.getpid()}").write_text(str(len(requests)))
        time.sleep(self._generate_delay)
        return super().generate(requests, sampling)

    def publish(self, *args, **kwargs):
        self._buckets_read = 0
        return super().publish(*args, **kwargs)

    def read_chunk(self, chunk, transport):
        data = super().read_chunk(chunk, transport)
        self._buckets_read += 1
        if self._buckets_read == 1:  # mid-transaction: begun, not finished
            if self._marker_dir:
                Path(self._marker_dir, f"publish-{os.getpid()}").write_text("1")
            time.sleep(self._publish_delay)
        return data


class DebugManagerProcess(RolloutManagerProcess):
    def set_debug(self, index: int, **kwargs) -> None:
        ray.get(self.group.handles[index].set_debug.remote(**kwargs))

    def set_timeouts(
        self,
        generate_s: float | None = None,
        health_s: float | None = None,
        publish_s: float | None = None,
    ) -> dict[str, float | None]:
        """Change the group's generate / health / publish timeouts (None: unchanged); returns the
        previous ones."""
        group = self.group
        old = {
            "generate_s": group.generate_timeout_s,
            "health_s": group.health_timeout_s,
            "publish_s": group.publish_timeout_s,
        }
        if generate_s is not None:
            group.generate_timeout_s = float(generate_s)
        if health_s is not None:
            group.health_timeout_s = float(health_s)
        if publish_s is not None:
            group.publish_timeout_s = float(publish_s)
        return old

    def set_restart_limit(self, max_restarts_per_call: int) -> int:
        """Engine restarts allowed per call; returns the previous limit."""
        old = self.group.max_restarts_per_call
        self.group.max_restarts_per_call = int(max_restarts_per_call)
        return old


def debug_client(rollout, actor_model, settings, **kwargs) -> RayRolloutClient:
    """A RayRolloutClient whose manager and engines are the debug processes above."""
    return RayRolloutClient(
        rollout,
        actor_model,
        settings,
        manager_process=DebugManagerProcess,
        engine_process=DebugEngineProcess,
        **kwargs,
    )


def hf_tensors(client: RayRolloutClient, policy: Policy) -> list[tuple[str, np.ndarray]]:
    """`policy` as HF-named tensors in the client's engines' dtypes (what it publishes)."""
    return policy_hf_tensors(policy, {n: dtype for n, (_, dtype) in client.expected.items()})
