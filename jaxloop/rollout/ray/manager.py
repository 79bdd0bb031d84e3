"""The rollout manager actor: owns the RolloutProducer (data cursor, seeds, rewards) whose engine
is an EngineGroup."""

from __future__ import annotations

import os
import time
from typing import Any

import ray

from jaxloop.rollout.ray.actor import EngineProcess, EngineSpec, configure_actor_logging
from jaxloop.rollout.ray.group import EngineGroup
from jaxloop.rollout.ray.transport import Publication, ReplayChain
from jaxloop.rollout.types import PublishStats, Sample


class RolloutManagerProcess:
    """Owns the RolloutProducer (data cursor, seeds, rewards) and the EngineGroup
    (RolloutManager: this class as a Ray actor). `engine_process`: the engines' process class."""

    def __init__(
        self,
        settings,
        spec: EngineSpec,
        num_engines: int,
        bundle: dict[str, float],
        engine_timeout_s: float = 600.0,
        publish_timeout_s: float = 600.0,
        placement_timeout_s: float = 300.0,
        engine_process: type[EngineProcess] = EngineProcess,
    ):
        from jaxloop.rollout.producer import RolloutProducer

        configure_actor_logging(spec.log_level)
        start = time.perf_counter()
        # a health check is a trivial call: bounded by the generate timeout, at most 2 minutes
        self.group = EngineGroup(
            spec,
            num_engines,
            bundle,
            generate_timeout_s=engine_timeout_s,
            publish_timeout_s=publish_timeout_s,
            health_timeout_s=min(120.0, engine_timeout_s),
            placement_timeout_s=placement_timeout_s,
            engine_process=engine_process,
        )
        self.producer = RolloutProducer(settings, self.group)
        self.start_seconds = time.perf_counter() - start

    def __repr__(self) -> str:
        return "rollout manager"

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "start_seconds": self.start_seconds,
            "engine_start_seconds": list(self.group.start_seconds),
            "num_engines": len(self.group.handles),
            "placement_group": self.group.pg.id.hex(),
        }

    def expected_specs(self) -> dict:
        return self.group.expected_specs()

    def publish(self, publication: Publication, chain: ReplayChain) -> list[PublishStats]:
        return self.group.publish(publication, chain)

    def serve(self, chain: ReplayChain) -> None:
        self.group.serve(chain)

    def version(self) -> int | None:
        return self.group.version

    def produce(self, update: int):
        self.group.check_health()
        return self.producer.produce(update)

    def produce_step(self, update: int):
        """produce(update) and the data cursor after it, in one reply (the client's record of
        the cursor can never be ahead of, or behind, the samples it received)."""
        samples, stats = self.produce(update)
        return samples, stats, self.producer.state()

    def evaluate(self) -> float:
        self.group.check_health()
        return self.producer.evaluate()

    def evaluate_samples(self) -> tuple[float, list[dict[str, Any]]]:
        self.group.check_health()
        return self.producer.evaluate_samples()

    def generate(self, requests, sampling) -> list[Sample]:
        return self.group.generate(requests, sampling)

    def state(self) -> dict:
        return self.producer.state()

    def restore(self, state: dict) -> None:
        self.producer.restore(state)

    def health(self) -> list[dict]:
        return self.group.check_health()

    def stats(self) -> dict[str, float]:
        return self.group.stats()

    def close(self) -> None:
        self.group.close()


def manager_actor(process: type[RolloutManagerProcess] = RolloutManagerProcess):
    """`process` (RolloutManagerProcess or a subclass) as a Ray actor class, never restarted by
    Ray (the client replaces a dead manager itself)."""
    return ray.remote(max_restarts=0)(process)
