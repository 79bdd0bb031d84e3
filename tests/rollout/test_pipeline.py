"""RolloutPipeline: which policy version generates which batch is a function of (update, k)."""

import json
import threading
import time

import pytest

from jaxloop.rollout.pipeline import RolloutPipeline
from jaxloop.rollout.types import Sample


class VersionedSource:
    """A rollout source whose samples record the version published when they were generated;
    generation takes a little time so a racy pipeline would see a newer version."""

    def __init__(self, fail_at: int | None = None):
        self.version = 0
        self.fail_at = fail_at
        self.threads: set[str] = set()

    def produce(self, update: int):
        generated_by = self.version
        self.threads.add(threading.current_thread().name)
        time.sleep(0.01)
        if update == self.fail_at:
            raise RuntimeError(f"engine failed at update {update}")
        sample = Sample(
            [1], [2], [-0.5], "stop", generated_by, seed=update, group_id=0, sample_index=0
        )
        return [sample], {"num_samples": 1.0}


def _run(pipeline, source, first, last):
    """The train loop's order: take, (train), join, publish the next version."""
    versions = {}
    for update in range(first, last):
        samples, _ = pipeline.take(update)
        versions[update] = samples[0].policy_version
        time.sleep(0.005)  # the learner
        pipeline.join()
        source.version = update + 1
    return versions


@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_batch_u_comes_from_the_policy_of_update_u_minus_k(k, background):
    source = VersionedSource()
    pipeline = RolloutPipeline(source, k, total_updates=8, background=background)
    pipeline.fill(0)
    versions = _run(pipeline, source, 0, 8)
    assert versions == {u: max(0, u - k) for u in range(8)}
    assert pipeline.state() == []  # nothing is generated past the last update
    if k and background:
        assert any(name.startswith("rollout-") for name in source.threads)
    else:
        assert source.threads == {threading.current_thread().name}


def test_state_restores_the_batches_generated_ahead():
    source = VersionedSource()
    straight = _run(_filled(source, k=2), source, 0, 6)

    source = VersionedSource()
    first = _filled(source, k=2)
    versions = _run(first, source, 0, 3)
    saved = json.loads(json.dumps(first.state()))  # as the checkpoint stores it
    assert [b["update"] for b in saved] == [3, 4]
    source_after = VersionedSource()
    source_after.version = 3  # the restored policy
    second = RolloutPipeline(source_after, 2, total_updates=6)
    second.restore(saved)
    second.fill(3)  # has both batches already: generates nothing
    versions.update(_run(second, source_after, 3, 6))
    assert versions == straight


def _filled(source, k):
    pipeline = RolloutPipeline(source, k, total_updates=6)
    pipeline.fill(0)
    return pipeline


def test_a_failed_generation_raises_in_the_learner_thread():
    source = VersionedSource(fail_at=2)
    pipeline = RolloutPipeline(source, 1, total_updates=4)
    pipeline.fill(0)
    pipeline.take(0)
    pipeline.join()
    pipeline.take(1)  # starts update 2's batch, which fails
    with pytest.raises(RuntimeError, match="engine failed at update 2"):
        pipeline.join()


def test_timings_count_engine_and_wait_seconds():
    source = VersionedSource()
    pipeline = RolloutPipeline(source, 0, total_updates=2)
    pipeline.take(0)
    engine, wait = pipeline.take_timings()
    assert engine >= 0.01 and wait >= 0.01  # synchronous: the learner waits for every batch
    assert pipeline.take_timings() == (0.0, 0.0)
