"""vLLM worker extension: the engine side of policy publication, and unfiltered log-probs.

Mixed into vLLM's worker class through `worker_extension_cls`; its methods are called with
`LLM.collective_rpc(name, args=...)` and run in every worker (engine processes only). Arguments
are plain Python objects and bytes (torch tensors do not survive collective_rpc). Replies are
dicts `{"ok": bool, "error": str | None, ...}` rather than exceptions, so that a refusal reads
the same in-process and across processes.
"""

from __future__ import annotations

import time
import warnings

import ml_dtypes
import numpy as np
import torch

from jaxloop.rollout.api import PublicationError
from jaxloop.rollout.publication import Manifest, PublicationReceiver

BF16 = np.dtype(ml_dtypes.bfloat16)


def numpy_to_torch(arr: np.ndarray) -> torch.Tensor:
    """Zero-copy numpy -> torch (bf16 through a uint16 view); read-only input stays read-only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        if arr.dtype == BF16:
            return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(arr)


def install_unfiltered_logprobs(sampler) -> None:
    """Make the sampled token's log-prob log_softmax(logits / temperature) over the whole
    vocabulary even when top-k / top-p filter the sampling distribution.

    vLLM's 'processed_logprobs' mode returns log-probs after temperature *and* top-k/top-p
    (renormalised over the kept tokens); the rollout contract wants them before filtering. The
    V1 sampler hands temperature-scaled float32 logits to `topk_topp_sampler`, which filters them
    in place; this wraps it to take the log-softmax first. Without filtering the wrapped sampler
    already returns exactly that and is called unchanged.
    """
    if getattr(sampler, "logprobs_mode", None) != "processed_logprobs":
        raise RuntimeError(
            f"sampler logprobs_mode={getattr(sampler, 'logprobs_mode', None)!r}; "
            "expected 'processed_logprobs'"
        )
    tts = getattr(sampler, "topk_topp_sampler", None)
    if tts is None:
        raise RuntimeError(
            f"{type(sampler).__name__} has no topk_topp_sampler (Model Runner V2?); set "
            "VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if getattr(tts, "_jaxloop_unfiltered", False):
        return
    inner = tts.forward

    def forward(logits, generators, k, p):
        if k is None and p is None:
            return inner(logits, generators, k, p)
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        sampled, _ = inner(logits, generators, k, p)
        return sampled, logprobs

    tts.forward = forward
    tts._jaxloop_unfiltered = True


def _reply(ok: bool = True, error: str | None = None, **extra) -> dict:
    return {"ok": ok, "error": error, **extra}


class JaxloopWorkerExtension:
    """Methods added to the vLLM worker (self is the worker: self.model_runner, reload_weights)."""

    def jaxloop_setup(self, unfiltered_logprobs: bool = True) -> dict:
        model = self.model_runner.get_model()
        specs = model.hf_tensor_specs()
        self._jaxloop_receiver = PublicationReceiver(specs)
        if unfiltered_logprobs:
            install_unfiltered_logprobs(self.model_runner.sampler)
        return _reply(expected={n: [list(s), d] for n, (s, d) in specs.items()})

    def jaxloop_begin(self, version: int, manifest: dict) -> dict:
        try:
            self._jaxloop_receiver.begin(version, Manifest.from_dict(manifest))
        except PublicationError as e:
            return _reply(False, str(e))
        return _reply()

    def jaxloop_add_chunk(self, version: int, data: bytes) -> dict:
        try:
            n = self._jaxloop_receiver.add_chunk(version, data)
        except PublicationError as e:
            return _reply(False, str(e))
        return _reply(tensors=n)

    def jaxloop_finish(self, version: int, count: int, digest: str) -> dict:
        try:
            tensors = self._jaxloop_receiver.finish(version, count, digest)
        except PublicationError as e:
            return _reply(False, str(e))
        start = time.perf_counter()
        try:
            self.reload_weights(
                weights_iterator=((n, numpy_to_torch(a)) for n, a in tensors.items())
            )
        except Exception as e:  # the model may now hold a mix of versions
            return _reply(False, f"loading version {version} failed: {e!r}", fatal=True)
        return _reply(load_seconds=time.perf_counter() - start)

    def jaxloop_abort(self) -> dict:
        self._jaxloop_receiver.abort()
        return _reply()
