"""The learner: pure jitted functions of (TrainState, TrainBatch).

    old_logprobs(state, batch)        -> [N, T] selected-token log-probs of the actor
    update(state, batch)              -> (state, metrics): reference log-probs, values, advantages
                                         (the algorithm's registered estimator), the policy steps
                                         and the critic steps of one rollout

The learner knows the algorithm only through its registry entry (`rl.algorithms.Algorithm`):
which policy loss and advantage estimator, whether the loss needs the frozen old policy's
full-vocabulary logits. Whether there is a critic or a reference is a property of the state.
The loop budget K is a static argument of every entry (`num_loops`): one Learner, one compiled
program per K, the model running its first K loops (`looped_forward(num_loops=K)`).
Every jitted entry (the fused update, its offloaded phases, the old log-probs) has explicit in/out
shardings and runs under `jax.set_mesh` (so the model's activation constraints apply); one device
is a mesh of one, with the same jits. `update` donates the state it replaces (an offloaded phase
the part it replaces): no second copy of parameters and optimizer state exists during a step.

Model statistics live in `rl.stats`, micro-batches and optimizer steps in `rl.microbatch`, the
per-loop loss in `rl.loop_credit`, memory offload in `rl.offload`; the traced implementations
the jitted entries run (micro-batch losses, the three phases of an update) in `rl.phases`.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
from jax.sharding import Mesh

from jaxloop.parallel import mesh as shd
from jaxloop.rl import advantages as adv_lib
from jaxloop.rl import microbatch as mb
from jaxloop.rl import offload as offload_lib
from jaxloop.rl.algorithms import Algorithm
from jaxloop.rl.losses import (
    LossHParams,
)
from jaxloop.rl.offload import OffloadConfig
from jaxloop.rl.phases import LearnerPhases, next_state
from jaxloop.rl.state import COUNTERS, TrainState, advance_counters
from jaxloop.rl.train_batch import TrainBatch


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    micro_batch_size: int
    temperature: float
    updates_per_rollout: int
    critic_steps: int
    advantage: adv_lib.AdvantageHParams = adv_lib.AdvantageHParams()
    logits_chunk: int | None = None  # positions per LM-head chunk (None: the whole sequence)
    # each micro-batch's samples packed into rows of this many tokens (jaxloop.rl.packing);
    # None: padded to the longest
    pack_tokens: int | None = None
    loop_credit: str = "last"  # the policy loss over loops (LOOP_CREDITS; last: the last loop)
    step_split: str = "contiguous"  # the policy steps' parts of a batch (microbatch.step_plan)


NO_OFFLOAD = OffloadConfig()


class Learner(LearnerPhases):
    """Static parts (graphdefs, algorithm, hyper-parameters, optimizers, shardings) and the
    jitted entries. It holds no parameters: those live in the TrainState."""

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
        offload: OffloadConfig = NO_OFFLOAD,
    ):
        self.algorithm = algorithm
        self.hp = hparams
        self.cfg = config
        self.actor_graphdef = actor_graphdef
        self.critic_graphdef = critic_graphdef
        self.actor_tx = actor_tx
        self.critic_tx = critic_tx
        self.offload = offload
        if mesh is None:  # one device: a mesh of one, so both take the same jits
            mesh = shd.make_mesh(devices=jax.devices()[:1])
        self.mesh = mesh
        # one device without per-field shardings: one sharding, a prefix of the whole state
        self.state_shardings = state_shardings
        if state_shardings is None:
            self.state_shardings = shd.replicated(mesh)
        # packed rows per micro-batch are a multiple of the data-parallel size (even shards)
        self.row_multiple = shd.data_parallel_size(mesh)
        self._jit_entries()

    def _part(self, field: str):
        """The sharding of one TrainState field (a prefix of its subtree)."""
        s = self.state_shardings
        return getattr(s, field) if isinstance(s, TrainState) else s

    def _jit_entries(self) -> None:
        """Every jitted entry with explicit in/out shardings; the state (or the part of it a
        phase replaces) is donated, so no second copy of parameters or optimizer state exists
        during a step. The offloaded phases (`_prepare`, `_actor_phase`, `_critic_phase`,
        `_counters`) are the fused `_update` in pieces."""
        rows = self.batch_sharding = shd.batch_sharding(self.mesh, ndim=1)
        rep, part, state = shd.replicated(self.mesh), self._part, self.state_shardings
        counters = {name: part(name) for name in COUNTERS}
        # static: with_hidden / critic_only, and the loop budget (one compiled program per K)
        self._old_logprobs = jax.jit(
            self._old_logprobs_impl,
            static_argnums=(2, 3),
            in_shardings=(part("actor_params"), rows),
            out_shardings=rows,
        )
        self._update = jax.jit(
            self._update_impl,
            static_argnums=(2, 3),
            in_shardings=(state, rows),
            out_shardings=(state, rep),
            donate_argnums=0,
        )
        # without old_logprobs in the batch: the old log-probs come back as a third output
        self._update_fused = jax.jit(
            self._update_impl,
            static_argnums=(2, 3),
            in_shardings=(state, rows),
            out_shardings=(state, rep, rows),
            donate_argnums=0,
        )
        self._prepare = jax.jit(
            self._prepare_impl,
            static_argnums=3,
            in_shardings=(part("ref_params"), part("critic_params"), rows),
            out_shardings=(rows, rep),
        )
        self._actor_phase = jax.jit(
            self._actor_impl,
            static_argnums=4,
            in_shardings=(part("actor_params"), part("actor_opt"), rows, rows),
            out_shardings=(part("actor_params"), part("actor_opt"), rep, rep, rep, rows),
            donate_argnums=(0, 1),
        )
        self._critic_phase = jax.jit(
            self._critic_impl,
            static_argnums=4,
            in_shardings=(part("critic_params"), part("critic_opt"), rows, rows),
            out_shardings=(part("critic_params"), part("critic_opt"), rep, rep),
            donate_argnums=(0, 1),
        )
        self._counters = jax.jit(
            advance_counters,
            in_shardings=(counters, rep, rep, rep),
            out_shardings=(counters, rep),
            donate_argnums=0,
        )

    def _mesh_context(self):
        return jax.set_mesh(self.mesh)

    def place_batch(self, batch: TrainBatch) -> TrainBatch:
        """Host arrays -> device arrays, sample axis over the data-parallel mesh axes; with
        packing, plus the packed rows of both micro-batch layouts (`microbatch.pack_plan`)."""
        cfg = self.cfg
        if cfg.pack_tokens is not None:
            if batch.depths is not None:
                raise ValueError("packed rows carry no per-token depths (early-exit rollouts)")
            micro, steps = cfg.micro_batch_size, cfg.updates_per_rollout
            pack, step_pack = mb.pack_plan(
                batch.tokens,
                batch.attention_mask,
                micro,
                steps,
                cfg.pack_tokens,
                self.row_multiple,
                cfg.step_split,
            )
            batch = batch.replace(pack=pack, step_pack=step_pack)
        return jax.tree.map(lambda x: shd.put_global(x, self.batch_sharding), batch)

    # ---- the public pure functions ----
    def old_logprobs(
        self,
        state: TrainState,
        batch: TrainBatch,
        with_hidden: bool = False,
        *,
        num_loops: int | None = None,
    ):
        """[N, T] log-probs of the actor (with_hidden: and the [N, T, E] LM-head inputs of the
        last loop); per-loop credit: [N, L, T] (`TrainBatch.old_logprobs`). num_loops: the loop
        budget K, a static argument of every entry (the model runs its first K loops; None:
        all of them)."""
        with self._mesh_context():
            return self._old_logprobs(state.actor_params, batch, with_hidden, num_loops)

    @property
    def fuses_old_logprobs(self) -> bool:
        """One optimizer step per rollout, last-loop credit: the old policy is the one the
        update's own forward runs, so `update_fused` takes its log-probs from that forward
        (held fixed by stop_gradient) instead of a separate pass (slime's
        --use-rollout-logprobs and Tunix skip that pass too; here the engine-vs-trainer check
        still gets them)."""
        return self.cfg.updates_per_rollout == 1 and not self.per_loop

    def update_fused(
        self, state: TrainState, batch: TrainBatch, *, num_loops: int | None = None
    ) -> tuple[TrainState, dict, jax.Array]:
        """`update` without a separate old-log-prob forward (`fuses_old_logprobs`): `batch`
        has no old_logprobs; returns (state, metrics, the [N, T] old log-probs,
        i.e. the received policy's, as `old_logprobs` would give them)."""
        if not self.fuses_old_logprobs:
            raise ValueError(
                f"update_fused needs one optimizer step per rollout and last-loop credit "
                f"(updates_per_rollout={self.cfg.updates_per_rollout}, "
                f"loop_credit={self.cfg.loop_credit})"
            )
        if batch.old_logprobs is not None or state.ref_params is not None:
            raise ValueError(
                "update_fused: the batch carries old_logprobs, or the state has a reference "
                "(its KL term reads them before the policy step): use old_logprobs + update"
            )
        with self._mesh_context():
            if self.offload.any:
                return self._update_offloaded(state, batch, False, num_loops)
            return self._update_fused(state, batch, False, num_loops)

    def update(
        self,
        state: TrainState,
        batch: TrainBatch,
        critic_only: bool = False,
        *,
        num_loops: int | None = None,
    ) -> tuple[TrainState, dict]:
        """One rollout's optimizer steps. `batch` carries old_logprobs (`old_logprobs`'s: per
        loop [N, L, T] with per-loop credit). `critic_only` (critic warm-up): only the critic's
        steps; the actor, its optimizer state and the policy version stay. num_loops: the loop
        budget K of the actor, reference and critic (None: all loops). The input state is
        donated: use only the returned one."""
        if critic_only and self.critic_graphdef is None:
            raise ValueError("critic_only update without a critic")
        if batch.old_logprobs is None:
            raise ValueError("update: the batch has no 'old_logprobs' (see update_fused)")
        want = 3 if self.per_loop else 2
        if batch.old_logprobs.ndim != want:
            raise ValueError(
                f"loop_credit={self.cfg.loop_credit}: old_logprobs must have {want} axes "
                f"(Learner.old_logprobs), got shape {batch.old_logprobs.shape}"
            )
        with self._mesh_context():
            if self.offload.any:
                return self._update_offloaded(state, batch, critic_only, num_loops)
            return self._update(state, batch, critic_only, num_loops)

    # ---- offloading ----
    def rest(self, state: TrainState) -> TrainState:
        """`state` as the learner keeps it between updates (after init or restore): on the
        learner's mesh, every offloaded part in host memory. A state built off the mesh (one
        device, `build_train_state` without shardings) is put on its shardings first: the jitted
        entries' outputs live there, so a state off it would make the second update trace and
        compile every entry again (the trainer's state is born there: nothing moves)."""
        if not shd.on_mesh(state, self.mesh):
            present = [
                f.name for f in dataclasses.fields(state) if getattr(state, f.name) is not None
            ]
            state = jax.device_put(state, state.replace(**{f: self._part(f) for f in present}))
        return offload_lib.rest(self.offload, state)

    def _update_offloaded(
        self, state: TrainState, batch: TrainBatch, critic_only: bool, loops: int | None
    ):
        """The update as its phases with the offloaded parts moved in and out between them; the
        moves' times and sizes are in the metrics (`offload.move`)."""
        phases = offload_lib.Phases(
            lambda ref, critic, b: self._prepare(ref, critic, b, loops),
            lambda params, opt, b, prepared: self._actor_phase(params, opt, b, prepared, loops),
            lambda params, opt, b, prepared: self._critic_phase(params, opt, b, prepared, loops),
            self._counters,
        )
        trained, counted, metrics, old_lp = offload_lib.run_phases(
            phases, self.offload, state, batch, critic_only
        )
        new_state, metrics = next_state(state, trained, counted, metrics)
        fused = batch.old_logprobs is None
        return (new_state, metrics, old_lp) if fused else (new_state, metrics)
