"""One rollout engine in its own Ray actor process: how it is built (EngineSpec), its publication
transaction, and the log settings of the actor processes."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from jaxloop.rollout.api import PublicationError
from jaxloop.rollout.publication.transaction import PublicationReceiver, dtype_name
from jaxloop.rollout.types import PromptRequest, PublishStats, Sample, SamplingConfig

if TYPE_CHECKING:
    from jaxloop.rollout.ray.transport import Publication, Transport

logger = logging.getLogger(__name__)


def cause(err: BaseException) -> BaseException:
    """The original exception inside (possibly nested) Ray task errors."""
    seen = 0
    while getattr(err, "cause", None) is not None and seen < 8:
        err = err.cause
        seen += 1
    return err


def error_text(err: BaseException) -> str:
    err = cause(err)
    return str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """How to build one engine (crosses process boundaries: plain values only).

    kind 'jax': hf_config (LoopedConfig.to_hf_dict()) + numerics (LoopedConfig.numerics(): the
    trainer's dtypes, attention and scan_layers, so the engine runs the trainer sampler's
    program); weights arrive with the first publication.
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

    def __post_init__(self):  # kind itself is checked by the config validation
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


class EngineProcess:
    """One rollout engine in its own process (EngineActor: this class as a Ray actor); its log
    lines are prefixed `(engine <index> pid=...)` (Ray's prefix is the actor's repr)."""

    def __init__(self, spec: EngineSpec, index: int = 0):
        start = time.perf_counter()
        self.spec = spec
        self.index = int(index)
        configure_actor_logging(spec.log_level)
        self._log_config: str | None = None
        if spec.kind == "jax":
            import jax.numpy as jnp
            from flax import nnx

            from jaxloop.families import hf_tensor_shapes
            from jaxloop.models import LoopedConfig, LoopedLM
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
        return self.engine.version, os.getpid()

    def expected_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return self.expected

    def publish(self, publication: Publication) -> PublishStats:
        """One publication transaction; refusal -> PublicationError, previous version kept."""
        start = time.perf_counter()
        m, transport = publication.manifest, publication.transport
        buckets = (self.read_chunk(c, transport) for c in publication.chunks)
        finish = dict(count=publication.count, digest=publication.digest)
        if self.receiver is None:  # vLLM: the transaction is checked in the engine's worker(s)
            data = (bytes(memoryview(b)) for b in buckets)
            return self.engine.publish_chunks(m, data, start=start, **finish)
        try:
            self.receiver.begin(m.version, m)
            for bucket in buckets:
                self.receiver.add_chunk(m.version, bucket)
            tensors = self.receiver.finish(m.version, publication.count, publication.digest)
        except PublicationError:
            self.receiver.abort()
            raise
        except Exception as e:  # e.g. a lost object or file: refuse, keep the old version
            self.receiver.abort()
            raise PublicationError(f"publication {m.version}: {e!r}") from e
        stats = self.engine.publish_tensors(tensors.items(), m.version)
        return dataclasses.replace(stats, seconds=time.perf_counter() - start)

    def read_chunk(self, chunk, transport: Transport):
        """One publication bucket, read as its transport stages it."""
        return transport.read(chunk)

    def generate(self, requests: list[PromptRequest], sampling: SamplingConfig) -> list[Sample]:
        return self.engine.generate(requests, sampling)

    def close(self) -> None:
        self.engine.close()
        if self._log_config:
            Path(self._log_config).unlink(missing_ok=True)


def engine_actor(process: type[EngineProcess] = EngineProcess):
    """`process` (EngineProcess or a subclass) as the Ray actor class of an engine: never
    restarted by Ray (the group restarts engines itself, on the committed policy)."""
    return ray.remote(max_restarts=0, max_task_retries=0)(process)
