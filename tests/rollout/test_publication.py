"""Publication transaction (numpy only, no engine): digest, buckets, and every refusal."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import ml_dtypes
import numpy as np
import pytest

from jaxloop.rollout.api import PublicationError
from jaxloop.rollout.publication import transaction as pub
from jaxloop.rollout.publication.transaction import (
    Manifest,
    PublicationReceiver,
    deserialize_tensors,
    iter_chunks,
    make_chunks,
    serialize_tensors,
    tensor_digest,
)

BF16 = np.dtype(ml_dtypes.bfloat16)


def _tensors(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [
        ("model.embed_tokens.weight", rng.normal(size=(16, 8)).astype(dtype)),
        ("model.layers.0.self_attn.q_proj.weight", rng.normal(size=(12, 8)).astype(dtype)),
        ("model.norm.weight", rng.normal(size=(8,)).astype(dtype)),
        ("lm_head.weight", rng.normal(size=(16, 8)).astype(dtype)),
        ("model.early_exit_gate.bias", rng.normal(size=(1,)).astype(dtype)),
    ]


def _expected(tensors):
    return {n: (a.shape, str(a.dtype)) for n, a in tensors}


def _transaction(rx, version, tensors, bucket=200, manifest=None, count=None, digest=None):
    manifest = manifest or Manifest.build(version, tensors)
    rx.begin(version, manifest)
    for chunk in make_chunks(tensors, bucket):
        rx.add_chunk(version, chunk)
    return rx.finish(
        version,
        manifest.count if count is None else count,
        manifest.digest if digest is None else digest,
    )


# ---- digest --------------------------------------------------------------------------------------
def test_digest_is_order_independent_and_sensitive():
    t = _tensors()
    d = tensor_digest(t)
    assert d == tensor_digest(list(reversed(t)))
    assert len(d) == 64
    # byte change
    changed = [(n, a.copy()) for n, a in t]
    changed[1][1].reshape(-1).view(np.uint8)[5] ^= 1
    assert tensor_digest(changed) != d
    # name change
    assert tensor_digest([("x" + t[0][0], t[0][1])] + t[1:]) != d
    # shape change, same bytes
    assert tensor_digest([(t[0][0], t[0][1].reshape(8, 16))] + t[1:]) != d
    # dtype change, same bytes
    assert tensor_digest([(t[0][0], t[0][1].view(np.int32))] + t[1:]) != d
    # non-contiguous input digests like its contiguous copy
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert tensor_digest([("a", arr.T)]) == tensor_digest([("a", np.ascontiguousarray(arr.T))])
    with pytest.raises(PublicationError, match="twice"):
        tensor_digest([t[0], t[0]])


def test_manifest_roundtrip():
    t = _tensors()
    m = Manifest.build(7, t)
    assert m.count == 5 and m.version == 7
    assert m.total_bytes == sum(a.nbytes for _, a in t)
    assert m.tensors["model.norm.weight"] == ((8,), "float32")
    assert Manifest.from_dict(m.to_dict()) == m


# ---- buckets -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
def test_chunks_roundtrip_exactly(dtype):
    t = _tensors(dtype=dtype)
    chunks = make_chunks(t, bucket_bytes=300)
    assert len(chunks) > 1
    back = [item for c in chunks for item in deserialize_tensors(c)]
    assert [n for n, _ in back] == [n for n, _ in t]
    for (_, a), (_, b) in zip(t, back, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def test_chunks_respect_bucket_size():
    t = _tensors()
    sizes = [a.nbytes for _, a in t]  # 512, 384, 32, 512, 4
    chunks = make_chunks(t, bucket_bytes=520)
    per_chunk = [sum(a.nbytes for _, a in deserialize_tensors(c)) for c in chunks]
    assert sum(per_chunk) == sum(sizes)
    assert all(s <= 520 for s in per_chunk)
    assert list(iter_chunks(iter(t), 520)) == chunks
    # one bucket when it fits; a tensor bigger than the bucket gets its own
    assert len(make_chunks(t, bucket_bytes=10**6)) == 1
    assert len(make_chunks(t, bucket_bytes=1)) == len(t)


def test_safetensors_bytes_readable_by_safetensors_library():
    from safetensors.numpy import load

    t = _tensors()
    loaded = load(serialize_tensors(t))
    for n, a in t:
        np.testing.assert_array_equal(loaded[n], a)


def test_malformed_chunk_refused():
    with pytest.raises(PublicationError, match="malformed"):
        deserialize_tensors(b"\x01")
    blob = bytearray(serialize_tensors(_tensors()))
    with pytest.raises(PublicationError, match="malformed"):
        deserialize_tensors(bytes(blob[:-10]))  # truncated data


# ---- receiver: success ---------------------------------------------------------------------------
def test_receiver_commits_exact_tensors():
    t = _tensors()
    rx = PublicationReceiver(_expected(t))
    got = _transaction(rx, 3, t)
    assert set(got) == {n for n, _ in t}
    for n, a in t:
        assert got[n].tobytes() == a.tobytes() and got[n].shape == a.shape
    assert rx.committed_version == 3 and rx.in_progress is None
    # next version with other values
    t2 = _tensors(seed=1)
    got2 = _transaction(rx, 4, t2)
    assert got2["lm_head.weight"].tobytes() == t2[3][1].tobytes()
    assert rx.committed_version == 4


# ---- receiver: refusals --------------------------------------------------------------------------
def _fresh(t=None):
    t = t or _tensors()
    return PublicationReceiver(_expected(t)), t


def test_refuses_wrong_version():
    rx, t = _fresh()
    m = Manifest.build(2, t)
    with pytest.raises(PublicationError, match="manifest for version 2"):
        rx.begin(3, m)
    rx.begin(2, m)
    chunks = make_chunks(t, 10**6)
    with pytest.raises(PublicationError, match="version 5"):
        rx.add_chunk(5, chunks[0])
    # the refusal aborted the transaction
    with pytest.raises(PublicationError, match="without begin"):
        rx.add_chunk(2, chunks[0])
    rx.begin(2, m)
    rx.add_chunk(2, chunks[0])
    with pytest.raises(PublicationError, match="version 1"):
        rx.finish(1, m.count, m.digest)
    assert rx.committed_version is None


def test_refuses_stale_version():
    rx, t = _fresh()
    _transaction(rx, 5, t)
    for v in (5, 4):
        with pytest.raises(PublicationError, match="not newer"):
            rx.begin(v, Manifest.build(v, t))
    assert rx.committed_version == 5


def test_refuses_unknown_tensor():
    rx, t = _fresh()
    extra = t + [("model.layers.9.mlp.up_proj.weight", np.zeros((2, 2), np.float32))]
    with pytest.raises(PublicationError, match="unknown tensor model.layers.9"):
        rx.begin(1, Manifest.build(1, extra))
    # smuggled in a chunk although not in the manifest
    m = Manifest.build(1, t)
    rx.begin(1, m)
    with pytest.raises(PublicationError, match="not in the manifest"):
        rx.add_chunk(1, serialize_tensors(extra[-1:]))


def test_refuses_missing_tensor():
    rx, t = _fresh()
    with pytest.raises(PublicationError, match="missing tensor model.norm.weight"):
        rx.begin(1, Manifest.build(1, [x for x in t if x[0] != "model.norm.weight"]))
    # manifest complete, but a chunk never arrives
    m = Manifest.build(1, t)
    rx.begin(1, m)
    chunks = make_chunks(t, 1)
    for c in chunks[:-1]:
        rx.add_chunk(1, c)
    with pytest.raises(PublicationError, match="received 4 tensors, expected 5"):
        rx.finish(1, m.count, m.digest)
    assert rx.committed_version is None


def test_refuses_wrong_shape():
    rx, t = _fresh()
    bad = [(n, a.reshape(-1) if n == "lm_head.weight" else a) for n, a in t]
    with pytest.raises(PublicationError, match=r"lm_head.weight has shape \(128,\)"):
        rx.begin(1, Manifest.build(1, bad))
    # manifest claims the right shape, the chunk carries another
    m = Manifest.build(1, t)
    rx.begin(1, m)
    with pytest.raises(PublicationError, match="shape"):
        rx.add_chunk(1, serialize_tensors([("lm_head.weight", t[3][1][:8])]))


def test_refuses_wrong_dtype():
    rx, t = _fresh()
    bad = [(n, a.astype(BF16)) for n, a in t]
    with pytest.raises(PublicationError, match="dtype bfloat16, expected float32"):
        rx.begin(1, Manifest.build(1, bad))
    m = Manifest.build(1, t)
    rx.begin(1, m)
    with pytest.raises(PublicationError, match="dtype float16"):
        rx.add_chunk(1, serialize_tensors([("model.norm.weight", t[2][1].astype(np.float16))]))


def test_refuses_digest_mismatch():
    rx, t = _fresh()
    m = Manifest.build(1, t)
    # a byte flipped in transit (in the data region of the last chunk)
    chunks = [bytearray(c) for c in make_chunks(t, 300)]
    chunks[-1][-1] ^= 0x40
    rx.begin(1, m)
    for c in chunks:
        rx.add_chunk(1, bytes(c))
    with pytest.raises(PublicationError, match="digest mismatch"):
        rx.finish(1, m.count, m.digest)
    # finish called with another digest than the manifest's
    with pytest.raises(PublicationError, match="differs from the manifest"):
        _transaction(rx, 1, t, digest="0" * 64)
    assert rx.committed_version is None


def test_refuses_count_mismatch():
    rx, t = _fresh()
    with pytest.raises(PublicationError, match="count 4"):
        _transaction(rx, 1, t, count=4)
    m = Manifest.build(1, t)
    lying = Manifest(m.version, m.tensors, 6, m.digest, m.total_bytes)
    with pytest.raises(PublicationError, match="manifest count 6"):
        rx.begin(1, lying)
    assert rx.committed_version is None


def test_refuses_duplicate_tensor():
    rx, t = _fresh()
    m = Manifest.build(1, t)
    rx.begin(1, m)
    rx.add_chunk(1, serialize_tensors(t[:1]))
    with pytest.raises(PublicationError, match="received twice"):
        rx.add_chunk(1, serialize_tensors(t[:1]))


def test_receiver_recovers_after_refusal():
    rx, t = _fresh()
    with pytest.raises(PublicationError):
        _transaction(rx, 1, t, digest="f" * 64)
    got = _transaction(rx, 1, t)
    assert rx.committed_version == 1 and len(got) == len(t)


def test_publication_module_imports_no_jax_or_torch():
    """publication/transaction.py (and its package) and api.py must stay importable in engine
    processes (no jax / torch)."""
    here = pathlib.Path(pub.__file__)
    root = here.parent.parent  # jaxloop/rollout
    for name in (here, here.parent / "__init__.py", root / "api.py", root / "types.py"):
        tree = ast.parse(name.read_text())
        mods = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods.add(node.module.split(".")[0])
        assert not mods & {"jax", "flax", "torch", "vllm"}, (name, mods)


# ---- delta publication ---------------------------------------------------------------------------
def _changed(tensors, names, seed):
    """`tensors` with the tensors `names` replaced by new values (the others the same arrays)."""
    rng = np.random.default_rng(seed)
    return [(n, rng.normal(size=a.shape).astype(a.dtype) if n in names else a) for n, a in tensors]


def _delta(rx, version, base_version, tensors, sent, **kw):
    """A delta transaction over `base_version` carrying the tensors `sent` of the new `tensors`."""
    manifest = Manifest.build(version, tensors, base_version=base_version, sent=sent, retain=True)
    return _transaction(
        rx, version, [(n, a) for n, a in tensors if n in sent], manifest=manifest, **kw
    )


def test_delta_reconstructs_every_version_bit_exactly():
    """Over several versions where only some tensors change, each delta carries only those and
    `finish` hands out the whole new version, equal byte for byte to the publisher's tensors
    (an independent comparison of the bytes, besides the receiver's own digest check)."""
    v0 = _tensors(dtype=BF16)
    rx = PublicationReceiver(_expected(v0))
    full = Manifest.build(0, v0, retain=True)
    assert full.sent_bytes == full.total_bytes
    _transaction(rx, 0, v0, manifest=full)
    versions = [v0]
    for version, names in [(1, {"lm_head.weight"}), (2, {"model.norm.weight"}), (3, set())]:
        new = _changed(versions[-1], names, seed=version)
        manifest = Manifest.build(version, new, base_version=version - 1, sent=sorted(names))
        assert manifest.sent_bytes == sum(a.nbytes for n, a in new if n in names)
        got = _delta(rx, version, version - 1, new, sorted(names))
        assert rx.committed_version == version
        assert sorted(got) == sorted(n for n, _ in new)
        for name, arr in new:
            assert got[name].dtype == arr.dtype and got[name].tobytes() == arr.tobytes(), name
        versions.append(new)
    # the changed tensors did change: the comparison above has power
    assert versions[1][3][1].tobytes() != v0[3][1].tobytes()


def test_refused_delta_keeps_the_committed_version_and_base():
    v0 = _tensors()
    rx = PublicationReceiver(_expected(v0))
    _transaction(rx, 0, v0, manifest=Manifest.build(0, v0, retain=True))
    v1 = _changed(v0, {"lm_head.weight", "model.norm.weight"}, seed=1)
    # a delta over a version the receiver does not hold
    with pytest.raises(
        PublicationError, match="delta over version 5, but .* committed version is 0"
    ):
        _delta(rx, 1, 5, v1, ["lm_head.weight", "model.norm.weight"])
    # a delta that leaves out a changed tensor: the reconstruction's digest differs
    with pytest.raises(PublicationError, match="digest mismatch \\(reconstructed"):
        manifest = Manifest.build(1, v1, base_version=0, sent=["lm_head.weight"], retain=True)
        _transaction(rx, 1, [t for t in v1 if t[0] == "lm_head.weight"], manifest=manifest)
    # a bucket with a tensor the delta does not name
    with pytest.raises(PublicationError, match="not in this delta"):
        manifest = Manifest.build(1, v1, base_version=0, sent=["lm_head.weight"], retain=True)
        _transaction(rx, 1, v1[3:4] + v1[2:3], manifest=manifest)
    assert rx.committed_version == 0 and rx.in_progress is None
    assert all(rx.retained[n].tobytes() == a.tobytes() for n, a in v0)
    # a full publication without retain leaves no base: the next delta is refused
    got = _delta(rx, 1, 0, v1, ["lm_head.weight", "model.norm.weight"])
    assert all(got[n].tobytes() == a.tobytes() for n, a in v1)
    _transaction(rx, 2, v0)
    assert rx.retained is None
    with pytest.raises(PublicationError, match="no retained tensors"):
        _delta(rx, 3, 2, v1, ["lm_head.weight"])


def test_delta_manifest_round_trips():
    t = _tensors()
    m = Manifest.build(4, t, base_version=3, sent=["model.norm.weight"], retain=True)
    assert Manifest.from_dict(m.to_dict()) == m
    assert m.digest == Manifest.build(4, t).digest  # the digest is the whole version's
    assert m.sent_bytes == 8 * 4 < m.total_bytes


# ---- xor payloads (rollout.publish=delta_xor) ----------------------------------------------------
def _nudged(tensors, names, seed, step=1e-3):
    """`tensors` with the tensors `names` moved by a small step (as one optimizer update does:
    the sign and exponent bytes mostly stay, so their xor compresses)."""
    rng = np.random.default_rng(seed)
    return [
        (n, (a.astype(np.float32) + step * rng.normal(size=a.shape)).astype(a.dtype))
        if n in names
        else (n, a)
        for n, a in tensors
    ]


def _xor_manifest(version, base, new, sent):
    """The delta of `new` over `base` (version - 1) sending `sent`, each as an xor payload where
    xor_encode finds one smaller than the raw bytes; returns the manifest and the bucket items."""
    old = dict(base)
    payloads = {n: pub.xor_encode(a, old[n]) for n, a in new if n in sent}
    xor = {n: len(p) for n, p in payloads.items() if p is not None}
    manifest = Manifest.build(
        version, new, base_version=version - 1, sent=sent, retain=True, xor=xor
    )
    items = [
        (n, a if payloads[n] is None else np.frombuffer(payloads[n], np.uint8))
        for n, a in new
        if n in sent
    ]
    return manifest, items


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_xor_delta_reconstructs_every_version_bit_exactly(dtype):
    """Versions sent as xor payloads over the previous one (whose base is itself an xor
    reconstruction) come out byte for byte equal to the publisher's tensors; payloads are
    smaller than the raw bytes, and an incompressible change (fresh random values: its xor is
    noise) goes raw in the same delta."""
    v0 = _tensors(dtype=dtype)
    rx = PublicationReceiver(_expected(v0))
    _transaction(rx, 0, v0, manifest=Manifest.build(0, v0, retain=True))
    versions = [v0]
    q, head, norm = "model.layers.0.self_attn.q_proj.weight", "lm_head.weight", "model.norm.weight"
    for version, nudged, fresh in [(1, {head, q}, set()), (2, {q}, {norm}), (3, {head}, {q})]:
        new = _changed(_nudged(versions[-1], nudged, seed=version), fresh, seed=10 + version)
        sent = sorted(nudged | fresh)
        manifest, items = _xor_manifest(version, versions[-1], new, sent)
        assert sorted(manifest.xor) == sorted(nudged)  # the fresh tensors go raw
        raw = {n: a.nbytes for n, a in new}
        assert all(0 < manifest.xor[n] < raw[n] for n in nudged)
        assert manifest.sent_bytes == sum(manifest.xor.values()) + sum(raw[n] for n in fresh)
        rx.begin(version, manifest)
        for chunk in make_chunks(items, 200):
            rx.add_chunk(version, chunk)
        got = rx.finish(version, manifest.count, manifest.digest)
        assert rx.committed_version == version
        for name, arr in new:
            assert got[name].dtype == arr.dtype and got[name].tobytes() == arr.tobytes(), name
            assert rx.retained[name].tobytes() == arr.tobytes(), name
        assert got[head].tobytes() != versions[-1][3][1].tobytes() or head not in sent
        versions.append(new)


def test_xor_encode_round_trip_and_incompressible():
    base = np.random.default_rng(0).normal(size=(64, 32)).astype(BF16)
    new = (base.astype(np.float32) * (1 + 1e-3)).astype(BF16)
    payload = pub.xor_encode(new, base)
    assert payload is not None and len(payload) < new.nbytes
    back = pub.xor_decode("t", np.frombuffer(payload, np.uint8), base)
    assert back.dtype == new.dtype and back.shape == new.shape
    assert back.tobytes() == new.tobytes()
    noise = np.random.default_rng(1).integers(0, 256, base.nbytes, np.uint8)  # random bits
    noise = noise.view(BF16).reshape(base.shape)
    assert pub.xor_encode(noise, base) is None  # not smaller than its raw bytes: sent raw
    with pytest.raises(ValueError, match="xor of"):
        pub.xor_encode(new.astype(np.float32), base)


def test_corrupted_xor_payload_is_refused_and_the_old_version_serves():
    """A payload with a flipped byte (zlib's checksum), a truncated one, one of the wrong length
    and one that inflates to other bytes (a valid stream over the wrong tensor: only the full
    digest catches it) are refused; the committed version and its retained base stay, and the
    correct delta then commits."""
    v0 = _tensors()
    rx = PublicationReceiver(_expected(v0))
    _transaction(rx, 0, v0, manifest=Manifest.build(0, v0, retain=True))
    head = "lm_head.weight"
    v1 = _nudged(v0, {head}, seed=1)
    manifest, items = _xor_manifest(1, v0, v1, [head])
    payload = items[0][1]
    assert manifest.xor == {head: payload.size}

    def attempt(data, man=manifest):
        rx.begin(1, man)
        rx.add_chunk(1, serialize_tensors([(head, data)]))
        return rx.finish(1, man.count, man.digest)

    flipped = payload.copy()
    flipped[payload.size // 2] ^= 0x10
    with pytest.raises(PublicationError, match=f"xor payload of {head}"):
        attempt(flipped)
    truncated = dataclasses.replace(manifest, xor={head: payload.size - 4})
    with pytest.raises(PublicationError, match="truncated"):
        attempt(payload[:-4], truncated)
    with pytest.raises(PublicationError, match="expected uint8"):
        attempt(payload[:-4])
    wrong = np.frombuffer(pub.xor_encode(_nudged(v0, {head}, seed=2)[3][1], v0[3][1]), np.uint8)
    with pytest.raises(PublicationError, match="digest mismatch \\(reconstructed"):
        attempt(wrong, dataclasses.replace(manifest, xor={head: wrong.size}))
    assert rx.committed_version == 0 and rx.in_progress is None
    assert all(rx.retained[n].tobytes() == a.tobytes() for n, a in v0)
    got = attempt(payload)
    assert rx.committed_version == 1 and got[head].tobytes() == v1[3][1].tobytes()


def test_xor_manifest_round_trips_and_is_checked():
    t = _tensors()
    head = "lm_head.weight"
    m = Manifest.build(4, t, base_version=3, sent=[head], retain=True, xor={head: 100})
    assert Manifest.from_dict(m.to_dict()) == m
    assert m.sent_bytes == 100
    with pytest.raises(PublicationError, match="not in sent"):
        Manifest.build(4, t, base_version=3, sent=[head], xor={"model.norm.weight": 10})
    rx = PublicationReceiver(_expected(t))
    _transaction(rx, 0, t)
    with pytest.raises(PublicationError, match="xor payloads in a full publication"):
        rx.begin(1, dataclasses.replace(Manifest.build(1, t), xor={head: 10}))
