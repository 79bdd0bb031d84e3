"""The embedded rollout engine: batched prefill + decode over the per-(loop, layer) KV cache.

One jitted program per (batch bucket, prompt bucket, sampling settings): prompts are left-padded
to a power-of-two length and the batch to a multiple of 8, so a run compiles a handful of times,
not every update. Each row samples from its own seed (key = fold_in(key(seed), step)).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxloop.io.hf_walk import fill_from_hf
from jaxloop.mathutil import round_up
from jaxloop.models.kv_cache import grow_cache, init_cache, read_length_for, read_lengths
from jaxloop.models.looped import LoopedLM, compute_dtype_state, project
from jaxloop.parallel import mesh as shd
from jaxloop.rollout.api import NotPublishedError, Policy, PublicationError
from jaxloop.rollout.types import PromptRequest, PublishStats, Sample, SamplingConfig

# [loops, layers, batch, length, kv_heads, head_dim]: sharded over batch and kv_heads
K_CACHE_AXES = ("loops", "layers", "batch", "kv_heads", "length", "head_dim")  # KVCache.k
V_CACHE_AXES = ("loops", "layers", "batch", "kv_heads", "head_dim", "length")  # KVCache.v
# folded into a sample's key for its exit draws, so they never reuse a token draw's key
EXIT_KEY_SALT = 0xE417


def exit_depths(exit_probs: jax.Array, mode: str, threshold: float, keys=None) -> jax.Array:
    """Exit depths [B] in 1..L from the gate's exit distribution [L, B]: 'threshold' the first
    loop whose cumulative probability reaches `threshold` (the last loop if none does in float32),
    'sample' a draw from the distribution with per-row `keys`."""
    loops = exit_probs.shape[0]
    if mode == "threshold":
        below = jnp.cumsum(exit_probs, axis=0) < threshold
        return jnp.minimum(jnp.sum(below, axis=0) + 1, loops).astype(jnp.int32)
    if mode == "sample":
        logits = jnp.log(exit_probs.T)  # a loop of probability 0 is never drawn
        return (jax.vmap(jax.random.categorical)(keys, logits) + 1).astype(jnp.int32)
    raise ValueError(f"early_exit={mode!r}")


def exit_step(out, cache_index, depths: jax.Array):
    """One decoded token per row run through every loop (`out`: forward with return_loops) made a
    token that exits at `depths` [B]: its logits are those of its exit loop, and the cache slots of
    the loops >= depth get its exit loop's keys / values (LAST_EXITED, as forward(depths=) writes
    them), so the next tokens see what the trainer's replay shows them. Returns (logits [B, V],
    cache)."""
    logits = jnp.take_along_axis(out.loop_logits[:, :, -1], (depths - 1)[None, :, None], axis=0)
    cache = out.cache
    at_exit = (depths - 1)[None, None, :, None, None, None]
    deeper = jnp.arange(cache.k.shape[0])[:, None, None, None, None, None] >= at_exit + 1

    def fill(x, axis):  # the token's slot along the cache's length axis
        column = jax.lax.dynamic_slice_in_dim(x, cache_index, 1, axis=axis)
        exited = jnp.take_along_axis(column, at_exit, axis=0)
        column = jnp.where(deeper, exited, column)
        return jax.lax.dynamic_update_slice_in_dim(x, column, cache_index, axis=axis)

    return logits[0], cache.replace(k=fill(cache.k, 4), v=fill(cache.v, 5))


def loop_head_logits(model: LoopedLM, loop_hidden: jax.Array) -> jax.Array:
    """Each loop's float32 logits [L, B, V] of the last position of `loop_hidden` [L, B, S, E]
    (`ModelOutput.loop_hidden`): the LM head applied as the trainer's per-loop recompute
    applies it (`rl.stats.loop_stats`), so both mean the same by loop t's logits."""
    lm_head = model.lm_head[...].astype(jnp.dtype(model.config.compute_dtype))
    return jax.vmap(lambda h: project(h, lm_head))(loop_hidden[:, :, -1:])[:, :, 0]


def exited_loop_logits(loop_logits: jax.Array, depths: jax.Array) -> jax.Array:
    """Per-loop logits [L, B, V] of tokens that exit at `depths` [B]: entry t is loop
    min(t + 1, depth)'s (loops >= depth repeat the exit loop), as the trainer's replay
    (forward(depths=, return_loops=True)) gives them."""
    source = jnp.minimum(jnp.arange(loop_logits.shape[0])[:, None], (depths - 1)[None, :])
    return jnp.take_along_axis(loop_logits, source[:, :, None], axis=0)


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def process_logits(logits: jax.Array, temperature: float) -> jax.Array:
    """log_softmax(logits / temperature): the distribution whose log-probs samples carry."""
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def filter_logprobs(logprobs: jax.Array, top_k: int | None, top_p: float) -> jax.Array:
    """Mask (to -inf) tokens outside top-k (None: off) and outside the top-p nucleus."""
    neg_inf = jnp.finfo(jnp.float32).min
    if top_k is not None:
        kth = jax.lax.top_k(logprobs, top_k)[0][..., -1:]
        logprobs = jnp.where(logprobs < kth, neg_inf, logprobs)
    if top_p < 1.0:
        sorted_lp = jnp.sort(logprobs, axis=-1)[..., ::-1]
        cumulative = jnp.cumsum(jnp.exp(sorted_lp), axis=-1)
        # keep the smallest set whose mass reaches top_p (the token crossing it included)
        keep_sorted = (cumulative - jnp.exp(sorted_lp)) < top_p
        threshold = jnp.min(jnp.where(keep_sorted, sorted_lp, jnp.inf), axis=-1, keepdims=True)
        logprobs = jnp.where(logprobs < threshold, neg_inf, logprobs)
    return logprobs


def _constrained(cache):
    return cache.replace(
        k=shd.constrain(cache.k, K_CACHE_AXES), v=shd.constrain(cache.v, V_CACHE_AXES)
    )


def _prefill(model, prompt_ids, prompt_mask, cache_len: int, loop_logprobs: bool):
    """The prompt's forward into a fresh cache: (output, the last position's per-loop logits
    [L, B, V] with loop_logprobs, else None)."""
    batch, prompt_len = prompt_ids.shape
    # the first of read_lengths(cache_len) that holds the prompt; decoding grows it (_grown)
    cache = _constrained(init_cache(model.config, batch, read_length_for(cache_len, prompt_len)))
    if loop_logprobs:  # only the last position's loop logits: no [L, B, S, V]
        out = model.forward(prompt_ids, attention_mask=prompt_mask, cache=cache, return_loops=True)
        return out, loop_head_logits(model, out.loop_hidden)
    out = model.forward(prompt_ids, attention_mask=prompt_mask, cache=cache)
    return out, None


def _token_picker(keys, temperature: float, greedy: bool, top_k: int | None, top_p: float):
    """`pick(logits, step) -> (token, its log-prob)`: argmax, or a draw from the filtered
    distribution with each row's key folded with the step."""

    def pick(logits, step):
        lp = process_logits(logits, temperature)
        if greedy:
            token = jnp.argmax(lp, axis=-1)
        else:
            filtered = filter_logprobs(lp, top_k, top_p)
            step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
            token = jax.vmap(jax.random.categorical)(step_keys, filtered)
        token = token.astype(jnp.int32)
        return token, jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0]

    return pick


def _decoder(model, batch: int, loops: int, early_exit, exit_threshold, exit_keys, loop_logprobs):
    """`decode(token, cache, step)`: one decode step of every row."""

    def decode(token, cache, step):
        """The next logits [B, V] after `token`, its exit depth [B], the gate's log p of it and
        (with loop_logprobs, else None) the next per-loop logits [L, B, V]."""
        ones = jnp.ones((batch, 1), jnp.bool_)
        if early_exit == "none":
            out = model.forward(
                token[:, None], attention_mask=ones, cache=cache, return_loops=loop_logprobs
            )
            full = jnp.full((batch,), loops, jnp.int32)
            next_loops = loop_head_logits(model, out.loop_hidden) if loop_logprobs else None
            return out.logits[:, -1], out.cache, full, jnp.zeros((batch,), jnp.float32), next_loops
        # every loop runs; the exit is decided on the gate's distribution and applied after
        # (a token's own loops before its exit do not depend on where it exits)
        out = model.forward(token[:, None], attention_mask=ones, cache=cache, return_loops=True)
        probs = out.exit_probs[:, :, -1]  # [L, B]
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(exit_keys)
        depth = exit_depths(probs, early_exit, exit_threshold, step_keys)
        exit_lp = jnp.log(jnp.take_along_axis(probs, (depth - 1)[None], axis=0)[0])
        next_loops = None
        if loop_logprobs:  # the exited token's deeper loops are its exit loop, as replayed
            next_loops = exited_loop_logits(loop_head_logits(model, out.loop_hidden), depth)
        logits, cache = exit_step(out, cache.index, depth)
        return logits, cache, depth, exit_lp, next_loops

    return decode


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "max_new_tokens", "sampling_key", "cache_len", "loop_logprobs"),
)
def _generate(
    graphdef,
    state,
    prompt_ids,
    prompt_mask,
    seeds,
    stop_ids,
    *,
    max_new_tokens: int,
    sampling_key: tuple,
    cache_len: int,
    loop_logprobs: bool = False,
):
    """Returns tokens, log-probs, depths and exit log-probs [B, max_new_tokens]; with
    `loop_logprobs` also each token's log-prob under every loop's logits [L, B, max_new_tokens]
    (else None; the program without them is the one it always was)."""
    temperature, top_p, top_k, greedy, early_exit, exit_threshold = sampling_key
    model = nnx.merge(graphdef, state)
    cfg = model.config
    if cfg.compute_dtype != cfg.param_dtype:  # one cast per call, not one per decode step
        model = nnx.merge(graphdef, compute_dtype_state(state, cfg.compute_dtype))
    batch, prompt_len = prompt_ids.shape
    out, last_loop_logits = _prefill(model, prompt_ids, prompt_mask, cache_len, loop_logprobs)
    last_logits = out.logits[:, -1]
    keys = jax.vmap(jax.random.key)(seeds)
    pick = _token_picker(keys, temperature, greedy, top_k, top_p)
    exit_keys = jax.vmap(lambda k: jax.random.fold_in(k, EXIT_KEY_SALT))(keys)
    loops = model.config.num_loops

    def loop_pick(loop_logits, token):  # [L, B]: the token's log-prob under each loop's
        lp = process_logits(loop_logits, temperature)
        return jnp.take_along_axis(lp, token[None, :, None], axis=-1)[..., 0]

    decode = _decoder(model, batch, loops, early_exit, exit_threshold, exit_keys, loop_logprobs)

    def body(carry):
        step, cache, logits, loop_logits, tokens, logprobs, loop_lps, depths, exit_lps, done = carry
        token, lp = pick(logits, step)
        token = jnp.where(done, 0, token)
        tokens = tokens.at[:, step].set(token)
        logprobs = logprobs.at[:, step].set(jnp.where(done, 0.0, lp))
        if loop_logprobs:
            loop_lp = jnp.where(done[None], 0.0, loop_pick(loop_logits, token))
            loop_lps = loop_lps.at[:, :, step].set(loop_lp)
        done = done | jnp.isin(token, stop_ids)
        logits, cache, depth, exit_lp, loop_logits = decode(token, cache, step)
        depths = depths.at[:, step].set(depth)
        exit_lps = exit_lps.at[:, step].set(exit_lp)
        carry = (step + 1, cache, logits, loop_logits, tokens, logprobs, loop_lps, depths, exit_lps)
        return carry + (done,)

    tokens = jnp.zeros((batch, max_new_tokens), jnp.int32)
    logprobs = jnp.zeros((batch, max_new_tokens), jnp.float32)
    depths = jnp.full((batch, max_new_tokens), loops, jnp.int32)
    exit_lps = jnp.zeros((batch, max_new_tokens), jnp.float32)
    loop_lps = None
    if loop_logprobs:
        loop_lps = jnp.zeros((loops, batch, max_new_tokens), jnp.float32)
    done = jnp.zeros((batch,), jnp.bool_)
    carry = (jnp.int32(0), out.cache, last_logits, last_loop_logits, tokens, logprobs, loop_lps)
    carry = carry + (depths, exit_lps, done)
    # decode step `step` writes slot prompt_len + step: one while loop per read length, each
    # on the cache grown to that length (read whole: see grow_cache) and running the steps whose
    # filled slots it holds (a static length per compiled body; no branch inside a step). Each
    # stops as soon as every row has finished (finished rows write 0s, which the buffers hold
    # already); the last step's forward is wasted work, kept so that every step has the same
    # body (it also gives the last token its depth)
    first = 0
    for length in read_lengths(cache_len):
        end = min(max_new_tokens, length - prompt_len)
        if end <= first:
            continue
        carry = (*carry[:1], _constrained(grow_cache(carry[1], length)), *carry[2:])
        carry = jax.lax.while_loop(lambda c, end=end: (c[0] < end) & ~jnp.all(c[-1]), body, carry)
        first = end
    _, _, _, _, tokens, logprobs, loop_lps, depths, exit_lps, _ = carry
    return tokens, logprobs, depths, exit_lps, loop_lps


@dataclasses.dataclass
class JaxSamplerEngine:
    """Embedded engine: generates with the same NNX decoder the trainer uses, on the trainer's
    mesh when given one (batch rows over the data-parallel axes; the published state keeps the
    trainer's shardings, so publication is zero-copy)."""

    model: LoopedLM
    min_prompt_bucket: int = 8
    batch_multiple: int = 8
    mesh: Mesh | None = None
    _version: int | None = None
    _state: nnx.State | None = None
    last_publish: PublishStats | None = None

    def __post_init__(self):
        self._graphdef, _ = nnx.split(self.model)
        self._budget_graphdefs = {self.model.config.num_loops: self._graphdef}
        if self.mesh is not None:
            self.batch_multiple = math.lcm(self.batch_multiple, shd.data_parallel_size(self.mesh))

    @property
    def version(self) -> int | None:
        return self._version

    def _graphdef_for(self, num_loops: int):
        """The decoder with config.num_loops = K (same parameters): a K-loop program with a
        K-slot KV cache, compiled once per distinct K (the graphdef is a static argument)."""
        if num_loops not in self._budget_graphdefs:
            full = self.model.config.num_loops
            if not 1 <= num_loops <= full:
                raise ValueError(f"sampling.num_loops={num_loops} is outside 1..{full}")
            graphdef, state = nnx.split(self.model)
            clone = nnx.merge(graphdef, state)
            clone.config = clone.config.replace(num_loops=num_loops)
            self._budget_graphdefs[num_loops] = nnx.split(clone)[0]
        return self._budget_graphdefs[num_loops]

    def publish(self, policy: Policy) -> PublishStats:
        """Serve `policy` from now on: its params (an nnx.State of the trainer's model) are
        installed as they are (zero-copy hand-off)."""
        start = time.perf_counter()
        state = policy.params
        count = len(jax.tree.leaves(state))
        return self._install(state, policy.version, count, start, sent=False)

    def publish_tensors(
        self, tensors: Iterable[tuple[str, np.ndarray]], version: int
    ) -> PublishStats:
        """Serve HF-named tensors as policy `version` (what an engine actor receives), checked
        for completeness and shapes like every remote engine's publication."""
        start = time.perf_counter()
        state, count = self._state_from_hf(tensors)
        return self._install(state, version, count, start, sent=True)

    def _install(self, state, version: int, count: int, start: float, sent: bool) -> PublishStats:
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        self._state, self._version = state, version
        seconds = time.perf_counter() - start
        # the trainer's arrays are installed as they are: nothing sent
        stats = PublishStats(version, count, nbytes, seconds, sent_bytes=nbytes if sent else 0)
        self.last_publish = stats
        return stats

    def _state_from_hf(self, tensors: Iterable[tuple[str, np.ndarray]]):
        _, state = nnx.split(self.model)
        flat = dict(nnx.to_flat_state(state))
        specs = {path: var[...] for path, var in flat.items()}
        buffers, count = fill_from_hf(
            tensors, specs, self.model.config, self.model.role, error=PublicationError
        )
        for path, buf in buffers.items():
            flat[path] = flat[path].replace(jnp.asarray(buf))
        return nnx.from_flat_state(flat), count

    def generate(self, requests: list[PromptRequest], sampling: SamplingConfig) -> list[Sample]:
        if self._state is None:
            raise NotPublishedError("generate() before any policy version was published")
        if not requests:
            return []
        n = len(requests)
        longest = max(len(r.prompt_ids) for r in requests)
        prompt_len = _bucket(longest, self.min_prompt_bucket)
        batch = round_up(n, self.batch_multiple)
        ids = np.zeros((batch, prompt_len), np.int32)
        mask = np.zeros((batch, prompt_len), np.bool_)
        seeds = np.zeros((batch,), np.uint32)
        for i, r in enumerate(requests):
            p = np.asarray(r.prompt_ids, np.int32)
            ids[i, prompt_len - len(p) :] = p
            mask[i, prompt_len - len(p) :] = True
            seeds[i] = np.uint32(r.seed % (1 << 32))
        mask[n:, -1] = True  # padding rows: one dummy token so no row is fully masked
        stop = np.asarray(sampling.stop_token_ids or (-1,), np.int32)
        key = (
            float(sampling.temperature),
            float(sampling.top_p),
            None if sampling.top_k is None else int(sampling.top_k),
            bool(sampling.greedy),
            str(sampling.early_exit),
            float(sampling.exit_threshold),
        )
        if sampling.early_exit != "none" and not self.model.config.early_exit_gate:
            raise ValueError(f"early_exit={sampling.early_exit!r} needs a model with an exit gate")
        if self.mesh is None:
            place, context = jnp.asarray, contextlib.nullcontext()
        else:
            rows, rep = shd.batch_sharding(self.mesh, 1), shd.replicated(self.mesh)
            place = lambda x: shd.put_global(x, rep if x is stop else rows)  # noqa: E731
            context = jax.set_mesh(self.mesh)
        loops = sampling.num_loops or self.model.config.num_loops
        with context:
            tokens, logprobs, depths, exit_lps, loop_lps = _generate(
                self._graphdef_for(loops),
                self._state,
                place(ids),
                place(mask),
                place(seeds),
                place(stop),
                max_new_tokens=sampling.max_new_tokens,
                sampling_key=key,
                cache_len=prompt_len + sampling.max_new_tokens,
                loop_logprobs=bool(sampling.loop_logprobs),
            )
        tokens, logprobs = shd.to_host(tokens), shd.to_host(logprobs)
        depths, exit_lps = shd.to_host(depths), shd.to_host(exit_lps)
        loop_lps = None if loop_lps is None else shd.to_host(loop_lps)
        stop_set = set(sampling.stop_token_ids)
        samples = []
        for i, r in enumerate(requests):
            row = tokens[i].tolist()
            length, reason = len(row), "length"
            for j, tok in enumerate(row):
                if tok in stop_set:
                    length, reason = j + 1, "stop"
                    break
            sample = Sample.from_request(
                r, row[:length], logprobs[i, :length].tolist(), reason, self._version
            )
            sample.extras["loop_budget"] = loops
            # response token j ran depths[j] loops (the logits of token j + 1 are of that loop)
            sample.extras["response_depths"] = depths[i, :length].tolist()
            sample.extras["response_exit_logprobs"] = exit_lps[i, :length].tolist()
            if loop_lps is not None:  # [L][T]: token j's log-prob under loop t's logits
                sample.extras["loop_logprobs"] = loop_lps[:, i, :length].tolist()
            samples.append(sample)
        return samples

    def close(self) -> None:
        self._state = None
