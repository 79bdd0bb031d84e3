"""The engine contract over N engine actors in one placement group (inside the manager)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jaxloop.rollout.api import EngineFailedError, PublicationError
from jaxloop.rollout.ray.actor import EngineProcess, EngineSpec, engine_actor, error_text
from jaxloop.rollout.ray.transport import Publication, ReplayChain
from jaxloop.rollout.types import PromptRequest, PublishStats, Sample, SamplingConfig

logger = logging.getLogger(__name__)


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` contiguous slices of range(n), sizes differing by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def placement_lines(placement_group_hex: str) -> list[str]:
    """'engine I on node ID (IP), resources {...}' for each engine's bundle of the group."""
    from ray.util.placement_group import PlacementGroup, placement_group_table

    pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(placement_group_hex)))
    table = placement_group_table(pg)
    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    lines = []
    for i, bundle in sorted(table["bundles"].items()):
        node = table["bundles_to_node_id"].get(i, "?")
        resources = ", ".join(f"{k}: {v:g}" for k, v in bundle.items())
        lines.append(f"engine {i} on node {node} ({ips.get(node, '?')}), resources {{{resources}}}")
    return lines


class EngineGroup:
    """The engine contract over N EngineActors placed in one placement group (a bundle each).

    generate_timeout_s: seconds an engine may take to answer its part of a generate call (None: no
    limit); an engine over it is treated as dead (killed, restarted, its part regenerated).
    publish_timeout_s: the same for a publication (the restarted engine gets the committed policy,
    then the publication again).
    health_timeout_s: the same for a health check. ready_timeout_s: engine start and the committed
    policy's re-delivery to a restarted engine. placement_timeout_s: a node with room for the
    bundles (at start) or for a restarted engine's bundle (its node lost: Ray re-places the bundle
    when a node can take it); past it EngineFailedError, never retried.
    engine_process: the engines' process class (EngineProcess, or a subclass).
    The committed version is the ReplayChain the publisher (the trainer's client) hands over
    with each publication; a restarted engine replays it.
    """

    def __init__(
        self,
        spec: EngineSpec,
        num_engines: int,
        bundle: dict[str, float],
        *,
        max_restarts_per_call: int = 3,
        generate_timeout_s: float | None = 600.0,
        publish_timeout_s: float | None = 600.0,
        health_timeout_s: float = 120.0,
        ready_timeout_s: float = 1800.0,
        placement_timeout_s: float = 300.0,
        engine_process: type[EngineProcess] = EngineProcess,
    ):
        self.spec = spec
        self.actor = engine_actor(engine_process)
        self.bundle = dict(bundle)
        self.max_restarts_per_call = max_restarts_per_call
        self.generate_timeout_s = generate_timeout_s
        self.publish_timeout_s = publish_timeout_s
        self.health_timeout_s = health_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.placement_timeout_s = placement_timeout_s
        self.restarts = 0
        self.start_seconds: list[float] = []
        self.chain = ReplayChain()  # the committed version, as its publisher's client has it
        self.pg = placement_group([dict(bundle) for _ in range(num_engines)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=placement_timeout_s)
        except GetTimeoutError:
            remove_placement_group(self.pg)
            raise EngineFailedError(
                f"no room for {num_engines} engine(s) of {bundle} after {placement_timeout_s:g}s "
                f"(cluster resources: {ray.cluster_resources()}); add a node and rerun to resume"
            ) from None
        self.handles = [self._spawn(i) for i in range(num_engines)]
        infos = self._gather({i: h.info.remote() for i, h in enumerate(self.handles)})
        self.start_seconds = [infos[i]["start_seconds"] for i in range(num_engines)]

    # ---- actors ----
    def _await_bundle(self, index: int, deadline: float) -> None:
        """Until bundle `index` is placed on a live node (after its node was lost, Ray re-places
        it once a node has room); EngineFailedError at `deadline` (time.monotonic)."""
        from ray.util.placement_group import placement_group_table

        while True:
            table = placement_group_table(self.pg)
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            node = table.get("bundles_to_node_id", {}).get(index)
            if table.get("state") == "CREATED" and node in alive:
                return
            if time.monotonic() >= deadline:
                raise EngineFailedError(
                    f"engine {index}: no node has room for its bundle {self.bundle} after "
                    f"{self.placement_timeout_s:g}s (its node was lost); add a node and rerun "
                    "to resume from the last checkpoint"
                )
            time.sleep(0.5)

    def _spawn(self, index: int):
        resources = dict(self.bundle)
        options = dict(
            num_cpus=resources.pop("CPU", 0),
            num_gpus=resources.pop("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=index
            ),
        )
        if resources:
            options["resources"] = resources
        return self.actor.options(**options).remote(self.spec, index)

    def _gather(self, refs: dict[int, Any], timeout: float | None = None) -> dict[int, Any]:
        out = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref, timeout=timeout or self.ready_timeout_s)
            except RayActorError as e:
                raise EngineFailedError(f"engine {i} failed to start: {error_text(e)}") from e
        return out

    def restart(self, index: int, reason: str = "died", count: bool = True) -> None:
        """Replace engine `index` with a fresh actor in the same bundle serving the committed
        policy (a restart that fails counts against the caller's restart limit)."""
        start = time.perf_counter()
        old = self.handles[index]
        try:
            ray.kill(old, no_restart=True)
        except Exception:  # already gone
            pass
        deadline = time.monotonic() + self.placement_timeout_s
        while True:
            self._await_bundle(index, deadline)
            self.handles[index] = handle = self._spawn(index)
            try:
                ray.get(handle.info.remote(), timeout=self.ready_timeout_s)
                break
            except RayActorError as err:
                # placed on a node that was dying but not yet declared dead: Ray re-places the
                # bundle once it is (or no node has room: _await_bundle says so). Any other
                # death of a new engine is the caller's to count.
                node_lost = isinstance(err, ActorUnavailableError) or "node has died" in str(err)
                if not node_lost or time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
        for publication in self.chain:
            ray.get(handle.publish.remote(publication), timeout=self.ready_timeout_s)
        self.restarts += int(count)
        logger.warning(
            "engine %d %s: restarted in %.1fs (restart #%d, serving version %s)",
            index,
            reason,
            time.perf_counter() - start,
            self.restarts,
            self.version,
        )

    def _run(
        self,
        call: Callable[[int, Any], Any],
        indices: Iterable[int],
        timeout_s: float | None = None,
    ) -> dict[int, Any | BaseException]:
        """call(index, handle) -> ObjectRef on each engine; an engine that dies, or (timeout_s)
        does not answer within timeout_s seconds of the call, is killed, restarted and the call
        repeated. Returns index -> result, or the (task) exception it raised."""
        if timeout_s is not None and not math.isfinite(timeout_s):
            timeout_s = None
        pending: dict[Any, tuple[int, float]] = {}  # ref -> (engine index, deadline)

        def submit(index: int) -> None:
            deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
            pending[call(index, self.handles[index])] = (index, deadline)

        for i in indices:
            submit(i)
        attempts: dict[int, int] = {}
        results: dict[int, Any] = {}
        while pending:
            wait = None
            if timeout_s is not None:
                first = min(deadline for _, deadline in pending.values())
                wait = max(0.0, first - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            if ready:
                index, _ = pending.pop(ready[0])
                try:
                    results[index] = ray.get(ready[0])
                    continue
                except RayActorError as e:
                    failure, cause = "died", e
                except Exception as e:  # the task raised: the caller decides
                    results[index] = e
                    continue
            else:
                ref, (index, deadline) = min(pending.items(), key=lambda kv: kv[1][1])
                if deadline > time.monotonic():
                    continue  # ray.wait returned early
                del pending[ref]
                failure = f"did not answer in {timeout_s:g}s"
                cause = GetTimeoutError(f"no result after {timeout_s:g}s")
            self._recover(index, failure, cause, attempts)
            submit(index)
        return results

    def _recover(
        self, index: int, failure: str, cause: BaseException, attempts: dict[int, int]
    ) -> None:
        """Restart engine `index` after `failure` ('died', 'did not answer in ...'), within the
        per-call restart limit."""
        attempts[index] = attempts.get(index, 0) + 1
        if attempts[index] > self.max_restarts_per_call:
            raise EngineFailedError(
                f"engine {index} failed {attempts[index]} times in one call (last: {failure}: "
                f"{error_text(cause)})"
            ) from cause
        while True:
            try:
                self.restart(index, reason=failure)
                return
            except (RayActorError, GetTimeoutError) as again:
                attempts[index] += 1
                if attempts[index] > self.max_restarts_per_call:
                    raise EngineFailedError(
                        f"engine {index} could not be restarted: {error_text(again)}"
                    ) from again

    def check_health(self) -> list[dict]:
        """Ask every engine for (version, pid); a dead or unresponsive engine is restarted."""
        refs = {i: h.health.remote() for i, h in enumerate(self.handles)}
        ready, _ = ray.wait(
            list(refs.values()), num_returns=len(refs), timeout=self.health_timeout_s
        )
        report = []
        for i, ref in refs.items():
            entry = {"index": i, "restarted": False}
            try:
                if ref not in ready:
                    raise GetTimeoutError(f"no health reply in {self.health_timeout_s}s")
                entry["version"], entry["pid"] = ray.get(ref)
            except (RayActorError, GetTimeoutError) as e:
                self.restart(i, reason=f"failed its health check ({error_text(e)})")
                try:
                    entry["version"], entry["pid"] = ray.get(
                        self.handles[i].health.remote(), timeout=self.health_timeout_s
                    )
                except (RayActorError, GetTimeoutError) as again:
                    raise EngineFailedError(
                        f"engine {i} failed its health check after a restart: {error_text(again)}"
                    ) from again
                entry["restarted"] = True
            report.append(entry)
        return report

    # ---- the engine contract ----
    @property
    def version(self) -> int | None:
        return self.chain.version

    def expected_specs(self) -> dict:
        return ray.get(self.handles[0].expected_specs.remote())

    def publish(self, publication: Publication, chain: ReplayChain) -> list[PublishStats]:
        """Run the transaction on every engine; commit only if all of them committed, and then
        serve `chain` (the committed version once `publication` commits, as its publisher
        chains it). An engine that dies (or hangs) inside it is restarted on the committed
        policy and sent the publication again, so every engine ends on the new version; if that
        fails too (restart limit), or an engine refuses, the engines that committed are
        restarted on the previous version: all of them end on one version, the one `version`
        names."""
        try:
            results = self._run(
                lambda i, h: h.publish.remote(publication),
                range(len(self.handles)),
                timeout_s=self.publish_timeout_s,
            )
        except BaseException:
            self._roll_back()
            raise
        errors = {i: r for i, r in results.items() if isinstance(r, BaseException)}
        if errors:
            for i in sorted(set(results) - set(errors)):
                # a resync, not a failure: not counted as a restart
                self.restart(
                    i, reason="committed a publication another engine refused", count=False
                )
            i, err = min(errors.items())
            if isinstance(err, PublicationError):
                raise PublicationError(f"engine {i} refused: {error_text(err)}")
            raise err
        self.chain = chain
        return [results[i] for i in range(len(self.handles))]

    def serve(self, chain: ReplayChain) -> None:
        """Serve `chain`'s version on every engine (a new group: its publications in turn)."""
        for n, publication in enumerate(chain, start=1):
            self.publish(publication, ReplayChain(chain.publications[:n]))

    def _roll_back(self) -> None:
        """After a publication failed part-way: every engine that does not serve the committed
        version (it committed the new one, died, or does not answer) is restarted on it. An
        engine's health reply queues behind its publication, so one still running is awaited."""
        wait = self.health_timeout_s
        if self.publish_timeout_s is not None and math.isfinite(self.publish_timeout_s):
            wait = max(wait, self.publish_timeout_s)
        for i in range(len(self.handles)):
            try:
                version, _ = ray.get(self.handles[i].health.remote(), timeout=wait)
                if version == self.version:
                    continue
                reason, count = "committed a publication that failed on another engine", False
            except RayActorError:
                reason, count = "died in a failed publication", True
            except GetTimeoutError:
                reason, count = f"did not answer in {wait:g}s after a failed publication", True
            self.restart(i, reason=reason, count=count)

    def generate(self, requests: list[PromptRequest], sampling: SamplingConfig) -> list[Sample]:
        parts = [
            (i, requests[a:b])
            for i, (a, b) in enumerate(split_evenly(len(requests), len(self.handles)))
            if b > a
        ]
        by_index = dict(parts)
        results = self._run(
            lambda i, h: h.generate.remote(by_index[i], sampling),
            [i for i, _ in parts],
            timeout_s=self.generate_timeout_s,
        )
        samples: list[Sample] = []
        for i, part in parts:
            out = results[i]
            if isinstance(out, BaseException):
                raise out
            if len(out) != len(part):
                raise RuntimeError(f"engine {i} returned {len(out)} samples for {len(part)}")
            samples.extend(out)
        return samples

    def stats(self) -> dict[str, float]:
        return {"engine_restarts": float(self.restarts)}

    def close(self) -> None:
        for h in self.handles:
            try:
                ray.get(h.close.remote(), timeout=60)
            except Exception:  # dead or stuck: killed below
                pass
            try:
                ray.kill(h, no_restart=True)
            except Exception:
                pass
        self.handles = []
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass
