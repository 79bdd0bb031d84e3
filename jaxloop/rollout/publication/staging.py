"""Reused host staging buffers for policy publication.

`HostStaging` turns a Policy into the `(HF name, host array)` list of `hf_tensors(policy, dtypes)`
(same names, order, shapes, dtypes and bytes) plus every tensor's sha256 (`tensor_hashes`), by
copying bucket after bucket of tensors device -> host into host buffers that are allocated at the
first publication and reused by every later one of the same layout, while worker threads hash
the bucket copied before (hashlib releases the GIL).

Backends (`StagedPolicy.stats['staging_backend']`):
- `torch_pinned`: torch pinned host buffers filled with `copy_(torch.from_dlpack(x),
  non_blocking=True)` and one synchronize per bucket (a CUDA device: pageable `device_get` runs
  at ~1.5 GB/s, pinned copies at ~54 GB/s on an H200). `torch` (pin_memory=False) is the same
  loop on CPU arrays, for tests. `auto` picks it on a GPU when torch has CUDA (else numpy,
  with a warning).
- `numpy`: the same bucket loop copying into reused numpy buffers (`np.copyto`).
torch is imported only by the torch backends (the CPU default never imports it).

DANGER: the returned arrays are views of the reused buffers; the next `stage` overwrites them.
Whoever keeps tensors past the publication keeps copies.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxloop.families.tables import HFTensor
from jaxloop.io.hf_walk import expected_hf_shape, hf_entries, hf_view
from jaxloop.mathutil import round_up
from jaxloop.rollout.api import Policy
from jaxloop.rollout.publication.transaction import _tensor_sha256  # the digest tensor_hashes uses

logger = logging.getLogger(__name__)
BACKENDS = ("auto", "numpy", "torch", "torch_pinned")
_ALIGN = 64  # bytes: every tensor's view starts on a cache line (and any dtype's alignment)


@dataclasses.dataclass
class StagedPolicy:
    """A staged publication: `tensors` as hf_tensors gives them (views of the staging buffers,
    valid until the next stage), their sha256 `hashes` (as tensor_hashes), and `stats`."""

    tensors: list[tuple[str, np.ndarray]]
    hashes: dict[str, bytes]
    stats: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _Slot:
    entry: HFTensor  # which HF tensor, from which parameter
    shape: tuple[int, ...]
    source_dtype: np.dtype  # the parameter's
    dtype: np.dtype  # what the engine receives
    offset: int  # in its bucket's buffer
    nbytes: int

    @property
    def name(self) -> str:
        return self.entry.name


_CAST_EXACT: dict[tuple[str, str, str], bool] = {}


def device_cast_is_exact(source, target, device) -> bool:
    """Whether `astype(target)` on `device` gives the same bits as numpy's (ml_dtypes) cast on
    the host, for every 16-bit pattern in the high half of a 32-bit float (each exponent and
    sign with all bf16 mantissas, including NaN payloads and subnormals), the tie cases and
    random patterns. Probed once per (source, target, platform)."""
    import jax

    source, target = np.dtype(source), np.dtype(target)
    key = (source.name, target.name, device.platform)
    if key not in _CAST_EXACT:
        rng = np.random.default_rng(0)
        if source.itemsize == 4:
            high = np.arange(2**16, dtype=np.uint32) << 16
            lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
            bits = np.concatenate(
                [(high[:, None] | lows[None, :]).reshape(-1), rng.integers(0, 2**32, 2**16)]
            ).astype(np.uint32)
            probe = bits.view(np.float32).astype(source) if source.kind == "f" else None
        else:
            probe = None
        if probe is None:  # not a 32-bit float: random values of the source dtype
            probe = (rng.standard_normal(2**16) * 100).astype(source)
        with np.errstate(invalid="ignore", over="ignore"):
            want = probe.astype(target)
        got = np.asarray(jax.device_put(probe, device).astype(target))
        _CAST_EXACT[key] = got.dtype == want.dtype and got.tobytes() == want.tobytes()
    return _CAST_EXACT[key]


class HostStaging:
    """Stages policies through host buffers reused across publications (one per publisher).

    bucket_bytes: tensors are grouped, in table order, into buckets of at most this many bytes (a
    larger tensor gets a bucket of its own); each bucket is copied, synchronised, then hashed on
    worker threads while the next one copies. backend: 'auto' (torch_pinned on a CUDA device,
    numpy elsewhere), 'numpy', 'torch' (torch buffers, not pinned: the torch path on CPU arrays),
    'torch_pinned'. cast_on_device: None casts to the engine's dtype on the device where that is
    bitwise numpy's cast (device_cast_is_exact), False always on the host. Buffers are
    re-allocated only when the layout (names, shapes, dtypes, buckets, backend) changes.
    """

    def __init__(
        self,
        bucket_bytes: int,
        backend: str = "auto",
        *,
        hash_workers: int | None = None,
        cast_on_device: bool | None = None,
    ):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
        if backend not in BACKENDS:
            raise ValueError(f"staging backend {backend!r}: expected one of {BACKENDS}")
        self.bucket_bytes = int(bucket_bytes)
        self.backend = backend
        self.hash_workers = hash_workers or max(1, min(8, os.cpu_count() or 1))
        self.cast_on_device = cast_on_device  # None: where device_cast_is_exact; False: never
        self.allocations = 0  # how many times buffers were allocated (1 while the layout holds)
        self._warned = False
        self._layout_key: tuple | None = None
        self._buckets: list[list[_Slot]] = []
        self._host: list[np.ndarray] = []  # one uint8 buffer per bucket
        self._torch: list[Any] = []  # the same memory as torch uint8 tensors (torch backends)

    # ---- layout ----
    def _resolve_backend(self, device) -> str:
        if self.backend != "auto":
            return self.backend
        if device.platform not in ("gpu", "cuda"):
            return "numpy"
        try:  # pinned buffers need a CUDA build of torch beside jax
            import torch

            if torch.cuda.is_available():
                return "torch_pinned"
        except ImportError:
            pass
        if not self._warned:
            self._warned = True
            logger.warning("no CUDA torch: publication stages through pageable numpy buffers")
        return "numpy"

    def _plan(self, flat, table, dtypes: Mapping[str, str]) -> list[list[_Slot]]:
        import jax.numpy as jnp

        buckets: list[list[_Slot]] = []
        size = 0
        for t in table:
            param = flat[t.path][...]
            shape = expected_hf_shape(param.shape, t)
            source = np.dtype(param.dtype)
            want = dtypes.get(t.name)
            dtype = source if want is None else np.dtype(jnp.dtype(want))
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if not buckets or (buckets[-1] and size + nbytes > self.bucket_bytes):
                buckets.append([])
                size = 0
            offset = round_up(size, _ALIGN)
            buckets[-1].append(_Slot(t, shape, source, dtype, offset, nbytes))
            size = offset + nbytes
        return buckets

    def _allocate(self, buckets: list[list[_Slot]], backend: str) -> None:
        self._host, self._torch = [], []
        for bucket in buckets:
            nbytes = max(1, bucket[-1].offset + bucket[-1].nbytes)
            if backend == "numpy":
                self._host.append(np.empty(nbytes, np.uint8))
            else:
                import torch

                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=backend == "torch_pinned")
                self._torch.append(buf)
                self._host.append(buf.numpy())
        self._buckets = buckets
        self.allocations += 1

    def _view(self, k: int, slot: _Slot) -> np.ndarray:
        raw = self._host[k][slot.offset : slot.offset + slot.nbytes]
        return raw.view(slot.dtype).reshape(slot.shape)

    def _torch_view(self, k: int, slot: _Slot):
        import torch

        dtype = getattr(torch, slot.dtype.name)  # float32, bfloat16, float16, int32, ...
        raw = self._torch[k][slot.offset : slot.offset + slot.nbytes]
        return raw.view(dtype).view(slot.shape)

    # ---- staging ----
    def stage(self, policy: Policy, dtypes: Mapping[str, str] | None = None) -> StagedPolicy:
        """The policy's HF tensors (views of the reused buffers) and their sha256 hashes. A
        parameter sharded over several processes is gathered bucket by bucket (a collective:
        every other process runs `gather` of the same policy meanwhile)."""
        from flax import nnx

        start = time.perf_counter()
        flat = dict(nnx.to_flat_state(policy.params))
        table = hf_entries(policy.config, "actor")
        device = _local_device(flat[table[0].path][...])
        backend = self._resolve_backend(device)
        buckets = self._plan(flat, table, dtypes or {})
        key = (backend, tuple((s.name, s.shape, s.dtype.str, s.offset) for b in buckets for s in b))
        allocated = key != self._layout_key
        if allocated:
            self._layout_key = None  # a failed allocation leaves nothing half-built in use
            self._allocate(buckets, backend)
            self._layout_key = key
        device_cast = self._device_casts(buckets, device)
        t_setup = time.perf_counter()
        tensors: list[tuple[str, np.ndarray]] = []
        futures: list[concurrent.futures.Future] = []
        host_casts = 0
        with concurrent.futures.ThreadPoolExecutor(self.hash_workers) as pool:
            for k, bucket, current in self._prepared(flat, buckets, device_cast):
                host_casts += self._copy_bucket(k, bucket, current, backend)
                del current
                for slot in bucket:  # hashed while the next bucket copies
                    view = self._view(k, slot)
                    tensors.append((slot.name, view))
                    futures.append(pool.submit(_tensor_sha256, view))
            t_copied = time.perf_counter()
            hashes = {name: f.result() for (name, _), f in zip(tensors, futures, strict=True)}
        done = time.perf_counter()
        nbytes = sum(s.nbytes for b in buckets for s in b)
        stats = {
            "staging_backend": backend,
            "stage_bytes": nbytes,
            "stage_buckets": len(buckets),
            "stage_allocated": int(allocated),
            "stage_setup_s": t_setup - start,  # the plan; allocation and cast probes once
            "stage_device_to_host_s": t_copied - t_setup,
            "stage_digest_wait_s": done - t_copied,
            "stage_host_casts": host_casts,
            "stage_s": done - start,
        }
        return StagedPolicy(tensors, hashes, stats)

    def gather(self, policy: Policy, dtypes: Mapping[str, str] | None = None) -> None:
        """What `stage` runs on the devices, in its order, without the host copies and hashes:
        the part of a publication a process other than the publishing one takes (each of its
        collectives, the gathers of multi-process parameters, needs every process)."""
        from flax import nnx

        flat = dict(nnx.to_flat_state(policy.params))
        table = hf_entries(policy.config, "actor")
        device = _local_device(flat[table[0].path][...])
        buckets = self._plan(flat, table, dtypes or {})
        device_cast = self._device_casts(buckets, device)
        for _, _, current in self._prepared(flat, buckets, device_cast):
            for value in current:
                if not value.is_fully_addressable:
                    to_host(value)

    def _device_casts(self, buckets: list[list[_Slot]], device) -> dict:
        return {
            (s.source_dtype, s.dtype): self.cast_on_device is not False
            and device_cast_is_exact(s.source_dtype, s.dtype, device)
            for b in buckets
            for s in b
            if s.source_dtype != s.dtype
        }

    def _prepared(self, flat, buckets: list[list[_Slot]], device_cast: dict):
        """(k, bucket k, its device values), bucket k + 1's device work dispatched before k is
        yielded (it queues while k copies); `stage` and `gather` both walk this, so every
        process runs the same device programs in the same order."""
        pending = self._prepare(flat, buckets[0], device_cast)
        for k, bucket in enumerate(buckets):
            current, pending = pending, None
            if k + 1 < len(buckets):
                pending = self._prepare(flat, buckets[k + 1], device_cast)
            yield k, bucket, current
            del current

    def _prepare(self, flat, bucket: list[_Slot], device_cast: dict) -> list:
        """Dispatch the device work of one bucket: the layer slice, the HF layout (transposes,
        reshapes: exact on any device) and the cast where the device's cast is bitwise numpy's."""
        out = []
        for slot in bucket:
            value = hf_view(flat[slot.entry.path][...], slot.entry)
            if slot.dtype != slot.source_dtype and device_cast[(slot.source_dtype, slot.dtype)]:
                value = value.astype(slot.dtype)
            out.append(value)
        return out

    def _copy_bucket(self, k: int, bucket: list[_Slot], values: list, backend: str) -> int:
        """Copy one bucket's device values into its buffer; returns the number of host casts."""
        host_casts = 0
        cuda_devices = set()  # the devices whose copies this bucket waits for
        for slot, value in zip(bucket, values, strict=True):
            if slot.nbytes == 0:
                continue
            dst = self._view(k, slot)
            if not value.is_fully_addressable:  # sharded over processes: gathered (collective)
                with np.errstate(invalid="ignore", over="ignore"):
                    np.copyto(dst, to_host(value), casting="unsafe")
                host_casts += int(np.dtype(value.dtype) != slot.dtype)
            elif np.dtype(value.dtype) != slot.dtype:  # numpy's cast, on the host
                with np.errstate(invalid="ignore", over="ignore"):
                    for index, data in _pieces(value):
                        np.copyto(dst[index], np.asarray(data), casting="unsafe")
                host_casts += 1
            elif backend == "numpy":
                for index, data in _pieces(value):
                    np.copyto(dst[index], np.asarray(data))
            else:
                import torch

                target = self._torch_view(k, slot)
                for index, data in _pieces(value):
                    source = torch.from_dlpack(data)
                    target[index].copy_(source, non_blocking=True)
                    if source.is_cuda:
                        cuda_devices.add(source.device)
        if cuda_devices:  # the whole bucket is on the host before it is hashed
            import torch

            for cuda_device in cuda_devices:
                torch.cuda.synchronize(cuda_device)
        return host_casts

    def close(self) -> None:
        """Release the buffers (the next stage allocates again)."""
        self._host, self._torch, self._buckets, self._layout_key = [], [], [], None


def to_host(value) -> np.ndarray:
    """The whole of a multi-process array on this host (a collective over the processes)."""
    from jaxloop.parallel.mesh import to_host as gather

    return gather(value)


def _local_device(array):
    """A device of this process that holds part of `array` (where cast probes run)."""
    return min(array.sharding.addressable_devices, key=lambda d: d.id)


def _pieces(value):
    """(index into the whole tensor, single-device array) covering `value` once: the array itself,
    or one replica of each distinct shard of a sharded array (no gather on the device)."""
    if len(value.sharding.device_set) == 1:
        return [((), value)]
    seen, out = set(), []
    for shard in value.addressable_shards:
        key = tuple((s.start, s.stop, s.step) for s in shard.index)
        if key not in seen:
            seen.add(key)
            out.append((shard.index, shard.data))
    return out
