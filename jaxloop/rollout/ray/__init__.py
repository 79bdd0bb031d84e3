"""Rollouts on Ray: engine actors, a manager actor that owns the producer, and the trainer's client.

    trainer process (JAX)                 Ray
    RayRolloutClient ──publish──> RolloutManager ──> engine actor 0 (JaxSamplerEngine | VLLMEngine)
                     ──produce──>  RolloutProducer ──> engine actor 1 ...
                                   EngineGroup (placement group, one bundle per engine)

- `EngineProcess` (an engine actor): one engine built from a picklable `EngineSpec` ('jax': the
  embedded sampler around a LoopedLM built from an HF config dict; 'vllm': `VLLMEngine(model_dir,
  ...)` booted from the config alone, on dummy weights). Policy publication is a transaction
  (jaxloop.rollout.publication): manifest, safetensors buckets, finish with count and digest,
  received as one `Publication` (ray/transport.py: buckets as Ray object refs or files, per
  `rollout.transport`). A refused publication raises PublicationError and the engine keeps
  serving its previous committed version.
- `EngineGroup` (inside the manager) implements the engine contract over N EngineActors: generate
  splits the requests into N contiguous parts (deterministic), gathers and reassembles them in
  order. An engine that dies (also mid-rollout), or does not answer its part within
  `generate_timeout_s` (`rollout.engine_timeout_s`: alive but hung), is killed, restarted in its
  placement-group bundle, receives the committed policy again (the manager keeps the committed
  chunks) and its part is regenerated: per-request seeds make the regenerated samples the same.
  A publication is bounded the same way (`publish_timeout_s`, `rollout.publish_timeout_s`): an
  engine that dies or hangs inside it is restarted on the committed policy and the publication is
  sent again; if that fails too (or an engine refuses), every engine not on the committed version
  is restarted on it: all engines serve one version, and every sample names the version of the
  engine that made it. Health checks are bounded by `health_timeout_s`. `stats()` reports
  `engine_restarts`. The committed version is the `ReplayChain` the client hands over with each
  publication: what a restarted engine replays.
- `RolloutManager`: holds the `RolloutProducer` (data cursor, seeds, rewards) whose engine is the
  group; produce / evaluate / state / restore run there.
- `RayRolloutClient`: what the trainer uses for `rollout.engine=vllm` / `ray_jax`. Starts a local
  Ray cluster or joins `rollout.ray_address`, writes the model's config for vLLM engines to boot
  from, and publishes policies (version 0 included: the weights leave the trainer only this way) as
  HF-named tensors (names from the family table), in buckets of `rollout.publish_bucket_mb`, through
  the object store or files (`rollout.transport`). It owns the policy version and the replay chain
  (it outlives managers and engines). A manager that dies (a call fails with RayActorError, not a
  task error) is replaced: a new manager and engines (the old placement group removed), restored to
  the data cursor of the last call that returned (so a produce(update) that failed regenerates
  exactly update's batch), handed the replay chain, and the call made once more; a second death is
  ManagerFailedError naming the update. `manager_restarts` joins `engine_restarts` (summed over the
  managers) in produce's stats.

The trainer process never imports torch or vLLM: vLLM is imported inside the engine actors only.
"""
