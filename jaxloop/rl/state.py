"""The train state: one pytree that owns everything an update changes.

actor params + optimizer state; critic params + optimizer state (PPO family); the frozen
reference params (when a KL term needs them); the number of finished updates; the policy version
(its only owner: the trainer, the checkpointer and the rollout source read it from here); an RNG
key. Flow-DPPO's frozen pi_old is the actor params as the update receives them: the learner holds
them for the duration of that one jitted update and nothing outlives it.

`build_train_state` creates it born sharded: each part is produced by a jitted function whose
`out_shardings` are the mesh shardings from the parameters' logical axes, so no device ever holds
a full copy of a sharded tensor.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding

from jaxloop.parallel import mesh as shd

# the TrainState's scalar bookkeeping (everything but parameters and optimizer states)
COUNTERS = ("step", "policy_version", "rng", "consecutive_skips", "skipped_updates")


@struct.dataclass
class TrainState:
    actor_params: Any
    actor_opt: Any
    critic_params: Any = None
    critic_opt: Any = None
    ref_params: Any = None
    step: jax.Array = None  # int32 []: finished updates
    policy_version: jax.Array = None  # int32 []: version of actor_params
    rng: jax.Array = None  # uint32 [2]: key data, advanced once per update
    consecutive_skips: jax.Array = None  # int32 []: updates skipped in a row (non-finite)
    skipped_updates: jax.Array = None  # int32 []: updates skipped in all

    @property
    def version(self) -> int:
        return int(self.policy_version)

    @property
    def update_count(self) -> int:
        return int(self.step)

    @property
    def counters(self) -> dict:
        """The scalar bookkeeping (`COUNTERS`) by name."""
        return {name: getattr(self, name) for name in COUNTERS}

    def apply_update(
        self, actor_params, actor_opt, critic_params, critic_opt, counters: dict
    ) -> TrainState:
        """The state after an update: its trained parts and its counters (`advance_counters`)."""
        return self.replace(
            actor_params=actor_params,
            actor_opt=actor_opt,
            critic_params=critic_params,
            critic_opt=critic_opt,
            **counters,
        )


def advance_counters(counters: dict, first_ok, actor_ok, critic_ok) -> tuple[dict, jax.Array]:
    """The counters after an update (pure: jitted alone by the offloaded update) and whether the
    update was skipped. first_ok: the first policy step was applied; actor_ok / critic_ok: every
    step of each was."""
    c = counters
    skipped = ~(actor_ok & critic_ok)
    return dict(
        step=c["step"] + 1,
        # the version counts applied policy changes: a skipped update keeps it
        policy_version=c["policy_version"] + first_ok.astype(jnp.int32),
        consecutive_skips=jnp.where(skipped, c["consecutive_skips"] + 1, 0),
        skipped_updates=c["skipped_updates"] + skipped.astype(jnp.int32),
        rng=jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(c["rng"]), c["step"])),
    ), skipped


def opt_shardings(tx: optax.GradientTransformation, params_abstract, params_sharding, mesh):
    """Optimizer-state shardings: every per-parameter leaf (Adam's moments...) takes its
    parameter's sharding, everything else (step counts) is replicated."""
    shapes = jax.eval_shape(tx.init, params_abstract)
    return optax.tree_map_params(
        tx,
        lambda _, s: s,
        shapes,
        params_sharding,
        transform_non_params=lambda _: shd.replicated(mesh),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def state_shardings(
    mesh: Mesh,
    actor_sharding: dict,
    actor_abstract: dict,
    actor_tx,
    critic_sharding: dict | None = None,
    critic_abstract: dict | None = None,
    critic_tx=None,
    with_reference: bool = False,
) -> TrainState:
    rep = shd.replicated(mesh)
    return TrainState(
        actor_params=actor_sharding,
        actor_opt=opt_shardings(actor_tx, actor_abstract, actor_sharding, mesh),
        critic_params=critic_sharding,
        critic_opt=(
            None
            if critic_sharding is None
            else opt_shardings(critic_tx, critic_abstract, critic_sharding, mesh)
        ),
        ref_params=actor_sharding if with_reference else None,
        step=rep,
        policy_version=rep,
        rng=rep,
        consecutive_skips=rep,
        skipped_updates=rep,
    )


def abstract_params(model: nnx.Module) -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.state(model).to_pure_dict()
    )


def abstract_train_state(
    actor_abstract: dict,
    actor_tx,
    critic_abstract: dict | None = None,
    critic_tx=None,
    with_reference: bool = False,
) -> TrainState:
    """Shapes and dtypes of the state (`jax.ShapeDtypeStruct` leaves), for restores and for
    ahead-of-time compilation; no memory is allocated."""
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return TrainState(
        actor_params=actor_abstract,
        actor_opt=jax.eval_shape(actor_tx.init, actor_abstract),
        critic_params=critic_abstract,
        critic_opt=None
        if critic_abstract is None
        else jax.eval_shape(critic_tx.init, critic_abstract),
        ref_params=actor_abstract if with_reference else None,
        step=scalar,
        policy_version=scalar,
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
        consecutive_skips=scalar,
        skipped_updates=scalar,
    )


def build_train_state(
    actor_params: dict,
    actor_tx,
    critic_params: dict | None = None,
    critic_tx=None,
    *,
    shardings: TrainState | None = None,
    with_reference: bool = False,
    seed: int = 0,
) -> TrainState:
    """Optimizer states, the reference copy and the counters, each made by a jitted function
    straight onto its shardings (actor/critic params must already be on theirs). Without
    `shardings`: wherever the parameters are (one device)."""

    def sharding(field: str):
        return None if shardings is None else getattr(shardings, field)

    with_reference = with_reference or (shardings is not None and shardings.ref_params is not None)
    actor_opt = jax.jit(actor_tx.init, out_shardings=sharding("actor_opt"))(actor_params)
    critic_opt = None
    if critic_params is not None:
        critic_opt = jax.jit(critic_tx.init, out_shardings=sharding("critic_opt"))(critic_params)
    ref = None
    if with_reference:
        # a distinct buffer: the actor's is donated to every update
        ref = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=sharding("ref_params"))(
            actor_params
        )

    def initial(name: str):
        if name == "rng":
            return jax.random.key_data(jax.random.key(seed))
        return jnp.zeros((), jnp.int32)

    counters = jax.jit(
        lambda: {name: initial(name) for name in COUNTERS},
        out_shardings=None if shardings is None else {n: sharding(n) for n in COUNTERS},
    )()
    return TrainState(actor_params, actor_opt, critic_params, critic_opt, ref, **counters)
