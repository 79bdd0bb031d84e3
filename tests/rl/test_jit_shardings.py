"""Every jitted learner entry (the fused update, its offloaded phases, the old log-probs) has
explicit in/out shardings and donates the state it replaces, on one device and on the 8-device
mesh alike: one set of jits, lowered here on a tiny model from abstract arguments (no compile)."""

import functools

import jax
import optax
import pytest
from flax import nnx

from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.parallel import mesh as shd
from jaxloop.rl.algorithms import get_algorithm
from jaxloop.rl.learner import Learner, LearnerConfig
from jaxloop.rl.losses import LossHParams
from jaxloop.rl.state import COUNTERS, abstract_params, abstract_train_state, state_shardings
from tests.rl.test_learner import _arrays

CFG = LoopedConfig.from_hf_dict(tiny_hf_config("nanbeige", num_hidden_layers=1))
LOOPS = 1  # a loop budget below the model's 2 loops: a static argument of every entry

# entry -> the argument positions it donates (the state, or the part of it the entry replaces)
DONATED = {
    "_old_logprobs": (),
    "_update": (0,),
    "_update_fused": (0,),
    "_prepare": (),
    "_actor_phase": (0, 1),
    "_critic_phase": (0, 1),
    "_counters": (0,),
}


# entry -> how many trailing arguments are static (with_hidden / critic_only, the loop budget)
STATIC_TAIL = {
    "_old_logprobs": 2,
    "_update": 2,
    "_update_fused": 2,
    "_prepare": 1,
    "_actor_phase": 1,
    "_critic_phase": 1,
    "_counters": 0,
}


def _learner(mesh, with_reference: bool):
    """A PPO learner with a critic (and a reference: KL to it), its abstract state and a placed
    batch of 8 samples."""
    actor = nnx.eval_shape(lambda: LoopedLM(CFG, rngs=nnx.Rngs(0)))
    critic = nnx.eval_shape(lambda: LoopedLM(CFG, rngs=nnx.Rngs(1), role="critic"))
    tx = optax.adam(1e-3)
    abstract = abstract_train_state(
        abstract_params(actor), tx, abstract_params(critic), tx, with_reference=with_reference
    )
    shardings = None
    if mesh is not None:
        shardings = state_shardings(
            mesh,
            shd.shardings_for(actor, mesh),
            abstract_params(actor),
            tx,
            shd.shardings_for(critic, mesh),
            abstract_params(critic),
            tx,
            with_reference=with_reference,
        )
    config = LearnerConfig(8, 0.8, 2, 1)
    learner = Learner(
        nnx.graphdef(actor),
        nnx.graphdef(critic),
        get_algorithm("ppo"),
        LossHParams(kl_coef=0.1 if with_reference else 0.0),
        config,
        tx,
        tx,
        mesh=mesh,
        state_shardings=shardings,
    )
    return learner, abstract, learner.place_batch(_arrays().train_batch())


def _entry_args(learner, state, batch) -> dict:
    """Each entry's arguments (its static ones included), as the update passes them."""
    shapes = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    batch = shapes(batch)
    old = jax.eval_shape(
        lambda p, b: learner._old_logprobs_impl(p, b, False, LOOPS), state.actor_params, batch
    )
    with_old = batch.replace(old_logprobs=old)
    prepared = jax.eval_shape(
        lambda r, c, b: learner._prepare_impl(r, c, b, LOOPS),
        state.ref_params,
        state.critic_params,
        with_old,
    )[0]
    flag = jax.ShapeDtypeStruct((), bool)
    return {
        "_old_logprobs": (state.actor_params, batch, False, LOOPS),
        "_update": (state, with_old, False, LOOPS),
        "_update_fused": (state, batch, False, LOOPS),
        "_prepare": (state.ref_params, state.critic_params, with_old, LOOPS),
        "_actor_phase": (state.actor_params, state.actor_opt, with_old, prepared, LOOPS),
        "_critic_phase": (state.critic_params, state.critic_opt, with_old, prepared, LOOPS),
        "_counters": ({n: getattr(state, n) for n in COUNTERS}, flag, flag, flag),
    }


def _with_static(fn, static, *args):
    return fn(*args, *static)


@pytest.mark.parametrize("with_reference", [False, True])
@pytest.mark.parametrize("mesh_size", [1, 8])
def test_every_jitted_entry_has_explicit_shardings_and_donates_its_state(mesh_size, with_reference):
    mesh = None if mesh_size == 1 else shd.make_mesh(fsdp=8)
    learner, state, batch = _learner(mesh, with_reference)
    jitted = {k for k, v in vars(learner).items() if isinstance(v, jax.stages.Wrapped)}
    assert jitted == set(DONATED), "a jitted entry this test does not check"
    assert learner.mesh.devices.size == mesh_size  # one device: a mesh of one, the same jits
    for name, args in _entry_args(learner, state, batch).items():
        if name == "_update_fused" and with_reference:
            continue  # the fused update refuses a reference (its KL reads the old log-probs)
        fn = getattr(learner, name)
        split = len(args) - STATIC_TAIL[name]
        traced_args, static = args[:split], args[split:]
        call = functools.partial(_with_static, fn, static)
        with jax.set_mesh(learner.mesh):
            (eqn,) = jax.make_jaxpr(call)(*traced_args).eqns  # the one jit call
            lowered = fn.lower(*args)
        for kind in ("in_shardings", "out_shardings"):
            shardings = eqn.params[kind]
            explicit = [isinstance(s, jax.sharding.NamedSharding) for s in shardings]
            assert shardings and all(explicit), (name, kind, shardings)
            assert all(s.mesh.devices.size == mesh_size for s in shardings), (name, kind)
        positional, _ = lowered.args_info
        for i, arg in enumerate(positional[: len(traced_args)]):
            flags = {a.donated for a in jax.tree.leaves(arg)}  # empty: an absent part (None)
            assert flags <= {i in DONATED[name]}, (name, i, flags)
