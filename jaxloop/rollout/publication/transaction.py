"""Policy publication as a transaction: complete, versioned and digest-checked.

A publisher describes a policy version with a `Manifest` (every tensor's name, shape and dtype, the
count, a sha256 digest and the byte total), serialises the tensors into safetensors-format buckets
(`make_chunks`), and a `PublicationReceiver` on the engine side accepts `begin` / `add_chunk` /
`finish`. Only `finish` hands tensors out, and only when the set received is exactly the expected
one (names, shapes, dtypes), the count matches and the digest of what arrived matches the digest
the publisher computed. Anything else raises `PublicationError` and nothing is handed out, so the
engine keeps serving its previous version.

Delta publication: a manifest with `base_version` set still describes (and digests) the whole
new version, but its buckets carry only the tensors named in `sent`; a receiver that retained
the tensors of exactly `base_version` (a publication with `retain`) takes the others from them,
and `finish` verifies the digest of the reconstructed whole. A receiver on another version, or
one that kept no tensors, refuses the delta at `begin`.

Xor payloads (`Manifest.xor`, rollout.publish=delta_xor): a changed tensor may travel as
`xor_encode(new, base)`, a 1-D uint8 tensor under its own name in the bucket: the bytes of new xor
base, split into byte planes (byte 0 of every element, then byte 1, ...: the sign and exponent
bytes, which a small update rarely flips, become long zero runs), compressed with zlib level 1.
The receiver rebuilds new = base xor payload from the base tensor it retained (`xor_decode`) and
the whole version's digest is verified as for any delta.

numpy + ml_dtypes only: importable by the JAX trainer and by engine processes (no jax, no torch).
The safetensors byte format comes from jaxloop.io.safetensors (bfloat16 included).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from jaxloop.io import safetensors as st
from jaxloop.rollout.api import PublicationError

Spec = tuple[tuple[int, ...], str]  # (shape, dtype name)


def dtype_name(dtype) -> str:
    """Canonical dtype name: 'float32', 'bfloat16', ... (what manifests and specs carry)."""
    return str(np.dtype(dtype))


def _as_array(name: str, value) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype not in st.TAGS:
        raise PublicationError(f"tensor {name}: dtype {arr.dtype} cannot be published")
    return arr


# ---- digest --------------------------------------------------------------------------------------
def _tensor_sha256(arr: np.ndarray) -> bytes:
    data = np.ascontiguousarray(arr)
    return hashlib.sha256(memoryview(data.reshape(-1).view(np.uint8))).digest()


def _unique(tensors: Iterable[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    items: dict[str, np.ndarray] = {}
    for name, value in tensors:
        if name in items:
            raise PublicationError(f"tensor {name} appears twice")
        items[name] = _as_array(name, value)
    return items


def tensor_hashes(tensors: Iterable[tuple[str, np.ndarray]]) -> dict[str, bytes]:
    """name -> sha256 of the tensor's raw bytes (parallel threads: hashlib releases the GIL,
    which matters for multi-GB policies). What a delta publisher compares between versions."""
    items = _unique(tensors)
    names = list(items)
    workers = min(8, os.cpu_count() or 1, max(1, len(names)))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(lambda n: _tensor_sha256(items[n]), names), strict=True))


def combine_digest(specs: Mapping[str, Spec], hashes: Mapping[str, bytes]) -> str:
    """The digest of tensor_digest from the tensors' specs and per-tensor hashes."""
    h = hashlib.sha256()
    for name in sorted(specs):
        shape, dtype = specs[name]
        header = json.dumps([name, dtype, list(shape)], separators=(",", ":"))
        h.update(struct.pack("<Q", len(header)))
        h.update(header.encode())
        h.update(hashes[name])
    return h.hexdigest()


def _specs(items: Mapping[str, np.ndarray]) -> dict[str, Spec]:
    return {n: (tuple(int(d) for d in a.shape), dtype_name(a.dtype)) for n, a in items.items()}


def tensor_digest(tensors: Iterable[tuple[str, np.ndarray]]) -> str:
    """sha256 over (name, dtype, shape, sha256 of the raw bytes) of every tensor, in name-sorted
    order (a two-level hash, see tensor_hashes).

    The result does not depend on the order tensors are given in; it changes with any name, dtype,
    shape or byte. Duplicate names are an error.
    """
    items = _unique(tensors)
    return combine_digest(_specs(items), tensor_hashes(items.items()))


# ---- xor payloads --------------------------------------------------------------------------------
XOR_ZLIB_LEVEL = 1  # level 1: ~2-4x the speed of the default level at a few % larger payloads


def _byte_planes(arr: np.ndarray) -> np.ndarray:
    """[itemsize, n] uint8: row j holds byte j of every element."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    return flat.view(np.uint8).reshape(flat.size, flat.itemsize).T


def xor_encode(new: np.ndarray, base: np.ndarray) -> bytes | None:
    """The xor payload of `new` over `base` (same shape and dtype): zlib(byte planes of new xor
    base). None when it is not smaller than new's raw bytes (then the tensor is sent raw)."""
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"xor of {new.dtype}{new.shape} over {base.dtype}{base.shape}")
    planes = np.empty((new.dtype.itemsize, new.size), np.uint8)  # plane-major, contiguous
    np.bitwise_xor(_byte_planes(new), _byte_planes(base), out=planes)
    payload = zlib.compress(planes.data, XOR_ZLIB_LEVEL)
    return payload if len(payload) < new.nbytes else None


def xor_decode(name: str, payload: np.ndarray, base: np.ndarray) -> np.ndarray:
    """The tensor whose xor payload over `base` is `payload` (uint8); a payload that is not a
    complete zlib stream of exactly base's byte count -> PublicationError."""
    n, itemsize = base.size, base.dtype.itemsize
    inflater = zlib.decompressobj()
    try:  # max_length: never inflate more than the tensor's bytes (a corrupted length field)
        data = inflater.decompress(memoryview(np.ascontiguousarray(payload)), n * itemsize + 1)
    except zlib.error as e:
        raise PublicationError(f"xor payload of {name}: {e}") from None
    if len(data) != n * itemsize or not inflater.eof or inflater.unconsumed_tail:
        raise PublicationError(
            f"xor payload of {name}: {len(data)} bytes"
            + ("" if inflater.eof else " (truncated)")
            + f", expected {n * itemsize}"
        )
    planes = np.frombuffer(data, np.uint8).reshape(itemsize, n)
    elements = np.empty((n, itemsize), np.uint8)  # element-major, contiguous
    np.bitwise_xor(planes.T, _byte_planes(base).T, out=elements)
    return elements.reshape(-1).view(base.dtype).reshape(base.shape)


# ---- manifest ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Manifest:
    """What one publication promises to deliver: the whole version (every tensor's spec, the
    count, the digest, the bytes), and for a delta (`base_version` set) the names its buckets
    carry (`sent`; the rest are the base version's), of which those in `xor` (name -> payload
    bytes) travel as xor payloads over the base (see xor_encode). `retain`: the receiver keeps
    this version's tensors as the base of later deltas."""

    version: int
    tensors: dict[str, Spec]  # name -> (shape, dtype name)
    count: int
    digest: str
    total_bytes: int
    base_version: int | None = None
    sent: tuple[str, ...] | None = None  # None: every tensor
    retain: bool = False
    xor: dict[str, int] | None = None  # delta only: sent tensors carried as xor payloads

    @classmethod
    def build(
        cls,
        version: int,
        tensors: Iterable[tuple[str, np.ndarray]],
        *,
        hashes: Mapping[str, bytes] | None = None,
        base_version: int | None = None,
        sent: Iterable[str] | None = None,
        retain: bool = False,
        xor: Mapping[str, int] | None = None,
    ) -> Manifest:
        """The manifest of `tensors` (all of the version); `hashes`: their tensor_hashes when
        already computed; `base_version` and `sent`: a delta over that version carrying those
        tensors, `xor` (name -> payload bytes) the ones sent as xor payloads."""
        items = _unique(tensors)
        if (base_version is None) != (sent is None):
            raise ValueError("a delta manifest needs both base_version and sent")
        if xor is not None and sent is None:
            raise ValueError("xor payloads need a delta (base_version and sent)")
        if sent is not None:
            sent = tuple(sent)
            unknown = sorted(set(sent) - set(items))
            if unknown:
                raise PublicationError(f"delta sends tensor {unknown[0]}, not in the version")
            unsent = sorted(set(xor or ()) - set(sent))
            if unsent:
                raise PublicationError(f"xor payload for tensor {unsent[0]}, not in sent")
        specs = _specs(items)
        return cls(
            version=int(version),
            tensors=specs,
            count=len(items),
            digest=combine_digest(specs, hashes or tensor_hashes(items.items())),
            total_bytes=int(sum(arr.nbytes for arr in items.values())),
            base_version=None if base_version is None else int(base_version),
            sent=sent,
            retain=bool(retain),
            xor=None if xor is None else {str(n): int(b) for n, b in xor.items()},
        )

    @property
    def sent_bytes(self) -> int:
        """Tensor bytes the buckets carry (total_bytes for a full publication; an xor payload
        counts its compressed bytes)."""
        if self.sent is None:
            return self.total_bytes
        xor = self.xor or {}
        return int(
            sum(
                xor[n]
                if n in xor
                else math.prod(self.tensors[n][0]) * np.dtype(self.tensors[n][1]).itemsize
                for n in self.sent
            )
        )

    def to_dict(self) -> dict:
        """A JSON/msgpack-friendly form (for sending across processes)."""
        return {
            "version": self.version,
            "tensors": {n: [list(s), d] for n, (s, d) in self.tensors.items()},
            "count": self.count,
            "digest": self.digest,
            "total_bytes": self.total_bytes,
            "base_version": self.base_version,
            "sent": None if self.sent is None else list(self.sent),
            "retain": self.retain,
            "xor": self.xor,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Manifest:
        return cls(
            version=int(d["version"]),
            tensors={n: (tuple(int(x) for x in s), str(t)) for n, (s, t) in d["tensors"].items()},
            count=int(d["count"]),
            digest=str(d["digest"]),
            total_bytes=int(d["total_bytes"]),
            base_version=None if d.get("base_version") is None else int(d["base_version"]),
            sent=None if d.get("sent") is None else tuple(str(n) for n in d["sent"]),
            retain=bool(d.get("retain", False)),
            xor=None if d.get("xor") is None else {str(n): int(b) for n, b in d["xor"].items()},
        )


# ---- safetensors buckets -------------------------------------------------------------------------
def serialize_tensors(tensors: Iterable[tuple[str, np.ndarray]]) -> bytes:
    """One safetensors blob (8-byte header length, JSON header, raw little-endian data)."""
    items = [(name, _as_array(name, value)) for name, value in tensors]
    try:
        return st.serialize(items)
    except st.FormatError as e:
        raise PublicationError(str(e)) from e


def deserialize_tensors(data: bytes) -> list[tuple[str, np.ndarray]]:
    """Parse a safetensors blob into zero-copy views of `data`; malformed -> PublicationError."""
    try:
        return st.parse(memoryview(data))
    except st.FormatError as e:
        raise PublicationError(f"malformed chunk: {e}") from e


def iter_chunks(tensors: Iterable[tuple[str, np.ndarray]], bucket_bytes: int) -> Iterator[bytes]:
    """Serialise tensors into safetensors buckets of at most ~bucket_bytes of tensor data each
    (a tensor larger than a bucket gets a bucket of its own; tensors are never split), one
    bucket at a time."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    pending: list[tuple[str, np.ndarray]] = []
    size = 0
    for name, value in tensors:
        arr = _as_array(name, value)
        if pending and size + arr.nbytes > bucket_bytes:
            yield serialize_tensors(pending)
            pending, size = [], 0
        pending.append((name, arr))
        size += arr.nbytes
    if pending:
        yield serialize_tensors(pending)


def make_chunks(tensors: Iterable[tuple[str, np.ndarray]], bucket_bytes: int) -> list[bytes]:
    """All buckets of `iter_chunks` as a list."""
    return list(iter_chunks(tensors, bucket_bytes))


# ---- receiver ------------------------------------------------------------------------------------
class PublicationReceiver:
    """Engine-side state machine for one publication at a time.

    expected: name -> (shape, dtype) that this engine can load; a publication must deliver exactly
    that set. `committed_version` is the last version `finish` handed out; versions must increase.
    Any refusal aborts the open transaction (a new `begin` is needed) and leaves the committed
    version (and its retained tensors) as they were. After a publication with `retain`, a copy of
    its tensors is kept (one model in host memory) as the base of a delta.
    """

    def __init__(self, expected: Mapping[str, tuple]):
        self.expected: dict[str, Spec] = {
            n: (tuple(int(d) for d in s), dtype_name(t)) for n, (s, t) in expected.items()
        }
        self.committed_version: int | None = None
        self.retained: dict[str, np.ndarray] | None = None  # tensors of committed_version
        self._manifest: Manifest | None = None
        self._received: dict[str, np.ndarray] = {}

    @property
    def in_progress(self) -> int | None:
        return None if self._manifest is None else self._manifest.version

    def abort(self) -> None:
        self._manifest = None
        self._received = {}

    def _refuse(self, message: str):
        self.abort()
        raise PublicationError(message)

    def _check_spec(self, name: str, shape: tuple, dtype: str, what: str) -> None:
        if name not in self.expected:
            self._refuse(f"{what}: unknown tensor {name}")
        want_shape, want_dtype = self.expected[name]
        if tuple(shape) != want_shape:
            self._refuse(f"{what}: tensor {name} has shape {tuple(shape)}, expected {want_shape}")
        if dtype != want_dtype:
            self._refuse(f"{what}: tensor {name} has dtype {dtype}, expected {want_dtype}")

    def _check_version(self, version: int, what: str) -> None:
        if self._manifest is None:
            self._refuse(f"{what} for version {version} without begin()")
        if version != self._manifest.version:
            self._refuse(
                f"{what} for version {version}, but version {self._manifest.version} is open"
            )

    def begin(self, version: int, manifest: Manifest | Mapping) -> None:
        if not isinstance(manifest, Manifest):
            manifest = Manifest.from_dict(manifest)
        self.abort()
        if manifest.version != version:
            self._refuse(f"begin({version}) with a manifest for version {manifest.version}")
        if self.committed_version is not None and version <= self.committed_version:
            self._refuse(f"version {version} is not newer than committed {self.committed_version}")
        if manifest.count != len(manifest.tensors):
            self._refuse(
                f"manifest count {manifest.count} != its {len(manifest.tensors)} tensor entries"
            )
        for name, (shape, dtype) in manifest.tensors.items():
            self._check_spec(name, shape, dtype, "manifest")
        missing = sorted(set(self.expected) - set(manifest.tensors))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            self._refuse(f"manifest: missing tensor {missing[0]}{more}")
        if manifest.base_version is not None:
            base = manifest.base_version
            if base != self.committed_version or self.retained is None:
                have = "no retained tensors" if self.retained is None else "retained"
                self._refuse(
                    f"delta over version {base}, but this engine's committed version is "
                    f"{self.committed_version} ({have})"
                )
            unknown = sorted(set(manifest.sent) - set(manifest.tensors))
            if unknown:
                self._refuse(f"manifest: delta sends tensor {unknown[0]}, not in the version")
            unsent = sorted(set(manifest.xor or ()) - set(manifest.sent))
            if unsent:
                self._refuse(f"manifest: xor payload for tensor {unsent[0]}, not in sent")
        elif manifest.xor is not None:
            self._refuse("manifest: xor payloads in a full publication (they need a base)")
        self._manifest = manifest

    def add_chunk(self, version: int, data: bytes) -> int:
        """Accept one bucket; returns the number of tensors it held."""
        self._check_version(version, "add_chunk")
        try:
            items = deserialize_tensors(data)
        except PublicationError as e:
            self._refuse(str(e))
        sent, xor = self._manifest.sent, self._manifest.xor or {}
        for name, arr in items:
            if name not in self._manifest.tensors:
                self._refuse(f"chunk: tensor {name} is not in the manifest")
            if sent is not None and name not in sent:
                self._refuse(f"chunk: tensor {name} is not in this delta's tensors")
            if name in self._received:
                self._refuse(f"chunk: tensor {name} received twice")
            if name in xor:  # a 1-D uint8 payload of the manifest's length, over the base
                if arr.dtype != np.uint8 or arr.shape != (xor[name],):
                    self._refuse(
                        f"chunk: xor payload of {name} is {dtype_name(arr.dtype)}{arr.shape}, "
                        f"expected uint8({xor[name]},)"
                    )
                try:
                    arr = xor_decode(name, arr, self.retained[name])
                except PublicationError as e:
                    self._refuse(f"chunk: {e}")
            self._check_spec(name, arr.shape, dtype_name(arr.dtype), "chunk")
            self._received[name] = arr
        return len(items)

    def finish(self, version: int, count: int, digest: str) -> dict[str, np.ndarray]:
        """Verify the whole transaction; on success commit `version` and return the tensors."""
        self._check_version(version, "finish")
        manifest = self._manifest
        if count != manifest.count:
            self._refuse(f"finish: count {count} != manifest count {manifest.count}")
        sent = len(manifest.tensors) if manifest.sent is None else len(manifest.sent)
        if len(self._received) != sent:
            self._refuse(f"finish: received {len(self._received)} tensors, expected {sent}")
        tensors = self._received
        if manifest.sent is not None:  # the delta's base: the retained tensors of base_version
            tensors = {**self.retained, **self._received}
        missing = sorted(set(self.expected) - set(tensors))
        if missing:
            self._refuse(f"finish: missing tensor {missing[0]}")
        if digest != manifest.digest:
            self._refuse("finish: digest differs from the manifest's")
        actual = tensor_digest(tensors.items())
        if actual != digest:
            what = "reconstructed" if manifest.sent is not None else "received"
            self._refuse(
                f"finish: digest mismatch ({what} {actual[:16]}..., sent {digest[:16]}...)"
            )
        self.abort()
        self.committed_version = version
        if manifest.retain:  # copies of what arrived (views of bucket buffers), read-only
            arrived = manifest.tensors if manifest.sent is None else set(manifest.sent)
            decoded = manifest.xor or {}  # xor_decode's own arrays: no second copy
            self.retained = {
                n: _owned(a, copy=n not in decoded) if n in arrived else a
                for n, a in tensors.items()
            }
        else:
            self.retained = None
        return tensors


def _owned(arr: np.ndarray, copy: bool = True) -> np.ndarray:
    out = np.array(arr) if copy else arr
    out.setflags(write=False)
    return out
