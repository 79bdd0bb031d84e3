"""A RolloutEngine on vLLM (in-process `vllm.LLM`), serving looped models via jaxloop's plugin.

Importing this module is cheap; vLLM (and torch) are imported when a VLLMEngine is created.

- Prompts go in as token ids (no tokenizer in the engine: skip_tokenizer_init=True).
- `publish` is a transaction (jaxloop.rollout.publication): manifest -> safetensors buckets ->
  finish with count and digest, checked in the engine's worker(s) before anything is loaded.
  On success the weights are reloaded in place (`reload_weights`), the prefix cache is dropped
  (its KV was computed with the old weights) and the version is committed. On refusal
  PublicationError is raised and the previous version keeps serving.
- `generate` returns, per sampled token, log_softmax(logits / temperature) over the full
  vocabulary (top-k / top-p filtering is not reflected; greedy: log_softmax(logits)): vLLM runs
  with logprobs_mode='processed_logprobs' and the worker extension takes the log-softmax ahead
  of top-k / top-p filtering (see vllm_models.worker.install_unfiltered_logprobs).
- Early exit (`sampling.early_exit` threshold | sample, Ouro): the plugin exits each response
  token at its loop (vllm_models.worker.EarlyExitPlan) and the depths and exit log-probs come
  back through the worker extension, as `extras['response_depths']` and
  `extras['response_exit_logprobs']` like the JAX sampler's. vLLM never runs a response's last
  token through the model (nothing reads its forward: it predicts past the response), so that
  token reports full depth and exit log-prob 0. Needs enforce_eager=True and no prefix caching
  (a cached block holding response tokens was computed with their exits).
- Loop budgets (`sampling.num_loops` = K): the plugin runs the first K loops; every sample
  records `extras['loop_budget']`. Needs enforce_eager=True; a change of K drops the prefix
  cache (its blocks hold the other depth's keys / values).

Not thread-safe: call publish / generate from one thread.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from jaxloop import families
from jaxloop.rollout.api import NotPublishedError, Policy, PublicationError
from jaxloop.rollout.publication.transaction import Manifest, iter_chunks
from jaxloop.rollout.types import PromptRequest, PublishStats, Sample, SamplingConfig

WORKER_EXTENSION = "jaxloop.rollout.vllm_models.worker.JaxloopWorkerExtension"


class EngineBrokenError(RuntimeError):
    """Loading a verified publication failed part-way; the engine's weights are undefined."""


class VLLMEngine:
    """In-process vLLM engine implementing the RolloutEngine protocol.

    model_dir: an HF checkpoint directory (config.json + safetensors) whose architecture is
    NanbeigeForCausalLM or OuroForCausalLM; its weights are loaded at start-up but not served
    until the first `publish` commits a version.
    bucket_bytes: tensor bytes per publication chunk.
    Other keyword arguments go to `vllm.LLM` (e.g. gpu_memory_utilization, tensor_parallel_size,
    block_size, enforce_eager, max_num_seqs).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int = 2048,
        bucket_bytes: int = 256 << 20,
        enable_prefix_caching: bool = True,
        **llm_kwargs,
    ):
        # The unfiltered-logprob hook needs the V1 model runner's sampler.
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        from vllm import LLM

        from jaxloop.rollout.vllm_models import register

        register()
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.enforce_eager = bool(llm_kwargs.get("enforce_eager", False))
        self.enable_prefix_caching = bool(enable_prefix_caching)
        hf_config = json.loads((Path(self.model_dir) / "config.json").read_text())
        self.num_loops = int(families.read_hf_config(hf_config)["num_loops"])
        self.bucket_bytes = int(bucket_bytes)
        self._llm = LLM(
            model=self.model_dir,
            skip_tokenizer_init=True,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=enable_prefix_caching,
            worker_extension_cls=WORKER_EXTENSION,
            **llm_kwargs,
        )
        replies = self._rpc("jaxloop_setup")
        self.expected: dict[str, tuple[tuple[int, ...], str]] = {
            n: (tuple(s), d) for n, (s, d) in replies[0]["expected"].items()
        }
        self._version: int | None = None
        self._depth_mode: tuple[str, float, int] = ("none", 1.0, 0)
        self._broken: str | None = None
        self.last_publish: PublishStats | None = None

    # ---- RolloutEngine -----------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        return self._version

    def publish(self, policy: Policy) -> PublishStats:
        """Serve `policy` from now on (all-or-nothing): its HF-named tensors in the dtypes this
        engine loads, as one transaction."""
        from jaxloop.rollout.publication.policy import (
            hf_tensors,  # jax: only where a Policy is published
        )

        dtypes = {name: dtype for name, (_, dtype) in self.expected.items()}
        return self.publish_tensors(hf_tensors(policy, dtypes), policy.version)

    def publish_tensors(
        self, tensors: Iterable[tuple[str, np.ndarray]], version: int
    ) -> PublishStats:
        """Install HF-named tensors as policy `version` (all-or-nothing)."""
        start = time.perf_counter()
        items = [(name, np.asarray(value)) for name, value in tensors]
        manifest = Manifest.build(version, items)
        # buckets are serialised one at a time as they are sent (host memory: one bucket)
        return self.publish_chunks(manifest, iter_chunks(items, self.bucket_bytes), start=start)

    def generate(self, requests: list[PromptRequest], sampling: SamplingConfig) -> list[Sample]:
        self._check_serving()
        if not requests:
            return []
        from vllm.inputs import TokensPrompt

        early_exit = self._set_depth(sampling)
        loops = int(sampling.num_loops or self.num_loops)
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [self._sampling_params(sampling, r.seed) for r in requests]
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        exits = self._take_exits() if early_exit else None
        samples = []
        for req, out in zip(requests, outputs, strict=True):
            completion = out.outputs[0]
            ids = [int(t) for t in completion.token_ids]
            if completion.logprobs is None or len(completion.logprobs) != len(ids):
                raise RuntimeError(f"vLLM returned no log-prob for some tokens of {out.request_id}")
            logprobs = [
                float(step[t].logprob) for step, t in zip(completion.logprobs, ids, strict=True)
            ]
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"request finished with {completion.finish_reason!r}")
            sample = Sample.from_request(
                req, ids, logprobs, completion.finish_reason, self._version
            )
            sample.extras["loop_budget"] = loops
            if exits is not None:
                depths, exit_lps = self._response_exits(exits, out.request_id, req, len(ids), loops)
                sample.extras["response_depths"] = depths
                sample.extras["response_exit_logprobs"] = exit_lps
            samples.append(sample)
        return samples

    def _set_depth(self, sampling: SamplingConfig) -> bool:
        """Put the engine's depth plan (early exit, loop budget) in the mode `sampling` asks for;
        True when tokens exit early."""
        loops = int(sampling.num_loops) if sampling.num_loops != self.num_loops else 0
        mode = (sampling.early_exit, float(sampling.exit_threshold), loops)
        if mode[0] != "none" and (not self.enforce_eager or self.enable_prefix_caching):
            raise ValueError(
                f"early_exit={mode[0]} needs a VLLMEngine with enforce_eager=True and "
                "enable_prefix_caching=False"
            )
        if loops and not self.enforce_eager:  # a compiled graph holds one loop count
            raise ValueError(f"num_loops={loops} needs a VLLMEngine with enforce_eager=True")
        if mode != self._depth_mode:
            self._rpc_checked("jaxloop_set_depth", *mode)
            if loops != self._depth_mode[2]:  # cached prompt blocks hold the other depth's KV
                self._llm.reset_prefix_cache()
            self._depth_mode = mode
        return mode[0] != "none"

    def _take_exits(self) -> dict[str, dict[int, tuple[int, float]]]:
        """{request id: {position: (depth, exit log-prob)}}, keyed by the ids generate's outputs
        carry (vLLM's internal id is the external one + '-' + a random suffix)."""
        # every worker runs the same batch; the first one's record stands for all
        exits = self._rpc_checked("jaxloop_take_exits")[0]["exits"]
        return {internal.rsplit("-", 1)[0]: record for internal, record in exits.items()}

    def _response_exits(self, exits, request_id: str, req: PromptRequest, length: int, loops: int):
        """(depths, exit log-probs) of a response of `length` tokens from the plan's records."""
        record = exits.get(request_id, {} if length <= 1 else None)  # 1 token: none ran
        if record is None:
            raise RuntimeError(f"no early-exit record for request {request_id}")
        start = len(req.prompt_ids)
        depths, exit_lps = [], []
        for j in range(length - 1):
            if start + j not in record:
                raise RuntimeError(f"request {request_id}: no exit for response token {j}")
            depth, lp = record[start + j]
            depths.append(depth)
            exit_lps.append(lp)
        if length:  # the last token never ran (see the module docstring)
            depths.append(loops)
            exit_lps.append(0.0)
        return depths, exit_lps

    def close(self) -> None:
        if self._llm is None:
            return
        engine = getattr(self._llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self._llm = None
        gc.collect()

    # ---- extras ------------------------------------------------------------------------------
    def publish_chunks(
        self,
        manifest: Manifest,
        chunks: Iterable[bytes],
        *,
        count: int | None = None,
        digest: str | None = None,
        start: float | None = None,
    ) -> PublishStats:
        """Run one publication transaction from prepared parts: begin with `manifest`, the
        buckets, then finish with `count` and `digest` (the finish message; the manifest's
        unless given, e.g. by an engine actor relaying a Publication)."""
        start = time.perf_counter() if start is None else start
        if self._broken:
            raise EngineBrokenError(self._broken)
        version = manifest.version
        if self._version is not None and version <= self._version:
            raise PublicationError(f"version {version} is not newer than committed {self._version}")
        try:
            self._rpc_checked("jaxloop_begin", version, manifest.to_dict())
            chunk_iter = iter(chunks)
            while True:
                try:
                    chunk = next(chunk_iter)
                except StopIteration:
                    break
                except Exception as e:  # the publisher's side (a lost object, a file): refuse
                    raise PublicationError(f"publication {version}: chunk failed: {e!r}") from e
                self._rpc_checked("jaxloop_add_chunk", version, chunk)
            self._rpc_checked(
                "jaxloop_finish",
                version,
                manifest.count if count is None else count,
                manifest.digest if digest is None else digest,
            )
        except PublicationError:
            self._rpc("jaxloop_abort")
            raise
        if not self._llm.reset_prefix_cache():
            self._broken = f"version {version} loaded but the prefix cache could not be reset"
            raise EngineBrokenError(self._broken)
        self._version = version
        stats = PublishStats(
            version=version,
            num_tensors=manifest.count,
            num_bytes=manifest.total_bytes,
            seconds=time.perf_counter() - start,
        )
        self.last_publish = stats
        return stats

    def prompt_logprobs(self, token_ids) -> np.ndarray:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1 under the committed policy
        (temperature 1, full vocabulary): float32 array of len(token_ids) - 1."""
        self._check_serving()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = [int(t) for t in token_ids]
        params = SamplingParams(
            max_tokens=1, prompt_logprobs=0, detokenize=False, ignore_eos=True, temperature=1.0
        )
        out = self._llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        steps = out[0].prompt_logprobs[1:]
        if len(steps) != len(ids) - 1:
            raise RuntimeError(f"vLLM returned {len(steps)} prompt log-probs for {len(ids)} tokens")
        return np.array([s[t].logprob for s, t in zip(steps, ids[1:], strict=True)], np.float32)

    # ---- internals ---------------------------------------------------------------------------
    def _check_serving(self) -> None:
        if self._broken:
            raise EngineBrokenError(self._broken)
        if self._version is None:
            raise NotPublishedError("no policy version has been published to this engine yet")

    def _sampling_params(self, sampling: SamplingConfig, seed: int):
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=0.0 if sampling.greedy else float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=0 if sampling.top_k is None else int(sampling.top_k),  # vLLM's 0: off
            seed=int(seed),
            max_tokens=int(sampling.max_new_tokens),
            stop_token_ids=[int(t) for t in sampling.stop_token_ids],
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
        )

    def _rpc(self, method: str, *args) -> list:
        return self._llm.collective_rpc(method, args=args)

    def _rpc_checked(self, method: str, *args) -> list:
        replies = self._rpc(method, *args)
        for reply in replies:
            if reply.get("fatal"):
                self._broken = reply["error"]
                raise EngineBrokenError(reply["error"])
            if not reply["ok"]:
                raise PublicationError(reply["error"])
        return replies

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
