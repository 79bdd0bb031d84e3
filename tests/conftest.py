"""Shared test settings: 8 fake CPU devices (for the sharding tests), tiny configs, vLLM env,
one persistent XLA compilation cache for the whole session (every trainer subprocess of the same
shapes reuses the programs an earlier one compiled; results are the same executables), and the
xdist groups that `pytest -n` distributes: one group per test module, and every real-engine test
(`slow`: vLLM, Ray) in the "real-engines" group, so its engines run one at a time; a module that
starts a Ray cluster of its own names its group (`ENGINE_GROUP`: the simulated multi-node cluster
and the trainer-through-vLLM runs each run beside the real-engines group; every test cluster is
private, RAY_ADDRESS=local). A
slow module without engines (long trainer runs) says `USES_REAL_ENGINES = False` and keeps its own
group, so it runs beside the engine tests instead of after them."""

import atexit
import os
import shutil
import tempfile

import pytest

from tests.xla import SESSION_FLAGS

# Must be set before jax initialises its backends (tests/xla.py says why these flags).
os.environ.setdefault("XLA_FLAGS", SESSION_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Every Ray cluster a test starts without an address is its own (Ray's default joins the last one
# started on this machine), so the two Ray groups below can run at once.
os.environ.setdefault("RAY_ADDRESS", "local")
# Ray runs its workers (engine actors, launched trainer processes) at nice 15: beside two busy
# xdist workers they got almost no CPU (a launch on the simulated cluster took 549 s in CI, ~70 s
# alone). Tests give them the priority of everything else.
os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One compilation cache for the session: made by the first process (the xdist controller, or a
# plain pytest run), inherited by xdist workers and every subprocess, removed by its maker.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="jaxloop-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    _owner = os.getpid()
    atexit.register(lambda: os.getpid() == _owner and shutil.rmtree(_cache_dir, True))


# Rough seconds per xdist group (from a full run's junit times): the groups are handed out longest
# first (pyproject passes --no-loadscope-reorder, so xdist keeps this order), so the serial
# real-engine group starts at once and the short modules fill in at the end. A group not listed
# counts as short; the order only changes when tests run, not what they check.
GROUP_SECONDS = {
    "train-vllm": 740,
    "ray-cluster": 520,
    "real-engines": 550,
    "tests.train.test_learning": 420,  # four 150-update runs
    "tests.train.test_resume": 260,
    "tests.train.test_mesh": 250,
    "tests.rl.test_learner": 240,
    "tests.train.test_chaos": 200,
    "tests.train.test_cli": 180,
    "tests.train.test_sft_train": 240,
    "tests.rl.test_loop_credit": 120,
    "tests.train.test_samples": 85,
    "tests.train.test_write_refusals": 90,
    "tests.train.test_resume_step": 80,
    "tests.train.test_soak": 60,
    "tests.io.test_orbax_leaks": 25,
    "tests.test_bad_inputs": 120,
    "tests.rl.test_packing": 110,
    "tests.test_e2e_official": 80,
    "tests.test_worked_example": 70,
    "tests.rollout.test_jax_sampler": 60,
    "tests.conversion.test_conversion": 50,
    "tests.train.test_early_exit_train": 45,
}


def _with_group_suffix(item, group: str) -> None:
    """What xdist's loadgroup does to a node id ("<id>@<group>": its scheduler groups by the
    suffix). xdist 3.8 writes `item._nodeid`, which pytest >= 9 no longer reads (the id lives in
    `item._id`), so without this every test is a group of its own: two real-engine tests would run
    at once and a module's fixtures would be set up on both workers."""
    from _pytest.nodeid import NodeId

    node = item._id
    if not node.names or item.nodeid.endswith(f"@{group}"):
        return
    last = node.names[-1] + ("" if node.params is None else f"[{node.params}]")
    # the params go into the last name, so the id reads "<path>::<name>[<params>]@<group>"
    item._id = NodeId(path=node.path, names=(*node.names[:-1], f"{last}@{group}"))


@pytest.hookimpl(tryfirst=True)  # before xdist's hook, which reads the markers set here
def pytest_collection_modifyitems(config, items):
    groups = {}
    for item in items:
        engines = item.get_closest_marker("slow") and getattr(
            item.module, "USES_REAL_ENGINES", True
        )
        # a module may name its engine group (ENGINE_GROUP): groups run at once, their tests not
        group = getattr(item.module, "ENGINE_GROUP", "real-engines") if engines else None
        group = group or item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
        groups[item] = group
        if config.getoption("loadgroup", default=False):  # an xdist worker under loadgroup
            _with_group_suffix(item, group)
    # stable: each module's tests keep their order
    items.sort(key=lambda item: -GROUP_SECONDS.get(groups[item], 0))
