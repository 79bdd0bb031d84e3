"""The learner's sections of the run's config: optim, offload, learner, critic, algo
(jaxloop.config composes the sections; each field's default, help, domain and resume policy are
declared here, once)."""

from __future__ import annotations

import dataclasses

from jaxloop.settings import FREE, NON_NEGATIVE, Domain, count, knob, one_of, positive


@dataclasses.dataclass(frozen=True)
class OptimSection:
    """the actor's optimizer"""

    name: str = knob("adamw", "adamw | sgd (no momentum)", one_of("adamw", "sgd"))
    lr: float = knob(0.001, "actor learning rate (peak)", positive())
    schedule: str = knob(
        "constant",
        "constant | cosine | linear (over total_updates x updates_per_rollout)",
        one_of("constant", "cosine", "linear"),
    )
    warmup_steps: int = knob(0, "linear warm-up steps", count(0))
    weight_decay: float = knob(0.0, "AdamW weight decay", NON_NEGATIVE)
    b1: float = knob(0.9, "Adam beta1", Domain(lo=0, hi=1, open_hi=True))
    b2: float = knob(0.99, "Adam beta2", Domain(lo=0, hi=1, open_hi=True))
    grad_clip: float = knob(
        1.0, "global gradient-norm clip of actor and critic (0: off)", NON_NEGATIVE
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
    pack_tokens: int = knob(
        0,
        (
            "0: pad every sample to the longest; > 0: pack each micro-batch's samples into "
            "rows of this many tokens (>= data.max_prompt_tokens + rollout.max_new_tokens)"
        ),
        count(0),
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
    clip_eps_high: float = knob(
        -1.0, "upper ratio clip (clip-higher); <0: clip_eps", positive(off_below_zero=True)
    )
    dual_clip: float = knob(
        -1.0,
        "dual-clip bound (> 1) for negative advantages; <0: off",
        Domain(lo=1, hi=3.4028234663852886e38, open_lo=True, off_below_zero=True),
    )
    kl_coef: float = knob(
        0.0, "grpo: KL-to-reference loss coefficient (0: no reference model)", NON_NEGATIVE
    )
    kl_estimator: str = knob("k3", "KL estimator: k1 | k2 | k3", one_of("k1", "k2", "k3"))
    behav_weight_min: float = knob(
        0.5, "dppo: lower clamp of the behaviour weight exp(prox - behav)", NON_NEGATIVE
    )
    behav_weight_max: float = knob(2.0, "dppo: upper clamp of the behaviour weight", positive())
    behav_drop_cap: float = knob(
        -1.0,
        (
            "dppo: >0: tokens whose behaviour weight exceeds it get weight 0 (instead of the "
            "clamp); <0: off"
        ),
        positive(off_below_zero=True),
    )
    flow_delta: float = knob(
        0.01,
        "flow_dppo: trust region; tokens with D = KL(pi_old || pi) > delta are blocked",
        NON_NEGATIVE,
    )
    value_clip: float = knob(
        0.2,
        "critic: clip of the new values around the old ones; <0: off",
        positive(off_below_zero=True),
    )
    gamma: float = knob(1.0, "GAE discount", count(0, 1))
    lam: float = knob(1.0, "GAE lambda (default 1.0: slime --lambd, verl)", count(0, 1))
    whiten_advantages: bool = knob(
        False, "whiten GAE advantages over the batch (default off: slime --normalize-advantages)"
    )
    grpo_use_std: bool = knob(True, "grpo: divide advantages by the group std (false: Dr.GRPO)")

    # per-loop credit: the policy loss is sum_t w_t loss_t over loop t's logits (last: the last
    # loop only)
    loop_credit: str = knob(
        "last",
        (
            "policy loss over loops, sum_t w_t loss_t of loop t's logits: last (the last loop "
            "only) | uniform (w_t = 1/L) | progressive (w_t ~ t + 1) | exit_pdf (Ouro's exit "
            "distribution per token, no gradient through it; needs the exit gate)"
        ),
        one_of("last", "uniform", "progressive", "exit_pdf"),
    )
    reduction: str = knob(
        "seq_mean_token_mean",
        "loss reduction: seq_mean_token_mean | token_mean",
        one_of("seq_mean_token_mean", "token_mean"),
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
