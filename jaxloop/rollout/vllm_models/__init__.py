"""vLLM plugin: looped Nanbeige4.2 and Ouro models for vLLM engines.

Loaded by vLLM in every engine process through the `vllm.general_plugins` entry point
`jaxloop = "jaxloop.rollout.vllm_models:register"` (pyproject.toml). Importing this package is
cheap (no torch, no vLLM); `register()` imports vLLM and transformers. Never import the
submodules from JAX code.
"""

from __future__ import annotations

ARCHITECTURES = {
    "NanbeigeForCausalLM": "jaxloop.rollout.vllm_models.looped:NanbeigeForCausalLM",
    "OuroForCausalLM": "jaxloop.rollout.vllm_models.looped:OuroForCausalLM",
}

_registered = False


def register() -> None:
    """Register the config classes (transformers AutoConfig) and the model classes (vLLM's
    ModelRegistry, lazily by module path). Idempotent; safe in every process."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    from jaxloop.rollout.vllm_models.configs import register_configs

    register_configs()
    for arch, path in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, path)
    _registered = True
