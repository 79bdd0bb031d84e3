"""The one looped decoder (Nanbeige4.2 and Ouro) as a Flax NNX module.

Physical layers are stored stacked on a leading 'layers' axis and run with `lax.scan`; the loops
are an outer `lax.scan` over the same weights. Each (loop, layer) has its own KV cache slot.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxloop.models import layers as L
from jaxloop.models.config import LoopedConfig
from jaxloop.models.kv_cache import KVCache
from jaxloop.parallel.mesh import constrain

ROLES = ("actor", "critic")
# logical axes of activations (jaxloop.sharding maps them onto the mesh, when there is one)
HIDDEN_AXES = ("batch", "length", "act_embed")
Q_AXES = ("batch", "length", "q_heads", "head_dim")
KV_AXES = ("batch", "length", "kv_heads", "head_dim")
LOGITS_AXES = ("batch", "length", "vocab")


def _param(value: jax.Array, axes: tuple) -> nnx.Param:
    assert value.ndim == len(axes), (value.shape, axes)
    return nnx.Param(value, logical_axes=axes)


def _normal(key, shape, dtype, std=0.02):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class Blocks(nnx.Module):
    """The physical decoder layers, each parameter stacked on a leading layer axis."""

    def __init__(self, cfg: LoopedConfig, key: jax.Array):
        n, e, m = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dt = jnp.dtype(cfg.param_dtype)
        keys = jax.random.split(key, 7)
        # a fresh array per norm: parameters never share a buffer (the train state is donated)
        ones = lambda: jnp.ones((n, e), dt)  # noqa: E731
        self.input_norm = _param(ones(), ("layers", "norm"))
        self.q_proj = _param(
            _normal(keys[0], (n, e, h, d), dt), ("layers", "embed", "q_heads", "head_dim")
        )
        self.k_proj = _param(
            _normal(keys[1], (n, e, kv, d), dt), ("layers", "embed", "kv_heads", "head_dim")
        )
        self.v_proj = _param(
            _normal(keys[2], (n, e, kv, d), dt), ("layers", "embed", "kv_heads", "head_dim")
        )
        self.o_proj = _param(
            _normal(keys[3], (n, h, d, e), dt), ("layers", "q_heads", "head_dim", "embed")
        )
        self.post_attn_norm = _param(ones(), ("layers", "norm"))
        self.gate_proj = _param(_normal(keys[4], (n, e, m), dt), ("layers", "embed", "mlp"))
        self.up_proj = _param(_normal(keys[5], (n, e, m), dt), ("layers", "embed", "mlp"))
        self.down_proj = _param(_normal(keys[6], (n, m, e), dt), ("layers", "mlp", "embed"))
        if cfg.sandwich_norm:
            self.attn_out_norm = _param(ones(), ("layers", "norm"))
            self.mlp_out_norm = _param(ones(), ("layers", "norm"))


class ModelOutput(NamedTuple):
    logits: jax.Array | None  # [B, S, V] float32 (actor), last loop
    values: jax.Array | None  # [B, S] float32 (critic)
    hidden: jax.Array  # [B, S, E] LM-head input of the last loop
    loop_logits: jax.Array | None  # [loops, B, S, V] when requested
    exit_probs: jax.Array | None  # [loops, B, S] Ouro exit distribution when requested
    cache: KVCache | None
    # [loops, B, S, E] with return_loops: entry t is the LM-head input of a model that stops after
    # loop t (the state after the norm that ends loop t; normed also without a norm between loops)
    loop_hidden: jax.Array | None = None


class LoopedLM(nnx.Module):
    """Looped decoder with an LM head (role='actor') or a scalar value head (role='critic')."""

    def __init__(self, cfg: LoopedConfig, *, rngs: nnx.Rngs, role: str = "actor"):
        if role not in ROLES:
            raise ValueError(f"role={role!r}; expected one of {ROLES}")
        self.config = cfg
        self.role = role
        e, v = cfg.hidden_size, cfg.vocab_size
        dt = jnp.dtype(cfg.param_dtype)
        keys = jax.random.split(rngs.params(), 4)
        self.embed = _param(_normal(keys[0], (v, e), dt), ("vocab", "embed"))
        self.blocks = Blocks(cfg, keys[1])
        self.final_norm = _param(jnp.ones((e,), dt), ("norm",))
        if role == "actor":
            self.lm_head = _param(_normal(keys[2], (e, v), dt), ("embed", "vocab"))
        else:
            self.value_head = _param(jnp.zeros((e,), dt), ("embed",))
            self.value_bias = _param(jnp.zeros((), dt), ())
        if cfg.early_exit_gate:
            self.exit_gate = _param(_normal(keys[3], (e,), dt), ("embed",))
            self.exit_bias = _param(jnp.zeros((), dt), ())

    def __call__(self, input_ids, positions=None, attention_mask=None):
        out = self.forward(input_ids, positions, attention_mask)
        return out.logits if self.role == "actor" else out.values

    def forward(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        cache: KVCache | None = None,
        return_loops: bool = False,
        logits_slice: slice | None = None,
        head: bool = True,
        depths: jax.Array | None = None,
        num_loops: int | None = None,
        segment_ids: jax.Array | None = None,
    ) -> ModelOutput:
        """head=False: no LM-head projection (logits None; callers that project the hidden
        states themselves, chunk by chunk, never hold [B, S, V]).

        depths: int32 [B, S] in 1..num_loops, per-position exit depth (depth replay; None: full
        depth). num_loops: a static loop budget K <= config.num_loops (the first K loops run,
        costing K loops; None: all). See `looped_forward` for the semantics."""
        return looped_forward(
            self,
            input_ids,
            positions,
            attention_mask,
            cache=cache,
            return_loops=return_loops,
            logits_slice=logits_slice,
            head=head,
            depths=depths,
            num_loops=num_loops,
            segment_ids=segment_ids,
        )


def _remat(fn, policy: str):
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


def _block_weights(blocks: Blocks) -> dict[str, jax.Array]:
    """The stacked layer weights in the parameter dtype: each layer's slice is cast to the
    compute dtype inside the layer scan, so no compute-dtype copy of the whole stack exists."""
    names = ["input_norm", "q_proj", "k_proj", "v_proj", "o_proj", "post_attn_norm"]
    names += ["gate_proj", "up_proj", "down_proj"]
    if hasattr(blocks, "attn_out_norm"):
        names += ["attn_out_norm", "mlp_out_norm"]
    return {n: getattr(blocks, n)[...] for n in names}


# the parameters the forward reads in the compute dtype (each cast where it is used)
COMPUTE_DTYPE_PARAMS = ("blocks", "embed", "lm_head", "final_norm", "exit_gate")


def compute_dtype_state(state: nnx.State, compute_dtype) -> nnx.State:
    """`state` with every parameter the forward casts to `compute_dtype` already in it. The
    forward's own casts then do nothing, so its results are bitwise the same; a decode loop that
    gets this state casts once per call instead of every layer's weights at every step (with fp32
    master weights and bf16 compute that halves the weight bytes a step reads)."""
    cdt = jnp.dtype(compute_dtype)
    flat = []
    for path, var in nnx.to_flat_state(state):
        if path[0] in COMPUTE_DTYPE_PARAMS and var[...].dtype != cdt:
            var = var.replace(var[...].astype(cdt))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


# Depth replay (looped_forward's `depths`, int32 [B, S], each in 1..K; LAST_EXITED semantics):
# position i's outputs (hidden, logits, values) are its state after loop depths[b, i], taken after
# the norm that ends that loop. At loop t (0-based) a position with depths <= t is frozen: its
# hidden state is not updated, and at every layer of loop t the keys / values it shows to the
# other positions (and writes into the cache slot of loop t) are the ones it computed at that
# layer in its own last loop, depths - 1. So a token that exits at depth d fills the slots of
# loops >= d with its loop d-1 keys / values, and prefill + decode with per-token depths equals
# the full-sequence replay. depths == K everywhere equals depths=None.
# Families whose loops do not end with a norm (Nanbeige with skip_loop_final_norm): the state that
# feeds the next loop stays un-normed, but an exited position's output is final_norm(state after
# loop d), i.e. normed the way the head (and Ouro's exit gate, which reads every step's normed
# output) sees a model that stops there. Ouro and default Nanbeige end every loop with
# final_norm, so their exited output is that loop's normed state.
# return_loops with depths: entry t is a position's output after loop min(t + 1, depths) (entry t
# of an exited position is its exit output; un-exited positions of a family without a norm
# between loops keep today's un-normed entries), and exit_probs are computed from those.
# depths=None adds no work: the replay is a Python-level branch.


def looped_forward(
    model: LoopedLM,
    input_ids: jax.Array,
    positions: jax.Array | None,
    attention_mask: jax.Array | None,
    *,
    cache: KVCache | None = None,
    return_loops: bool = False,
    logits_slice: slice | None = None,
    head: bool = True,
    depths: jax.Array | None = None,
    num_loops: int | None = None,
    segment_ids: jax.Array | None = None,
) -> ModelOutput:
    """The looped decoder, optionally with a static loop budget and per-position exit depths
    (depth replay: the comment above).

    num_loops=K (a Python int, 1..config.num_loops): only the first K loops run (K loops of
    compute, one compile per K); the outputs are those of a K-loop model. With a cache, the K
    loops read and write cache slots 0..K-1 and leave the deeper slots untouched (a K-loop
    decode never reads them).
    return_loops also gives loop_hidden: entry t is what the LM head reads in a model that stops
    after loop t (normed where a family without a norm between loops left it un-normed), so loop
    t's logits are project(loop_hidden[t]) in every family.
    segment_ids (int32 [B, S], 0 = padding; packed rows, no cache): a position attends only to
    earlier positions of its own segment (in every loop, to that loop's keys), with `positions`
    given explicitly (restarting per segment). The cudnn kernel takes no segments: the mask
    path runs instead."""
    cfg = model.config
    cdt = jnp.dtype(cfg.compute_dtype)
    b, s = input_ids.shape
    loops = cfg.num_loops if num_loops is None else int(num_loops)
    if not 1 <= loops <= cfg.num_loops:
        raise ValueError(f"num_loops={num_loops} is outside 1..{cfg.num_loops}")
    if depths is not None:
        if depths.shape != (b, s):
            raise ValueError(f"depths has shape {depths.shape}, expected {(b, s)}")
        depths = depths.astype(jnp.int32)
    attention_mask, positions = _mask_and_positions(attention_mask, positions, cache, b, s)
    if segment_ids is not None and (cache is not None or positions is None):
        raise ValueError("segment_ids need explicit positions and no cache (packed training rows)")
    mask, valid, use_cudnn = _attention_mask(cfg, attention_mask, cache, segment_ids, s)
    cos, sin = L.rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    layer = _layer_fn(cfg, cos, sin, mask, cache, use_cudnn)
    if cache is None:
        # remat matters for training only; the cached (decode) path is never differentiated
        layer = _remat(layer, cfg.remat)
    final_norm = model.final_norm[...].astype(cdt)
    run_loop = _loop_fn(
        cfg, layer, _block_weights(model.blocks), final_norm, depths, loops, return_loops
    )

    # the lookup gathers whole rows: the table's hidden width is gathered first (as FSDP does for
    # every weight), its vocab rows may stay split over 'tensor'
    table = constrain(model.embed[...].astype(cdt), ("vocab", "act_embed"))
    h0 = constrain(table[input_ids], HIDDEN_AXES)
    kv_all0 = None if cache is None else (cache.k, cache.v)
    last_kv0 = None
    if depths is not None:
        # every position is active in loop 0, so these zeros are never read
        kv_shape = (cfg.num_layers, b, s, cfg.num_kv_heads, cfg.head_dim)
        last_kv0 = (jnp.zeros(kv_shape, cdt), jnp.zeros(kv_shape, cdt))
    # a K-loop budget writes slots 0..K-1 of the carried cache and leaves the deeper ones as
    # they are
    (h, _, new_kv, _), loop_hidden = jax.lax.scan(
        run_loop,
        (h0, jnp.int32(0), kv_all0, last_kv0),
        None,
        length=loops,
        unroll=not cfg.scan_layers,
    )
    new_cache = None
    if cache is not None:
        new_k, new_v = new_kv
        new_cache = cache.replace(k=new_k, v=new_v, valid=valid, index=cache.index + s)
    return _heads(
        model, h, loop_hidden, final_norm, depths, loops, logits_slice, head, return_loops
    )._replace(cache=new_cache)


def _mask_and_positions(attention_mask, positions, cache, b: int, s: int):
    """The boolean attention mask ([B, S], all ones when absent) and int32 positions (counted
    over the mask, after the cache's valid slots when decoding)."""
    if attention_mask is None:
        attention_mask = jnp.ones((b, s), jnp.bool_)
    attention_mask = attention_mask.astype(jnp.bool_)
    if positions is None:
        if cache is None:
            positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
        else:
            prev = jnp.sum(cache.valid, axis=1, keepdims=True)
            positions = prev + jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
    return attention_mask, positions.astype(jnp.int32)


def _attention_mask(cfg: LoopedConfig, attention_mask, cache, segment_ids, s: int):
    """(mask, the cache's new valid slots or None, whether the cudnn kernel runs)."""
    if cache is None:
        causal = jnp.tril(jnp.ones((s, s), jnp.bool_))
        mask = causal[None] & attention_mask[:, None, :]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        return mask, None, cfg.attention_impl == "cudnn" and segment_ids is None
    # the mask spans the slots attention reads (KVCache.read_length), not the whole cache
    t = cache.attended_length
    valid = jax.lax.dynamic_update_slice(cache.valid, attention_mask, (0, cache.index))
    slots = jnp.arange(t)
    query_slots = cache.index + jnp.arange(s)
    mask = (slots[None, :] <= query_slots[:, None])[None] & valid[:, None, :t]
    return mask, valid, False


def _layer_fn(cfg: LoopedConfig, cos, sin, mask, cache, use_cudnn: bool):
    """One decoder layer, `layer(h, w, kv_cache, last_kv, active) -> (h, new cache kv, last kv)`.
    kv_cache: None, or (k_all, v_all, loop_index, layer_index) with the whole cache; the new
    positions' keys / values are written into slot [loop, layer] in place."""
    cdt, eps = jnp.dtype(cfg.compute_dtype), cfg.rms_norm_eps

    def layer(h, w, kv_cache, last_kv, active):
        w = {name: x.astype(cdt) for name, x in w.items()}
        x = L.rms_norm(h, w["input_norm"], eps)
        q = L.project(x, w["q_proj"])
        k = L.project(x, w["k_proj"])
        v = L.project(x, w["v_proj"])
        q = constrain(L.apply_rope(q, cos, sin), Q_AXES)
        k = constrain(L.apply_rope(k, cos, sin), KV_AXES)
        v = constrain(v, KV_AXES)
        new_last = None
        if last_kv is not None:
            # LAST_EXITED: a frozen position shows the keys / values of its own last loop
            keep = active[:, :, None, None]
            k = jnp.where(keep, k, last_kv[0])
            v = jnp.where(keep, v, last_kv[1])
            new_last = (k, v)
        if kv_cache is not None:
            k_all, v_all, loop_index, layer_index = kv_cache
            slot_index = (loop_index, layer_index, cache.index)
            k_all = _write_slot(k_all, jnp.swapaxes(k, 1, 2), *slot_index, length_axis=4)
            v_all = _write_slot(v_all, jnp.transpose(v, (0, 2, 3, 1)), *slot_index, length_axis=5)
            new_cache_kv = (k_all, v_all)
            slot = (k_all, v_all, loop_index, layer_index)
            attn = _attend_slot(q, slot, mask, cache.attended_length, cdt)
        else:
            new_cache_kv = None
            if use_cudnn:
                attn = L.cudnn_causal_attention(q, k, v)
            else:
                attn = L.grouped_attention(q, k, v, mask)
        o = L.project(attn, w["o_proj"], contract=2)
        if cfg.sandwich_norm:
            o = L.rms_norm(o, w["attn_out_norm"], eps)
        h = h + o
        x = L.rms_norm(h, w["post_attn_norm"], eps)
        m = L.swiglu(x, w["gate_proj"], w["up_proj"], w["down_proj"])
        if cfg.sandwich_norm:
            m = L.rms_norm(m, w["mlp_out_norm"], eps)
        return constrain(h + m, HIDDEN_AXES), new_cache_kv, new_last

    return layer


def _loop_fn(cfg: LoopedConfig, layer, weights, final_norm, depths, loops: int, return_loops):
    """One loop over the layer stack as a scan body over (h, loop_index, kv_all, last_kv); it
    emits the loop's output when return_loops. model.scan_layers=false unrolls the layer and loop
    scans: XLA then fuses and schedules across layers (at the bench_peers shape the update ~25%
    faster, decode as fast or faster); true keeps one compiled layer body (compile time of deep
    models)."""
    eps, unroll = cfg.rms_norm_eps, not cfg.scan_layers

    def run_layers(h, kv_all, loop_index, last_kv, active):
        """kv_all: None or the whole (k, v) cache, carried (not scanned over: a scanned slice
        would be copied in and its updated version stacked into a new buffer every step)."""

        def body(carry, xs):
            h, kv_all, layer_index = carry
            w, layer_last_kv = xs
            kv_cache = None if kv_all is None else (*kv_all, loop_index, layer_index)
            h, kv_all, new_last = layer(h, w, kv_cache, layer_last_kv, active)
            return (h, kv_all, layer_index + 1), new_last

        (h, kv_all, _), last_kv = jax.lax.scan(
            body, (h, kv_all, jnp.int32(0)), (weights, last_kv), unroll=unroll
        )
        return h, kv_all, last_kv

    def run_loop(carry, _):
        h, loop_index, kv_all, last_kv = carry
        active = None if depths is None else depths > loop_index
        h_out, kv_all, last_kv = run_layers(h, kv_all, loop_index, last_kv, active)
        is_last = loop_index == loops - 1
        if depths is None:
            if cfg.norm_between_loops:
                h = L.rms_norm(h_out, final_norm, eps)
            else:
                h = jnp.where(is_last, L.rms_norm(h_out, final_norm, eps), h_out)
            out = h
        else:
            keep = active[..., None]
            if cfg.norm_between_loops:
                h = jnp.where(keep, L.rms_norm(h_out, final_norm, eps), h)
                out = h
            else:
                h = jnp.where(keep, h_out, h)
                normed = L.rms_norm(h, final_norm, eps)
                exited = (depths <= loop_index + 1)[..., None]
                out = jnp.where(is_last | exited, normed, h)
                h = jnp.where(is_last, normed, h)
        return (h, loop_index + 1, kv_all, last_kv), (out if return_loops else None)

    return run_loop


def _heads(
    model: LoopedLM, h, loop_hidden, final_norm, depths, loops, logits_slice, head, return_loops
) -> ModelOutput:
    """The LM head (actor) or value head (critic) on the last state, per-loop logits and exit
    probabilities with return_loops, and what the head reads after each loop (loop_hidden)."""
    cfg = model.config
    cdt, eps = jnp.dtype(cfg.compute_dtype), cfg.rms_norm_eps
    hidden = h if logits_slice is None else h[:, logits_slice]
    logits = values = loop_logits = exit_probs = None
    if model.role == "actor" and head:
        lm_head = model.lm_head[...].astype(cdt)
        logits = project(hidden, lm_head)
        if return_loops:
            lh = loop_hidden if logits_slice is None else loop_hidden[:, :, logits_slice]
            loop_logits = jax.vmap(lambda x: project(x, lm_head))(lh)
    elif model.role == "critic":
        vh = model.value_head[...].astype(cdt)
        values = jnp.einsum("bse,e->bs", hidden, vh, preferred_element_type=jnp.float32)
        values = values + model.value_bias[...].astype(jnp.float32)
    if return_loops and cfg.early_exit_gate:
        exit_probs = exit_distribution(model, loop_hidden)
    head_inputs = None
    if return_loops:
        head_inputs = loop_hidden
        if not cfg.norm_between_loops:  # un-normed entries: loops before the last, not exited
            unnormed = (jnp.arange(loops) < loops - 1)[:, None, None]
            if depths is not None:
                unnormed = unnormed & (depths[None] > jnp.arange(1, loops + 1)[:, None, None])
            normed = L.rms_norm(loop_hidden, final_norm, eps)
            head_inputs = jnp.where(unnormed[..., None], normed, loop_hidden)
        if logits_slice is not None:
            head_inputs = head_inputs[:, :, logits_slice]
    return ModelOutput(
        logits, values, hidden, loop_logits, exit_probs, None, loop_hidden=head_inputs
    )


def _write_slot(full, new, loop_index, layer_index, index, length_axis: int):
    """Write `new` ([B, kv_heads, S, head_dim] into KVCache.k, length_axis 4; [B, kv_heads,
    head_dim, S] into KVCache.v, length_axis 5) at token slot `index` of cache slot
    [loop_index, layer_index] of `full`, in place."""
    start = [loop_index, layer_index, 0, 0, 0, 0]
    start[length_axis] = index
    return jax.lax.dynamic_update_slice(full, new.astype(full.dtype)[None, None], tuple(start))


def _attend_slot(q, slot, mask, length, cdt):
    """Attention of q [B, S, H, D] over the first `length` (static) token slots of cache slot
    [loop, layer] (slot = (k_all, v_all, loop_index, layer_index); KVCache.read_length); mask
    [B, S, length]."""
    k_all, v_all, loop_index, layer_index = slot
    start = (loop_index, layer_index, 0, 0, 0, 0)
    b, kv, d = k_all.shape[2], k_all.shape[3], k_all.shape[5]
    k = jax.lax.dynamic_slice(k_all, start, (1, 1, b, kv, length, d))[0, 0].astype(cdt)
    v = jax.lax.dynamic_slice(v_all, start, (1, 1, b, kv, d, length))[0, 0].astype(cdt)
    return L.grouped_attention(q, k, v, mask, cache_layout=True)


def project(hidden: jax.Array, lm_head: jax.Array) -> jax.Array:
    """float32 logits [B, S, V] of LM-head inputs [B, S, E] (lm_head in the compute dtype)."""
    logits = jnp.einsum("bse,ev->bsv", hidden, lm_head, preferred_element_type=jnp.float32)
    return constrain(logits, LOGITS_AXES)


def exit_distribution(model: LoopedLM, loop_hidden: jax.Array) -> jax.Array:
    """Ouro exit distribution p_t over loops: lambda_t = sigmoid(gate(h_t)),
    p_t = lambda_t * prod_{j<t}(1 - lambda_j), and the last step takes the remaining mass."""
    gate = jnp.einsum(
        "lbse,e->lbs",
        loop_hidden,
        model.exit_gate[...].astype(loop_hidden.dtype),
        preferred_element_type=jnp.float32,
    )
    lam = jax.nn.sigmoid(gate + model.exit_bias[...].astype(jnp.float32))
    survive = jnp.cumprod(1.0 - lam, axis=0)
    survive_before = jnp.concatenate([jnp.ones_like(survive[:1]), survive[:-1]], axis=0)
    probs = lam * survive_before
    return probs.at[-1].set(survive_before[-1])
