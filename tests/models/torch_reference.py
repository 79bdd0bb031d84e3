"""An independent float64 PyTorch reference of the two looped architectures, on HF-named tensors.

Written from the architecture description (not from the JAX code):

- Nanbeige4.2: embedding; the N physical layers run `num_loops` times with the same weights;
  pre-norm Llama blocks (RMSNorm -> GQA attention with split-half RoPE, same positions in every
  loop -> residual; RMSNorm -> SwiGLU -> residual); `model.norm` after every loop, its output
  feeding the next loop; logits = lm_head(last loop output).
- Ouro: sandwich blocks (attention / MLP outputs pass through input_layernorm_2 /
  post_attention_layernorm_2 before the residual add); `model.norm` after every step, fed to the
  next step; `total_ut_steps` steps; an early-exit gate Linear(hidden -> 1) on each step's normed
  output gives lambda_t = sigmoid(gate_t), p_t = lambda_t * prod_{j<t}(1 - lambda_j), and the last
  step takes the remaining mass.
- A plain Llama (`model_type: llama`) is the Nanbeige block run once.
- Depth replay (`depths`, LAST_EXITED): a position with depth d stops after loop d; in every later
  loop its state stays the same, and at each layer the keys / values it offers to the others are
  the ones it computed at that layer in loop d - 1. Its output is its state after loop d, normed
  with `model.norm` when the family does not norm between loops (the head always reads normed
  states). A loop budget K runs the first K loops only.

Also: a helper that writes random HF-named weights (norm weights random around 1) as safetensors
with a config.json from `jaxloop.models.tiny_hf_config`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

F64 = torch.float64


# ---- config helpers ----------------------------------------------------------------------------
def _head_dim(hf: dict) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def _rope_theta(hf: dict) -> float:
    if hf.get("rope_theta") is not None:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def _num_loops(hf: dict) -> int:
    if hf["model_type"] == "ouro":
        return int(hf["total_ut_steps"])
    if hf["model_type"] == "llama":
        return 1
    return int(hf.get("num_loops", 1))


# ---- building blocks ---------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [B, heads, S, D]; positions: [B, S] integers."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=F64) / d))
    angles = (positions.to(F64)[..., None] * inv_freq).to(x.dtype)  # [B, S, D/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, S, D]
    return x * torch.cos(angles) + rotate_half(x) * torch.sin(angles)


def attention(x, W, prefix, hf, positions, key_mask, memory=None, active=None):
    """Causal GQA self-attention. x: [B, S, E]; key_mask: [B, S] bool (True = real token).

    memory (depth replay): a dict holding this layer's keys / values of the previous loop; where
    `active` [B, S] is False the position's remembered keys / values replace the new ones."""
    b, s, _ = x.shape
    h, kv, d = hf["num_attention_heads"], hf["num_key_value_heads"], _head_dim(hf)
    theta = _rope_theta(hf)
    q = (x @ W[prefix + "self_attn.q_proj.weight"].T).view(b, s, h, d).transpose(1, 2)
    k = (x @ W[prefix + "self_attn.k_proj.weight"].T).view(b, s, kv, d).transpose(1, 2)
    v = (x @ W[prefix + "self_attn.v_proj.weight"].T).view(b, s, kv, d).transpose(1, 2)
    q = apply_rope(q, positions, theta)
    k = apply_rope(k, positions, theta)
    if memory is not None:
        if memory:  # loop 0 has no memory: every position is active there
            frozen = ~active[:, None, :, None]  # [B, 1, S, 1] against [B, kv, S, D]
            k = torch.where(frozen, memory["k"], k)
            v = torch.where(frozen, memory["v"], v)
        memory["k"], memory["v"] = k, v
    # query head i reads kv head i // (h // kv)
    k = k.repeat_interleave(h // kv, dim=1)
    v = v.repeat_interleave(h // kv, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)  # [B, H, S, S]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    allowed = causal[None, None] & key_mask[:, None, None, :]
    # a finite fill keeps fully-masked (padding) query rows finite instead of NaN
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(b, s, h * d)
    return out @ W[prefix + "self_attn.o_proj.weight"].T


def swiglu(x, W, prefix):
    gate = x @ W[prefix + "mlp.gate_proj.weight"].T
    up = x @ W[prefix + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ W[prefix + "mlp.down_proj.weight"].T


def block(h, W, i, hf, positions, key_mask, memory=None, active=None):
    eps = float(hf["rms_norm_eps"])
    p = f"model.layers.{i}."
    sandwich = hf["model_type"] == "ouro"
    x = rms_norm(h, W[p + "input_layernorm.weight"], eps)
    a = attention(x, W, p, hf, positions, key_mask, memory, active)
    if sandwich:
        a = rms_norm(a, W[p + "input_layernorm_2.weight"], eps)
    h = h + a
    m = swiglu(rms_norm(h, W[p + "post_attention_layernorm.weight"], eps), W, p)
    if sandwich:
        m = rms_norm(m, W[p + "post_attention_layernorm_2.weight"], eps)
    return h + m


# ---- the model ---------------------------------------------------------------------------------
def reference_forward(
    tensors: dict[str, torch.Tensor],
    hf: dict,
    input_ids,
    attention_mask=None,
    positions=None,
    dtype: torch.dtype = F64,
    depths=None,
    num_loops: int | None = None,
) -> dict[str, torch.Tensor | None]:
    """float64 forward on HF-named tensors.

    Returns logits [B,S,V] (actor; None for a critic), values [B,S] (critic), loop_logits
    [loops,B,S,V] (actor), loop_hidden [loops,B,S,E] and exit_probs [loops,B,S] (Ouro only).
    Without `positions`, they are derived from the mask: cumsum(mask) - 1, clipped at 0.
    `dtype` other than float64 is only for measuring how well-conditioned a test model is.
    `depths` [B, S] (1..loops): depth replay (module docstring); loop_hidden[t] is then each
    position's output after loop min(t + 1, depth). `num_loops`: run only the first K loops.
    """
    W = {k: v.to(dtype) for k, v in tensors.items()}
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    b, s = ids.shape
    if attention_mask is None:
        key_mask = torch.ones(b, s, dtype=torch.bool)
    else:
        key_mask = torch.as_tensor(attention_mask).to(torch.bool)
    if positions is None:
        positions = (key_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    positions = torch.as_tensor(positions, dtype=torch.long)
    eps = float(hf["rms_norm_eps"])
    skip_between = bool(hf.get("skip_loop_final_norm", False))
    loops = _num_loops(hf) if num_loops is None else num_loops
    norm_w = W["model.norm.weight"]

    h = W["model.embed_tokens.weight"][ids]
    loop_hidden = []
    if depths is None:
        for t in range(loops):
            for i in range(hf["num_hidden_layers"]):
                h = block(h, W, i, hf, positions, key_mask)
            if not skip_between or t == loops - 1:
                h = rms_norm(h, norm_w, eps)
            loop_hidden.append(h)
    else:
        depths = torch.as_tensor(np.asarray(depths), dtype=torch.long)
        memories = [{} for _ in range(hf["num_hidden_layers"])]
        state = h  # what feeds the next loop (un-normed between loops when skip_between)
        exit_output = torch.zeros_like(h)  # each position's output once it has exited
        for t in range(loops):
            active = depths > t
            x = state
            for i in range(hf["num_hidden_layers"]):
                x = block(x, W, i, hf, positions, key_mask, memories[i], active)
            if not skip_between:
                x = rms_norm(x, norm_w, eps)
            state = torch.where(active[..., None], x, state)
            exits_now = (depths == t + 1)[..., None]
            exit_output = torch.where(exits_now, rms_norm(state, norm_w, eps), exit_output)
            if not skip_between:  # the normed state is the output; no second norm
                exit_output = torch.where(exits_now, state, exit_output)
            exited = (depths <= t + 1)[..., None]
            if t == loops - 1:
                loop_hidden.append(torch.where(exited, exit_output, rms_norm(state, norm_w, eps)))
            else:
                loop_hidden.append(torch.where(exited, exit_output, state))
        h = loop_hidden[-1]
    loop_hidden = torch.stack(loop_hidden)

    out: dict[str, torch.Tensor | None] = {
        "logits": None,
        "values": None,
        "loop_logits": None,
        "loop_hidden": loop_hidden,
        "exit_probs": None,
    }
    if "lm_head.weight" in W:
        out["loop_logits"] = loop_hidden @ W["lm_head.weight"].T
        out["logits"] = out["loop_logits"][-1]
    if "value_head.weight" in W:
        out["values"] = (h @ W["value_head.weight"].T)[..., 0] + W["value_head.bias"][0]
    if hf["model_type"] == "ouro":
        gate = (loop_hidden @ W["model.early_exit_gate.weight"].T)[..., 0]
        lam = torch.sigmoid(gate + W["model.early_exit_gate.bias"][0])  # [loops, B, S]
        probs = []
        survive = torch.ones_like(lam[0])
        for t in range(loops):
            if t == loops - 1:
                probs.append(survive)
            else:
                probs.append(lam[t] * survive)
                survive = survive * (1.0 - lam[t])
        out["exit_probs"] = torch.stack(probs)
    return out


# ---- random checkpoints ------------------------------------------------------------------------
def random_hf_tensors(hf: dict, seed: int = 0, role: str = "actor") -> dict[str, torch.Tensor]:
    """Random float64 weights with every HF name of the model (norm weights around 1)."""
    g = torch.Generator().manual_seed(seed)
    v, e, m = hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"]
    h, kv, d = hf["num_attention_heads"], hf["num_key_value_heads"], _head_dim(hf)

    def lin(out_dim, in_dim):
        return torch.randn(out_dim, in_dim, generator=g, dtype=F64) / math.sqrt(in_dim)

    def norm(n):
        return 1.0 + 0.25 * torch.randn(n, generator=g, dtype=F64)

    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(v, e, generator=g, dtype=F64)
    }
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(e)
        t[p + "self_attn.q_proj.weight"] = lin(h * d, e)
        t[p + "self_attn.k_proj.weight"] = lin(kv * d, e)
        t[p + "self_attn.v_proj.weight"] = lin(kv * d, e)
        t[p + "self_attn.o_proj.weight"] = lin(e, h * d)
        t[p + "post_attention_layernorm.weight"] = norm(e)
        t[p + "mlp.gate_proj.weight"] = lin(m, e)
        t[p + "mlp.up_proj.weight"] = lin(m, e)
        t[p + "mlp.down_proj.weight"] = lin(e, m)
        if hf["model_type"] == "ouro":
            t[p + "input_layernorm_2.weight"] = norm(e)
            t[p + "post_attention_layernorm_2.weight"] = norm(e)
    t["model.norm.weight"] = norm(e)
    if hf["model_type"] == "ouro":
        t["model.early_exit_gate.weight"] = lin(1, e)
        t["model.early_exit_gate.bias"] = 0.5 * torch.randn(1, generator=g, dtype=F64)
    if role == "actor":
        t["lm_head.weight"] = lin(v, e)
    else:
        t["value_head.weight"] = lin(1, e)
        t["value_head.bias"] = torch.randn(1, generator=g, dtype=F64)
    return t


def write_random_checkpoint(
    path: str | Path,
    family: str = "nanbeige",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    role: str = "actor",
    hf_config: dict | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    **overrides,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Write config.json + model.safetensors of a random model; return (config, saved tensors).

    The returned tensors are exactly what was written (in `dtype`), so a float64 reference run on
    them sees the same weights as the loaded model.
    """
    from jaxloop.models import tiny_hf_config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = dict(hf_config) if hf_config is not None else tiny_hf_config(family, **overrides)
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    if role == "critic":
        hf["jaxloop_role"] = "critic"
    tensors = {k: v.to(dtype).contiguous() for k, v in random_hf_tensors(hf, seed, role).items()}
    to_save = dict(tensors)
    if extra_tensors:
        to_save.update({k: v.contiguous() for k, v in extra_tensors.items()})
    save_file(to_save, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return hf, tensors


def rel_err(a, b) -> float:
    """max|a - b| / max|b| (b is the reference)."""
    a, b = _f64(a), _f64(b)
    return float((a - b).abs().max() / b.abs().max())


def _f64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(F64)
    return torch.from_numpy(np.asarray(x, dtype=np.float64))
