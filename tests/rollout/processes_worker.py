"""One of two jax.distributed processes (4 fake CPU devices each) for test_processes.py:
`python -m tests.rollout.processes_worker RANK COORDINATOR OUT_DIR`.

1. Publication staging of a policy sharded over both processes' 8 devices: process 0 stages it
   (gathering bucket by bucket), process 1 runs the same gathers; process 0 writes the hashes and
   the tensors' bytes digest it got, and those of the same parameters staged in one process
   (their host copy on one device).
2. LeaderChannel: a value computed on process 0 alone reaches process 1, and an error raised on
   process 0 is raised on process 1 as the same class and message.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402


def main(rank: int, coordinator: str, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=rank)
    import hashlib

    import numpy as np
    from flax import nnx

    from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
    from jaxloop.parallel.distributed import LeaderChannel
    from jaxloop.parallel.mesh import make_mesh, shard_model, to_host
    from jaxloop.rollout.api import EngineFailedError, Policy
    from jaxloop.rollout.publication.staging import HostStaging

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    cfg = LoopedConfig.from_hf_dict(
        tiny_hf_config("nanbeige", hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    )
    model = LoopedLM(cfg, rngs=nnx.Rngs(0))
    shard_model(model, make_mesh())  # fsdp over both processes' devices
    state = nnx.state(model)
    leaves = jax.tree.leaves(state)
    assert any(not x.is_fully_addressable for x in leaves)
    policy = Policy(state, 3, cfg)
    dtypes = {"model.embed_tokens.weight": "bfloat16"}  # one cast, as an engine may ask
    staging = HostStaging(bucket_bytes=16 << 10)  # several buckets
    result = {}
    if rank == 0:
        staged = staging.stage(policy, dtypes)
        result["buckets"] = staged.stats["stage_buckets"]
        result["hashes"] = {n: h.hex() for n, h in staged.hashes.items()}
        result["bytes"] = hashlib.sha256(
            b"".join(a.tobytes() for _, a in staged.tensors)
        ).hexdigest()
    else:
        staging.gather(policy, dtypes)
    # the one-process reference: the same parameters, gathered, on one local device
    host = jax.tree.map(lambda x: jax.device_put(to_host(x), jax.local_devices()[0]), state)
    if rank == 0:
        ref = HostStaging(bucket_bytes=16 << 10).stage(Policy(host, 3, cfg), dtypes)
        result["ref_hashes"] = {n: h.hex() for n, h in ref.hashes.items()}
        result["ref_bytes"] = hashlib.sha256(
            b"".join(a.tobytes() for _, a in ref.tensors)
        ).hexdigest()

    channel = LeaderChannel(poll_s=1.0)
    result["shared"] = channel.share("test/value", lambda: {"update": 7, "ids": [1, 2, 3]})

    def fail():
        raise EngineFailedError("engine 0: no node has room for its bundle")

    try:
        channel.share("test/error", fail)
    except EngineFailedError as err:
        result["error"] = [type(err).__name__, str(err)]
    with open(os.path.join(out, f"process{rank}.json"), "w") as f:
        json.dump(result, f)
    np.asarray(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
