"""The model section of the run's config (jaxloop.config composes the sections; each field's
default, help, domain and resume policy are declared here, once)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxloop.settings import FREE, count, knob, positive

Dtype = Literal["float32", "bfloat16"]


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """the policy model (the critic copies its architecture and backbone)"""

    hf_dir: str = knob(
        "",
        ("start from this HF checkpoint dir; empty: the built-in model below from random init"),
        resume=FREE,
    )
    init_checkpoint: str = knob(
        "", "start from a run dir written by `conversion.from_hf`", resume=FREE
    )
    preset: Literal["", "nanbeige-3b", "ouro-1.4b"] = knob(
        "",
        (
            "a released model's shape with random weights (nanbeige-3b, ouro-1.4b; empty: the "
            "tiny keys below); hf_dir / init_checkpoint take precedence"
        ),
    )
    family: Literal["nanbeige", "ouro"] = knob(
        "nanbeige", "built-in model: nanbeige (pre-norm) | ouro (sandwich norm, exit gate)"
    )
    vocab_size: int = knob(
        64, "built-in model: vocabulary size (the char tokenizer uses it)", count(1)
    )
    hidden_size: int = knob(64, "built-in model: hidden size", count(1))
    intermediate_size: int = knob(128, "built-in model: MLP size", count(1))
    num_layers: int = knob(2, "built-in model: physical layers (shared by every loop)", count(1))
    num_heads: int = knob(4, "built-in model: attention heads", count(1))

    # a divisor of num_heads (checked with the model)
    num_kv_heads: int = knob(
        2, "built-in model: key/value heads (grouped-query attention)", count(1)
    )

    # even (rotary embeddings; checked with the model)
    head_dim: int = knob(
        32, "built-in model: head dimension (even; vLLM on CPU needs >= 32)", count(2)
    )
    num_loops: int = knob(
        2, "built-in model: loops over the layer stack (ouro: total_ut_steps)", count(1)
    )
    rope_theta: float = knob(10000.0, "built-in model: RoPE base", positive())
    param_dtype: Dtype = knob("float32", "parameter dtype: float32 | bfloat16")
    compute_dtype: Dtype = knob("float32", "compute dtype: float32 | bfloat16")
    remat: Literal["none", "full", "dots"] = knob(
        "none", "activation rematerialisation: none | full | dots", resume=FREE
    )
    attention_impl: Literal["xla", "cudnn"] = knob(
        "xla", "attention kernel: xla | cudnn (GPU)", resume=FREE
    )
    logits_chunk: int | None = knob(
        None,
        (
            "sequence positions per LM-head chunk in the learner (None: the whole sequence); "
            "bounds the [B, chunk, V] logits held at once"
        ),
        count(1),
        resume=FREE,
        legacy_none=lambda value: value == 0,
    )
    scan_layers: bool = knob(
        False,
        (
            "true: lax.scan over the layers and over the loops (one compiled body each: short "
            "compiles for deep models, the full-size configs); false: both unrolled (XLA fuses "
            "across layers: faster for small models)"
        ),
        resume=FREE,
    )

    # parsed by parse_loop_budget
    loop_budget: str = knob(
        "",
        (
            "loops per update, K@N,...: K loops (1..num_loops) from update N (starts at 0, N "
            "increasing), in the sampler (vllm engines: eagerly), recompute, loss and critic; "
            "empty: full depth"
        ),
    )
