"""The learner's typed inputs: `TrainBatch` (one rollout, as the jitted entries take it) and
`Prepared` (what the update's first phase computes from it). Both are pytrees
(`flax.struct.dataclass`); an absent field is None (no leaf). A value computed in flight is
added with `.replace` (`dataclasses.replace`): nothing is assigned into a batch.

Shapes: N rows (samples, padding rows included: `sample_mask` 0), S tokens per row, T = S - 1
target positions (the token at j + 1 is predicted at j), L loops of the looped model. Every
per-sample field has the sample axis first, so one sharding (samples over the data-parallel
mesh axes) places the whole batch.
"""

from __future__ import annotations

import jax
from flax import struct

from jaxloop.rl.packing import PackedRows


@struct.dataclass
class TrainBatch:
    """One rollout as learner input (numpy on the host, `Learner.place_batch` -> jax arrays).

    The rollout (`RolloutBatch.train_batch`):
      tokens [N, S] int32: prompt + response, right-padded.
      attention_mask [N, S] bool: real tokens.
      response_mask [N, T] float32: 1 at targets that are response tokens.
      behav_logprobs [N, T] float32: the engine's log-probs of the response targets (plus the
        exit log-prob where the exit choice is an action).
      scores [N] float32: sequence rewards.
      group_ids [N] int32: the prompt group of each sample (padding rows: groups of one).
      sample_mask [N] float32: 1 for a real sample, 0 for a padding row.
    Early-exit rollouts (else None):
      depths [N, T] int32: the loops run at input position t (prompt and padding at full depth).
      exit_mask [N, T] float32: targets whose position's exit was an action (algo.depth_as_action).
    Packing (learner.pack_tokens set; added by `place_batch`, else None):
      pack: the rows of the per-sample passes and the critic (micro-batches of consecutive
        samples).
      step_pack: the rows of each policy step's micro-batches (`microbatch.step_plan`).
    The old policy (`Learner.old_logprobs`, added with `.replace` before `Learner.update`; None
    for `Learner.update_fused`, whose own forward gives them):
      old_logprobs [N, T] float32 of the actor before the update; with per-loop credit
        (learner.loop_credit != 'last') [N, L, T]: old_logprobs[:, t] is loop t's, [:, -1] the
        last loop's (the one the engine sampled from). Sample axis first, as every field.
    """

    tokens: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
    behav_logprobs: jax.Array
    scores: jax.Array
    group_ids: jax.Array
    sample_mask: jax.Array
    depths: jax.Array | None = None
    exit_mask: jax.Array | None = None
    pack: PackedRows | None = None
    step_pack: PackedRows | None = None
    old_logprobs: jax.Array | None = None

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def last_loop_old_logprobs(self) -> jax.Array | None:
        """[N, T]: the old log-probs of the last loop (all of them without per-loop credit)."""
        old = self.old_logprobs
        return old if old is None or old.ndim == 2 else old[:, -1]


@struct.dataclass
class Prepared:
    """What an update computes from its batch before the optimizer steps (`Learner`'s prepare
    phase), all [N, T] float32 unless said otherwise:
      advantages: the algorithm's advantage estimator's.
      returns: the value targets (estimators with a critic, else None).
      values: the critic's values before its steps (a critic, else None).
      ref_logprobs: the frozen reference's log-probs (a KL-to-reference term, else None); with
        per-loop credit [N, L, T], laid out as `TrainBatch.old_logprobs`.
    """

    advantages: jax.Array
    returns: jax.Array | None = None
    values: jax.Array | None = None
    ref_logprobs: jax.Array | None = None
