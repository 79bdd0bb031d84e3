"""Rollouts on Ray: engine actors, a manager actor that owns the producer, and the trainer's client.

    trainer process (JAX)                 Ray
    RayRolloutClient ──publish──> RolloutManager ──> EngineActor 0 (JaxSamplerEngine | VLLMEngine)
                     ──produce──>  RolloutProducer ──> EngineActor 1 ...
                                   EngineGroup (placement group, one bundle per engine)

- `EngineActor`: one engine built from a picklable `EngineSpec` ('jax': the embedded sampler
  around a LoopedLM built from an HF config dict; 'vllm': `VLLMEngine(model_dir, ...)`). Policy
  publication is a transaction (jaxloop.rollout.publication): manifest, safetensors buckets (Ray
  object refs or files), finish with count and digest. A refused publication raises
  PublicationError and the engine keeps serving its previous committed version.
- `EngineGroup` (inside the manager) implements the engine contract over N EngineActors: generate
  splits the requests into N contiguous parts (deterministic), gathers and reassembles them in
  order. An engine that dies (also mid-rollout), or does not answer its part within
  `generate_timeout_s` (`rollout.engine_timeout_s`: alive but hung), is killed, restarted in its
  placement-group bundle, receives the committed policy again (the manager keeps the committed
  chunks) and its part is regenerated: per-request seeds make the regenerated samples the same.
  A publication is bounded the same way (`publish_timeout_s`, `rollout.publish_timeout_s`): an
  engine that dies or hangs inside it is restarted on the committed policy and the publication is
  sent again; if that fails too (or an engine refuses), every engine not on the committed version
  is restarted on it: all engines serve one version, and every sample names the version of the
  engine that made it. Health checks are bounded by `health_timeout_s`. `stats()` reports
  `engine_restarts`.
- `RolloutManager`: holds the `RolloutProducer` (data cursor, seeds, rewards) whose engine is the
  group; produce / evaluate / state / restore run there.
- `RayRolloutClient`: what train.py uses for `rollout.engine=vllm`. Starts a local Ray cluster or
  joins `rollout.ray_address`, writes the initial model for vLLM engines, and publishes policies as
  HF-named tensors (names from the family table), in buckets of `rollout.publish_bucket_mb`, through
  the object store or files (`rollout.transport`). A manager that dies (a call fails with
  RayActorError, not a task error) is replaced: a new manager and engines (the old placement group
  removed), restored to the data cursor of the last call that returned (so a produce(update) that
  failed regenerates exactly update's batch), the committed publication sent again, and the call
  made once more; a second death is ManagerFailedError naming the update. `manager_restarts`
  joins `engine_restarts` (summed over the managers) in produce's stats.

The trainer process never imports torch or vLLM: vLLM is imported inside the engine actors only.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jaxloop.config import engine_log_level
from jaxloop.rollout.engine import PublicationError
from jaxloop.rollout.publication import Manifest, PublicationReceiver, dtype_name, iter_chunks
from jaxloop.rollout.types import PromptRequest, PublishStats, Sample, SamplingConfig

logger = logging.getLogger(__name__)

TRANSPORTS = ("object_store", "disk")
# environment variables handed from the trainer process to the Ray actors
_ENV_PREFIXES = ("JAX_", "XLA_", "VLLM_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")


class EngineFailedError(RuntimeError):
    """An engine actor kept dying (or could not be started) beyond the restart limit."""


class ManagerFailedError(RuntimeError):
    """The rollout manager actor died again right after it was replaced."""


def _cause(err: BaseException) -> BaseException:
    """The original exception inside (possibly nested) Ray task errors."""
    seen = 0
    while getattr(err, "cause", None) is not None and seen < 8:
        err = err.cause
        seen += 1
    return err


def _error_text(err: BaseException) -> str:
    err = _cause(err)
    return str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__


# ---- engine actor ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """How to build one engine (crosses process boundaries: plain values only).

    kind 'jax': hf_config (LoopedConfig.to_hf_dict()) + numerics (LoopedConfig.replace kwargs:
    param_dtype, compute_dtype, attention_impl); weights arrive with the first publication.
    kind 'vllm': model_dir (an HF checkpoint the engine starts from), dtype, seed,
    max_model_len and llm_kwargs for vllm.LLM.
    """

    kind: str
    hf_config: dict | None = None
    numerics: dict = dataclasses.field(default_factory=dict)
    model_dir: str = ""
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int = 2048
    llm_kwargs: dict = dataclasses.field(default_factory=dict)
    log_level: str = "WARNING"  # the actor's log level (rollout.engine_log_level)

    def __post_init__(self):
        if self.kind not in ("jax", "vllm"):
            raise ValueError(f"engine kind {self.kind!r}; expected 'jax' or 'vllm'")
        if self.kind == "jax" and not self.hf_config:
            raise ValueError("a 'jax' engine spec needs hf_config")
        if self.kind == "vllm" and not self.model_dir:
            raise ValueError("a 'vllm' engine spec needs model_dir")


# Warnings that jaxloop's own engine settings cause by design, hidden at levels above INFO
# (verbose shows them): no tokenizer in the engine (jaxloop tokenizes), in-place weight reloads
# (the rotary embedding has no weights), per-request seeds, and the CPU test engines (eager, no
# Triton).
BENIGN_ENGINE_MESSAGES = (
    "Chat template warmup failed",
    "because tokenizer is not initialized",
    "RotaryEmbedding: Failed to load weights",
    "The global random seed is set to",
    "Enforce eager set",
    "Inductor compilation was disabled",
    "doesn't allow to use `torch.set_num_threads`",
    "Triton is not installed",
    "Triton not available",
    "Reset SSM cache type",
    "is not found in LD_PRELOAD",
)


class _BenignFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        return not any(m in message for m in BENIGN_ENGINE_MESSAGES)


def configure_actor_logging(level: str) -> None:
    """Log level of this actor process (before vLLM / torch are imported): vLLM's logger via
    VLLM_LOGGING_LEVEL (an explicit one in the environment wins), Python's root and Ray loggers,
    and, above INFO, no deprecation warnings."""
    level = level.upper()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", level)
    logging.getLogger().setLevel(level)
    logging.getLogger("ray").setLevel(level)
    if logging.getLevelName(level) > logging.INFO:
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)


def _filter_benign_vllm(level: str) -> str | None:
    """Above INFO, have vLLM configure its logging (it does so when an engine starts, replacing
    any handler set earlier) from its default config plus a _BenignFilter (BENIGN_ENGINE_MESSAGES)
    on its handlers, through VLLM_LOGGING_CONFIG_PATH (one set in the environment wins); torch's
    handler gets the filter too. Returns the file written."""
    if logging.getLevelName(level.upper()) <= logging.INFO:
        return None
    import torch  # noqa: F401  (installs the handler of the "torch" logger)

    for handler in logging.getLogger("torch").handlers:
        handler.addFilter(_BenignFilter())
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        return None
    try:
        import copy
        import json

        import vllm.logger

        config = copy.deepcopy(vllm.logger.DEFAULT_LOGGING_CONFIG)
        config.setdefault("filters", {})["jaxloop_benign"] = {"()": f"{__name__}._BenignFilter"}
        for handler in config["handlers"].values():
            handler["filters"] = [*handler.get("filters", []), "jaxloop_benign"]
        fd, path = tempfile.mkstemp(prefix="jaxloop-vllm-logging-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
    except Exception as e:  # another vLLM logging layout: unfiltered, never fatal
        logger.debug("vLLM log filter not installed: %r", e)
        return None
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path
    return path


def _read_chunk(chunk, transport: str):
    """One publication bucket: an object ref (uint8 array in the object store) or a file path."""
    if transport == "object_store":
        return ray.get(chunk)
    if transport == "disk":
        return Path(chunk).read_bytes()
    raise PublicationError(f"unknown transport {transport!r}")


@ray.remote(max_restarts=0, max_task_retries=0)
class EngineActor:
    """One rollout engine in its own process; its log lines are prefixed `(engine <index> pid=...)`
    (Ray's prefix is the actor's repr)."""

    def __init__(self, spec: EngineSpec, index: int = 0):
        start = time.perf_counter()
        self.spec = spec
        self.index = int(index)
        configure_actor_logging(spec.log_level)
        self._delay = 0.0
        self._health_delay = 0.0
        self._publish_delay = 0.0
        self._marker_dir = ""
        self._log_config: str | None = None
        if spec.kind == "jax":
            import jax.numpy as jnp
            from flax import nnx

            from jaxloop.models import LoopedConfig, LoopedLM
            from jaxloop.models.hf_io import hf_tensor_shapes
            from jaxloop.rollout.jax_sampler import JaxSamplerEngine

            cfg = LoopedConfig.from_hf_dict(dict(spec.hf_config)).replace(**spec.numerics)
            self.engine = JaxSamplerEngine(LoopedLM(cfg, rngs=nnx.Rngs(spec.seed)))
            dtype = dtype_name(jnp.dtype(cfg.param_dtype))
            self.receiver = PublicationReceiver(
                {n: (s, dtype) for n, s in hf_tensor_shapes(cfg, "actor").items()}
            )
            self.expected = dict(self.receiver.expected)
        else:
            self._log_config = _filter_benign_vllm(spec.log_level)
            import vllm.logger

            from jaxloop.rollout.vllm_engine import VLLMEngine

            if hasattr(vllm.logger, "set_vllm_process_name"):  # "(engine 0 pid=...) WARNING ..."
                vllm.logger.set_vllm_process_name(f"engine {self.index}")
            self.engine = VLLMEngine(
                spec.model_dir,
                dtype=spec.dtype,
                seed=spec.seed,
                max_model_len=spec.max_model_len,
                **spec.llm_kwargs,
            )
            self.receiver = None
            self.expected = dict(self.engine.expected)
        self.start_seconds = time.perf_counter() - start

    def __repr__(self) -> str:
        return f"engine {getattr(self, 'index', '?')}"

    def info(self) -> dict:
        return {"pid": os.getpid(), "start_seconds": self.start_seconds, "kind": self.spec.kind}

    def health(self) -> tuple[int | None, int]:
        if self._health_delay > 0:
            time.sleep(self._health_delay)
        return self.engine.version, os.getpid()

    def expected_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return self.expected

    def publish(
        self,
        manifest: dict,
        chunks: list,
        transport: str,
        count: int | None = None,
        digest: str | None = None,
    ) -> PublishStats:
        """One publication transaction; refusal -> PublicationError, previous version kept."""
        start = time.perf_counter()
        m = Manifest.from_dict(manifest)
        count = m.count if count is None else count
        digest = m.digest if digest is None else digest
        if self.receiver is None:  # vLLM: the transaction is checked in the engine's worker(s)
            self._publish_pause()
            data = (bytes(memoryview(_read_chunk(c, transport))) for c in chunks)
            return self.engine.publish_chunks(m, data, count=count, digest=digest, start=start)
        try:
            self.receiver.begin(m.version, m)
            for k, c in enumerate(chunks):
                self.receiver.add_chunk(m.version, _read_chunk(c, transport))
                if k == 0:  # mid-transaction: begun, one bucket in, not finished
                    self._publish_pause()
            if not chunks:
                self._publish_pause()
            tensors = self.receiver.finish(m.version, count, digest)
        except PublicationError:
            self.receiver.abort()
            raise
        except Exception as e:  # e.g. a lost object or file: refuse, keep the old version
            self.receiver.abort()
            raise PublicationError(f"publication {m.version}: {e!r}") from e
        stats = self.engine.publish(tensors.items(), m.version)
        return dataclasses.replace(stats, seconds=time.perf_counter() - start)

    def _publish_pause(self) -> None:
        """Test hook (set_debug): touch `marker_dir/publish-<pid>` and sleep publish_delay_s."""
        if self._marker_dir:
            Path(self._marker_dir, f"publish-{os.getpid()}").write_text("1")
        if self._publish_delay > 0:
            time.sleep(self._publish_delay)

    def generate(self, requests: list[PromptRequest], sampling: SamplingConfig) -> list[Sample]:
        if self._marker_dir:
            Path(self._marker_dir, f"generate-{os.getpid()}").write_text(str(len(requests)))
        if self._delay > 0:
            time.sleep(self._delay)
        return self.engine.generate(requests, sampling)

    def set_debug(
        self,
        generate_delay_s: float = 0.0,
        marker_dir: str = "",
        health_delay_s: float = 0.0,
        publish_delay_s: float = 0.0,
    ) -> None:
        """Test hook: sleep before each generate (or health reply, or inside a publication, after
        its first bucket), and touch `marker_dir/generate-<pid>` when a generate call starts
        (`publish-<pid>` at that point of a publication), so a test can kill the engine while it
        is generating or publishing, or let it hang past the group's timeout."""
        self._delay = float(generate_delay_s)
        self._health_delay = float(health_delay_s)
        self._publish_delay = float(publish_delay_s)
        self._marker_dir = marker_dir

    def close(self) -> None:
        self.engine.close()
        if self._log_config:
            Path(self._log_config).unlink(missing_ok=True)


# ---- engine group (inside the manager) -----------------------------------------------------------
def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` contiguous slices of range(n), sizes differing by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


class EngineGroup:
    """The engine contract over N EngineActors placed in one placement group (a bundle each).

    generate_timeout_s: seconds an engine may take to answer its part of a generate call (None: no
    limit); an engine over it is treated as dead (killed, restarted, its part regenerated).
    publish_timeout_s: the same for a publication (the restarted engine gets the committed policy,
    then the publication again).
    health_timeout_s: the same for a health check. ready_timeout_s: placement group, engine start
    and the committed policy's re-delivery to a restarted engine.
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
    ):
        if num_engines < 1:
            raise ValueError(f"num_engines={num_engines} must be >= 1")
        self.spec = spec
        self.bundle = dict(bundle)
        self.max_restarts_per_call = max_restarts_per_call
        self.generate_timeout_s = generate_timeout_s
        self.publish_timeout_s = publish_timeout_s
        self.health_timeout_s = health_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.restarts = 0
        self.start_seconds: list[float] = []
        self._committed: tuple | None = None  # (manifest dict, chunks, transport) now served
        self._version: int | None = None
        self.pg = placement_group([dict(bundle) for _ in range(num_engines)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout_s)
        except GetTimeoutError:
            remove_placement_group(self.pg)
            raise EngineFailedError(
                f"placement group of {num_engines} x {bundle} not ready after {ready_timeout_s}s "
                f"(cluster resources: {ray.cluster_resources()})"
            ) from None
        self.handles = [self._spawn(i) for i in range(num_engines)]
        infos = self._gather({i: h.info.remote() for i, h in enumerate(self.handles)})
        self.start_seconds = [infos[i]["start_seconds"] for i in range(num_engines)]

    # ---- actors ----
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
        return EngineActor.options(**options).remote(self.spec, index)

    def _gather(self, refs: dict[int, Any], timeout: float | None = None) -> dict[int, Any]:
        out = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref, timeout=timeout or self.ready_timeout_s)
            except RayActorError as e:
                raise EngineFailedError(f"engine {i} failed to start: {_error_text(e)}") from e
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
        self.handles[index] = handle = self._spawn(index)
        if self._committed is not None:
            ray.get(handle.publish.remote(*self._committed), timeout=self.ready_timeout_s)
        else:
            ray.get(handle.info.remote(), timeout=self.ready_timeout_s)
        self.restarts += int(count)
        logger.warning(
            "engine %d %s: restarted in %.1fs (restart #%d, serving version %s)",
            index,
            reason,
            time.perf_counter() - start,
            self.restarts,
            self._version,
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
                f"{_error_text(cause)})"
            ) from cause
        while True:
            try:
                self.restart(index, reason=failure)
                return
            except (RayActorError, GetTimeoutError) as again:
                attempts[index] += 1
                if attempts[index] > self.max_restarts_per_call:
                    raise EngineFailedError(
                        f"engine {index} could not be restarted: {_error_text(again)}"
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
                self.restart(i, reason=f"failed its health check ({_error_text(e)})")
                try:
                    entry["version"], entry["pid"] = ray.get(
                        self.handles[i].health.remote(), timeout=self.health_timeout_s
                    )
                except (RayActorError, GetTimeoutError) as again:
                    raise EngineFailedError(
                        f"engine {i} failed its health check after a restart: {_error_text(again)}"
                    ) from again
                entry["restarted"] = True
            report.append(entry)
        return report

    # ---- the engine contract ----
    @property
    def version(self) -> int | None:
        return self._version

    def expected_specs(self) -> dict:
        return ray.get(self.handles[0].expected_specs.remote())

    def publish_chunks(
        self,
        manifest: dict,
        chunks: list,
        transport: str,
        count: int | None = None,
        digest: str | None = None,
    ) -> list[PublishStats]:
        """Run the transaction on every engine; commit only if all of them committed. An engine
        that dies (or hangs) inside it is restarted on the committed policy and sent the
        publication again, so every engine ends on the new version; if that fails too (restart
        limit), or an engine refuses, the engines that committed are restarted on the previous
        version: all of them end on one version, the one `version` names."""
        if transport not in TRANSPORTS:
            raise PublicationError(f"transport={transport!r}; expected one of {TRANSPORTS}")
        args = (manifest, chunks, transport, count, digest)
        try:
            results = self._run(
                lambda i, h: h.publish.remote(*args),
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
                raise PublicationError(f"engine {i} refused: {_error_text(err)}")
            raise err
        self._committed = args[:3]  # count / digest: the manifest's (they matched)
        self._version = int(manifest["version"])
        return [results[i] for i in range(len(self.handles))]

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
                if version == self._version:
                    continue
                reason, count = "committed a publication that failed on another engine", False
            except RayActorError:
                reason, count = "died in a failed publication", True
            except GetTimeoutError:
                reason, count = f"did not answer in {wait:g}s after a failed publication", True
            self.restart(i, reason=reason, count=count)

    def publish(
        self, tensors: Iterable[tuple[str, np.ndarray]], version: int, bucket_bytes: int = 64 << 20
    ) -> PublishStats:
        """The engine contract's publish: HF-named tensors, shipped through the object store."""
        start = time.perf_counter()
        items = [(name, np.asarray(value)) for name, value in tensors]
        manifest = Manifest.build(version, items)
        refs = [ray.put(np.frombuffer(c, np.uint8)) for c in iter_chunks(items, bucket_bytes)]
        self.publish_chunks(manifest.to_dict(), refs, "object_store")
        return PublishStats(
            version, manifest.count, manifest.total_bytes, time.perf_counter() - start
        )

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

    def set_debug(self, index: int, **kwargs) -> None:
        ray.get(self.handles[index].set_debug.remote(**kwargs))

    def set_timeouts(
        self,
        generate_s: float | None = None,
        health_s: float | None = None,
        publish_s: float | None = None,
    ) -> dict[str, float | None]:
        """Change the generate / health / publish timeouts (None: unchanged); returns the previous
        ones."""
        old = {
            "generate_s": self.generate_timeout_s,
            "health_s": self.health_timeout_s,
            "publish_s": self.publish_timeout_s,
        }
        if generate_s is not None:
            self.generate_timeout_s = float(generate_s)
        if health_s is not None:
            self.health_timeout_s = float(health_s)
        if publish_s is not None:
            self.publish_timeout_s = float(publish_s)
        return old

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


# ---- manager actor -------------------------------------------------------------------------------
@ray.remote(max_restarts=0)
class RolloutManager:
    """Owns the RolloutProducer (data cursor, seeds, rewards) and the EngineGroup."""

    def __init__(
        self,
        settings,
        spec: EngineSpec,
        num_engines: int,
        bundle: dict[str, float],
        engine_timeout_s: float = 600.0,
        publish_timeout_s: float = 600.0,
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

    def publish(self, manifest, chunks, transport, count=None, digest=None) -> list[PublishStats]:
        return self.group.publish_chunks(manifest, chunks, transport, count, digest)

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

    def set_debug(self, index: int, **kwargs) -> None:
        self.group.set_debug(index, **kwargs)

    def set_timeouts(self, **kwargs) -> dict[str, float | None]:
        return self.group.set_timeouts(**kwargs)

    def set_restart_limit(self, max_restarts_per_call: int) -> int:
        """Engine restarts allowed per call (tests set 0); returns the previous limit."""
        old, self.group.max_restarts_per_call = (
            self.group.max_restarts_per_call,
            int(max_restarts_per_call),
        )
        return old

    def close(self) -> None:
        self.group.close()


# ---- the trainer's client ------------------------------------------------------------------------
def _actor_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    # the trainer's import path (e.g. custom reward modules) for the manager and engines
    paths = [os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class RayRolloutClient:
    """The rollout side of the trainer for Ray engines (`rollout.engine=vllm`).

    Same surface as RolloutProducer: publish(policy, version), produce(update), evaluate(),
    state(), restore(state), close(). `engine_kind` overrides cfg.rollout.engine ('jax' runs the
    embedded sampler in the engine actors: used by tests, needs no vLLM).
    """

    def __init__(self, cfg, actor_model, settings, *, engine_kind: str | None = None):
        from flax import nnx

        self.cfg = cfg
        r = cfg.rollout
        self.kind = engine_kind or r.engine
        self.log_level = engine_log_level(cfg)
        self.transport = r.transport
        if self.transport not in TRANSPORTS:
            raise ValueError(f"rollout.transport={self.transport!r}; expected one of {TRANSPORTS}")
        self.bucket_bytes = max(1, int(r.publish_bucket_mb * 2**20))
        self.model_config = actor_model.config
        self._graphdef = nnx.split(actor_model)[0]
        self.timings: dict[str, float] = {}
        self.publish_history: list[PublishStats] = []
        self.publish_breakdowns: list[dict[str, float]] = []
        self.last_breakdown: dict[str, float] = {}
        self._tmp = Path(tempfile.mkdtemp(prefix="jaxloop-rollout-"))
        self._committed: tuple[int, list] | None = None  # (version, refs or dir) now served
        # what a replacement manager needs: the committed publication (manifest dict, chunks,
        # transport) and the data cursor as of the last call that returned (restore / produce)
        self._publication: tuple[dict, list, str] | None = None
        self._cursor: dict | None = None
        self.manager_restarts = 0
        self._engine_restarts = [0.0, 0.0]  # [of replaced managers, last read from this one]
        self._started_ray = False
        self.manager = None
        self._placement_group: str | None = None
        try:
            self._connect(r.ray_address, r.num_engines)
            spec, bundle = self._engine_spec(cfg, actor_model, settings)
            self._manager_args = (settings, spec, r.num_engines, bundle)
            self._manager_kwargs = dict(
                engine_timeout_s=float(r.engine_timeout_s),
                publish_timeout_s=float(r.publish_timeout_s),
            )
            start = time.perf_counter()
            info = self._start_manager()
            self.timings["manager_start_s"] = time.perf_counter() - start
            self.timings["engine_start_s"] = max(info["engine_start_seconds"])
            self.expected = ray.get(self.manager.expected_specs.remote())
            self._cursor = ray.get(self.manager.state.remote())
            print(
                f"rollout: {r.num_engines} {self.kind} engine(s) ready in "
                f"{self.timings['manager_start_s']:.1f}s (engine start "
                f"{self.timings['engine_start_s']:.1f}s; ray "
                + (f"init {self.timings['ray_init_s']:.1f}s)" if self._started_ray else "joined)"),
                file=sys.stderr,
            )
        except BaseException:
            self.close()
            raise

    # ---- set-up ----
    def _start_manager(self) -> dict:
        """A new RolloutManager (and its engines) from the client's settings; returns its info."""
        self.manager = RolloutManager.options(num_cpus=0, runtime_env=self._runtime_env).remote(
            *self._manager_args, **self._manager_kwargs
        )
        info = ray.get(self.manager.info.remote())
        self._placement_group = info["placement_group"]
        return info

    def _replace_manager(self, what: str, err: BaseException) -> None:
        """The manager died during `what`: kill what is left of it (its engines die with it; its
        placement group outlives it and is removed), start a new one, restore the data cursor of
        the last call that returned and republish the committed policy."""
        start = time.perf_counter()
        try:
            ray.kill(self.manager, no_restart=True)
        except Exception:  # already gone
            pass
        self._remove_placement_group()
        self._engine_restarts = [sum(self._engine_restarts), 0.0]
        self._start_manager()
        if self._cursor is not None:
            ray.get(self.manager.restore.remote(self._cursor))
        if self._publication is not None:
            ray.get(self.manager.publish.remote(*self._publication))
        self.manager_restarts += 1
        logger.warning(
            "rollout manager died during %s (%s): restarted in %.1fs (restart #%d, serving "
            "version %s, data cursor restored)",
            what,
            _error_text(err),
            time.perf_counter() - start,
            self.manager_restarts,
            self.version,
        )

    def _remove_placement_group(self) -> None:
        if self._placement_group is None:
            return
        from ray.util.placement_group import PlacementGroup

        try:
            pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(self._placement_group)))
            remove_placement_group(pg)
        except Exception as e:  # already removed
            logger.debug("placement group %s not removed: %r", self._placement_group, e)
        self._placement_group = None

    def _call(self, what: str, method: str, *args):
        """ray.get(manager.method(*args)); if the manager actor dies (not: a call that raised),
        it is replaced (see _replace_manager) and the call made once more. A second death is
        ManagerFailedError naming `what` (e.g. 'update 7')."""
        try:
            return ray.get(getattr(self.manager, method).remote(*args))
        except RayActorError as e:
            if isinstance(e, RayTaskError):  # the manager is alive: its call raised
                raise
            first = e
        try:
            self._replace_manager(what, first)
        except RayActorError as e:
            if isinstance(e, RayTaskError):
                raise
            raise ManagerFailedError(
                f"{what}: the rollout manager died ({_error_text(first)}) and its replacement "
                f"died too ({_error_text(e)}); rerun to resume from the last checkpoint"
            ) from e
        try:
            return ray.get(getattr(self.manager, method).remote(*args))
        except RayActorError as e:
            if isinstance(e, RayTaskError):
                raise
            raise ManagerFailedError(
                f"{what}: the rollout manager died again after a restart ({_error_text(e)}); "
                "rerun to resume from the last checkpoint"
            ) from e

    def _count_restarts(self, stats: dict[str, float]) -> dict[str, float]:
        """engine_restarts over every manager of this client, and manager_restarts."""
        if "engine_restarts" in stats:
            self._engine_restarts[1] = float(stats["engine_restarts"])
            stats["engine_restarts"] = sum(self._engine_restarts)
        stats["manager_restarts"] = float(self.manager_restarts)
        return stats

    def _connect(self, address: str, num_engines: int) -> None:
        self._runtime_env = {"env_vars": _actor_env()}
        if ray.is_initialized():
            return  # a cluster this process already joined (not ours to shut down)
        start = time.perf_counter()
        quiet = logging.getLevelName(self.log_level) > logging.INFO
        # the engines' lines reach this process (log_to_driver); Ray's own at the engines' level
        common = dict(include_dashboard=False, log_to_driver=True, logging_level=self.log_level)
        with warnings.catch_warnings():
            if quiet:  # Ray starts its processes with fork + exec, not a bare fork
                warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
            if address:
                ray.init(address=address, **common)
            else:
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local test cluster
                # one logical CPU per engine (its bundle) and one spare
                ray.init(num_cpus=num_engines + 1, **common)
        self._started_ray = True
        self.timings["ray_init_s"] = time.perf_counter() - start

    def _engine_spec(self, cfg, actor_model, settings) -> tuple[EngineSpec, dict]:
        gpus = ray.cluster_resources().get("GPU", 0.0)
        m = self.model_config
        if self.kind == "jax":
            spec = EngineSpec(
                kind="jax",
                hf_config=m.to_hf_dict(),
                numerics=dict(
                    param_dtype=m.param_dtype,
                    compute_dtype=m.compute_dtype,
                    attention_impl=m.attention_impl,
                ),
                seed=int(cfg.seed),
                log_level=self.log_level,
            )
            return spec, {"CPU": 1.0}
        if self.kind != "vllm":
            raise ValueError(f"rollout.engine={self.kind!r}; expected 'jax' or 'vllm'")
        from jaxloop.models import save_hf

        start = time.perf_counter()
        model_dir = save_hf(actor_model, self._tmp / "model", dtype="float32")
        self.timings["save_initial_model_s"] = time.perf_counter() - start
        limit = int(m.hf_config.get("max_position_embeddings", 1 << 30))
        need = settings.max_prompt_tokens + settings.sampling.max_new_tokens
        llm_kwargs: dict[str, Any] = {}
        if logging.getLevelName(self.log_level) > logging.INFO:
            llm_kwargs["use_tqdm_on_load"] = False  # weight-loading progress bars
        if gpus < 1:  # CPU engines (tests, CI): eager, in-process engine core, small KV cache
            llm_kwargs["enforce_eager"] = True
            self._runtime_env["env_vars"].setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            self._runtime_env["env_vars"].setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if logging.getLevelName(self.log_level) > logging.INFO:  # torch's NUMA binding note
                self._runtime_env["env_vars"].setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        spec = EngineSpec(
            kind="vllm",
            model_dir=str(model_dir),
            dtype=m.compute_dtype,
            seed=int(cfg.seed),
            max_model_len=min(limit, _round_up(need, 32)),
            llm_kwargs=llm_kwargs,
            log_level=self.log_level,
        )
        return spec, ({"CPU": 1.0, "GPU": 1.0} if gpus >= 1 else {"CPU": 1.0})

    # ---- publication ----
    def hf_tensors(self, policy) -> list[tuple[str, np.ndarray]]:
        """The policy (nnx.State of the trainer's actor) as HF-named tensors in the engines'
        dtypes; names come from the family table."""
        import jax.numpy as jnp
        from flax import nnx

        from jaxloop.models.families import hf_table
        from jaxloop.models.hf_mapping import iter_hf_tensors

        model = nnx.merge(self._graphdef, policy)
        out = []
        for name, arr in iter_hf_tensors(model, hf_table(self.model_config, "actor")):
            want = self.expected.get(name)
            if want is not None and dtype_name(arr.dtype) != want[1]:
                arr = arr.astype(np.dtype(jnp.dtype(want[1])))
            out.append((name, arr))
        return out

    def publish(self, policy, version: int) -> PublishStats:
        """Publish the trainer's actor state as policy `version` on every engine (all-or-nothing;
        PublicationError on refusal, the engines keep serving the previous version)."""
        start = time.perf_counter()
        tensors = self.hf_tensors(policy)
        t_tensors = time.perf_counter()
        manifest = Manifest.build(version, tensors)
        self.last_breakdown = {"hf_tensors_s": t_tensors - start}
        self.last_breakdown["manifest_s"] = time.perf_counter() - t_tensors
        return self.publish_prepared(manifest, iter_chunks(tensors, self.bucket_bytes), start=start)

    def publish_prepared(
        self,
        manifest: Manifest,
        chunks: Iterable[bytes],
        *,
        count: int | None = None,
        digest: str | None = None,
        start: float | None = None,
    ) -> PublishStats:
        """Ship prepared buckets and run the transaction on every engine (count / digest default
        to the manifest's; tests pass others). Refusal -> PublicationError; the engines keep
        serving the previous version."""
        start = time.perf_counter() if start is None else start
        t_send = time.perf_counter()
        version = manifest.version
        if self.transport == "object_store":
            sent: list = [ray.put(np.frombuffer(c, np.uint8)) for c in chunks]
            where = None
        else:
            where = self._tmp / "publish" / f"v{version}"
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            sent = []
            for i, c in enumerate(chunks):
                path = where / f"chunk-{i:05d}.safetensors"
                path.write_bytes(c)
                sent.append(str(path))
        t_commit = time.perf_counter()
        args = (manifest.to_dict(), sent, self.transport)
        try:
            engine_stats = self._call(f"publication {version}", "publish", *args, count, digest)
        except PublicationError as e:
            if where is not None:
                shutil.rmtree(where, ignore_errors=True)
            raise PublicationError(_error_text(e)) from None
        self._publication = args  # count / digest: the manifest's (they matched)
        old, self._committed = self._committed, (version, sent if where is None else where)
        if old is not None and isinstance(old[1], Path) and old[1] != where:
            shutil.rmtree(old[1], ignore_errors=True)
        stats = PublishStats(
            version=version,
            num_tensors=manifest.count,
            num_bytes=manifest.total_bytes,
            seconds=time.perf_counter() - start,
        )
        self.publish_history.append(stats)
        breakdown = getattr(self, "last_breakdown", {})
        breakdown.update(
            send_s=t_commit - t_send,  # bucket serialisation + ray.put / file writes
            commit_s=time.perf_counter() - t_commit,  # engines: fetch, verify, load (parallel)
            engine_s=max(s.seconds for s in engine_stats),
        )
        self.last_breakdown = {}
        self.publish_breakdowns.append(breakdown)
        logger.info(
            "published version %d: %d tensors, %.1f MB in %.3fs (%.3f GB/s, %s)",
            version,
            stats.num_tensors,
            stats.num_bytes / 1e6,
            stats.seconds,
            stats.gb_per_s,
            self.transport,
        )
        return stats

    # ---- the producer surface ----
    def produce(self, update: int) -> tuple[list[Sample], dict[str, float]]:
        """The samples of `update`. A manager that dies meanwhile is replaced from the cursor as
        it was before this call and the committed policy: the same samples (see _call)."""
        samples, stats, cursor = self._call(f"update {update}", "produce_step", update)
        self._cursor = cursor
        return samples, self._count_restarts(stats)

    def evaluate(self) -> float:
        return self._call("evaluation", "evaluate")

    def state(self) -> dict:
        return self._call("reading the data cursor", "state")

    def restore(self, state: dict) -> None:
        state = copy.deepcopy(state)
        self._call("restoring the data cursor", "restore", state)
        self._cursor = state

    def health(self) -> list[dict]:
        return self._call("a health check", "health")

    def stats(self) -> dict[str, float]:
        return self._count_restarts(self._call("reading stats", "stats"))

    @property
    def version(self) -> int | None:
        return None if self._committed is None else self._committed[0]

    def close(self) -> None:
        """Stop the engines and the manager, remove temp files, and shut Ray down if this client
        started (or joined) it."""
        if self.manager is not None:
            try:
                ray.get(self.manager.close.remote(), timeout=120)
            except Exception as e:
                logger.warning("rollout manager close failed: %s", _error_text(e))
            try:
                ray.kill(self.manager, no_restart=True)
            except Exception:
                pass
            self.manager = None
            self._remove_placement_group()  # a dead manager's (a live one removed its own)
        self._committed = None
        shutil.rmtree(self._tmp, ignore_errors=True)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False
