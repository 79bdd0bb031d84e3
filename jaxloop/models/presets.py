"""The released models' config.json values that matter for shapes (the full files: the model
cards; the tensor tables behind these shapes: shared/fixtures/). Used by the benchmarks and the
ahead-of-time memory plan, which never need weights."""

from __future__ import annotations

FULL_SIZE: dict[str, dict] = {
    "nanbeige-3b": {
        "architectures": ["NanbeigeForCausalLM"],
        "model_type": "nanbeige",
        "vocab_size": 166144,
        "hidden_size": 3072,
        "intermediate_size": 10752,
        "num_hidden_layers": 22,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rope_theta": 70000000,
        "rope_scaling": None,
        "rms_norm_eps": 1e-05,
        "num_loops": 2,
        "skip_loop_final_norm": False,
        "tie_word_embeddings": False,
    },
    "ouro-1.4b": {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": 49152,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_act": "silu",
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-06,
        "total_ut_steps": 4,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    },
}
