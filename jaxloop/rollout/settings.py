"""The rollout section of the run's config (jaxloop.config composes the sections; each field's
default, help, domain and resume policy are declared here, once)."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from jaxloop.rollout.types import EarlyExit
from jaxloop.settings import FREE, Domain, count, knob, positive

# the embedded sampler, and the engines that run as Ray actors (the "vllm:" keys apply to both)
Engine = Literal["jax", "ray_jax", "vllm"]
ENGINES: tuple[str, ...] = get_args(Engine)
RAY_ENGINES = ("ray_jax", "vllm")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # rollout.engine_log_level, any case


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """sampling engines (jax: embedded sampler; ray_jax / vllm: engine actors on Ray)"""

    engine: Engine = knob(
        "jax",
        (
            "jax (embedded KV-cache sampler, on the trainer's devices) | ray_jax (the same "
            "sampler in Ray engine actors) | vllm (vLLM engine actors on Ray)"
        ),
        resume=FREE,
    )
    temperature: float = knob(
        1.0, "sampling temperature (> 0); log-probs are of the tempered policy", positive()
    )

    # and 1 in training (validate)
    top_p: float = knob(1.0, "nucleus sampling threshold (1: off)", positive(1))

    # off in training (validate)
    top_k: int | None = knob(
        None, "top-k sampling (None: off)", count(1), legacy_none=lambda value: value == -1
    )

    # built-in task answers are one character
    max_new_tokens: int = knob(1, "response length limit in tokens", count(1))

    # early-exit rollouts (Ouro exit gate): each generated token stops at a loop chosen from the
    # gate's exit distribution; 'none': every token runs every loop
    early_exit: EarlyExit = knob(
        "none",
        (
            "Ouro (exit gate): none | threshold (a token exits at the first loop whose "
            "cumulative exit probability reaches exit_threshold) | sample (at a loop drawn "
            "from the gate's distribution); the prompt runs every loop, the trainer replays "
            "the depths; vllm engines run eagerly without prefix caching then"
        ),
    )
    exit_threshold: float = knob(
        0.5, "early_exit=threshold: cumulative exit probability in (0, 1]", positive(1)
    )

    # engine vs trainer selected log-prob bound; None: the engine's (default_logprob_diff)
    max_logprob_diff: float | None = knob(
        None,
        (
            "stop (exit 3) when engine and trainer log-probs differ by more; None: 1e-3 (jax, "
            "fp32) or 0.03 (vllm or bf16)"
        ),
        positive(),
        resume=FREE,
        legacy_none=lambda value: value == 0,
    )
    num_engines: int = knob(
        1, "vllm: engine actors (one placement-group bundle each)", count(1), resume=FREE
    )
    ray_address: str = knob(
        "", "vllm: join this Ray cluster (HOST:PORT); empty: start a local one", resume=FREE
    )
    publish_bucket_mb: int = knob(
        64, "vllm: policy publication bucket size in MB", count(1), resume=FREE
    )
    transport: Literal["object_store", "disk"] = knob(
        "object_store", "vllm: publication transport object_store | disk", resume=FREE
    )

    # or 'delta': only the tensors that changed since the last version; 'delta_xor': those as
    # compressed xor payloads over the last version (the trainer keeps one model copy on the host)
    publish: Literal["full", "delta", "delta_xor"] = knob(
        "full",
        (
            "vllm: full | delta (send only the tensors whose bytes changed since the engines' "
            "committed version; a refused delta is sent in full) | delta_xor (delta, each "
            "changed tensor sent as zlib(new xor committed bytes) where that is smaller; the "
            "trainer keeps the committed version's tensors: one more model copy in host "
            "memory)"
        ),
        resume=FREE,
    )

    # Ray engines: seconds an engine may take to answer its part of a generate call; one that does
    # not is killed, restarted with the committed policy and its part regenerated (health checks:
    # min(120, this))
    engine_timeout_s: float = knob(
        600.0,
        (
            "vllm: seconds an engine may take for its part of a generate call; past it, it is "
            "restarted and its part regenerated"
        ),
        positive(),
        resume=FREE,
    )
    publish_timeout_s: float = knob(
        600.0,
        (
            "vllm: seconds an engine may take for its part of a policy publication; past it, "
            "it is restarted with the committed policy and the publication resent"
        ),
        positive(),
        resume=FREE,
    )
    # a lost engine node whose bundle no other node can take would otherwise leave the restart
    # waiting for a node forever (Ray keeps the bundle pending)
    engine_placement_timeout_s: float = knob(
        300.0,
        (
            "vllm: seconds to wait for a node with room for an engine's bundle (at start, and "
            "after the engine's node is lost); past it the run stops with one line (exit 3) and "
            "resumes from its last checkpoint once a node is back"
        ),
        positive(),
        resume=FREE,
    )
    engine_log_level: str = knob(
        "WARNING",
        "vllm: log level in the engine actors: DEBUG | INFO | WARNING | ERROR",
        Domain(choices=LOG_LEVELS, any_case=True),
        resume=FREE,
    )

    # DAPO's dynamic sampling (jaxloop/rollout/dynamic_sampling.py); 0 keeps every drawn group
    dynamic_sampling_rounds: int = knob(
        0,
        (
            "dynamic sampling (DAPO): up to this many further prompt batches are drawn per "
            "update, and groups whose rewards are all equal give way to groups whose rewards "
            "differ (0: off; needs n_samples_per_prompt >= 2)"
        ),
        count(0, 64),
    )

    # batches generated ahead by up to this many policy versions while the learner trains
    # (0: synchronous; jaxloop/rollout/pipeline.py)
    max_staleness: int = knob(
        0,
        (
            "generate the batches of the next k updates while the learner trains (the batch of "
            "update u comes from the policy of update u-k; 0: synchronous)"
        ),
        count(0),
    )

    # Ray places each engine's bundle on a node that has these resources (a cluster marks its
    # engine nodes with a custom resource: `ray start --resources='{"engine_slot": 1}'`)
    engine_resources: str = knob(
        "",
        (
            "vllm: NAME=AMOUNT[,NAME=AMOUNT] custom Ray resources each engine actor requests, "
            "e.g. engine_slot=1 (the engines go to nodes that have them; needs "
            "rollout.ray_address); empty: any node with a free CPU / GPU"
        ),
        resume=FREE,
    )
