"""Reliability of the Ray rollout side (JAX engine actors, no vLLM): the rollout manager actor
killed mid-run is replaced from the data cursor of the last committed call and the run goes on
with the same batches as an unkilled run; an engine killed in the middle of a publication ends,
with the others, on one version (the new one after its restart, or the old one when the restart
limit is spent), and every sample names the version that generated it.

Its own local Ray cluster and two engine actors (the helpers are test_ray_rollout's).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from jaxloop.rollout.api import EngineFailedError
from tests.rollout.test_ray_rollout import Bridge, assert_same_samples, strip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bridge():
    b = Bridge()
    yield b
    b.client.close()
    assert not ray.is_initialized()


def _kill_when(marker: Path, pid: int, timeout: float = 120.0) -> threading.Thread:
    """SIGKILL `pid` as soon as `marker` exists (a background thread; join it)."""
    failed: list[str] = []

    def run():
        start = time.perf_counter()
        while not marker.exists():
            if time.perf_counter() - start > timeout:
                failed.append(f"{marker.name} never appeared")
                return
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.failed = failed
    thread.start()
    return thread


def _versions(client) -> list[int]:
    return [h["version"] for h in client.health()]


def test_manager_killed_mid_produce_is_replaced_with_the_same_batches(bridge, tmp_path):
    client = bridge.client
    bridge.serve("B")
    served = bridge.next_version - 1
    cursor = client.state()
    eval_before = client.evaluate()
    unkilled = [client.produce(u) for u in (4, 5)]  # what an unkilled run gets
    cursor_after = client.state()
    assert all(stats["manager_restarts"] == 0.0 for _, stats in unkilled)
    engine_restarts = client.stats()["engine_restarts"]

    client.restore(cursor)
    manager_pid = ray.get(client.manager.info.remote())["pid"]
    ray.get(client.manager.set_debug.remote(1, generate_delay_s=120.0, marker_dir=str(tmp_path)))
    engine_pid = client.health()[1]["pid"]
    killer = _kill_when(tmp_path / f"generate-{engine_pid}", manager_pid)
    start = time.perf_counter()
    samples4, stats4 = client.produce(4)  # the manager dies while engine 1 generates its part
    elapsed = time.perf_counter() - start
    killer.join()
    assert not killer.failed, killer.failed
    samples5, stats5 = client.produce(5)
    print(f"\nmanager kill -> replaced and update regenerated in {elapsed:.1f}s")

    assert ray.get(client.manager.info.remote())["pid"] != manager_pid
    for (got, stats), (want, want_stats) in zip(
        [(samples4, stats4), (samples5, stats5)], unkilled, strict=True
    ):
        assert_same_samples(got, want)
        assert strip(stats) == strip(want_stats)
        assert stats["manager_restarts"] == 1.0
        assert stats["engine_restarts"] == engine_restarts  # no engine restart counted
        assert all(s.policy_version == served for s in got)
    assert client.state() == cursor_after
    assert client.stats()["manager_restarts"] == 1.0
    assert _versions(client) == [served, served]
    assert client.evaluate() == eval_before

    # killed while idle: the next call (a publication) replaces it; the run goes on
    os.kill(ray.get(client.manager.info.remote())["pid"], signal.SIGKILL)
    bridge.serve("A")
    assert client.version == served + 1 and _versions(client) == [served + 1, served + 1]
    client.restore(cursor)
    samples, stats = client.produce(4)
    assert stats["manager_restarts"] == 2.0
    assert_same_samples(samples, bridge.reference_produce("A", cursor, 4)[0])
    assert all(s.policy_version == served + 1 for s in samples)


def test_engine_killed_mid_publication_ends_on_the_new_version(bridge, tmp_path):
    """Engine 1 dies inside the transaction (begun, one bucket in): it is restarted on the
    committed policy and sent the publication again; both engines serve the new version."""
    client = bridge.client
    bridge.serve("A")
    cursor = client.state()
    restarts = client.stats()["engine_restarts"]
    pids = [h["pid"] for h in client.health()]
    ray.get(client.manager.set_debug.remote(1, publish_delay_s=120.0, marker_dir=str(tmp_path)))
    killer = _kill_when(tmp_path / f"publish-{pids[1]}", pids[1])
    bridge.serve("B")
    killer.join()
    assert not killer.failed, killer.failed
    served = bridge.next_version - 1
    assert client.version == served
    assert client.stats()["engine_restarts"] == restarts + 1
    health = client.health()
    assert [h["version"] for h in health] == [served, served]
    assert health[0]["pid"] == pids[0] and health[1]["pid"] != pids[1]
    client.restore(cursor)
    samples, _ = client.produce(5)
    assert_same_samples(samples, bridge.reference_produce("B", cursor, 5)[0])
    assert all(s.policy_version == served for s in samples)


def test_engine_killed_mid_publication_beyond_the_restart_limit_rolls_back(bridge, tmp_path):
    """With no restart allowed, engine 1's death fails the publication: engine 0, which
    committed the new version, is restarted on the old one; both serve the old version."""
    client = bridge.client
    bridge.serve("B")
    served = bridge.next_version - 1
    cursor = client.state()
    restarts = client.stats()["engine_restarts"]
    pids = [h["pid"] for h in client.health()]
    old_limit = ray.get(client.manager.set_restart_limit.remote(0))
    try:
        ray.get(client.manager.set_debug.remote(1, publish_delay_s=120.0, marker_dir=str(tmp_path)))
        killer = _kill_when(tmp_path / f"publish-{pids[1]}", pids[1])
        with pytest.raises(EngineFailedError, match="engine 1"):
            client.publish(bridge.policy("A", bridge.next_version))
        killer.join()
        assert not killer.failed, killer.failed
    finally:
        ray.get(client.manager.set_restart_limit.remote(old_limit))
    assert client.version == served
    assert client.stats()["engine_restarts"] == restarts + 1  # the death; the rollback is not
    health = client.health()
    assert [h["version"] for h in health] == [served, served]
    assert health[0]["pid"] != pids[0] and health[1]["pid"] != pids[1]
    client.restore(cursor)
    samples, _ = client.produce(5)
    assert_same_samples(samples, bridge.reference_produce("B", cursor, 5)[0])
    assert all(s.policy_version == served for s in samples)
    # the rolled-back engines take the next publication
    bridge.serve("A")
    assert _versions(client) == [served + 1, served + 1]
