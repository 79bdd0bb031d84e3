"""Ray rollouts (jaxloop.rollout.ray) with JAX engine actors (no vLLM needed): bitwise parity with
the in-process producer, transactional publication through the bridge, and engine restarts (an
engine killed mid-rollout, or hung past the group's timeout).

Bitwise parity holds when the in-process batch and each engine's part pad to the same batch
shape (the JAX sampler pads batches to multiples of 8); otherwise tokens are equal and log-probs
agree to ~1 ulp (XLA CPU rounds differently at another batch shape).

One local Ray cluster for the module (started by the module's RayRolloutClient, i.e. the
default `ray.init()` path), two engine actors. The reference is the in-process RolloutProducer
around a JaxSamplerEngine of the same weights, driven with the same seeds and data cursor.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from flax import nnx

from jaxloop.config import base_config, run_config
from jaxloop.rollout.api import Policy, PublicationError
from jaxloop.rollout.jax_sampler import JaxSamplerEngine
from jaxloop.rollout.producer import RolloutProducer
from jaxloop.rollout.publication.transaction import (
    Manifest,
    make_chunks,
    serialize_tensors,
    tensor_hashes,
)
from jaxloop.rollout.ray.group import split_evenly
from jaxloop.train.build import build_actor
from jaxloop.train.setup import actor_seed, producer_settings
from tests.rollout.ray_debug import debug_client, hf_tensors

pytestmark = pytest.mark.slow

TIMINGS: dict[str, float] = {}


def _cfg(seed: int = 0):
    cfg = base_config()
    cfg.seed = seed
    cfg.model.hidden_size = 32
    cfg.model.intermediate_size = 64
    cfg.model.num_layers = 1
    cfg.model.head_dim = 16
    # 8 requests: the in-process engine runs one batch of 8, each engine actor 4 padded to 8.
    # (The JAX sampler's log-probs are bitwise a function of the row *and* the padded batch
    # shape: XLA CPU rounds differently at batch 16 vs 8, by ~1 ulp; see the 12-request check.)
    cfg.prompts_per_update = 4
    cfg.n_samples_per_prompt = 2
    cfg.rollout.max_new_tokens = 4
    cfg.rollout.num_engines = 2
    cfg.eval_prompts = 6
    cfg.data.reward = "tests.train.rewards:char_code_reward"  # imported inside the manager
    return cfg


class Bridge:
    def __init__(self):
        cfg = _cfg()
        self.actor = build_actor(cfg, actor_seed(cfg))
        self.settings = producer_settings(cfg, requires_groups=True)
        self.policies = {
            "A": nnx.split(self.actor)[1],
            "B": nnx.split(build_actor(_cfg(seed=1), actor_seed(_cfg(seed=1))))[1],
        }
        start = time.perf_counter()
        # rollout.engine 'jax': the embedded sampler in the engine actors (no vLLM)
        self.client = debug_client(run_config(cfg).rollout, self.actor.config, self.settings)
        self.client.bucket_bytes = 16 << 10  # several buckets per publication of this tiny model
        TIMINGS["client_start_s"] = time.perf_counter() - start
        TIMINGS.update({k: v for k, v in self.client.timings.items()})
        self.next_version = 0
        self.serving: str | None = None
        self.refs: dict[str, RolloutProducer] = {}

    def policy(self, which: str, version: int = 0) -> Policy:
        return Policy(self.policies[which], version, self.actor.config)

    def serve(self, which: str):
        """Publish policy `which` as the next version; returns its PublishStats."""
        stats = self.client.publish(self.policy(which, self.next_version))
        self.next_version += 1
        self.serving = which
        return stats

    def reference(self, which: str) -> RolloutProducer:
        """An in-process producer serving policy `which` (its own data cursor)."""
        if which not in self.refs:
            producer = RolloutProducer(
                self.settings, JaxSamplerEngine(build_actor(_cfg(), actor_seed(_cfg())))
            )
            producer.publish(self.policy(which))
            self.refs[which] = producer
        return self.refs[which]

    def reference_produce(self, which: str, cursor: dict, update: int):
        ref = self.reference(which)
        ref.restore(cursor)
        return ref.produce(update)


@pytest.fixture(scope="module")
def bridge():
    b = Bridge()
    yield b
    b.client.close()
    assert not ray.is_initialized()  # the client shut down the cluster it started
    print("\nray bridge timings:", {k: float(f"{v:.3g}") for k, v in TIMINGS.items()})


def assert_same_samples(got, want):
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert g.response_ids == w.response_ids
        assert np.asarray(g.response_logprobs, np.float32).tobytes() == (
            np.asarray(w.response_logprobs, np.float32).tobytes()
        )
        assert (g.prompt_ids, g.seed, g.group_id, g.sample_index) == (
            w.prompt_ids,
            w.seed,
            w.group_id,
            w.sample_index,
        )
        assert (g.finish_reason, g.reward, g.response_text, g.label) == (
            w.finish_reason,
            w.reward,
            w.response_text,
            w.label,
        )


def strip(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k not in ("engine_restarts", "manager_restarts")}


def test_driver_imports_neither_torch_nor_vllm():
    code = (
        "import sys, jaxloop.train.cli, jaxloop.rollout.ray.client; "
        "bad = [m for m in ('torch', 'vllm') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_split_evenly():
    assert split_evenly(12, 2) == [(0, 6), (6, 12)]
    assert split_evenly(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert split_evenly(1, 2) == [(0, 1), (1, 1)]


def test_bridge_matches_in_process_producer(bridge, tmp_path):
    client = bridge.client
    stats = bridge.serve("A")
    assert stats.num_tensors == len(client.expected) and stats.num_bytes > 0
    TIMINGS["publish_s"] = stats.seconds
    # both engines generate a part of the batch
    for i in range(2):
        ray.get(client.manager.set_debug.remote(i, marker_dir=str(tmp_path)))
    for update in (0, 1):
        cursor = client.state()
        samples, stats = client.produce(update)
        want, want_stats = bridge.reference_produce("A", cursor, update)
        assert_same_samples(samples, want)
        assert strip(stats) == want_stats and stats["engine_restarts"] == 0.0
        assert all(s.policy_version == bridge.next_version - 1 for s in samples)
        assert len({s.group_id for s in samples}) == 4 and stats["reward_std"] > 0
    markers = sorted(p.read_text() for p in tmp_path.glob("generate-*"))
    assert markers == ["4", "4"]  # two engine processes, four requests each
    for i in range(2):
        ray.get(client.manager.set_debug.remote(i))
    assert client.evaluate() == bridge.reference("A").evaluate()
    # the data cursor lives in the manager and round-trips
    cursor = client.state()
    client.restore(cursor)
    assert client.state() == cursor == bridge.reference("A").state()
    # 12 requests: in-process batch 16, engine parts 6 + 6 (batch 8 each): the same tokens, and
    # log-probs equal up to XLA's batch-shape-dependent rounding (fp32, 1e-6 absolute)
    ref = bridge.reference("A")
    requests = ref.requests(9)[:8] + ref.requests(10)[:4]
    got = ray.get(client.manager.generate.remote(requests, ref.sampling))
    want = ref.engine.generate(requests, ref.sampling)
    assert [g.response_ids for g in got] == [w.response_ids for w in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.response_logprobs, w.response_logprobs, rtol=0, atol=1e-6)
        assert (g.seed, g.sample_index) == (w.seed, w.sample_index)


def _versions(client) -> list[int]:
    return [h["version"] for h in client.health()]


def _refused(client, manifest, chunks, match, **kw):
    with pytest.raises(PublicationError, match=match):
        client.send(dataclasses.replace(client.stage(manifest, chunks), **kw))


def test_publication_through_bridge_and_refusals(bridge):
    client = bridge.client
    bridge.serve("A")
    cursor = client.state()
    on_a, _ = client.produce(5)
    bridge.serve("B")
    served = bridge.next_version - 1
    assert _versions(client) == [served, served]
    client.restore(cursor)
    on_b, _ = client.produce(5)
    assert_same_samples(on_b, bridge.reference_produce("B", cursor, 5)[0])
    # the comparison has power: the two policies sample differently
    assert [s.response_ids for s in on_a] != [s.response_ids for s in on_b]

    tensors = hf_tensors(client, bridge.policy("A"))
    version = bridge.next_version
    manifest = Manifest.build(version, tensors)
    chunks = make_chunks(tensors, client.bucket_bytes)
    assert len(chunks) > 1
    # wrong digest at finish
    _refused(client, manifest, chunks, "digest differs", digest="0" * 64)
    # a byte of one tensor changed in transit: the digest of what arrived differs
    name, arr = tensors[3]
    bad = arr.copy()
    bad.reshape(-1)[0] += 1.0
    tampered = [serialize_tensors([(n, bad if n == name else a) for n, a in tensors])]
    _refused(client, manifest, tampered, "digest mismatch")
    # a tensor missing from the chunks, and one missing from the manifest
    _refused(client, manifest, make_chunks(tensors[1:], client.bucket_bytes), "received|missing")
    short = Manifest.build(version, tensors[1:])
    _refused(client, short, make_chunks(tensors[1:], client.bucket_bytes), "missing tensor")
    # a tensor of the wrong shape, and a stale version
    wrong = [(n, a[:1] if n == name else a) for n, a in tensors]
    _refused(client, Manifest.build(version, wrong), make_chunks(wrong, 1 << 20), "shape")
    stale = Manifest.build(served, tensors)
    _refused(client, stale, make_chunks(tensors, 1 << 20), "not newer")

    # every engine still serves B at the old version
    assert _versions(client) == [served, served]
    assert client.version == served
    client.restore(cursor)
    again, stats = client.produce(5)
    assert_same_samples(again, on_b)
    assert all(s.policy_version == served for s in again)
    assert stats["engine_restarts"] == 0.0

    # and the receivers are not stuck: the next good publication (through files) commits
    client.transport = "disk"
    try:
        bridge.serve("A")
    finally:
        client.transport = "object_store"
    assert _versions(client) == [version, version]
    client.restore(cursor)
    assert_same_samples(client.produce(5)[0], on_a)


def test_engine_killed_mid_rollout_is_restarted(bridge, tmp_path):
    client = bridge.client
    bridge.serve("B")
    served = bridge.next_version - 1
    cursor = client.state()
    undisturbed, stats0 = client.produce(7)
    restarts = client.stats()["engine_restarts"]

    client.restore(cursor)
    ray.get(client.manager.set_debug.remote(1, generate_delay_s=120.0, marker_dir=str(tmp_path)))
    pid = client.health()[1]["pid"]
    start = time.perf_counter()
    pending = client.manager.produce.remote(7)
    marker = tmp_path / f"generate-{pid}"
    while not marker.exists():  # engine 1 has started generating its part
        assert time.perf_counter() - start < 120, "engine 1 never started generating"
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    samples, stats = ray.get(pending)
    TIMINGS["restart_and_regenerate_s"] = time.perf_counter() - start
    assert stats["engine_restarts"] == restarts + 1 == client.stats()["engine_restarts"]
    assert_same_samples(samples, undisturbed)
    assert strip(stats) == strip(stats0)
    health = client.health()
    assert health[1]["pid"] != pid and health[0]["pid"] != pid
    assert [h["version"] for h in health] == [served, served]
    assert all(s.policy_version == served for s in samples)
    # the restarted engine takes later publications like the others
    bridge.serve("A")
    assert _versions(client) == [served + 1, served + 1]


def test_hung_engine_is_killed_and_restarted(bridge, tmp_path):
    """An engine alive but stuck in generate (or in a health check) past the group's timeout is
    treated like a dead one: killed, restarted with the committed policy, its part regenerated."""
    client = bridge.client
    bridge.serve("A")
    served = bridge.next_version - 1
    cursor = client.state()
    undisturbed, stats0 = client.produce(3)
    restarts = client.stats()["engine_restarts"]
    pid = client.health()[1]["pid"]
    # well above a fresh engine's first generate (~1.5 s with its compile), far below the hang
    timeout = 15.0
    old = ray.get(client.manager.set_timeouts.remote(generate_s=timeout, health_s=5.0))
    try:
        client.restore(cursor)
        ray.get(
            client.manager.set_debug.remote(1, generate_delay_s=600.0, marker_dir=str(tmp_path))
        )
        start = time.perf_counter()
        samples, stats = client.produce(3)
        elapsed = time.perf_counter() - start
        TIMINGS["hung_generate_restart_and_regenerate_s"] = elapsed
        assert (tmp_path / f"generate-{pid}").read_text() == "4"  # engine 1 hung in its part
        assert timeout <= elapsed < timeout + 60  # it waited for the timeout, not for the hang
        assert stats["engine_restarts"] == restarts + 1 == client.stats()["engine_restarts"]
        assert_same_samples(samples, undisturbed)
        assert strip(stats) == strip(stats0)
        health = client.health()
        assert health[1]["pid"] != pid and not any(h["restarted"] for h in health)
        assert [h["version"] for h in health] == [served, served]
        assert all(s.policy_version == served for s in samples)

        # a health check that hangs: engine 0 is replaced, engine 1 left alone
        pid0 = health[0]["pid"]
        ray.get(client.manager.set_debug.remote(0, health_delay_s=600.0))
        start = time.perf_counter()
        health = client.health()
        TIMINGS["hung_health_restart_s"] = time.perf_counter() - start
        assert [h["restarted"] for h in health] == [True, False]
        assert health[0]["pid"] != pid0 and health[1]["pid"] != pid
        assert [h["version"] for h in health] == [served, served]
        assert client.stats()["engine_restarts"] == restarts + 2

        # the replaced engines serve the same samples, with no further restarts
        client.restore(cursor)
        again, stats = client.produce(3)
        assert_same_samples(again, undisturbed)
        assert stats["engine_restarts"] == restarts + 2
    finally:
        ray.get(client.manager.set_timeouts.remote(**old))


def test_hung_publication_is_killed_and_restarted(bridge):
    """An engine alive but stuck inside a publication past the group's publish timeout
    (rollout.publish_timeout_s) is handled like a dead one: killed, restarted on the committed
    policy, the publication sent again; it commits on every engine and the run goes on."""
    client = bridge.client
    bridge.serve("A")
    cursor = client.state()
    restarts = client.stats()["engine_restarts"]
    pid = client.health()[1]["pid"]
    timeout = 15.0  # far above a publication of this model (~0.1 s), far below the hang
    old = ray.get(client.manager.set_timeouts.remote(publish_s=timeout))
    try:
        ray.get(client.manager.set_debug.remote(1, publish_delay_s=600.0))
        start = time.perf_counter()
        bridge.serve("B")
        elapsed = time.perf_counter() - start
        TIMINGS["hung_publish_restart_s"] = elapsed
        served = bridge.next_version - 1
        assert timeout <= elapsed < timeout + 60  # it waited for the timeout, not for the hang
        assert client.stats()["engine_restarts"] == restarts + 1
        assert client.version == served
        health = client.health()
        assert health[1]["pid"] != pid and not any(h["restarted"] for h in health)
        assert [h["version"] for h in health] == [served, served]
        client.restore(cursor)
        samples, _ = client.produce(5)
        assert_same_samples(samples, bridge.reference_produce("B", cursor, 5)[0])
        assert all(s.policy_version == served for s in samples)
    finally:
        ray.get(client.manager.set_timeouts.remote(**old))


def test_publish_bandwidth_is_reported(bridge):
    stats = bridge.serve("B")
    assert stats.num_bytes == sum(
        a.nbytes for _, a in hf_tensors(bridge.client, bridge.policy("B"))
    )
    assert stats.seconds > 0 and stats.gb_per_s == pytest.approx(
        stats.num_bytes / stats.seconds / 1e9
    )
    assert bridge.client.last_publish == stats
    TIMINGS["publish_gb_per_s"] = stats.gb_per_s
    assert dataclasses.asdict(stats)["version"] == bridge.next_version - 1


def _altered(bridge, which: str, scale: dict[str, float]):
    """Policy `which` with the parameters named in `scale` multiplied (the others untouched)."""
    model = build_actor(_cfg(), actor_seed(_cfg()))
    nnx.update(model, bridge.policies[which])  # its values (immutable arrays), not its Variables
    for path, factor in scale.items():
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part)
        obj[...] = obj[...] * factor
    return nnx.split(model)[1]


def test_delta_publication(bridge, tmp_path):
    """rollout.publish=delta through the engines: each version ships only the changed tensors,
    the engines serve it bit-exactly (the same samples as an in-process engine given the whole
    policy), an engine restarted after deltas replays them; a delta built on a wrong base is
    refused and published in full; a refused delta leaves the old version serving."""
    client = bridge.client
    client.publish_mode = "delta"
    try:
        first = bridge.serve("A")  # no retained base yet: in full
        assert first.sent_bytes == first.num_bytes and not first.fell_back
        bridge.policies["C"] = _altered(bridge, "A", {"lm_head": 1.5})
        bridge.policies["D"] = _altered(bridge, "C", {"final_norm": 0.5, "blocks.o_proj": 2.0})
        cursor = client.state()
        seen = {}
        for which in ("C", "D"):
            stats = bridge.serve(which)
            assert 0 < stats.sent_bytes < stats.num_bytes and not stats.fell_back
            TIMINGS[f"delta_{which}_sent_fraction"] = stats.sent_bytes / stats.num_bytes
            client.restore(cursor)
            seen[which], _ = client.produce(6)
            assert_same_samples(seen[which], bridge.reference_produce(which, cursor, 6)[0])
        assert [s.response_ids for s in seen["C"]] != [s.response_ids for s in seen["D"]]
        served = bridge.next_version - 1

        # an engine killed after the deltas comes back on the same version (full + deltas)
        pid = client.health()[1]["pid"]
        os.kill(pid, signal.SIGKILL)
        health = client.health()
        assert health[1]["restarted"] and [h["version"] for h in health] == [served, served]
        client.restore(cursor)
        assert_same_samples(client.produce(6)[0], seen["D"])

        # a refused delta (over a version the engines do not serve): D keeps serving
        tensors = hf_tensors(client, bridge.policy("A"))
        names = [n for n, _ in tensors]
        bad = Manifest.build(served + 1, tensors, base_version=served - 1, sent=names[:1])
        _refused(client, bad, make_chunks(tensors[:1], 1 << 20), "delta over version")
        assert client.version == served and _versions(client) == [served, served]
        client.restore(cursor)
        assert_same_samples(client.produce(6)[0], seen["D"])

        # the publisher's record of the base is wrong (lm_head "unchanged" since A): the engines'
        # reconstruction fails its digest, and the version is published in full
        client._hashes["lm_head.weight"] = tensor_hashes(tensors)["lm_head.weight"]
        fallbacks = client.publish_fallbacks
        stats = bridge.serve("A")
        assert stats.fell_back and client.publish_fallbacks == fallbacks + 1
        assert stats.num_bytes < stats.sent_bytes < 2 * stats.num_bytes
        assert _versions(client) == [served + 1, served + 1]
        client.restore(cursor)
        assert_same_samples(client.produce(6)[0], bridge.reference_produce("A", cursor, 6)[0])
    finally:
        client.publish_mode = "full"


def test_xor_delta_publication(bridge):
    """rollout.publish=delta_xor through the engines: changed tensors travel as compressed xor
    payloads over the committed version (an exponent-only change compresses to almost nothing);
    a delta that would bring the replay chain above one model's bytes is still sent as a delta,
    with a full publication of its version staged as the chain's new start; the engines serve it
    bit-exactly, and an engine killed afterwards comes back on it from the staged publication."""
    client = bridge.client
    client.publish_mode = "delta_xor"
    # whatever the module's earlier tests left committed, start from a full publication: the
    # client forgets its record of the engines' tensors (a delta needs one)
    client._hashes = None
    try:
        first = bridge.serve("A")
        assert first.sent_bytes == first.num_bytes and client._base_tensors is not None
        bridge.policies["E"] = _altered(bridge, "A", {"blocks.o_proj": 2.0, "lm_head": 1.5})
        stats = bridge.serve("E")
        delta = client.chain[-1].manifest
        assert delta.base_version == first.version and "lm_head.weight" in delta.sent
        assert delta.xor and any("o_proj" in n for n in delta.xor)
        raw = sum(a.nbytes for n, a in hf_tensors(client, bridge.policy("E")) if n in delta.sent)
        assert stats.sent_bytes == delta.sent_bytes < raw and not stats.fell_back
        TIMINGS["xor_delta_sent_of_changed"] = stats.sent_bytes / raw

        # more deltas until the chain's deltas would pass one model: then a rebase
        scale = {"embed": 1.5, "blocks.q_proj": 1.5, "blocks.up_proj": 1.5, "lm_head": 0.75}
        chained = delta.sent_bytes
        for step in range(8):
            bridge.policies["F"] = _altered(bridge, "E" if step == 0 else "F", scale)
            stats = bridge.serve("F")
            assert stats.sent_bytes < stats.num_bytes and not stats.fell_back
            chained += stats.sent_bytes
            if chained > stats.num_bytes:
                break
        assert chained > stats.num_bytes, chained
        staged = client.chain[0].manifest  # the rebased chain: F in full
        assert len(client.chain) == 1 and staged.version == stats.version
        assert staged.base_version is None and staged.retain
        cursor = client.state()
        want = bridge.reference_produce("F", cursor, 6)[0]
        client.restore(cursor)
        assert_same_samples(client.produce(6)[0], want)

        os.kill(client.health()[0]["pid"], signal.SIGKILL)
        health = client.health()
        assert health[0]["restarted"] and [h["version"] for h in health] == [stats.version] * 2
        client.restore(cursor)
        assert_same_samples(client.produce(6)[0], want)
    finally:
        client.publish_mode = "full"


# ---- a vLLM engine actor behind the same bridge ----------------------------------------------
class VLLMBridge:
    """One vLLM engine actor (head_dim 32) in the module's cluster (joined, not started)."""

    def __init__(self):
        cfg = _cfg()
        cfg.model.hidden_size = 64
        cfg.model.head_dim = 32
        cfg.rollout.engine = "vllm"
        cfg.rollout.num_engines = 1
        cfg_b = _cfg_seed(cfg, 1)
        self.models = {
            "A": build_actor(cfg, actor_seed(cfg)),
            "B": build_actor(cfg_b, actor_seed(cfg_b)),
        }
        for model in self.models.values():  # sharpen: the default init gives ~uniform log-probs
            for name, scale in (("q_proj", 8.0), ("k_proj", 8.0), ("v_proj", 4.0)):
                param = getattr(model.blocks, name)
                param[...] = param[...] * scale
            model.lm_head[...] = model.lm_head[...] * 40.0
        self.policies = {k: nnx.split(m)[1] for k, m in self.models.items()}
        self.settings = producer_settings(cfg, requires_groups=True)
        start = time.perf_counter()
        self.client = debug_client(run_config(cfg).rollout, self.models["A"].config, self.settings)
        TIMINGS["vllm_client_start_s"] = time.perf_counter() - start
        TIMINGS["vllm_engine_start_s"] = self.client.timings["engine_start_s"]

    def policy(self, which: str, version: int = 0) -> Policy:
        return Policy(self.policies[which], version, self.models[which].config)


def _cfg_seed(cfg, seed):
    other = cfg.copy_and_resolve_references()
    other.seed = seed
    return other


def _engine_modules() -> set[str]:
    return {m for m in sys.modules if m.split(".")[0] in ("torch", "vllm")}


@pytest.fixture(scope="module")
def vllm_bridge(bridge):
    before = _engine_modules()
    b = VLLMBridge()
    yield b
    assert _engine_modules() == before  # vLLM and torch stayed inside the engine actor
    b.client.close()
    assert ray.is_initialized()  # it joined the module's cluster: not its to shut down


def _max_logprob_error(model, samples) -> float:
    """|engine log-prob - JAX log_softmax(logits)| over every sampled token (temperature 1)."""
    import jax
    import jax.numpy as jnp

    worst = 0.0
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        lp = jax.nn.log_softmax(model(jnp.asarray([ids], jnp.int32))[0], axis=-1)
        pos = len(s.prompt_ids) - 1 + np.arange(len(s.response_ids))
        ref = np.asarray(lp)[pos, np.asarray(s.response_ids)]
        worst = max(worst, float(np.abs(ref - np.asarray(s.response_logprobs)).max()))
    return worst


def test_vllm_weights_leave_the_trainer_only_by_publication(vllm_bridge):
    """The vLLM engine boots from the model's config alone: the bytes the trainer wrote for it
    hold no tensor, so version 0 leaves the trainer once, by its publication (the next test
    publishes it, in full, and checks the engine serves it). Before: the whole model was
    written for the engine to boot from, then published again as version 0."""
    client = vllm_bridge.client
    boot = Path(client.spec.model_dir)
    written = {f.name: f.stat().st_size for f in boot.rglob("*") if f.is_file()}
    assert "config.json" in written
    tensor_bytes = sum(size for name, size in written.items() if name != "config.json")
    assert tensor_bytes == 0, written
    assert client.version is None and client.last_publish is None  # nothing published yet


def test_vllm_engine_behind_bridge(vllm_bridge, tmp_path):
    client = vllm_bridge.client
    assert client.transport == "object_store"
    stats = client.publish(vllm_bridge.policy("A", 0))
    assert stats.sent_bytes == stats.num_bytes  # version 0 in full, once (boot: no tensors)
    TIMINGS["vllm_publish_s"] = stats.seconds
    cursor = client.state()
    on_a, _ = client.produce(0)
    err_a = _max_logprob_error(vllm_bridge.models["A"], on_a)
    client.publish(vllm_bridge.policy("B", 1))
    client.restore(cursor)
    on_b, _ = client.produce(0)
    err_b = _max_logprob_error(vllm_bridge.models["B"], on_b)
    TIMINGS["vllm_logprob_max_err"] = max(err_a, err_b)
    spread = np.ptp([lp for s in on_a + on_b for lp in s.response_logprobs])
    assert spread > 1.0  # the log-probs vary: the comparison below is not between constants
    assert max(err_a, err_b) < 1e-4  # fp32 engine vs the JAX model on the same weights
    assert [s.response_ids for s in on_a] != [s.response_ids for s in on_b]
    assert all(s.policy_version == 1 for s in on_b)

    # a refused publication (wrong digest; then a missing tensor) leaves B serving
    tensors = hf_tensors(client, vllm_bridge.policy("A"))
    manifest = Manifest.build(2, tensors)
    _refused(client, manifest, make_chunks(tensors, 1 << 20), "digest", digest="f" * 64)
    _refused(client, manifest, make_chunks(tensors[:-1], 1 << 20), "received|missing")
    assert _versions(client) == [1] and client.version == 1
    client.restore(cursor)
    again, _ = client.produce(0)
    assert [s.response_ids for s in again] == [s.response_ids for s in on_b]
    assert all(s.policy_version == 1 for s in again)

    # killed mid-rollout: restarted from the committed chunks, same samples
    ray.get(client.manager.set_debug.remote(0, generate_delay_s=120.0, marker_dir=str(tmp_path)))
    pid = client.health()[0]["pid"]
    client.restore(cursor)
    start = time.perf_counter()
    pending = client.manager.produce.remote(0)
    while not (tmp_path / f"generate-{pid}").exists():
        assert time.perf_counter() - start < 120, "the engine never started generating"
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    samples, stats = ray.get(pending)
    TIMINGS["vllm_restart_and_regenerate_s"] = time.perf_counter() - start
    assert stats["engine_restarts"] == 1.0
    assert [s.response_ids for s in samples] == [s.response_ids for s in on_b]
    for s, w in zip(samples, on_b, strict=True):
        np.testing.assert_allclose(s.response_logprobs, w.response_logprobs, rtol=0, atol=1e-5)
    assert all(s.policy_version == 1 for s in samples)
    assert client.health()[0]["pid"] != pid
