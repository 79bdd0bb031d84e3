"""Per-loop credit (algo.loop_credit): the policy loss over the loops of a looped model,
sum_t w_t loss_t, each loop t's term the registered policy loss of loop t's log-probs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxloop.rl.settings import LOOP_CREDITS

if TYPE_CHECKING:  # jaxloop.config reads LOOP_CREDITS from here: importing it loads no jax
    import jax

    from jaxloop.rl.losses import LossHParams
    from jaxloop.rl.microbatch import MicroBatch
    from jaxloop.rl.stats import LoopStats

__all__ = ["LOOP_CREDITS", "loop_weights", "per_loop_policy_loss"]


def loop_weights(credit: str, num_loops: int, exit_probs: jax.Array | None = None) -> jax.Array:
    """The weights w_t of the policy loss sum_t w_t loss_t, summing to 1 over loops: uniform
    1/L and progressive (t + 1) / sum_j (j + 1) as [L, 1, 1]; exit_pdf the exit distribution
    [L, B, T] of each token, stop-gradient (the weights carry no gradient into the gate)."""
    import jax
    import jax.numpy as jnp

    if credit == "exit_pdf":
        if exit_probs is None:
            raise ValueError("loop_credit=exit_pdf needs a model with an exit gate (Ouro)")
        return jax.lax.stop_gradient(exit_probs.astype(jnp.float32))
    if credit == "uniform":
        w = jnp.ones((num_loops,), jnp.float32)
    elif credit == "progressive":
        w = jnp.arange(1, num_loops + 1, dtype=jnp.float32)
    else:
        raise ValueError(f"loop_credit={credit!r} has no per-loop weights; one of {LOOP_CREDITS}")
    return (w / jnp.sum(w))[:, None, None]


def per_loop_policy_loss(
    loss_fn: Callable, hp: LossHParams, credit: str, stats: LoopStats, x: MicroBatch
) -> tuple[jax.Array, dict]:
    """Per token sum_t w_t loss_t (`loop_weights`), loss_t = `loss_fn` of loop t's log-probs
    against loop t's old / proximal (and reference) log-probs of the micro-batch `x`
    (old_logprobs, ref_logprobs: [micro, L, T], loop t at [:, t]); the behaviour log-probs (the
    engine's, of the last loop) serve every loop; Flow-DPPO gates loop t by its own D_t. The
    metrics are the last loop's (as with loop_credit=last); per loop (t = 1..L): loop<t>_entropy,
    loop<t>_kl_to_last (KL(pi_last || pi_t)) and loop<t>_weight (the mean w_t)."""
    import jax.numpy as jnp

    from jaxloop.rl.losses import LossInputs, kl_penalty

    loops = stats.logprobs.shape[0]
    weights = loop_weights(credit, loops, stats.exit_probs)
    old, ref = x.old_logprobs, x.ref_logprobs
    per_token, loop_metrics = 0.0, {}
    for t in range(loops):
        inputs = LossInputs(
            logprobs=stats.logprobs[t],
            old_logprobs=old[:, t],
            behav_logprobs=x.behav_logprobs,
            advantages=x.advantages,
            mask=x.mask,
            ref_logprobs=None if ref is None else ref[:, t],
            old_kl=None if stats.old_kl is None else stats.old_kl[t],
        )
        loss_t, metrics = loss_fn(inputs, hp)
        if hp.entropy_coef:
            loss_t = loss_t - hp.entropy_coef * stats.entropy[t]
        per_token = per_token + weights[t] * loss_t
        loop_metrics[f"loop{t + 1}_entropy"] = stats.entropy[t]
        loop_metrics[f"loop{t + 1}_kl_to_last"] = stats.kl_to_last[t]
        loop_metrics[f"loop{t + 1}_weight"] = jnp.broadcast_to(weights[t], x.mask.shape)
    metrics = dict(metrics)  # the last loop's
    metrics["approx_kl"] = kl_penalty(stats.logprobs[-1], old[:, -1], "k3")
    metrics["entropy"] = stats.entropy[-1]
    metrics.update(loop_metrics)
    return per_token, metrics
