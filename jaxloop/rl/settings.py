"""The learner's sections of the run's config: optim, offload, learner, critic, algo
(jaxloop.config composes the sections; each field's default, help, domain and resume policy are
declared here, once)."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from jaxloop.settings import FLOAT32_MAX, FREE, NON_NEGATIVE, Domain, count, knob, positive

# the choices of the string keys, declared once: the modules that implement them read these
KlEstimator = Literal["k1", "k2", "k3"]
Reduction = Literal["seq_mean_token_mean", "token_mean"]
# last: the loss of the last loop alone (the engine samples from it); the others weigh every loop
LoopCredit = Literal["last", "uniform", "progressive", "exit_pdf"]
LOOP_CREDITS: tuple[str, ...] = get_args(LoopCredit)


def _below_zero(value) -> bool:  # an older jaxloop's "off" (legacy_none)
    return value < 0


def _zero(value) -> bool:
    return value == 0


@dataclasses.dataclass(frozen=True)
class OptimSection:
    """the actor's optimizer"""

    name: Literal["adamw", "sgd"] = knob("adamw", "adamw | sgd (no momentum)")
    lr: float = knob(0.001, "actor learning rate (peak)", positive())
    schedule: Literal["constant", "cosine", "linear"] = knob(
        "constant", "constant | cosine | linear (over total_updates x updates_per_rollout)"
    )
    warmup_steps: int = knob(
        0,
        (
            "optimizer steps of a linear warm-up from 0 before the schedule (a run no longer "
            "than it is warm-up throughout)"
        ),
        count(0),
    )
    weight_decay: float = knob(0.0, "AdamW weight decay", NON_NEGATIVE)
    b1: float = knob(0.9, "Adam beta1", Domain(lo=0, hi=1, open_hi=True))
    b2: float = knob(0.99, "Adam beta2", Domain(lo=0, hi=1, open_hi=True))
    grad_clip: float | None = knob(
        1.0,
        "global gradient-norm clip of actor and critic (None: off)",
        positive(),
        legacy_none=_zero,
    )

    # 0 would stop after any update
    max_skipped_updates: int = knob(
        3,
        (
            "consecutive updates skipped for a non-finite loss or gradient norm before the run "
            "stops (exit 3)"
        ),
        count(1),
        resume=FREE,
    )


@dataclasses.dataclass(frozen=True)
class OffloadSection:
    """what rests in pinned host memory while the phase of an update at work does not use it"""

    critic: bool = knob(
        False,
        (
            "keep the critic and its optimizer state in pinned host memory outside the value "
            "and critic phases of an update"
        ),
        resume=FREE,
    )
    optimizer: bool = knob(
        False,
        (
            "keep the actor's optimizer state in pinned host memory outside the actor phase "
            "(during generation and the critic phase)"
        ),
        resume=FREE,
    )
    reference: bool = knob(
        False,
        "keep the reference policy in pinned host memory outside its log-prob phase",
        resume=FREE,
    )


@dataclasses.dataclass(frozen=True)
class LearnerSection:
    """how the learner lays out a batch for its forward and backward passes"""

    seq_multiple: int = knob(
        16,
        (
            "the learner's rows are the longest sample rounded up to a multiple of this (fewer "
            "distinct shapes to compile), at most the longest prompt + rollout.max_new_tokens"
        ),
        count(1),
        resume=FREE,
    )
    pack_tokens: int | None = knob(
        None,
        (
            "pack each micro-batch's samples into rows of this many tokens (>= "
            "data.max_prompt_tokens + rollout.max_new_tokens); None: pad every sample to the "
            "longest"
        ),
        count(1),
        legacy_none=_zero,
    )
    step_split: Literal["contiguous", "interleaved"] = knob(
        "contiguous",
        (
            "how a rollout batch is split over its updates_per_rollout optimizer steps: "
            "contiguous (each step whole groups, in order) | interleaved (sample i to step "
            "i mod steps: every step sees part of every group, as TRL's shuffled split does)"
        ),
    )


@dataclasses.dataclass(frozen=True)
class CriticSection:
    """the value model (ppo, dppo, flow_dppo)"""

    lr: float = knob(0.001, "critic learning rate (constant)", positive())
    steps_per_rollout: int = knob(1, "critic optimizer steps per rollout batch", count(1))

    # value loss = loss_scale * max((V_clip - R)^2, (V - R)^2)
    loss_scale: float = knob(
        1.0, "factor of the clipped squared value error (0.5: the 1/2 convention)", positive()
    )

    # the first N updates train only the critic (slime --num-critic-only-steps, verl
    # trainer.critic_warmup): the actor, its optimizer state and the policy version stay
    warmup_updates: int = knob(
        0,
        (
            "the first N updates train only the critic (actor, its optimizer state and the "
            "policy version unchanged; samples still generated); slime "
            "--num-critic-only-steps, verl trainer.critic_warmup"
        ),
        count(0),
    )


@dataclasses.dataclass(frozen=True)
class AlgoSection:
    """loss and advantage hyper-parameters"""

    clip_eps: float = knob(0.2, "PPO ratio clip (both sides unless clip_eps_high)", positive())
    clip_eps_high: float | None = knob(
        None,
        "upper ratio clip (clip-higher); None: clip_eps",
        positive(),
        legacy_none=_below_zero,
    )
    dual_clip: float | None = knob(
        None,
        "dual-clip bound (> 1) for negative advantages; None: off",
        Domain(lo=1, hi=FLOAT32_MAX, open_lo=True),
        legacy_none=_below_zero,
    )
    kl_coef: float = knob(
        0.0, "grpo: KL-to-reference loss coefficient (0: no reference model)", NON_NEGATIVE
    )
    kl_estimator: KlEstimator = knob("k3", "KL estimator: k1 | k2 | k3")
    behav_weight_min: float = knob(
        0.5, "dppo: lower clamp of the behaviour weight exp(prox - behav)", NON_NEGATIVE
    )
    behav_weight_max: float = knob(2.0, "dppo: upper clamp of the behaviour weight", positive())
    behav_drop_cap: float | None = knob(
        None,
        (
            "dppo: tokens whose behaviour weight exceeds it get weight 0 (instead of the "
            "clamp); None: off"
        ),
        positive(),
        legacy_none=_below_zero,
    )
    flow_delta: float = knob(
        0.01,
        "flow_dppo: trust region; tokens with D = KL(pi_old || pi) > delta are blocked",
        NON_NEGATIVE,
    )
    value_clip: float | None = knob(
        0.2,
        "critic: clip of the new values around the old ones; None: off",
        positive(),
        legacy_none=_below_zero,
    )
    gamma: float = knob(1.0, "GAE discount", count(0, 1))
    lam: float = knob(1.0, "GAE lambda (default 1.0: slime --lambd, verl)", count(0, 1))
    whiten_advantages: bool = knob(
        False, "whiten GAE advantages over the batch (default off: slime --normalize-advantages)"
    )
    grpo_use_std: bool = knob(True, "grpo: divide advantages by the group std (false: Dr.GRPO)")

    # per-loop credit: the policy loss is sum_t w_t loss_t over loop t's logits (last: the last
    # loop only)
    loop_credit: LoopCredit = knob(
        "last",
        (
            "policy loss over loops, sum_t w_t loss_t of loop t's logits: last (the last loop "
            "only) | uniform (w_t = 1/L) | progressive (w_t ~ t + 1) | exit_pdf (Ouro's exit "
            "distribution per token, no gradient through it; needs the exit gate)"
        ),
    )
    reduction: Reduction = knob(
        "seq_mean_token_mean", "loss reduction: seq_mean_token_mean | token_mean"
    )
    entropy_coef: float = knob(
        0.0,
        (
            "exploration bonus: entropy_coef x the policy's entropy is subtracted from every "
            "token's policy loss (>= 0; 0: off)"
        ),
        NON_NEGATIVE,
    )
    depth_as_action: bool = knob(
        False,
        (
            "rollout.early_exit=sample: add the exit choice's log-probability (the gate's log "
            "p at the exit loop) to the token's in every ratio, training the gate"
        ),
    )
