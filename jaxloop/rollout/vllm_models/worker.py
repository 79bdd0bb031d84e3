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
from jaxloop.rollout.publication.transaction import Manifest, PublicationReceiver
from jaxloop.rollout.types import EARLY_EXIT_MODES

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


# folded into a request's seed for its exit draws ('sample' mode), apart from vLLM's token draws
EXIT_DRAW_SALT = 0xE417


class EarlyExitPlan:
    """Where each token of a forward batch may exit, and what it did (vLLM has no per-token
    output a model can fill, so the depths go back through collective_rpc: jaxloop_take_exits).

    A token is a response token when its position is at or past its request's prompt length
    (prompts run at full depth, as the JAX sampler's prefill); it exits at the first loop whose
    cumulative exit probability reaches `threshold` ('threshold'), or a uniform draw seeded by
    (request seed, position) ('sample': a draw from the gate's distribution by its inverse CDF).
    Tokens map to requests through the runner's batch (`input_batch`, `query_start_loc`), which
    vLLM fills on the host before every forward; the model must run eagerly."""

    def __init__(self, runner):
        self.runner = runner
        self.mode = "none"
        self.threshold = 1.0
        self.num_loops = 0  # a loop budget K (0: every loop)
        self.exits: dict[str, dict[int, tuple[int, float]]] = {}  # request id -> position -> exit
        self._step = None

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def thresholds(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Per-token exit thresholds [T] (inf: full depth) of the batch being run; None for a
        warm-up batch without requests."""
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        if num_reqs == 0:
            self._step = None
            return None
        starts = self.runner.query_start_loc.np[: num_reqs + 1]
        total, n = int(starts[-1]), int(positions.shape[0])
        if total > n:
            raise RuntimeError(f"early exit: the batch schedules {total} tokens, forward got {n}")
        request = np.repeat(np.arange(num_reqs), np.diff(starts))
        pos = positions[:total].cpu().numpy().astype(np.int64)
        response = pos >= batch.num_prompt_tokens[:num_reqs][request]
        out = np.full(n, np.inf, np.float32)
        if self.mode == "threshold":
            out[:total][response] = self.threshold
        else:
            req_ids = batch.req_ids
            for k in np.nonzero(response)[0]:
                seed = self.runner.requests[req_ids[request[k]]].sampling_params.seed
                if seed is None:
                    raise RuntimeError("early_exit=sample needs a seed on every request")
                rng = np.random.default_rng((int(seed), int(pos[k]), EXIT_DRAW_SALT))
                out[k] = rng.random()
        self._step = (list(batch.req_ids), request, pos, response)
        return torch.from_numpy(out).to(positions.device)

    def record(self, depths: torch.Tensor, exit_logprobs: torch.Tensor) -> None:
        if self._step is None:
            return
        req_ids, request, pos, response = self._step
        d, e = depths.cpu().numpy(), exit_logprobs.cpu().numpy()
        for k in np.nonzero(response)[0]:
            self.exits.setdefault(req_ids[request[k]], {})[int(pos[k])] = (int(d[k]), float(e[k]))
        self._step = None


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

    def jaxloop_set_depth(self, mode: str, threshold: float, num_loops: int) -> dict:
        """Serve every following request with early exit `mode` (EARLY_EXIT_MODES) and a loop budget
        of `num_loops` (0: every loop), dropping what was recorded of earlier requests."""
        inner = self.model_runner.get_model().model
        if mode not in EARLY_EXIT_MODES:
            return _reply(
                False, f"early_exit={mode!r}; expected one of {'/'.join(EARLY_EXIT_MODES)}"
            )
        if mode != "none" and not inner.arch.early_exit_gate:
            return _reply(False, f"early_exit={mode} needs a model with an exit gate (Ouro)")
        if not 0 <= num_loops <= inner.arch.num_loops:
            return _reply(False, f"num_loops={num_loops} is outside 0..{inner.arch.num_loops}")
        plan = getattr(self, "_jaxloop_exit_plan", None)
        if plan is None:
            plan = self._jaxloop_exit_plan = EarlyExitPlan(self.model_runner)
            inner.exit_plan = plan
        plan.mode, plan.threshold, plan.num_loops = mode, float(threshold), int(num_loops)
        plan.exits = {}
        return _reply()

    def jaxloop_take_exits(self) -> dict:
        """{request id: {position: (depth, exit log-prob)}} of every response token run since
        the last call (vLLM's internal request ids), and forget them."""
        plan = getattr(self, "_jaxloop_exit_plan", None)
        exits = {} if plan is None else plan.exits
        if plan is not None:
            plan.exits = {}
        return _reply(exits=exits)

    def jaxloop_abort(self) -> dict:
        self._jaxloop_receiver.abort()
        return _reply()
