"""The actor and critic from the config's model section: their LoopedConfig, fresh or loaded
parameters (model.hf_dir, model.init_checkpoint, model.preset or the tiny keys), and the critic
built around the actor's backbone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxloop.io.hf import abstract_model, load_hf, read_hf_config
from jaxloop.io.orbax import read_config, restore_model
from jaxloop.models.config import LoopedConfig, tiny_hf_config
from jaxloop.models.looped import LoopedLM
from jaxloop.models.presets import FULL_SIZE


def actor_config(cfg) -> LoopedConfig:
    """The actor's LoopedConfig: from model.hf_dir, model.init_checkpoint, model.preset (a
    released model's shape, random init) or the tiny keys."""
    m = cfg.model
    numerics = dict(
        param_dtype=m.param_dtype,
        compute_dtype=m.compute_dtype,
        remat=m.remat,
        attention_impl=m.attention_impl,
        scan_layers=m.scan_layers,
    )
    if m.hf_dir:
        return read_hf_config(m.hf_dir)[0].replace(**numerics)
    if m.init_checkpoint:
        return read_config(m.init_checkpoint, "actor").replace(**numerics)
    if m.preset:
        return LoopedConfig.from_hf_dict(FULL_SIZE[m.preset]).replace(**numerics)
    overrides = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        rope_theta=m.rope_theta,
    )
    overrides["total_ut_steps" if m.family == "ouro" else "num_loops"] = m.num_loops
    return LoopedConfig.from_hf_dict(tiny_hf_config(m.family, **overrides)).replace(**numerics)


def init_actor_params(cfg, model_cfg: LoopedConfig, mesh, shardings: dict, seed: int) -> dict:
    """Fresh actor parameters, each tensor straight onto its sharding (`seed`: the random init's,
    used when the config names no weights)."""
    m = cfg.model
    numerics = dict(remat=m.remat, attention_impl=m.attention_impl, scan_layers=m.scan_layers)
    if m.hf_dir:
        model = load_hf(
            m.hf_dir, dtype=m.param_dtype, compute_dtype=m.compute_dtype, mesh=mesh, **numerics
        )
        return nnx.state(model).to_pure_dict()
    if m.init_checkpoint:
        model = restore_model(
            m.init_checkpoint,
            "actor",
            dtype=m.param_dtype,
            compute_dtype=m.compute_dtype,
            mesh=mesh,
            **numerics,
        )
        return nnx.state(model).to_pure_dict()
    return jax.jit(
        lambda: nnx.state(LoopedLM(model_cfg, rngs=nnx.Rngs(seed))).to_pure_dict(),
        out_shardings=shardings,
    )()


def build_actor(cfg, seed: int) -> LoopedLM:
    """The actor as a LoopedLM on the default device (tests, scripts; training builds its state
    through train.setup.TrainSetup)."""
    model_cfg = actor_config(cfg)
    params = init_actor_params(cfg, model_cfg, None, None, seed)
    model = abstract_model(model_cfg, "actor")
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(nnx.graphdef(model), state)


def critic_from_actor(actor_params: dict, model_cfg: LoopedConfig, seed: int) -> dict:
    """Critic parameters: the actor's backbone (copied) with a fresh value head."""
    critic = nnx.state(LoopedLM(model_cfg, rngs=nnx.Rngs(seed), role="critic")).to_pure_dict()
    for key in critic:
        if key in actor_params:
            critic[key] = jax.tree.map(jnp.copy, actor_params[key])
    return critic


def build_critic(actor: LoopedLM, seed: int) -> LoopedLM:
    """Same architecture with a value head; the backbone starts as a copy of the actor's."""
    critic = LoopedLM(actor.config, rngs=nnx.Rngs(seed), role="critic")
    pure = critic_from_actor(nnx.state(actor).to_pure_dict(), actor.config, seed)
    state = nnx.state(critic)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(critic, state)
    return critic
