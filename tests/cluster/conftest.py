"""A multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`): a head and three
worker nodes, each its own raylet with one CPU and a custom resource standing in for GPUs
(`trainer_slot` on two nodes, `engine_slot` on the third). Module scope: one cluster per test
module, removed node by node at the end."""

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.train.conftest import env  # noqa: F401 - the trainer subprocesses' environment

# Ray's floor is 75 MiB; the launch tests put nothing in the object store.
OBJECT_STORE_BYTES = 80 * 1024 * 1024
# A node that stops answering is declared dead after ~3 s instead of Ray's ~30 s default (a
# removed node's actors only fail once the head declares the node dead).
HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
TRAINER_NODE = {"num_cpus": 1, "resources": {"trainer_slot": 1}}
ENGINE_NODE = {"num_cpus": 1, "resources": {"engine_slot": 1}}
REPO = str(Path(__file__).resolve().parents[2])


@dataclass
class SimulatedCluster:
    cluster: object  # ray.cluster_utils.Cluster
    trainer_nodes: list = field(default_factory=list)
    engine_node: object = None
    startup_s: float = 0.0

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_trainer_node(self):
        node = self.cluster.add_node(object_store_memory=OBJECT_STORE_BYTES, **TRAINER_NODE)
        self.trainer_nodes.append(node)
        return node

    def add_engine_node(self):
        """Another node with an engine_slot (the fixture's own is `engine_node`)."""
        return self.cluster.add_node(object_store_memory=OBJECT_STORE_BYTES, **ENGINE_NODE)

    def remove_node(self, node) -> None:
        """The node's raylet and every process on it SIGKILLed, as when a machine is lost."""
        self.cluster.remove_node(node, allow_graceful=False)
        if node in self.trainer_nodes:
            self.trainer_nodes.remove(node)

    def node(self, node_id: str):
        return next(n for n in self.trainer_nodes if n.node_id == node_id)


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    # the raylets (and so every worker and trainer process) import this checkout's tests package
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, saved]))
    start = time.perf_counter()
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "object_store_memory": OBJECT_STORE_BYTES,
                "include_dashboard": False,
                "_system_config": HEALTH_CHECKS,
            },
        )
        sim = SimulatedCluster(cluster)
        try:
            for _ in range(2):
                sim.add_trainer_node()
            sim.engine_node = cluster.add_node(
                object_store_memory=OBJECT_STORE_BYTES, **ENGINE_NODE
            )
            cluster.wait_for_nodes()
        except BaseException:
            cluster.shutdown()
            raise
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    sim.startup_s = time.perf_counter() - start
    print(f"\nsimulated Ray cluster: head + 3 worker nodes up in {sim.startup_s:.1f} s")
    try:
        yield sim
    finally:
        cluster.shutdown()
