"""The learner: pure jitted functions of (TrainState, batch).

    old_logprobs(state, batch)        -> [N, T] selected-token log-probs of the actor
    update(state, batch)              -> (state, metrics): reference log-probs, values, advantages
                                         (the algorithm's registered estimator), the policy steps
                                         and the critic steps of one rollout

The learner knows the algorithm only through its registry entry (`rl.algorithms.Algorithm`):
which policy loss and advantage estimator, whether the loss needs the frozen old policy's
full-vocabulary logits. Whether there is a critic or a reference is a property of the state.
With a mesh, both functions are jitted with explicit in/out shardings under `jax.set_mesh` (so
the model's activation constraints apply) and `update` donates the state it replaces: no second
copy of parameters and optimizer state exists during a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxloop.config import LOOP_CREDITS
from jaxloop.mathutil import round_up
from jaxloop.models.looped import project
from jaxloop.parallel import mesh as shd
from jaxloop.rl import advantages as adv_lib
from jaxloop.rl.algorithms import Algorithm
from jaxloop.rl.losses import (
    POLICY_LOSSES,
    LossHParams,
    LossInputs,
    categorical_kl,
    kl_penalty,
    masked_metric_sums,
    reduce_loss,
    value_loss,
)
from jaxloop.rl.packing import PACK_KEYS, pack_groups
from jaxloop.rl.state import COUNTERS, TrainState


def make_optimizer(
    name: str,
    lr: float,
    schedule: str,
    warmup: int,
    total_steps: int,
    weight_decay: float,
    b1: float,
    b2: float,
    grad_clip: float,
):
    total_steps = max(total_steps, 1)
    if schedule == "constant":
        sched = optax.constant_schedule(lr)
    elif schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 0), total_steps)
    elif schedule == "linear":
        sched = optax.linear_schedule(lr, 0.0, total_steps)
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    if schedule == "constant" and warmup > 0:
        sched = optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
        )
    if name == "adamw":
        opt = optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay)
    elif name == "sgd":
        opt = optax.sgd(sched, momentum=None)
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
    return optax.chain(*parts, opt)


# ---- pure model functions (jit-friendly) ----
def token_logprobs(graphdef, params, tokens, attention_mask, temperature):
    """Selected-token log-probs of log_softmax(logits / T) at every target position and the
    scaled logits, whole: the plain reference form of `actor_token_stats`."""
    model = nnx.merge(graphdef, params)
    out = model.forward(tokens[:, :-1], attention_mask=attention_mask[:, :-1])
    logits = out.logits / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0], logits


def actor_token_stats(
    graphdef,
    params,
    tokens,
    attention_mask,
    temperature,
    chunk: int = 0,
    old_params=None,
    depths=None,
    exit_mask=None,
):
    """Per target position of `tokens`: the selected token's log-prob under log_softmax(logits /
    T), the entropy of that distribution and, with `old_params`, Flow-DPPO's exact full-vocabulary
    D_t = KL(pi_old || pi); plus the LM-head input hidden states [B, T, E].

    chunk > 0: the LM head is applied to `chunk` positions at a time under remat, so only one
    chunk's [B, chunk, V] logits exist at once, in the forward and in the backward pass (the
    gradient recomputes them); chunk = 0 (or >= T): the whole sequence at once.

    depths [B, T] (early-exit rollouts): each input position runs that many loops (depth replay);
    exit_mask [B, T]: where it is 1 the gate's log p of the position's exit depth is added to the
    selected log-prob (the exit choice is part of the action, algo.depth_as_action)."""
    inputs = (tokens[:, :-1], tokens[:, 1:], attention_mask[:, :-1], None, None)
    return input_token_stats(
        graphdef, params, inputs, temperature, chunk, old_params, depths, exit_mask
    )


def packed_token_stats(graphdef, params, rows: dict, temperature, chunk: int = 0, old_params=None):
    """`actor_token_stats` of packed rows (`rows_*` of a micro-batch, jaxloop.rl.packing), each
    result gathered back to the micro-batch's samples [micro, T, ...] (0 off their tokens)."""
    segments = rows["rows_segment_ids"]
    inputs = (rows["rows_tokens"], rows["rows_targets"], segments > 0, rows["rows_positions"])
    stats = input_token_stats(
        graphdef, params, inputs + (segments,), temperature, chunk, old_params
    )
    return tuple(None if x is None else unpack_rows(x, rows["rows_index"]) for x in stats)


def unpack_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """[R, P, ...] results of packed rows -> [micro, T, ...] by `index` (1 + flat row position;
    0 reads 0)."""
    flat = x.reshape((-1,) + x.shape[2:])
    flat = jnp.concatenate([jnp.zeros((1,) + flat.shape[1:], flat.dtype), flat], axis=0)
    return flat[index]


def selected_and_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The targets' log-probs under log_softmax(logits) and that distribution's entropy."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    selected = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return selected, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def input_token_stats(
    graphdef,
    params,
    inputs: tuple,
    temperature,
    chunk=0,
    old_params=None,
    depths=None,
    exit_mask=None,
):
    """`actor_token_stats` of model inputs (input ids, targets, attention mask, positions or None,
    segment ids or None), all [B, T]."""
    input_ids, targets, attention_mask, positions, segment_ids = inputs
    model = nnx.merge(graphdef, params)
    out = model.forward(
        input_ids,
        positions,
        attention_mask,
        head=False,
        segment_ids=segment_ids,
        depths=depths,
        return_loops=exit_mask is not None,  # head=False: only the exit distribution
    )
    cdt = jnp.dtype(model.config.compute_dtype)
    lm_head = model.lm_head[...].astype(cdt)
    old_hidden = old_head = None
    if old_params is not None:
        old = nnx.merge(graphdef, old_params)
        hidden = old.forward(
            input_ids, positions, attention_mask, head=False, segment_ids=segment_ids, depths=depths
        )
        old_hidden = jax.lax.stop_gradient(hidden.hidden)
        old_head = jax.lax.stop_gradient(old.lm_head[...].astype(cdt))

    def stats(h, t, oh):
        logits = project(h, lm_head) / temperature
        selected, entropy = selected_and_entropy(logits, t)
        kl = None if oh is None else categorical_kl(project(oh, old_head) / temperature, logits)
        return selected, entropy, kl

    length = out.hidden.shape[1]
    if chunk <= 0 or chunk >= length:
        selected, entropy, kl = stats(out.hidden, targets, old_hidden)
    else:
        n = -(-length // chunk)

        def split(x):  # [B, T, ...] -> [n, B, chunk, ...], zero-padded at the end
            if x is None:
                return None
            pad = [(0, 0), (0, n * chunk - length)] + [(0, 0)] * (x.ndim - 2)
            x = jnp.pad(x, pad).reshape((x.shape[0], n, chunk) + x.shape[2:])
            return jnp.moveaxis(x, 1, 0)

        def merge(x):  # [n, B, chunk] -> [B, T]
            return None if x is None else jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1)[:, :length]

        one = jax.checkpoint(lambda xs: stats(*xs))
        chunks = jax.lax.map(one, (split(out.hidden), split(targets), split(old_hidden)))
        selected, entropy, kl = (merge(x) for x in chunks)
    if exit_mask is not None:
        selected = selected + exit_mask * exit_logprobs(out.exit_probs, depths, exit_mask)
    return selected, entropy, kl, out.hidden


def exit_logprobs(exit_probs: jax.Array, depths: jax.Array, mask: jax.Array) -> jax.Array:
    """log p_d [B, T] of the exit distribution exit_probs [L, B, T] at each position's depth d
    (0 where mask is 0, without a log of 0 there)."""
    p = jnp.take_along_axis(exit_probs, (depths - 1)[None], axis=0)[0]
    return jnp.where(mask > 0, jnp.log(jnp.where(mask > 0, p, 1.0)), 0.0)


def token_values(graphdef, params, tokens, attention_mask, depths=None):
    model = nnx.merge(graphdef, params)
    out = model.forward(tokens[:, :-1], attention_mask=attention_mask[:, :-1], depths=depths)
    return out.values


def packed_token_values(graphdef, params, rows: dict):
    """`token_values` of packed rows, gathered back to the micro-batch's samples."""
    model = nnx.merge(graphdef, params)
    segments = rows["rows_segment_ids"]
    values = model.forward(
        rows["rows_tokens"], rows["rows_positions"], segments > 0, segment_ids=segments
    ).values
    return unpack_rows(values, rows["rows_index"])


# ---- per-loop credit (algo.loop_credit) ----


class LoopStats(NamedTuple):
    """Per loop t of the model, each [L, B, T]: the selected token's log-prob, the entropy and
    (with old parameters) Flow-DPPO's D_t = KL(pi_old_t || pi_t) of loop t's distribution, and
    KL(pi_last || pi_t); the exit distribution (models with an exit gate, else None) and the last
    loop's LM-head inputs [B, T, E]."""

    logprobs: jax.Array
    entropy: jax.Array
    old_kl: jax.Array | None
    kl_to_last: jax.Array
    exit_probs: jax.Array | None
    hidden: jax.Array


def loop_weights(credit: str, num_loops: int, exit_probs: jax.Array | None = None) -> jax.Array:
    """The weights w_t of the policy loss sum_t w_t loss_t, summing to 1 over loops: uniform
    1/L and progressive (t + 1) / sum_j (j + 1) as [L, 1, 1]; exit_pdf the exit distribution
    [L, B, T] of each token, stop-gradient (the weights carry no gradient into the gate)."""
    if credit == "exit_pdf":
        if exit_probs is None:
            raise ValueError("loop_credit=exit_pdf needs a model with an exit gate (Ouro)")
        return jax.lax.stop_gradient(exit_probs.astype(jnp.float32))
    if credit == "uniform":
        w = jnp.ones((num_loops,), jnp.float32)
    elif credit == "progressive":
        w = jnp.arange(1, num_loops + 1, dtype=jnp.float32)
    else:
        raise ValueError(f"loop_credit={credit!r} has no per-loop weights; one of {LOOP_CREDITS}")
    return (w / jnp.sum(w))[:, None, None]


def loop_token_stats(
    graphdef, params, inputs: tuple, temperature, chunk=0, old_params=None, depths=None
) -> LoopStats:
    """`LoopStats` of model inputs (as `input_token_stats`): loop t's logits are the LM head
    applied to the state after the norm that ends loop t (`ModelOutput.loop_hidden`).

    Only one loop's logits exist at a time (plus the last loop's, for the KL to it): per chunk of
    `chunk` positions (chunk <= 0: the whole sequence), each loop's statistics are computed in
    turn under remat, so the backward pass recomputes them loop by loop as well; with chunk > 0
    no [B, T, V] array exists, for any loop."""
    input_ids, targets, attention_mask, positions, segment_ids = inputs

    def loops_of(p):  # the model of `p` and its per-loop LM-head inputs
        m = nnx.merge(graphdef, p)
        kwargs = dict(head=False, return_loops=True, segment_ids=segment_ids, depths=depths)
        return m, m.forward(input_ids, positions, attention_mask, **kwargs)

    model, out = loops_of(params)
    cdt = jnp.dtype(model.config.compute_dtype)
    lm_head = model.lm_head[...].astype(cdt)
    old_hidden = old_head = None
    if old_params is not None:
        old, old_out = loops_of(old_params)
        old_hidden = jax.lax.stop_gradient(old_out.loop_hidden)
        old_head = jax.lax.stop_gradient(old.lm_head[...].astype(cdt))

    def one_loop(h, t, oh, last_logits):  # one loop's [B, c, E] -> four [B, c]
        logits = project(h, lm_head) / temperature
        selected, entropy = selected_and_entropy(logits, t)
        kl = None if oh is None else categorical_kl(project(oh, old_head) / temperature, logits)
        return selected, entropy, kl, categorical_kl(last_logits, logits)

    def one_chunk(xs):  # [L, B, c, E], [B, c], [L, B, c, E] or None -> four [L, B, c]
        h, t, oh = xs
        last_logits = jax.lax.stop_gradient(project(h[-1], lm_head) / temperature)
        per_loop = jax.checkpoint(lambda ys: one_loop(ys[0], t, ys[1], last_logits))
        return jax.lax.map(per_loop, (h, oh))

    length = out.loop_hidden.shape[2]
    size = length if chunk <= 0 or chunk >= length else chunk
    n = -(-length // size)

    def split(x, axis):  # the length axis -> a leading chunk axis, zero-padded at the end
        if x is None:
            return None
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, n * size - length)
        x = jnp.pad(x, pad)
        return jnp.moveaxis(x.reshape(x.shape[:axis] + (n, size) + x.shape[axis + 1 :]), axis, 0)

    def merge(x):  # [n, L, B, c] -> [L, B, T]
        if x is None:
            return None
        x = jnp.moveaxis(x, 0, 2)
        return x.reshape(x.shape[:2] + (-1,))[..., :length]

    body = one_chunk if n == 1 else jax.checkpoint(one_chunk)
    chunks = jax.lax.map(body, (split(out.loop_hidden, 2), split(targets, 1), split(old_hidden, 2)))
    selected, entropy, kl, kl_to_last = (merge(x) for x in chunks)
    return LoopStats(selected, entropy, kl, kl_to_last, out.exit_probs, out.hidden)


def packed_loop_stats(
    graphdef, params, rows: dict, temperature, chunk: int = 0, old_params=None
) -> LoopStats:
    """`loop_token_stats` of packed rows, each result gathered back to the micro-batch's samples
    (per loop: [L, micro, T]; hidden [micro, T, E])."""
    segments = rows["rows_segment_ids"]
    inputs = (rows["rows_tokens"], rows["rows_targets"], segments > 0, rows["rows_positions"])
    stats = loop_token_stats(graphdef, params, inputs + (segments,), temperature, chunk, old_params)
    index = rows["rows_index"]
    per_loop = jax.vmap(lambda x: unpack_rows(x, index))
    gathered = (None if x is None else per_loop(x) for x in stats[:-1])
    return LoopStats(*gathered, unpack_rows(stats.hidden, index))


def _micro_axes(x: jax.Array, micro_axis: int) -> tuple:
    axes = [None] * x.ndim
    axes[micro_axis] = "batch"
    return tuple(axes)


def _split_micro(batch: dict, micro: int) -> dict:
    """[N, ...] -> [K, micro, ...], padding N with zero rows (mask 0: no loss, no metrics); the
    micro axis is the sharded one."""
    n = next(iter(batch.values())).shape[0]
    total = round_up(n, micro)

    def pad(x):
        if total != n:
            x = jnp.concatenate([x, jnp.zeros((total - n,) + x.shape[1:], x.dtype)], axis=0)
        x = x.reshape((total // micro, micro) + x.shape[1:])
        return shd.constrain(x, _micro_axes(x, 1))

    return {k: pad(v) for k, v in batch.items()}


def _split_rows(batch: dict, prefix: str, leading: tuple) -> dict:
    """Packed rows [prod(leading) * R, P] of `batch` -> `rows_*` [*leading, R, P], the rows
    axis sharded (each micro-batch's rows spread over the data-parallel devices)."""
    out = {}
    for key in PACK_KEYS:
        x = batch[prefix + key]
        x = x.reshape(leading + (-1,) + x.shape[1:])
        out["rows_" + key] = shd.constrain(x, _micro_axes(x, len(leading)))
    return out


def _step_plan(n: int, steps: int, micro: int) -> np.ndarray:
    """Row indices [steps, P] of each optimizer step's part of the batch (np.array_split order),
    each part padded to a multiple of `micro` with index n (an all-zero row)."""
    parts = np.array_split(np.arange(n), steps)
    width = round_up(max(len(p) for p in parts), micro)
    plan = np.full((steps, width), n, np.int32)
    for i, p in enumerate(parts):
        plan[i, : len(p)] = p
    return plan


def _accumulate(micro_loss, params, batch, with_outputs: bool = False):
    """Sum loss, gradients and metric sums of `micro_loss(params, x) -> (loss, sums)` over the
    leading micro-batch axis of `batch` with one scan (one compiled body for any count).
    with_outputs: `micro_loss` returns (loss, (sums, outputs)) and the per-micro-batch outputs
    come back stacked as a fourth result."""
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    first = jax.tree.map(lambda v: v[0], batch)
    aux_shapes = jax.eval_shape(lambda: micro_loss(params, first)[1])
    sum_shapes = aux_shapes[0] if with_outputs else aux_shapes

    def step(carry, x):
        grads, loss, sums = carry
        (micro, aux), g = grad_fn(params, x)
        micro_sums, outputs = aux if with_outputs else (aux, None)
        return (
            jax.tree.map(jnp.add, grads, g),
            loss + micro,
            jax.tree.map(jnp.add, sums, micro_sums),
        ), outputs

    init = (
        jax.tree.map(jnp.zeros_like, params),
        jnp.float32(0.0),
        jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), sum_shapes),
    )
    if jax.tree.leaves(batch)[0].shape[0] == 1:
        # one micro-batch: no loop (a while loop of one trip still keeps XLA from fusing across
        # its boundary and adds the zero accumulators); the same sums
        totals, outputs = step(init, first)
        outputs = None if outputs is None else jax.tree.map(lambda x: x[None], outputs)
    else:
        totals, outputs = jax.lax.scan(step, init, batch)
    return (*totals, outputs) if with_outputs else totals


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    micro_batch_size: int
    temperature: float
    updates_per_rollout: int
    critic_steps: int
    advantage: adv_lib.AdvantageHParams = adv_lib.AdvantageHParams()
    logits_chunk: int = 0  # positions per LM-head chunk (0: the whole sequence)
    # > 0: each micro-batch's samples packed into rows of this many tokens (jaxloop.rl.packing)
    pack_tokens: int = 0
    loop_credit: str = "last"  # the policy loss over loops (LOOP_CREDITS; last: the last loop)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """What rests in host memory (`memory_kind='pinned_host'`) while the phase at work does not
    use it: the critic and its optimizer state (outside the value / critic phases), the actor's
    optimizer state (outside the actor phase: during generation and the critic phase), the
    reference (outside the reference log-prob phase). Any flag on runs the update as three
    jitted phases with the moves between them; all off runs it as one fused program."""

    critic: bool = False
    optimizer: bool = False
    reference: bool = False

    @property
    def any(self) -> bool:
        return self.critic or self.optimizer or self.reference


class Learner:
    """Static parts (graphdefs, algorithm, hyper-parameters, optimizers, shardings) and the two
    jitted functions. It holds no parameters: those live in the TrainState."""

    def __init__(
        self,
        actor_graphdef,
        critic_graphdef,
        algorithm: Algorithm,
        hparams: LossHParams,
        config: LearnerConfig,
        actor_tx: optax.GradientTransformation,
        critic_tx: optax.GradientTransformation | None = None,
        *,
        mesh: Mesh | None = None,
        state_shardings: TrainState | None = None,
        offload: OffloadConfig = OffloadConfig(),
    ):
        self.algorithm = algorithm
        self.hp = hparams
        self.cfg = config
        self.actor_graphdef = actor_graphdef
        self.critic_graphdef = critic_graphdef
        self.actor_tx = actor_tx
        self.critic_tx = critic_tx
        self.mesh = mesh
        self.state_shardings = state_shardings
        self.offload = offload
        # packed rows per micro-batch are a multiple of the data-parallel size (even shards)
        self.row_multiple = 1 if mesh is None else shd.data_parallel_size(mesh)
        self.last_moves: dict[str, float] = {}
        # the phases of an offloaded update (the fused `_update` is the same three in one)
        self._prepare = jax.jit(self._prepare_impl)
        self._actor_phase = jax.jit(self._actor_impl, donate_argnums=(0, 1))
        self._critic_phase = jax.jit(self._critic_impl, donate_argnums=(0, 1))
        self._counters = jax.jit(self._counters_impl)
        if mesh is None:
            self._old_logprobs = jax.jit(self._old_logprobs_impl, static_argnums=2)
            self._update = jax.jit(self._update_impl, static_argnums=2, donate_argnums=0)
            self._update_fused = self._update
        else:
            rows = shd.batch_sharding(mesh, ndim=1)
            self.batch_sharding = rows
            rep = shd.replicated(mesh)
            self._old_logprobs = jax.jit(
                self._old_logprobs_impl,
                static_argnums=2,
                in_shardings=(state_shardings.actor_params, rows),
                out_shardings=rows,
            )
            self._update = jax.jit(
                self._update_impl,
                static_argnums=2,
                in_shardings=(state_shardings, rows),
                out_shardings=(state_shardings, rep),
                donate_argnums=0,
            )
            # without 'old_logprobs' in the batch: the old log-probs come back as a third output
            self._update_fused = jax.jit(
                self._update_impl,
                static_argnums=2,
                in_shardings=(state_shardings, rows),
                out_shardings=(state_shardings, rep, rows),
                donate_argnums=0,
            )

    def _mesh_context(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def place_batch(self, arrays: dict) -> dict:
        """Host arrays -> device arrays, sample axis over the data-parallel mesh axes; with
        packing, plus the packed rows of both micro-batch layouts (`pack_plan`)."""
        if self.cfg.pack_tokens > 0:
            if "depths" in arrays:
                raise ValueError("packed rows carry no per-token depths (early-exit rollouts)")
            arrays = {**arrays, **self.pack_plan(arrays)}
        if self.mesh is None:
            return {k: jnp.asarray(v) for k, v in arrays.items()}
        return {k: shd.put_global(v, self.batch_sharding) for k, v in arrays.items()}

    def pack_plan(self, arrays: dict) -> dict[str, np.ndarray]:
        """The packing of one batch (host arrays, deterministic): `pack_*` for the per-sample
        passes and the critic (micro-batches of consecutive samples, `_split_micro`), `step_pack_*`
        for the policy steps (each step's micro-batches, `_step_plan`). Each micro-batch's samples
        fill rows of cfg.pack_tokens tokens; the rows, like the padded path's samples, are split
        over the data-parallel devices, so packing saves work when a micro-batch holds several
        samples per device."""
        cfg = self.cfg
        tokens, attn = arrays["tokens"], arrays["attention_mask"]
        n, micro = tokens.shape[0], cfg.micro_batch_size
        whole = np.arange(round_up(n, micro)).reshape(-1, micro)
        steps = _step_plan(n, cfg.updates_per_rollout, micro).reshape(-1, micro)
        plans = {}
        for prefix, groups in (("pack_", whole), ("step_pack_", steps)):
            packed = pack_groups(tokens, attn, groups, cfg.pack_tokens, self.row_multiple)
            plans.update(packed.arrays(prefix))
        return plans

    # ---- the public pure functions ----
    @property
    def per_loop(self) -> bool:
        """Per-loop credit: the loss (and the old / reference log-probs) are per loop."""
        return self.cfg.loop_credit != "last"

    def old_logprobs(self, state: TrainState, batch: dict, with_hidden: bool = False):
        """[N, T] log-probs of the actor (with_hidden: and the [N, T, E] LM-head inputs of the
        last loop); per-loop credit: [L, N, T], loop t's log-probs (the last loop's is entry -1,
        the one the engine sampled from)."""
        with self._mesh_context():
            out = self._old_logprobs(state.actor_params, batch, with_hidden)
            if not self.per_loop:
                return out
            lp, hidden = out if with_hidden else (out, None)
            lp = jnp.moveaxis(lp, 1, 0)  # computed sample axis first, as every batch field
            return (lp, hidden) if with_hidden else lp

    @property
    def fuses_old_logprobs(self) -> bool:
        """One optimizer step per rollout, last-loop credit: the old policy is the one the
        update's own forward runs, so `update_fused` takes its log-probs from that forward
        (held fixed by stop_gradient) instead of a separate pass (slime's
        --use-rollout-logprobs and Tunix skip that pass too; here the engine-vs-trainer check
        still gets them)."""
        return self.cfg.updates_per_rollout == 1 and not self.per_loop

    def update_fused(self, state: TrainState, batch: dict) -> tuple[TrainState, dict, jax.Array]:
        """`update` without a separate old-log-prob forward (`fuses_old_logprobs`): `batch`
        holds the RolloutBatch fields only; returns (state, metrics, the [N, T] old log-probs,
        i.e. the received policy's, as `old_logprobs` would give them)."""
        if not self.fuses_old_logprobs:
            raise ValueError(
                f"update_fused needs one optimizer step per rollout and last-loop credit "
                f"(updates_per_rollout={self.cfg.updates_per_rollout}, "
                f"loop_credit={self.cfg.loop_credit})"
            )
        if "old_logprobs" in batch or state.ref_params is not None:
            raise ValueError(
                "update_fused: the batch carries old_logprobs, or the state has a reference "
                "(its KL term reads them before the policy step): use old_logprobs + update"
            )
        with self._mesh_context():
            if self.offload.any:
                return self._update_offloaded(state, batch)
            return self._update_fused(state, batch, False)

    def _with_loop_logprobs(self, batch: dict) -> dict:
        """Per-loop credit: the [L, N, T] 'old_logprobs' -> 'old_logprobs' the last loop's [N, T]
        (advantages, metrics) and 'loop_old_logprobs' [N, L, T] (sample axis first, placed like
        every batch field)."""
        if not self.per_loop:
            return batch
        old = batch["old_logprobs"]
        if old.ndim != 3:
            raise ValueError(
                f"loop_credit={self.cfg.loop_credit}: old_logprobs must be per loop [L, N, T] "
                f"(Learner.old_logprobs), got shape {old.shape}"
            )
        fields = {"old_logprobs": old[-1], "loop_old_logprobs": jnp.moveaxis(old, 0, 1)}
        if self.mesh is not None:
            fields = {k: jax.device_put(v, self.batch_sharding) for k, v in fields.items()}
        return {**batch, **fields}

    def update(
        self, state: TrainState, batch: dict, critic_only: bool = False
    ) -> tuple[TrainState, dict]:
        """One rollout's optimizer steps. `batch` holds the RolloutBatch fields plus
        'old_logprobs' (per-loop credit: `old_logprobs`'s [L, N, T]). `critic_only` (critic
        warm-up): only the critic's steps; the actor, its optimizer state and the policy version
        stay. The input state is donated: use only the returned one."""
        if critic_only and self.critic_graphdef is None:
            raise ValueError("critic_only update without a critic")
        if "old_logprobs" not in batch:
            raise ValueError("update: the batch has no 'old_logprobs' (see update_fused)")
        with self._mesh_context():
            batch = self._with_loop_logprobs(batch)
            if self.offload.any:
                return self._update_offloaded(state, batch, critic_only)
            return self._update(state, batch, critic_only)

    # ---- offloading ----
    def _offloaded(self, state: TrainState) -> dict[str, tuple[str, ...]]:
        o = self.offload
        fields = {
            "critic": ("critic_params", "critic_opt") if o.critic else (),
            "optimizer": ("actor_opt",) if o.optimizer else (),
            "reference": ("ref_params",) if o.reference else (),
        }
        return {k: tuple(f for f in v if getattr(state, f) is not None) for k, v in fields.items()}

    def _move(self, name: str, tree, memory_kind: str, delete_source: bool):
        """Copy `tree` to `memory_kind` (same shardings otherwise); time and bytes go to
        `last_moves` as offload_{name}_{to_host|to_device}_{s|gb}."""
        start = time.perf_counter()
        moved = jax.tree.map(
            lambda x: jax.device_put(x, x.sharding.with_memory_kind(memory_kind)), tree
        )
        jax.block_until_ready(moved)
        if delete_source:
            jax.tree.map(lambda x: x.delete(), tree)
        way = "to_host" if memory_kind == "pinned_host" else "to_device"
        key = f"offload_{name}_{way}"
        self.last_moves[f"{key}_s"] = self.last_moves.get(f"{key}_s", 0.0) + (
            time.perf_counter() - start
        )
        gb = sum(x.nbytes for x in jax.tree.leaves(tree)) / 1e9
        self.last_moves[f"{key}_gb"] = self.last_moves.get(f"{key}_gb", 0.0) + gb
        return moved

    def rest(self, state: TrainState) -> TrainState:
        """`state` with every offloaded part in host memory (after init or restore)."""
        self.last_moves = {}
        moves = {}
        for name, fields in self._offloaded(state).items():
            for field in fields:
                value = getattr(state, field)
                kinds = {x.sharding.memory_kind for x in jax.tree.leaves(value)}
                if kinds - {"pinned_host"}:
                    moves[field] = self._move(name, value, "pinned_host", delete_source=True)
        return state.replace(**moves)

    def _update_offloaded(self, state: TrainState, batch: dict, critic_only: bool = False):
        """The update as three phases, each with only what it uses on the device."""
        self.last_moves = {}
        off = self._offloaded(state)
        fetch = lambda name, field: self._move(  # noqa: E731
            name, getattr(state, field), "device", delete_source=False
        )
        ref, critic = state.ref_params, state.critic_params
        if "ref_params" in off["reference"]:
            ref = fetch("reference", "ref_params")
        if "critic_params" in off["critic"]:
            critic = fetch("critic", "critic_params")
        prepared, metrics = self._prepare(ref, critic, batch)
        jax.block_until_ready(prepared)
        for on_host, copy in ((off["reference"], ref), (off["critic"], critic)):
            if on_host:  # the host copy is unchanged; the device copy goes
                jax.tree.map(lambda x: x.delete(), copy)

        actor_params, actor_opt = state.actor_params, state.actor_opt
        first_ok, actor_ok = jnp.bool_(False), jnp.bool_(True)  # critic_only: nothing applied
        old_lp = None
        if not critic_only:
            if off["optimizer"]:
                actor_opt = fetch("optimizer", "actor_opt")
            actor_params, actor_opt, first_ok, actor_ok, actor_metrics, old_lp = self._actor_phase(
                state.actor_params, actor_opt, batch, prepared
            )
            metrics.update(actor_metrics)
            if off["optimizer"]:
                actor_opt = self._move("optimizer", actor_opt, "pinned_host", delete_source=True)

        critic_params, critic_opt, critic_ok = state.critic_params, state.critic_opt, True
        if critic_params is not None:
            if off["critic"]:
                critic_params = fetch("critic", "critic_params")
                critic_opt = fetch("critic", "critic_opt")
            critic_params, critic_opt, critic_ok, critic_metrics = self._critic_phase(
                critic_params, critic_opt, batch, prepared
            )
            metrics.update(critic_metrics)
            if off["critic"]:
                critic_params = self._move("critic", critic_params, "pinned_host", True)
                critic_opt = self._move("critic", critic_opt, "pinned_host", True)
        counted = self._counters(_counter_fields(state), first_ok, actor_ok, critic_ok)
        trained = (actor_params, actor_opt, critic_params, critic_opt)
        new_state, metrics = _next_state(state, trained, counted, metrics)
        return (new_state, metrics) if "old_logprobs" in batch else (new_state, metrics, old_lp)

    # ---- implementations ----
    def _model_inputs(self, batch: dict) -> dict:
        """The per-sample model inputs of `batch` ([N, ...]): tokens and attention mask, or
        with packing the index into the packed rows."""
        if self.cfg.pack_tokens > 0:
            return {"rows_index": batch["pack_index"]}
        inputs = {"tokens": batch["tokens"], "attention_mask": batch["attention_mask"]}
        # early-exit rollouts: the depths to replay (and where the exit choice is an action)
        inputs.update({k: batch[k] for k in ("depths", "exit_mask") if k in batch})
        return inputs

    def _split_inputs(self, batch: dict, per_sample: dict) -> dict:
        """`_split_micro` of per-sample fields plus, with packing, the micro-batches' rows."""
        mb = _split_micro(per_sample, self.cfg.micro_batch_size)
        if self.cfg.pack_tokens > 0:
            mb.update(_split_rows(batch, "pack_", (next(iter(mb.values())).shape[0],)))
        return mb

    def _per_sample(self, fn, params, batch: dict):
        """fn(params, micro-batch inputs) over micro-batches; results back as [N, ...]."""
        n = batch["tokens"].shape[0]
        mb = self._split_inputs(batch, self._model_inputs(batch))
        out = jax.lax.scan(lambda _, x: (None, fn(params, x)), None, mb)[1]
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[:n], out)

    def _token_stats(self, params, x: dict, old_params=None):
        """Per-sample token stats of a micro-batch `x` (padded samples or packed rows)."""
        cfg = self.cfg
        if "rows_index" in x:
            return packed_token_stats(
                self.actor_graphdef, params, x, cfg.temperature, cfg.logits_chunk, old_params
            )
        return actor_token_stats(
            self.actor_graphdef,
            params,
            x["tokens"],
            x["attention_mask"],
            cfg.temperature,
            cfg.logits_chunk,
            old_params,
            x.get("depths"),
            x.get("exit_mask"),
        )

    def _values(self, params, x: dict):
        if "rows_index" in x:
            return packed_token_values(self.critic_graphdef, params, x)
        return token_values(
            self.critic_graphdef, params, x["tokens"], x["attention_mask"], x.get("depths")
        )

    def _actor_logprobs(self, params, x: dict):
        return self._token_stats(params, x)[0]

    def _loop_stats(self, params, x: dict, old_params=None) -> LoopStats:
        """Per-loop token stats of a micro-batch `x` (padded samples or packed rows)."""
        cfg = self.cfg
        if "rows_index" in x:
            return packed_loop_stats(
                self.actor_graphdef, params, x, cfg.temperature, cfg.logits_chunk, old_params
            )
        if "exit_mask" in x:  # refused by the config validation (algo.depth_as_action)
            raise ValueError("per-loop credit with the exit choice as an action is not supported")
        tokens, attn = x["tokens"], x["attention_mask"]
        inputs = (tokens[:, :-1], tokens[:, 1:], attn[:, :-1], None, None)
        return loop_token_stats(
            self.actor_graphdef,
            params,
            inputs,
            cfg.temperature,
            cfg.logits_chunk,
            old_params,
            x.get("depths"),
        )

    def _loop_logprobs(self, params, x: dict):
        """[micro, L, T]: each loop's selected log-probs, sample axis first."""
        return jnp.moveaxis(self._loop_stats(params, x).logprobs, 0, 1)

    def _old_logprobs_impl(self, actor_params, batch: dict, with_hidden: bool):
        def fn(params, x):
            if self.per_loop:
                stats = self._loop_stats(params, x)
                lp, hidden = jnp.moveaxis(stats.logprobs, 0, 1), stats.hidden
            else:
                lp, _, _, hidden = self._token_stats(params, x)
            return (lp, hidden) if with_hidden else lp

        return self._per_sample(fn, actor_params, batch)

    def _loop_policy_micro_loss(self, old_params, num_samples, num_tokens):
        """Per-loop credit: per token sum_t w_t loss_t (`loop_weights`), loss_t the registered
        policy loss of loop t's log-probs against loop t's old / proximal (and reference)
        log-probs; the behaviour log-probs (the engine's, of the last loop) serve every loop;
        Flow-DPPO gates loop t by its own D_t = KL(pi_old_t || pi_t). The algorithm's metrics are
        the last loop's (as with loop_credit=last); per loop (t = 1..L): loop<t>_entropy,
        loop<t>_kl_to_last (KL(pi_last || pi_t)) and loop<t>_weight (the mean w_t)."""
        algo, hp, credit = self.algorithm, self.hp, self.cfg.loop_credit
        loss_fn = POLICY_LOSSES[algo.policy_loss]

        def micro_loss(p, x):
            stats = self._loop_stats(p, x, old_params if algo.needs_old_policy_logits else None)
            loops = stats.logprobs.shape[0]
            weights = loop_weights(credit, loops, stats.exit_probs)
            old = jnp.moveaxis(x["loop_old_logprobs"], 1, 0)
            ref = x.get("loop_ref_logprobs")
            ref = None if ref is None else jnp.moveaxis(ref, 1, 0)
            per_token, loop_metrics = 0.0, {}
            for t in range(loops):
                inputs = LossInputs(
                    logprobs=stats.logprobs[t],
                    old_logprobs=old[t],
                    behav_logprobs=x["behav_logprobs"],
                    advantages=x["advantages"],
                    mask=x["mask"],
                    ref_logprobs=None if ref is None else ref[t],
                    old_kl=None if stats.old_kl is None else stats.old_kl[t],
                )
                loss_t, metrics = loss_fn(inputs, hp)
                if hp.entropy_coef:
                    loss_t = loss_t - hp.entropy_coef * stats.entropy[t]
                per_token = per_token + weights[t] * loss_t
                loop_metrics[f"loop{t + 1}_entropy"] = stats.entropy[t]
                loop_metrics[f"loop{t + 1}_kl_to_last"] = stats.kl_to_last[t]
                loop_metrics[f"loop{t + 1}_weight"] = jnp.broadcast_to(weights[t], x["mask"].shape)
            metrics = dict(metrics)  # the last loop's
            metrics["approx_kl"] = kl_penalty(stats.logprobs[-1], old[-1], "k3")
            metrics["entropy"] = stats.entropy[-1]
            metrics.update(loop_metrics)
            loss = reduce_loss(per_token, x["mask"], hp.reduction, num_samples, num_tokens)
            return loss, masked_metric_sums(metrics, x["mask"])

        return micro_loss

    def _policy_micro_loss(self, old_params, num_samples, num_tokens):
        if self.per_loop:
            return self._loop_policy_micro_loss(old_params, num_samples, num_tokens)
        algo, hp = self.algorithm, self.hp
        loss_fn = POLICY_LOSSES[algo.policy_loss]

        def micro_loss(p, x):
            lp, entropy, old_kl, _ = self._token_stats(
                p, x, old_params if algo.needs_old_policy_logits else None
            )
            fused = "old_logprobs" not in x  # one step per rollout: the old policy is p itself
            old_lp = jax.lax.stop_gradient(lp) if fused else x["old_logprobs"]
            inputs = LossInputs(
                logprobs=lp,
                old_logprobs=old_lp,
                behav_logprobs=x["behav_logprobs"],
                advantages=x["advantages"],
                mask=x["mask"],
                ref_logprobs=x.get("ref_logprobs"),
                old_kl=old_kl,
            )
            per_token, metrics = loss_fn(inputs, hp)
            if hp.entropy_coef:  # exploration bonus (the entropy is differentiable)
                per_token = per_token - hp.entropy_coef * entropy
            metrics = dict(metrics)
            metrics["approx_kl"] = kl_penalty(lp, old_lp, "k3")
            metrics["entropy"] = entropy
            loss = reduce_loss(per_token, x["mask"], hp.reduction, num_samples, num_tokens)
            sums = masked_metric_sums(metrics, x["mask"])
            return loss, ((sums, old_lp) if fused else sums)

        return micro_loss

    def _critic_micro_loss(self, num_samples, num_tokens):
        def micro_loss(p, x):
            values = self._values(p, x)
            per_token, metrics = value_loss(
                values,
                x["old_values"],
                x["returns"],
                x["mask"],
                self.hp.value_clip,
                scale=self.hp.value_loss_scale,
            )
            loss = reduce_loss(per_token, x["mask"], self.hp.reduction, num_samples, num_tokens)
            return loss, masked_metric_sums({"vf_clip_frac": metrics["vf_clip_frac"]}, x["mask"])

        return micro_loss

    # ---- the three phases of one update (fused in `_update_impl`, or run one by one with
    # offloading between them) ----
    def _prepare_impl(self, ref_params, critic_params, batch: dict):
        """Reference log-probs, critic values and the algorithm's advantages (and returns)."""
        mask, old_lp = batch["response_mask"], batch.get("old_logprobs")
        out = {}
        token_kl = values = None
        if ref_params is not None:
            if self.per_loop:  # loop t's loss term is held to the reference's loop t
                loop_ref = self._per_sample(self._loop_logprobs, ref_params, batch)
                out["loop_ref_logprobs"], out["ref_logprobs"] = loop_ref, loop_ref[:, -1]
            else:
                out["ref_logprobs"] = self._per_sample(self._actor_logprobs, ref_params, batch)
            token_kl = old_lp - out["ref_logprobs"]
        if critic_params is not None:
            values = out["values"] = self._per_sample(self._values, critic_params, batch)
        estimator = adv_lib.ADVANTAGE_ESTIMATORS[self.algorithm.advantage]
        out["advantages"], returns = estimator(
            adv_lib.AdvantageInputs(
                scores=batch["scores"],
                mask=mask,
                group_ids=batch["group_ids"],
                values=values,
                token_kl=token_kl,
            ),
            self.cfg.advantage,
        )
        if returns is not None:
            out["returns"] = returns
        metrics = {
            "advantage_mean": adv_lib.masked_mean(out["advantages"], mask),
            "advantage_std": jnp.sqrt(adv_lib.masked_var(out["advantages"], mask)),
        }
        if values is not None and returns is not None:
            # before any whitening: returns - values is GAE's raw advantage
            raw = returns - values
            metrics["raw_advantage_mean"] = adv_lib.masked_mean(raw, mask)
            metrics["raw_advantage_std"] = jnp.sqrt(adv_lib.masked_var(raw, mask))
            metrics["value_mean"] = adv_lib.masked_mean(values, mask)
            metrics["value_std"] = jnp.sqrt(adv_lib.masked_var(values, mask))
            metrics["explained_variance"] = _explained_variance(values, returns, mask)
        return out, metrics

    def _actor_impl(self, actor_params, actor_opt, batch: dict, prepared: dict):
        """`updates_per_rollout` optimizer steps, each on its part of the batch. Returns
        (params, opt state, first step applied, all steps applied, metrics, old log-probs): the
        last are None, or without 'old_logprobs' in `batch` (one step, `fuses_old_logprobs`)
        the [N, T] log-probs of the received parameters from the step's own forward."""
        cfg = self.cfg
        packed = cfg.pack_tokens > 0
        fused = "old_logprobs" not in batch
        fields = {
            **({"rows_index": batch["step_pack_index"]} if packed else self._model_inputs(batch)),
            "mask": batch["response_mask"],
            **({} if fused else {"old_logprobs": batch["old_logprobs"]}),
            "behav_logprobs": batch["behav_logprobs"],
            "advantages": prepared["advantages"],
            "sample": batch["sample_mask"],
        }
        if "ref_logprobs" in prepared:
            fields["ref_logprobs"] = prepared["ref_logprobs"]
        if self.per_loop:  # [N, L, T], gathered like the [N, T] fields
            fields["loop_old_logprobs"] = batch["loop_old_logprobs"]
            if "loop_ref_logprobs" in prepared:
                fields["loop_ref_logprobs"] = prepared["loop_ref_logprobs"]
        n = batch["tokens"].shape[0]
        plan = _step_plan(n, cfg.updates_per_rollout, cfg.micro_batch_size)
        k = plan.shape[1] // cfg.micro_batch_size

        def gather(x):  # [N, ...] -> [steps, K, micro, ...]; index n is an all-zero row
            x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)], axis=0)[plan]
            x = x.reshape((plan.shape[0], k, cfg.micro_batch_size) + x.shape[2:])
            return shd.constrain(x, _micro_axes(x, 2))

        parts = {name: gather(x) for name, x in fields.items()}
        if packed:  # index n (an empty slot) gathered an all-zero index row: it reads 0
            parts.update(_split_rows(batch, "step_pack_", (plan.shape[0], k)))
        # pi_old (Flow-DPPO): the actor parameters this update received, frozen for its steps
        old_params = actor_params if self.algorithm.needs_old_policy_logits else None

        def policy_step(carry, part):
            params, opt_state, ok = carry
            part = dict(part)
            num_samples = jnp.sum(part.pop("sample"))
            micro_loss = self._policy_micro_loss(old_params, num_samples, jnp.sum(part["mask"]))
            grads, loss, sums, *old_lp = _accumulate(micro_loss, params, part, fused)
            grad_norm = optax.tree.norm(grads)
            ok = ok & jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            params, opt_state, ok = _apply_if(ok, self.actor_tx, grads, params, opt_state)
            step_metrics = {k: s / jnp.maximum(c, 1.0) for k, (s, c) in sums.items()}
            step_metrics["policy_loss"] = loss
            step_metrics["grad_norm"] = grad_norm
            return (params, opt_state, ok), step_metrics, (old_lp[0] if fused else None)

        # The step loop is unrolled (a handful of steps): a scan would double-buffer its carry,
        # i.e. hold a second copy of the parameters and optimizer state. From the first step
        # with a non-finite loss or gradient norm on (or one whose step would leave non-finite
        # parameters or optimizer state: _apply_if), no step is applied.
        carry, per_step = (actor_params, actor_opt, jnp.bool_(True)), []
        first_ok = old_lp = None
        for i in range(plan.shape[0]):
            carry, step_metrics, step_lp = policy_step(carry, {k: v[i] for k, v in parts.items()})
            first_ok = carry[2] if first_ok is None else first_ok
            per_step.append(step_metrics)
            if step_lp is not None:  # one step: plan[0] is 0..n-1, then the padding index n
                old_lp = step_lp.reshape((-1,) + step_lp.shape[2:])[:n]
        params, opt_state, all_ok = carry
        metrics = {name: jnp.mean(jnp.stack([m[name] for m in per_step])) for name in per_step[0]}
        return params, opt_state, first_ok, all_ok, metrics, old_lp

    def _critic_impl(self, critic_params, critic_opt, batch: dict, prepared: dict):
        """`critic.steps_per_rollout` value-loss steps on the whole batch."""
        cfg, mask = self.cfg, batch["response_mask"]
        cbatch = self._split_inputs(
            batch,
            {
                **self._model_inputs(batch),
                "mask": mask,
                "old_values": prepared["values"],
                "returns": prepared["returns"],
            },
        )
        micro_loss = self._critic_micro_loss(jnp.sum(batch["sample_mask"]), jnp.sum(mask))

        def critic_step(carry):
            params, opt_state, ok = carry
            grads, loss, sums = _accumulate(micro_loss, params, cbatch)
            ok = ok & jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
            params, opt_state, ok = _apply_if(ok, self.critic_tx, grads, params, opt_state)
            s, c = sums["vf_clip_frac"]
            step_metrics = {
                "value_loss": loss,
                "vf_clip_frac": s / jnp.maximum(c, 1.0),
                "critic_grad_norm": optax.tree.norm(grads),
            }
            return (params, opt_state, ok), step_metrics

        carry = (critic_params, critic_opt, jnp.bool_(True))
        for _ in range(cfg.critic_steps):  # unrolled, as the policy steps
            carry, metrics = critic_step(carry)
        params, opt_state, ok = carry
        return params, opt_state, ok, metrics

    @staticmethod
    def _counters_impl(c: dict, first_ok, actor_ok, critic_ok) -> dict:
        """The TrainState's counters after an update (`c`: `_counter_fields` of the state)."""
        skipped = ~(actor_ok & critic_ok)
        return dict(
            step=c["step"] + 1,
            # the version counts applied policy changes: a skipped update keeps it
            policy_version=c["policy_version"] + first_ok.astype(jnp.int32),
            consecutive_skips=jnp.where(skipped, c["consecutive_skips"] + 1, 0),
            skipped_updates=c["skipped_updates"] + skipped.astype(jnp.int32),
            rng=jax.random.key_data(
                jax.random.fold_in(jax.random.wrap_key_data(c["rng"]), c["step"])
            ),
        ), skipped

    def _update_impl(self, state: TrainState, batch: dict, critic_only: bool = False):
        prepared, metrics = self._prepare_impl(state.ref_params, state.critic_params, batch)
        actor_params, actor_opt = state.actor_params, state.actor_opt
        first_ok, actor_ok = jnp.bool_(False), jnp.bool_(True)  # critic_only: nothing applied
        old_lp = None
        if not critic_only:
            actor_params, actor_opt, first_ok, actor_ok, actor_metrics, old_lp = self._actor_impl(
                state.actor_params, state.actor_opt, batch, prepared
            )
            metrics.update(actor_metrics)
        critic_params, critic_opt, critic_ok = state.critic_params, state.critic_opt, True
        if state.critic_params is not None:
            critic_params, critic_opt, critic_ok, critic_metrics = self._critic_impl(
                state.critic_params, state.critic_opt, batch, prepared
            )
            metrics.update(critic_metrics)
        counted = self._counters_impl(_counter_fields(state), first_ok, actor_ok, critic_ok)
        trained = (actor_params, actor_opt, critic_params, critic_opt)
        new_state, metrics = _next_state(state, trained, counted, metrics)
        return (new_state, metrics) if "old_logprobs" in batch else (new_state, metrics, old_lp)


def _next_state(state: TrainState, trained: tuple, counted: tuple, metrics: dict):
    """The state after an update: trained (actor params, actor opt, critic params, critic opt),
    counted (the new counters, whether the update was skipped)."""
    counters, skipped = counted
    metrics["skipped"] = skipped.astype(jnp.float32)
    actor_params, actor_opt, critic_params, critic_opt = trained
    new_state = state.replace(
        actor_params=actor_params,
        actor_opt=actor_opt,
        critic_params=critic_params,
        critic_opt=critic_opt,
        **counters,
    )
    return new_state, metrics


def _counter_fields(state: TrainState) -> dict:
    return {name: getattr(state, name) for name in COUNTERS}


def _all_finite(tree) -> jax.Array:
    """One boolean: every floating-point leaf of `tree` is finite."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return jnp.bool_(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _apply_if(ok, tx, grads, params, opt_state):
    """One optimizer step when `ok` and the step leaves the parameters and the optimizer state
    finite (a non-finite learning rate or hyper-parameter, or an overflow, would commit NaN / inf
    with a finite loss and gradient norm); else params and state unchanged (a cond, not a select:
    no second copy of either). The step is computed once into that check (elementwise work fused
    into its reductions) and once more, identically, in the cond. Returns (params, opt_state,
    applied)."""

    def step(grads, params, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ok = ok & _all_finite(step(grads, params, opt_state))

    def apply(operands):
        return step(*operands)

    params, opt_state = jax.lax.cond(
        ok, apply, lambda ops: (ops[1], ops[2]), (grads, params, opt_state)
    )
    return params, opt_state, ok


def _explained_variance(values, returns, mask):
    var_r = adv_lib.masked_var(returns, mask)
    var_diff = adv_lib.masked_var(returns - values, mask)
    return 1.0 - var_diff / jnp.maximum(var_r, 1e-8)


def metrics_to_host(metrics: dict) -> dict[str, float]:
    """Device scalars -> floats: one transfer for all of them (a multi-host array whose value
    is not all on this host goes through `to_host`)."""
    local = {k: v for k, v in metrics.items() if getattr(v, "is_fully_addressable", True)}
    fetched = jax.device_get(local)
    return {
        k: float(fetched[k]) if k in fetched else float(shd.to_host(v)) for k, v in metrics.items()
    }
