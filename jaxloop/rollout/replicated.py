"""Remote engines under a trainer of several processes (jax.distributed): process 0 alone talks to
the rollout manager; every process sees what it returns.

Every trainer process runs the same SPMD learner, so each needs the same batch, evaluation, data
cursor and publication stats. `ReplicatedSource` is the RolloutSource of every process: on process
0 it wraps the real source (the Ray client) and hands each result to the others through a
`LeaderChannel` (jax.distributed's key-value store, usable from the rollout thread while the
learner's collectives run); on the others it only receives. An error on process 0 (a dead
manager, engines that cannot be restarted, a refused publication) is raised on every process as
the same class and message: the same one-line error and exit code everywhere, nobody left waiting.

Publication: the policy's parameters are sharded over every process's devices. Process 0 stages
them bucket by bucket (HostStaging), gathering each multi-process tensor to the host as it goes;
the others run the same gathers (`HostStaging.gather`, the collectives need every process) and
keep nothing. So no device and no host holds the whole model beyond process 0's staging buffers,
and the bytes (hence the digests) are those of a one-process publication of the same parameters.
"""

from __future__ import annotations

from typing import Any

from jaxloop.rollout.api import Policy
from jaxloop.rollout.publication.staging import HostStaging
from jaxloop.rollout.types import PublishStats, Sample


def publication_layout(client) -> dict[str, Any]:
    """What the other processes need to run process 0's staging gathers in its order: the
    engines' tensor dtypes and the bucket size."""
    dtypes = {name: dtype for name, (_, dtype) in client.expected.items()}
    return {"dtypes": dtypes, "bucket_bytes": int(client.bucket_bytes)}


class ReplicatedSource:
    """A RolloutSource on every trainer process: `source` (process 0) or None (the others, which
    receive everything through `channel`). `layout`: publication_layout of process 0's client;
    `capabilities`: the wrapped source's class (its shares_devices / loop_logprobs)."""

    def __init__(self, source, channel, layout: dict[str, Any], capabilities):
        self.source = source
        self.channel = channel
        self.shares_devices = bool(capabilities.shares_devices)
        self.loop_logprobs = bool(capabilities.loop_logprobs)
        self._dtypes = dict(layout["dtypes"])
        # the other processes' gathers follow process 0's bucket plan
        self._staging = None if source is not None else HostStaging(layout["bucket_bytes"])
        self._version: int | None = None
        self._calls: dict[str, int] = {}

    def _key(self, what: str) -> str:
        """The n-th call of `what` (every process makes the same calls in the same order)."""
        n = self._calls.get(what, 0)
        self._calls[what] = n + 1
        return f"rollout/{what}/{n}"

    def _share(self, key: str, call):
        return self.channel.share(key, call if self.source is not None else None)

    def publish(self, policy: Policy) -> PublishStats:
        key = self._key("publish")
        if self.source is None:  # process 0's gathers need this process too
            self._staging.gather(policy, self._dtypes)
        stats = self._share(key, lambda: self.source.publish(policy))
        self._version = policy.version
        return stats

    def produce(self, update: int) -> tuple[list[Sample], dict[str, float]]:
        # keyed by update: the rollout thread of each process asks for the same one
        return self._share(f"rollout/produce/{update}", lambda: self.source.produce(update))

    def evaluate(self) -> float:
        return self._share(self._key("evaluate"), lambda: self.source.evaluate())

    def evaluate_samples(self) -> tuple[float, list[dict[str, Any]]]:
        return self._share(self._key("evaluate_samples"), lambda: self.source.evaluate_samples())

    def state(self) -> dict:
        return self._share(self._key("state"), lambda: self.source.state())

    def stats(self) -> dict[str, float]:
        return self._share(self._key("stats"), lambda: self.source.stats())

    def restore(self, state: dict) -> None:
        self._share(self._key("restore"), lambda: self.source.restore(state))

    @property
    def version(self) -> int | None:
        return self.source.version if self.source is not None else self._version

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        if self._staging is not None:
            self._staging.close()
