"""The learner's implementations, traced inside its jitted entries (`rl.learner.Learner` inherits
them): the model inputs of a micro-batch, the per-micro-batch losses and the three phases of one
update (reference log-probs / values / advantages, the policy steps, the critic steps), fused in
`_update_impl` or run one by one with offloading between them.

They read the learner's static parts only (`cfg`, `hp`, `algorithm`, the graphdefs, the
optimizers): a `LearnerPhases` holds no parameters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxloop.parallel import mesh as shd
from jaxloop.rl import advantages as adv_lib
from jaxloop.rl import microbatch as mb
from jaxloop.rl.loop_credit import per_loop_policy_loss
from jaxloop.rl.losses import (
    POLICY_LOSSES,
    LossInputs,
    kl_penalty,
    masked_metric_sums,
    reduce_loss,
    value_loss,
)
from jaxloop.rl.microbatch import MicroBatch
from jaxloop.rl.packing import PackedRows
from jaxloop.rl.state import TrainState, advance_counters
from jaxloop.rl.stats import LoopStats, ModelInputs, loop_stats, token_stats, token_values
from jaxloop.rl.train_batch import Prepared, TrainBatch


class LearnerPhases:
    """The traced implementations of `Learner` (a mixin: `Learner` holds the static parts)."""

    @property
    def per_loop(self) -> bool:
        """Per-loop credit: the loss (and the old / reference log-probs) are per loop."""
        return self.cfg.loop_credit != "last"

    def _model_inputs(self, packed: PackedRows | None, batch: TrainBatch, **fields):
        """The per-sample ([N, ...]) model inputs of `batch` plus `fields`: tokens and attention
        mask (and an early-exit rollout's depths and exit mask), or with packing the index into
        `packed`'s rows (the rows themselves are split by `split_rows`)."""
        if self.cfg.pack_tokens is not None:
            rows_index = PackedRows(None, None, None, None, packed.index)
            return MicroBatch(rows=rows_index, **fields)
        return MicroBatch(
            tokens=batch.tokens,
            attention_mask=batch.attention_mask,
            depths=batch.depths,
            exit_mask=batch.exit_mask,
            **fields,
        )

    def _split_inputs(self, batch: TrainBatch, per_sample: MicroBatch) -> MicroBatch:
        """`split_micro` of per-sample fields plus, with packing, the micro-batches' rows."""
        parts = mb.split_micro(per_sample, self.cfg.micro_batch_size)
        if self.cfg.pack_tokens is not None:
            index = parts.rows.index
            parts = parts.replace(rows=mb.split_rows(batch.pack, index.shape[:1], index))
        return parts

    def _per_sample(self, fn, params, batch: TrainBatch):
        """fn(params, micro-batch inputs) over micro-batches; results back as [N, ...]."""
        n = batch.tokens.shape[0]
        parts = self._split_inputs(batch, self._model_inputs(batch.pack, batch))
        out = jax.lax.scan(lambda _, x: (None, fn(params, x)), None, parts)[1]
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[:n], out)

    def _inputs(self, x: MicroBatch) -> ModelInputs:
        """The model inputs of a micro-batch `x` (padded samples or packed rows)."""
        if x.rows is not None:
            return ModelInputs.packed(x.rows)
        return ModelInputs.padded(x.tokens, x.attention_mask, x.depths, x.exit_mask)

    def _token_stats(self, params, x: MicroBatch, loops: int | None, old_params=None):
        """Per-sample token stats of a micro-batch `x` (padded samples or packed rows) after
        `loops` loops (the loop budget; None: all)."""
        cfg = self.cfg
        return token_stats(
            self.actor_graphdef,
            params,
            self._inputs(x),
            cfg.temperature,
            cfg.logits_chunk,
            old_params,
            loops,
        )

    def _values(self, loops: int | None, params, x: MicroBatch):
        return token_values(self.critic_graphdef, params, self._inputs(x), loops)

    def _actor_logprobs(self, loops: int | None, params, x: MicroBatch):
        return self._token_stats(params, x, loops)[0]

    def _loop_stats(self, params, x: MicroBatch, loops: int | None, old_params=None) -> LoopStats:
        """Per-loop token stats of a micro-batch `x` (padded samples or packed rows)."""
        if x.exit_mask is not None:  # refused by the config validation (algo.depth_as_action)
            raise ValueError("per-loop credit with the exit choice as an action is not supported")
        cfg = self.cfg
        return loop_stats(
            self.actor_graphdef,
            params,
            self._inputs(x),
            cfg.temperature,
            cfg.logits_chunk,
            old_params,
            loops,
        )

    def _loop_logprobs(self, loops: int | None, params, x: MicroBatch):
        """[micro, L, T]: each loop's selected log-probs, sample axis first."""
        return self._loop_stats(params, x, loops).sample_major_logprobs

    def _old_logprobs_impl(
        self, actor_params, batch: TrainBatch, with_hidden: bool, loops: int | None = None
    ):
        def fn(params, x):
            if self.per_loop:
                stats = self._loop_stats(params, x, loops)
                lp, hidden = stats.sample_major_logprobs, stats.hidden
            else:
                lp, _, _, hidden = self._token_stats(params, x, loops)
            return (lp, hidden) if with_hidden else lp

        return self._per_sample(fn, actor_params, batch)

    def _loop_policy_micro_loss(self, old_params, num_samples, num_tokens, loops):
        """Per-loop credit: `loop_credit.per_loop_policy_loss` of the loop stats."""
        algo, hp = self.algorithm, self.hp
        loss_fn = POLICY_LOSSES[algo.policy_loss]

        def micro_loss(p, x):
            old = old_params if algo.needs_old_policy_logits else None
            stats = self._loop_stats(p, x, loops, old)
            per_token, metrics = per_loop_policy_loss(loss_fn, hp, self.cfg.loop_credit, stats, x)
            loss = reduce_loss(per_token, x.mask, hp.reduction, num_samples, num_tokens)
            return loss, masked_metric_sums(metrics, x.mask)

        return micro_loss

    def _policy_micro_loss(self, old_params, num_samples, num_tokens, loops):
        if self.per_loop:
            return self._loop_policy_micro_loss(old_params, num_samples, num_tokens, loops)
        algo, hp = self.algorithm, self.hp
        loss_fn = POLICY_LOSSES[algo.policy_loss]

        def micro_loss(p, x):
            lp, entropy, old_kl, _ = self._token_stats(
                p, x, loops, old_params if algo.needs_old_policy_logits else None
            )
            fused = x.old_logprobs is None  # one step per rollout: the old policy is p itself
            old_lp = jax.lax.stop_gradient(lp) if fused else x.old_logprobs
            inputs = LossInputs(
                logprobs=lp,
                old_logprobs=old_lp,
                behav_logprobs=x.behav_logprobs,
                advantages=x.advantages,
                mask=x.mask,
                ref_logprobs=x.ref_logprobs,
                old_kl=old_kl,
            )
            per_token, metrics = loss_fn(inputs, hp)
            if hp.entropy_coef:  # exploration bonus (the entropy is differentiable)
                per_token = per_token - hp.entropy_coef * entropy
            metrics = dict(metrics)
            metrics["approx_kl"] = kl_penalty(lp, old_lp, "k3")
            metrics["entropy"] = entropy
            loss = reduce_loss(per_token, x.mask, hp.reduction, num_samples, num_tokens)
            sums = masked_metric_sums(metrics, x.mask)
            return loss, ((sums, old_lp) if fused else sums)

        return micro_loss

    def _critic_micro_loss(self, num_samples, num_tokens, loops):
        def micro_loss(p, x):
            values = self._values(loops, p, x)
            per_token, metrics = value_loss(
                values,
                x.old_values,
                x.returns,
                x.mask,
                self.hp.value_clip,
                scale=self.hp.value_loss_scale,
            )
            loss = reduce_loss(per_token, x.mask, self.hp.reduction, num_samples, num_tokens)
            return loss, masked_metric_sums({"vf_clip_frac": metrics["vf_clip_frac"]}, x.mask)

        return micro_loss

    # ---- the three phases of one update (fused in `_update_impl`, or run one by one with
    # offloading between them) ----
    def _prepare_impl(self, ref_params, critic_params, batch: TrainBatch, loops=None):
        """Reference log-probs, critic values and the algorithm's advantages (and returns)."""
        mask = batch.response_mask
        ref_lp = token_kl = values = None
        if ref_params is not None:
            # per-loop credit: loop t's loss term is held to the reference's loop t
            ref_fn = self._loop_logprobs if self.per_loop else self._actor_logprobs
            ref_lp = self._per_sample(functools.partial(ref_fn, loops), ref_params, batch)
            token_kl = batch.last_loop_old_logprobs - (ref_lp[:, -1] if self.per_loop else ref_lp)
        if critic_params is not None:
            values = self._per_sample(functools.partial(self._values, loops), critic_params, batch)
        estimator = adv_lib.ADVANTAGE_ESTIMATORS[self.algorithm.advantage]
        advantages, returns = estimator(
            adv_lib.AdvantageInputs(
                scores=batch.scores,
                mask=mask,
                group_ids=batch.group_ids,
                values=values,
                token_kl=token_kl,
            ),
            self.cfg.advantage,
        )
        metrics = {
            "advantage_mean": adv_lib.masked_mean(advantages, mask),
            "advantage_std": jnp.sqrt(adv_lib.masked_var(advantages, mask)),
        }
        if values is not None and returns is not None:
            metrics.update(adv_lib.value_metrics(values, returns, mask))
        return Prepared(advantages, returns, values, ref_lp), metrics

    def _actor_impl(
        self, actor_params, actor_opt, batch: TrainBatch, prepared: Prepared, loops=None
    ):
        """`updates_per_rollout` optimizer steps, each on its part of the batch. Returns
        (params, opt state, first step applied, all steps applied, metrics, old log-probs): the
        last are None, or without old_logprobs in `batch` (one step, `fuses_old_logprobs`) the
        [N, T] log-probs of the received parameters from the step's own forward."""
        cfg = self.cfg
        fused = batch.old_logprobs is None
        fields = self._model_inputs(
            batch.step_pack,
            batch,
            mask=batch.response_mask,
            old_logprobs=batch.old_logprobs,
            behav_logprobs=batch.behav_logprobs,
            advantages=prepared.advantages,
            sample_mask=batch.sample_mask,
            ref_logprobs=prepared.ref_logprobs,
        )
        n = batch.tokens.shape[0]
        plan = mb.step_plan(n, cfg.updates_per_rollout, cfg.micro_batch_size, cfg.step_split)
        k = plan.shape[1] // cfg.micro_batch_size

        def gather(x):  # [N, ...] -> [steps, K, micro, ...]; index n is an all-zero row
            x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)], axis=0)[plan]
            x = x.reshape((plan.shape[0], k, cfg.micro_batch_size) + x.shape[2:])
            return shd.constrain(x, mb.micro_axes(x, 2))

        parts = jax.tree.map(gather, fields)
        if cfg.pack_tokens is not None:
            # index n (an empty slot) gathered an all-zero index row: it reads 0
            index = parts.rows.index
            parts = parts.replace(rows=mb.split_rows(batch.step_pack, (plan.shape[0], k), index))
        # pi_old (Flow-DPPO): the actor parameters this update received, frozen for its steps
        old_params = actor_params if self.algorithm.needs_old_policy_logits else None

        def policy_step(carry, part: MicroBatch):
            params, opt_state, ok = carry
            num_samples = jnp.sum(part.sample_mask)
            part = part.replace(sample_mask=None)
            num_tokens = jnp.sum(part.mask)
            micro_loss = self._policy_micro_loss(old_params, num_samples, num_tokens, loops)
            grads, loss, sums, *old_lp = mb.accumulate(micro_loss, params, part, fused)
            grad_norm = optax.tree.norm(grads)
            ok = ok & jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            params, opt_state, ok = mb.apply_if(ok, self.actor_tx, grads, params, opt_state)
            step_metrics = {k: s / jnp.maximum(c, 1.0) for k, (s, c) in sums.items()}
            step_metrics["policy_loss"] = loss
            step_metrics["grad_norm"] = grad_norm
            return (params, opt_state, ok), step_metrics, (old_lp[0] if fused else None)

        # The step loop is unrolled (a handful of steps): a scan would double-buffer its carry,
        # i.e. hold a second copy of the parameters and optimizer state. From the first step
        # with a non-finite loss or gradient norm on (or one whose step would leave non-finite
        # parameters or optimizer state: apply_if), no step is applied.
        carry, per_step = (actor_params, actor_opt, jnp.bool_(True)), []
        first_ok = old_lp = None
        for i in range(plan.shape[0]):
            step_part = jax.tree.map(lambda v, i=i: v[i], parts)
            carry, step_metrics, step_lp = policy_step(carry, step_part)
            first_ok = carry[2] if first_ok is None else first_ok
            per_step.append(step_metrics)
            if step_lp is not None:  # one step: plan[0] is 0..n-1, then the padding index n
                old_lp = step_lp.reshape((-1,) + step_lp.shape[2:])[:n]
        params, opt_state, all_ok = carry
        metrics = {name: jnp.mean(jnp.stack([m[name] for m in per_step])) for name in per_step[0]}
        return params, opt_state, first_ok, all_ok, metrics, old_lp

    def _critic_impl(
        self, critic_params, critic_opt, batch: TrainBatch, prepared: Prepared, loops=None
    ):
        """`critic.steps_per_rollout` value-loss steps on the whole batch."""
        cfg, mask = self.cfg, batch.response_mask
        per_sample = self._model_inputs(
            batch.pack, batch, mask=mask, old_values=prepared.values, returns=prepared.returns
        )
        cbatch = self._split_inputs(batch, per_sample)
        micro_loss = self._critic_micro_loss(jnp.sum(batch.sample_mask), jnp.sum(mask), loops)

        def critic_step(carry):
            params, opt_state, ok = carry
            grads, loss, sums = mb.accumulate(micro_loss, params, cbatch)
            ok = ok & jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
            params, opt_state, ok = mb.apply_if(ok, self.critic_tx, grads, params, opt_state)
            s, c = sums["vf_clip_frac"]
            step_metrics = {
                "value_loss": loss,
                "vf_clip_frac": s / jnp.maximum(c, 1.0),
                "critic_grad_norm": optax.tree.norm(grads),
            }
            return (params, opt_state, ok), step_metrics

        carry = (critic_params, critic_opt, jnp.bool_(True))
        for _ in range(cfg.critic_steps):  # unrolled, as the policy steps
            carry, metrics = critic_step(carry)
        params, opt_state, ok = carry
        return params, opt_state, ok, metrics

    def _update_impl(
        self, state: TrainState, batch: TrainBatch, critic_only: bool = False, loops=None
    ):
        prepared, metrics = self._prepare_impl(state.ref_params, state.critic_params, batch, loops)
        actor_params, actor_opt = state.actor_params, state.actor_opt
        first_ok, actor_ok = jnp.bool_(False), jnp.bool_(True)  # critic_only: nothing applied
        old_lp = None
        if not critic_only:
            actor_params, actor_opt, first_ok, actor_ok, actor_metrics, old_lp = self._actor_impl(
                state.actor_params, state.actor_opt, batch, prepared, loops
            )
            metrics.update(actor_metrics)
        critic_params, critic_opt, critic_ok = state.critic_params, state.critic_opt, True
        if state.critic_params is not None:
            critic_params, critic_opt, critic_ok, critic_metrics = self._critic_impl(
                state.critic_params, state.critic_opt, batch, prepared, loops
            )
            metrics.update(critic_metrics)
        counted = advance_counters(state.counters, first_ok, actor_ok, critic_ok)
        trained = (actor_params, actor_opt, critic_params, critic_opt)
        new_state, metrics = next_state(state, trained, counted, metrics)
        fused = batch.old_logprobs is None
        return (new_state, metrics, old_lp) if fused else (new_state, metrics)


def next_state(state: TrainState, trained: tuple, counted: tuple, metrics: dict):
    """The state after an update: trained (actor params, actor opt, critic params, critic opt),
    counted (the new counters, whether the update was skipped: a metric)."""
    counters, skipped = counted
    metrics["skipped"] = skipped.astype(jnp.float32)
    return state.apply_update(*trained, counters), metrics
