"""Looped decoders (Nanbeige4.2, Ouro) for vLLM, built from vLLM's own layers.

Engine processes only (torch + vLLM); never import this from JAX code.

One copy of each physical layer's weights is shared by every loop, while every (loop, layer) pair
has its own `Attention` module and therefore its own KV cache. The attention modules sit in one
flat list, `model.loop_attn.{loop * num_layers + layer}`: vLLM derives each cache's layer index
from the single integer in that name. `model.norm` is applied after every loop (Nanbeige with
`skip_loop_final_norm=true`: after the last only). Ouro blocks use sandwich norms, run all
`total_ut_steps` steps at full depth unless the worker extension sets an early-exit plan
(`LoopedModel.exit_plan`, jaxloop_set_depth): then a response token exits at the first
loop whose cumulative exit probability (the gate's distribution) reaches its threshold (the
configured one, or a seeded uniform draw in 'sample' mode), is frozen from then on, and shows
the keys / values of its exit loop to every deeper loop's cache (LAST_EXITED, the semantics of
the JAX replay `forward(depths=)`); prompt tokens run at full depth. Needs eager mode (the plan
reads the runner's batch on the host). The plan also carries a loop budget K (model.loop_budget):
the first K loops run, the last of them ending with the norm, as the JAX model's num_loops=K.

`load_weights` consumes the HF tensor names and shapes of jaxloop's family tables
(jaxloop/families/nanbeige.py, ouro.py), mapping q/k/v onto the fused qkv_proj and gate/up onto
gate_up_proj, and refuses unknown names.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors

from jaxloop import families

# (fused vLLM parameter, HF name part, shard id)
STACKED_PARAMS = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


class LoopedArch:
    """What differs between the families, read from the HF config by the family's own reader
    (jaxloop/families), so the plugin and the JAX model agree on every flag, name and shape."""

    def __init__(self, config, family: str):
        hf = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
        fields = families.read_hf_config(hf)
        if fields["family"] != family:
            raise ValueError(f"{family}: config.json reads as family {fields['family']!r}")
        self.family = family
        self.vocab_size = fields["vocab_size"]
        self.hidden_size = fields["hidden_size"]
        self.intermediate_size = fields["intermediate_size"]
        self.num_layers = fields["num_layers"]
        self.num_heads = fields["num_heads"]
        self.num_kv_heads = fields["num_kv_heads"]
        self.head_dim = fields["head_dim"]
        self.eps = fields["rms_norm_eps"]
        self.num_loops = fields["num_loops"]
        self.sandwich_norm = fields.get("sandwich_norm", False)
        self.early_exit_gate = fields.get("early_exit_gate", False)
        self.norm_between_loops = fields.get("norm_between_loops", True)
        self.max_position = int(getattr(config, "max_position_embeddings", 8192))
        rope = getattr(config, "rope_parameters", None)
        if not rope:
            rope = {"rope_type": "default", "rope_theta": fields["rope_theta"]}
        self.rope_parameters = dict(rope)

    def hf_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor this model loads, with its full (unsharded) shape (the family table)."""
        return families.hf_tensor_shapes(self, "actor")


class LoopedSelfAttention(nn.Module):
    """q/k/v/o projections of one physical layer (shared by all loops). The attention itself
    (and its KV cache) is passed in per call: one `Attention` module per (loop, layer)."""

    def __init__(self, arch: LoopedArch, quant_config, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        if arch.num_heads % tp or (arch.num_kv_heads % tp and tp % arch.num_kv_heads):
            raise ValueError(f"heads {arch.num_heads}/{arch.num_kv_heads} do not split over {tp}")
        self.num_heads = arch.num_heads // tp
        self.num_kv_heads = max(1, arch.num_kv_heads // tp)
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden_size=arch.hidden_size,
            head_size=arch.head_dim,
            total_num_heads=arch.num_heads,
            total_num_kv_heads=arch.num_kv_heads,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            input_size=arch.num_heads * arch.head_dim,
            output_size=arch.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )

    def forward(self, positions, hidden_states, rotary_emb, attn: Attention, exits=None):
        """exits: None, or (active [T] bool, the keys / values this layer showed at the previous
        loop or None); a frozen (exited) token shows its previous keys / values again. Returns
        (output, the keys / values shown) then."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rotary_emb(positions, q, k)
        if exits is not None:
            active, shown = exits
            if shown is not None:
                keep = active[:, None]
                k, v = torch.where(keep, k, shown[0]), torch.where(keep, v, shown[1])
        out, _ = self.o_proj(attn(q, k, v))
        return out if exits is None else (out, (k, v))


class LoopedMLP(nn.Module):
    def __init__(self, arch: LoopedArch, quant_config, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            input_size=arch.hidden_size,
            output_sizes=[arch.intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            input_size=arch.intermediate_size,
            output_size=arch.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = SiluAndMul()

    def forward(self, x):
        x, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(x))
        return x


class LoopedDecoderLayer(nn.Module):
    def __init__(self, arch: LoopedArch, quant_config, prefix: str):
        super().__init__()
        e = arch.hidden_size
        self.sandwich_norm = arch.sandwich_norm
        self.input_layernorm = RMSNorm(e, eps=arch.eps)
        self.self_attn = LoopedSelfAttention(arch, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(e, eps=arch.eps)
        self.mlp = LoopedMLP(arch, quant_config, f"{prefix}.mlp")
        if arch.sandwich_norm:
            self.input_layernorm_2 = RMSNorm(e, eps=arch.eps)
            self.post_attention_layernorm_2 = RMSNorm(e, eps=arch.eps)

    def forward(self, positions, h, rotary_emb, attn: Attention, exits=None):
        a = self.self_attn(positions, self.input_layernorm(h), rotary_emb, attn, exits)
        shown = None
        if exits is not None:
            a, shown = a
        if self.sandwich_norm:
            a = self.input_layernorm_2(a)
        h = h + a
        m = self.mlp(self.post_attention_layernorm(h))
        if self.sandwich_norm:
            m = self.post_attention_layernorm_2(m)
        return h + m if exits is None else (h + m, shown)


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": 0,
        "positions": 0,
        "intermediate_tensors": 0,
        "inputs_embeds": 0,
    }
)
class LoopedModel(nn.Module):
    family = "nanbeige"

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", family: str = "nanbeige"):
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        cache_config = vllm_config.cache_config
        self.arch = arch = LoopedArch(config, family)
        self.embed_tokens = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, quant_config=quant_config
        )
        self.layers = nn.ModuleList(
            LoopedDecoderLayer(arch, quant_config, f"{prefix}.layers.{i}")
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, eps=arch.eps)
        self.rotary_emb = get_rope(
            arch.head_dim,
            max_position=arch.max_position,
            is_neox_style=True,
            rope_parameters=arch.rope_parameters,
        )
        heads, kv_heads = self.layers[0].self_attn.num_heads, self.layers[0].self_attn.num_kv_heads
        self.loop_attn = nn.ModuleList(
            Attention(
                heads,
                arch.head_dim,
                arch.head_dim**-0.5,
                num_kv_heads=kv_heads,
                cache_config=cache_config,
                quant_config=quant_config,
                prefix=f"{prefix}.loop_attn.{loop * arch.num_layers + i}",
            )
            for loop in range(arch.num_loops)
            for i in range(arch.num_layers)
        )
        if arch.early_exit_gate:
            # Used only under an early-exit plan; loaded and published either way.
            self.early_exit_gate = ReplicatedLinear(
                arch.hidden_size, 1, bias=True, prefix=f"{prefix}.early_exit_gate"
            )
        # set by the worker extension (vllm_models.worker.EarlyExitPlan); None: full depth
        self.exit_plan = None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        arch = self.arch
        plan = self.exit_plan
        # a loop budget K runs the first K loops (their caches; the deeper ones stay unused)
        loops = plan.num_loops if plan is not None and plan.num_loops else arch.num_loops
        if plan is not None and plan.enabled:
            thresholds = plan.thresholds(positions)  # None: a warm-up (dummy) batch
            if thresholds is not None:
                h, depths, exit_logprobs = self.forward_with_exits(positions, h, thresholds, loops)
                plan.record(depths, exit_logprobs)
                return h
        for loop in range(loops):
            for i, layer in enumerate(self.layers):
                attn = self.loop_attn[loop * arch.num_layers + i]
                h = layer(positions, h, self.rotary_emb, attn)
            if arch.norm_between_loops or loop == loops - 1:
                h = self.norm(h)
        return h

    def forward_with_exits(self, positions, h, thresholds, loops: int):
        """`loops` loops with early exit: token i exits after the first loop t (< the last) whose
        cumulative exit probability reaches thresholds[i] (inf: never, full depth), as the JAX
        sampler's exit_depths decides it. Returns (hidden after each token's exit loop [T, E],
        depths [T] int32 in 1..loops, log p of each exit under the gate's distribution [T])."""
        arch = self.arch
        n = h.shape[0]
        active = torch.ones(n, dtype=torch.bool, device=h.device)
        depths = torch.full((n,), loops, dtype=torch.int32, device=h.device)
        exit_logprobs = torch.zeros(n, dtype=torch.float32, device=h.device)
        survive = torch.ones(n, dtype=torch.float32, device=h.device)  # prod_{j<t} (1 - lambda_j)
        cumulative = torch.zeros(n, dtype=torch.float32, device=h.device)
        shown = [None] * arch.num_layers
        for loop in range(loops):
            for i, layer in enumerate(self.layers):
                attn = self.loop_attn[loop * arch.num_layers + i]
                out, shown[i] = layer(positions, h, self.rotary_emb, attn, (active, shown[i]))
                h = torch.where(active[:, None], out, h)
            h = torch.where(active[:, None], self.norm(h), h)
            if loop == loops - 1:  # the last loop takes the remaining mass
                exit_logprobs = torch.where(active, torch.log(survive), exit_logprobs)
                break
            gate, _ = self.early_exit_gate(h)
            lam = torch.sigmoid(gate.float()[:, 0])
            prob = lam * survive
            survive = survive * (1.0 - lam)
            cumulative = cumulative + prob
            exits = active & (cumulative >= thresholds)
            depths = torch.where(exits, loop + 1, depths)
            exit_logprobs = torch.where(exits, torch.log(prob), exit_logprobs)
            active = active & ~exits
        return h, depths, exit_logprobs


class _LoopedForCausalLM(nn.Module):
    family = "nanbeige"
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        prefix_model = f"{prefix}.model" if prefix else "model"
        self.model = LoopedModel(vllm_config=vllm_config, prefix=prefix_model, family=self.family)
        self.arch = self.model.arch
        self.lm_head = ParallelLMHead(
            self.arch.vocab_size,
            self.arch.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.lm_head" if prefix else "lm_head",
        )
        self.logits_processor = LogitsProcessor(self.arch.vocab_size)
        self.params_dtype = vllm_config.model_config.dtype

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def hf_tensor_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype name) of every HF tensor a publication must deliver."""
        dtype = _dtype_name(self.params_dtype)
        return {n: (s, dtype) for n, s in self.arch.hf_tensor_shapes().items()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        expected = self.arch.hf_tensor_shapes()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name not in expected:
                raise ValueError(f"{type(self).__name__}: unexpected tensor {name}")
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(
                    f"{type(self).__name__}: tensor {name} has shape {tuple(tensor.shape)}, "
                    f"expected {expected[name]}"
                )
            for fused, part, shard_id in STACKED_PARAMS:
                if part in name:
                    target = name.replace(part, fused)
                    param = params[target]
                    param.weight_loader(param, tensor, shard_id)
                    break
            else:
                target = name
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        return loaded


class NanbeigeForCausalLM(_LoopedForCausalLM):
    family = "nanbeige"


class OuroForCausalLM(_LoopedForCausalLM):
    family = "ouro"
