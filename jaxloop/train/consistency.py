"""Checks of one update's batch and numbers: the engine-vs-trainer log-prob check, the
non-finite-update stop, the batch's staleness and early-exit depths."""

from __future__ import annotations

import numpy as np

from jaxloop.rollout.api import EngineFailedError, ManagerFailedError


class LogprobMismatchError(RuntimeError):
    """Engine and trainer disagree on the sampled tokens' log-probs beyond the configured bound."""


class NonFiniteUpdateError(RuntimeError):
    """optim.max_skipped_updates updates in a row had a non-finite loss or gradient norm, or
    would have left non-finite parameters or optimizer state (the learner's guard)."""


# a run stopped by one of these exits with code 3 (a result, not a bad input or a bug; the last
# checkpoint resumes): rollout engines that cannot be restarted (e.g. no node has room) too
STOPPED_RUN_ERRORS = (
    LogprobMismatchError,
    NonFiniteUpdateError,
    EngineFailedError,
    ManagerFailedError,
)


def check_engine_logprobs(
    update: int, arrays, old_lp, bound: float, loop_old_lp=None
) -> dict[str, float]:
    """Engine vs trainer selected log-probs of the sampled (last) loop, `old_lp` [N, T]; with
    `loop_old_lp` [N, L, T] (per-loop credit, `TrainBatch.old_logprobs`) and the engine's
    per-loop log-probs (`arrays.loop_behav_logprobs`, [N, L, T] too), also of every loop t:
    loop<t>_logprob_diff_max. Each is held to `bound` (LogprobMismatchError)."""
    mask = arrays.response_mask
    diff = np.abs(old_lp - arrays.behav_logprobs) * mask
    stats = {
        "logprob_diff_max": float(diff.max()),
        "logprob_diff_mean": float(diff.sum() / max(mask.sum(), 1.0)),
    }
    checked = [("", stats["logprob_diff_max"])]
    if loop_old_lp is not None and arrays.loop_behav_logprobs is not None:
        engine_lp = arrays.loop_behav_logprobs  # [N, L, T], as the trainer's
        if engine_lp.shape != loop_old_lp.shape:
            raise ValueError(f"per-loop log-probs {engine_lp.shape} vs {loop_old_lp.shape}")
        for t in range(loop_old_lp.shape[1]):
            worst = float((np.abs(loop_old_lp[:, t] - engine_lp[:, t]) * mask).max())
            stats[f"loop{t + 1}_logprob_diff_max"] = worst
            checked.append((f" of loop {t + 1}", worst))
    for where, worst in checked:
        if worst > bound:
            raise LogprobMismatchError(
                f"update {update}: engine vs trainer log-prob difference{where} "
                f"{worst:.3g} exceeds rollout.max_logprob_diff={bound:g}"
            )
    return stats


def check_skips(update: int, in_a_row: int, limit: int, last_checkpoint) -> None:
    """NonFiniteUpdateError when `limit` updates in a row were skipped (nothing of this update is
    saved then: the last checkpoint stays good)."""
    if in_a_row >= limit:
        raise NonFiniteUpdateError(
            f"update {update}: non-finite loss or gradient norm in {in_a_row} consecutive "
            f"updates (optim.max_skipped_updates={limit}); nothing was applied since update "
            f"{update - in_a_row}, last checkpoint: step {last_checkpoint}"
        )


def staleness(samples, version: int) -> dict[str, float]:
    """How many versions older than the policy being trained (`version`) the samples are."""
    lag = np.array([version - s.policy_version for s in samples], np.float64)
    return {"staleness_mean": float(lag.mean()), "staleness_max": float(lag.max())}


def check_loop_budget(update: int, samples, loops: int) -> None:
    """The samples ran the update's loop budget (sampler, recompute, loss and critic all run K
    loops)."""
    sampled = {x.extras.get("loop_budget", loops) for x in samples}
    if sampled != {loops}:
        raise RuntimeError(f"update {update}: samples ran {sampled} loops, the trainer {loops}")


def depth_metrics(samples, loops: int) -> dict[str, float]:
    """Early-exit rollouts: the mean loops a response token ran, the fraction that exited at each
    loop t (depth_hist_<t>, t = 1..loops) and the compute saved against running every loop. Over
    every response token but the last: its forward would only predict past the response (vLLM
    never runs it; the embedded sampler's is discarded), so both engines count the same tokens."""
    depths = np.concatenate(
        [np.asarray(s.extras["response_depths"][:-1], np.int64) for s in samples] or [np.zeros(0)]
    )
    if depths.size == 0:
        return {}
    mean = float(depths.mean())
    metrics = {"depth_mean": mean, "saved_compute": 1.0 - mean / loops}
    for t in range(1, loops + 1):
        metrics[f"depth_hist_{t}"] = float(np.mean(depths == t))
    return metrics
