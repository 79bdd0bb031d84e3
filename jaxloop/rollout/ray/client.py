"""The trainer's side of Ray rollouts: RayRolloutClient (see jaxloop.rollout.ray)."""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group

from jaxloop.mathutil import round_up
from jaxloop.parallel.distributed import parse_resources
from jaxloop.rollout.api import ManagerFailedError, Policy, PublicationError
from jaxloop.rollout.publication.staging import HostStaging
from jaxloop.rollout.publication.transaction import Manifest, iter_chunks, xor_encode
from jaxloop.rollout.ray.actor import EngineProcess, EngineSpec, error_text
from jaxloop.rollout.ray.group import placement_lines
from jaxloop.rollout.ray.manager import RolloutManagerProcess, manager_actor
from jaxloop.rollout.ray.transport import Publication, ReplayChain, make_transport
from jaxloop.rollout.types import PublishStats, Sample

logger = logging.getLogger(__name__)


# environment variables handed from the trainer process to the Ray actors
_ENV_PREFIXES = ("JAX_", "XLA_", "VLLM_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")


def _actor_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    # the trainer's import path (e.g. custom reward modules) for the manager and engines
    paths = [os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def retained_copies(tensors: Iterable[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Owned copies of tensors kept past their publication: staged tensors are views of host
    buffers that the next publication overwrites (HostStaging), never to be retained as such."""
    return {name: np.array(arr, copy=True) for name, arr in tensors}


class RayRolloutClient:
    """The rollout side of the trainer for Ray engines (`rollout.engine=vllm` or `ray_jax`).

    A RolloutSource, like RolloutProducer: publish(policy), produce(update), evaluate(),
    state(), restore(state), version, close(). `rollout`: the run's rollout section
    (jaxloop/rollout/settings.py RolloutSection; engine 'jax' runs the embedded sampler in the
    engine actors, no vLLM needed); `model_config`: the actor's LoopedConfig (the engines boot
    from it alone: the weights leave the trainer only by publication, version 0 included);
    `settings`: the producer's (seed, sampling, loop budget);
    `log_level`: the engine actors' (default: rollout.engine_log_level); `manager_process` and
    `engine_process`: the manager's and the engines' process classes.

    The client owns the committed version as a ReplayChain (it outlives managers and engines,
    and its buckets are the client's): the engine group serves the chain handed over with each
    publication, and a replacement manager is handed it whole.
    """

    # capabilities (RolloutSource): engines on their own devices, generating while the learner
    # trains; no per-loop log-probs
    shares_devices = False
    loop_logprobs = False

    def __init__(
        self,
        rollout,
        model_config,
        settings,
        *,
        log_level: str | None = None,
        manager_process: type[RolloutManagerProcess] = RolloutManagerProcess,
        engine_process: type[EngineProcess] = EngineProcess,
    ):
        r = rollout
        self.kind = "jax" if r.engine == "ray_jax" else r.engine  # the engine actors' kind
        self.log_level = log_level or r.engine_log_level.upper()
        self.transport = r.transport  # its name: make_transport stages each publication
        self.publish_mode = r.publish  # 'full', 'delta' or 'delta_xor'
        self.bucket_bytes = max(1, int(r.publish_bucket_mb * 2**20))
        # host buffers every publication stages the policy through (allocated at the first)
        self._staging = HostStaging(self.bucket_bytes)
        self.model_config = model_config
        self.timings: dict[str, float] = {}
        self.last_publish: PublishStats | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix="jaxloop-rollout-"))
        # the committed version (see the class docstring) and the data cursor as of the last
        # call that returned (restore / produce): what a replacement manager is given
        self.chain = ReplayChain()
        self._cursor: dict | None = None
        # delta publication: sha256 of every tensor of the committed version; delta_xor: its
        # host tensors too (one model copy on the host), the base of the xor payloads
        self._hashes: dict[str, bytes] | None = None
        self._base_tensors: dict[str, np.ndarray] | None = None
        self.publish_fallbacks = 0
        self.manager_restarts = 0
        self._engine_restarts = [0.0, 0.0]  # [of replaced managers, last read from this one]
        self._started_ray = False
        self.manager = None
        self._placement_group: str | None = None
        try:
            self._connect(r.ray_address, r.num_engines)
            self.spec, bundle = self._engine_spec(settings)
            bundle.update(parse_resources(r.engine_resources))  # e.g. engine_slot=1: the node
            self._manager_args = (settings, self.spec, r.num_engines, bundle)
            self._manager_kwargs = dict(
                engine_timeout_s=float(r.engine_timeout_s),
                publish_timeout_s=float(r.publish_timeout_s),
                placement_timeout_s=float(r.engine_placement_timeout_s),
                engine_process=engine_process,
            )
            self._manager_actor = manager_actor(manager_process)
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
            for line in placement_lines(self._placement_group):
                print(f"rollout: {line}", file=sys.stderr)
        except BaseException:
            self.close()
            raise

    # ---- set-up ----
    def _start_manager(self) -> dict:
        """A new RolloutManager (and its engines) from the client's settings; returns its info.
        The manager runs on this process's node (it needs no resources): an engine node lost
        takes only its engines, which the manager's group restarts or gives up on in one line."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        options = dict(num_cpus=0, runtime_env=self._runtime_env, scheduling_strategy=here)
        self.manager = self._manager_actor.options(**options).remote(
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
        if self.chain:
            ray.get(self.manager.serve.remote(self.chain))
        self.manager_restarts += 1
        logger.warning(
            "rollout manager died during %s (%s): restarted in %.1fs (restart #%d, serving "
            "version %s, data cursor restored)",
            what,
            error_text(err),
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
                f"{what}: the rollout manager died ({error_text(first)}) and its replacement "
                f"died too ({error_text(e)}); rerun to resume from the last checkpoint"
            ) from e
        try:
            return ray.get(getattr(self.manager, method).remote(*args))
        except RayActorError as e:
            if isinstance(e, RayTaskError):
                raise
            raise ManagerFailedError(
                f"{what}: the rollout manager died again after a restart ({error_text(e)}); "
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
                # one logical CPU per engine (its bundle) and one spare; "local": a new cluster,
                # never one another process started on this machine (Ray's default joins it)
                ray.init(address="local", num_cpus=num_engines + 1, **common)
        self._started_ray = True
        self.timings["ray_init_s"] = time.perf_counter() - start

    def _engine_spec(self, settings) -> tuple[EngineSpec, dict]:
        gpus = ray.cluster_resources().get("GPU", 0.0)
        m = self.model_config
        if self.kind == "jax":
            spec = EngineSpec(
                kind="jax",
                hf_config=m.to_hf_dict(),
                numerics=m.numerics(),
                seed=int(settings.seed),
                log_level=self.log_level,
            )
            return spec, {"CPU": 1.0}
        from jaxloop.io.hf import hf_config_dict

        # vLLM boots from the config alone, on dummy weights it never serves: the policy's
        # weights reach it by publication (a NotPublishedError until the first)
        model_dir = self._tmp / "model"
        model_dir.mkdir()
        hf = {**hf_config_dict(m), "torch_dtype": "float32"}
        (model_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        limit = int(m.hf_config.get("max_position_embeddings", 1 << 30))
        need = settings.max_prompt_tokens + settings.sampling.max_new_tokens
        llm_kwargs: dict[str, Any] = {"load_format": "dummy"}
        if logging.getLevelName(self.log_level) > logging.INFO:
            llm_kwargs["use_tqdm_on_load"] = False  # weight-loading progress bars
        early_exit = settings.sampling.early_exit
        if early_exit != "none" or settings.loop_budget:
            # the plugin's depth plan reads the batch on the host per forward, and a cached block
            # holding response tokens was computed with their exits
            llm_kwargs["enforce_eager"] = True
            llm_kwargs["enable_prefix_caching"] = early_exit == "none"
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
            seed=int(settings.seed),
            max_model_len=min(limit, round_up(need, 32)),
            llm_kwargs=llm_kwargs,
            log_level=self.log_level,
        )
        return spec, ({"CPU": 1.0, "GPU": 1.0} if gpus >= 1 else {"CPU": 1.0})

    # ---- publication ----
    def publish(self, policy: Policy) -> PublishStats:
        """Publish the trainer's actor state as policy `policy.version` on every engine
        (all-or-nothing; PublicationError on refusal, the engines keep serving the previous
        version)."""
        start = time.perf_counter()
        # the tensors are views of the staging buffers, valid until the next publication:
        # whatever outlives this call is copied (retained_copies) or serialised (buckets)
        staged = self._staging.stage(
            policy, {name: dtype for name, (_, dtype) in self.expected.items()}
        )
        tensors, hashes = staged.tensors, staged.hashes
        t_tensors = time.perf_counter()
        delta_mode = self.publish_mode in ("delta", "delta_xor")
        full = Manifest.build(policy.version, tensors, hashes=hashes, retain=delta_mode)
        delta, payloads, rebase = (
            self._delta(full, hashes, tensors) if delta_mode else (None, {}, False)
        )
        # hf_tensors_s: the host tensors and their hashes (staging; its stages in stage_*)
        breakdown = {"hf_tensors_s": t_tensors - start, **staged.stats}
        breakdown["manifest_s"] = time.perf_counter() - t_tensors
        kept = dict(hashes=hashes, base=tensors if self.publish_mode == "delta_xor" else None)
        if delta is None:
            return self._send_full(full, tensors, start, breakdown, kept)
        t_send = time.perf_counter()
        changed = set(delta.sent)
        sent = [(n, payloads.get(n, a)) for n, a in tensors if n in changed]
        publication = self.stage(delta, iter_chunks(sent, self.bucket_bytes))
        replay = None
        if rebase:
            chunks = iter_chunks(tensors, self.bucket_bytes)
            replay = self.stage(full, chunks, label=f"v{full.version}-full")
        breakdown["send_s"] = time.perf_counter() - t_send
        try:
            return self.send(publication, start=start, breakdown=breakdown, replay=replay, **kept)
        except PublicationError as e:  # the engines still serve the committed version
            self.publish_fallbacks += 1
            logger.warning(
                "delta publication of version %d refused (%s): publishing it in full",
                policy.version,
                e,
            )
        stats = self._send_full(full, tensors, start, dict(breakdown), kept)
        stats = dataclasses.replace(
            stats, sent_bytes=stats.sent_bytes + delta.sent_bytes, fell_back=True
        )
        self.last_publish = stats
        return stats

    def _send_full(self, full: Manifest, tensors, start: float, breakdown: dict, kept: dict):
        t_send = time.perf_counter()
        publication = self.stage(full, iter_chunks(tensors, self.bucket_bytes))
        breakdown["send_s"] = time.perf_counter() - t_send
        return self.send(publication, start=start, breakdown=breakdown, **kept)

    def _delta(
        self, full: Manifest, hashes: dict[str, bytes], tensors: list[tuple[str, np.ndarray]]
    ) -> tuple[Manifest | None, dict[str, np.ndarray], bool]:
        """The delta of `full` over the committed version: the tensors whose bytes changed, and
        with delta_xor the xor payloads (uint8) of those whose payload is smaller than their raw
        bytes (the others go raw); and whether to rebase the replay chain. None (publish in full)
        before the first retained publication, or when the delta would carry as many bytes as
        the version (every tensor changed, no xor savings). The chain (the last full publication
        and the deltas since: what a restarted engine or manager replays) is rebased when its
        deltas would carry more bytes than one model: the delta is sent, and a full publication
        of the new version is staged (not sent) as the chain's new start, so at most two models
        stay staged."""
        if self._hashes is None or self.version is None:
            return None, {}, False
        changed = tuple(n for n in full.tensors if hashes[n] != self._hashes.get(n))
        payloads: dict[str, np.ndarray] = {}
        if self._base_tensors is not None and changed:
            new = dict(tensors)
            workers = min(8, os.cpu_count() or 1, len(changed))
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # zlib drops the GIL
                encoded = pool.map(lambda n: xor_encode(new[n], self._base_tensors[n]), changed)
                for name, payload in zip(changed, encoded, strict=True):
                    if payload is not None:
                        payloads[name] = np.frombuffer(payload, np.uint8)
        xor = {n: p.nbytes for n, p in payloads.items()} or None
        delta = dataclasses.replace(full, base_version=self.version, sent=changed, xor=xor)
        if delta.sent_bytes >= full.total_bytes:
            return None, {}, False
        return delta, payloads, self.chain.delta_bytes + delta.sent_bytes > full.total_bytes

    def stage(self, manifest: Manifest, buckets: Iterable[bytes], label: str = "") -> Publication:
        """The publication of `manifest` with its buckets staged where the engines fetch them
        (rollout.transport)."""
        transport = make_transport(self.transport, self._tmp / "publish")
        return Publication.stage(manifest, buckets, transport, label or f"v{manifest.version}")

    def send(
        self,
        publication: Publication,
        *,
        start: float | None = None,
        hashes: dict[str, bytes] | None = None,
        base: list[tuple[str, np.ndarray]] | None = None,
        replay: Publication | None = None,
        breakdown: dict[str, float] | None = None,
    ) -> PublishStats:
        """Run the transaction of a staged publication on every engine. Refusal ->
        PublicationError; the engines keep serving the previous version. `hashes`: the
        version's tensor_hashes, and `base` its host tensors (delta_xor), kept as the base of the
        next delta when the manifest asks the engines to retain it. `replay`: a full publication
        of the same version, staged as the new start of the replay chain (see _delta), not
        sent."""
        start = time.perf_counter() if start is None else start
        manifest = publication.manifest
        chain = self.chain.after(publication, replay)
        t_commit = time.perf_counter()
        try:
            engine_stats = self._call(
                f"publication {manifest.version}", "publish", publication, chain
            )
        except PublicationError as e:
            publication.release()
            if replay is not None:
                replay.release()
            raise PublicationError(error_text(e)) from None
        kept = {id(p) for p in chain}
        for old in self.chain:
            if id(old) not in kept:
                old.release()
        self.chain = chain
        self._hashes = dict(hashes) if manifest.retain and hashes is not None else None
        self._base_tensors = None
        if manifest.retain and base is not None:  # never a view of staging or jax buffers
            self._base_tensors = retained_copies(base)
        breakdown = dict(breakdown or {})
        breakdown.update(
            commit_s=time.perf_counter() - t_commit,  # engines: fetch, verify, load (parallel)
            engine_s=max(s.seconds for s in engine_stats),
        )
        stats = PublishStats(
            version=manifest.version,
            num_tensors=manifest.count,
            num_bytes=manifest.total_bytes,
            seconds=time.perf_counter() - start,
            sent_bytes=manifest.sent_bytes,
            breakdown=breakdown,
        )
        self.last_publish = stats
        logger.info(
            "published version %d: %d tensors, %.1f MB (%.1f MB sent) in %.3fs (%.3f GB/s, %s)",
            manifest.version,
            stats.num_tensors,
            stats.num_bytes / 1e6,
            stats.sent_bytes / 1e6,
            stats.seconds,
            stats.gb_per_s,
            publication.transport.name,
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

    def evaluate_samples(self) -> tuple[float, list[dict[str, Any]]]:
        return self._call("evaluation", "evaluate_samples")

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
        return self.chain.version

    def close(self) -> None:
        """Stop the engines and the manager, remove temp files, and shut Ray down if this client
        started (or joined) it."""
        if self.manager is not None:
            try:
                ray.get(self.manager.close.remote(), timeout=120)
            except Exception as e:
                logger.warning("rollout manager close failed: %s", error_text(e))
            try:
                ray.kill(self.manager, no_restart=True)
            except Exception:
                pass
            self.manager = None
            self._remove_placement_group()  # a dead manager's (a live one removed its own)
        self.chain, self._hashes, self._base_tensors = ReplayChain(), None, None
        if getattr(self, "_staging", None) is not None:  # close() also runs on a failed __init__
            self._staging.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False
