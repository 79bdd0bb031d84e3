"""Work-arounds for host-memory leaks under orbax 0.12.8 + tensorstore 0.1.86, applied on import.

tensorstore's Python bindings leak what a C++-JSON -> Python conversion returns (measured here:
about 250 bytes a `ts.KvStore.Spec(...).to_json()` call, 600 bytes a `ts.Spec(...).to_json()`,
3.5 KB an `experimental_collect_matching_metrics`, never freed). Orbax makes such calls around
every array it writes, so a trainer's host memory grew with every checkpoint (docs/reliability.md,
the soak). Both patches keep orbax's behaviour and its on-disk format; they only skip the leaking
conversion where its result is known without it.
"""

from __future__ import annotations

import types

import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils


def _no_raw_io_bytes(direction) -> None:
    return None  # orbax then skips its raw-throughput log line, the only use of the count


class _LocalFileSpec:
    """`ts.KvStore.Spec` for the one call orbax makes per array write (resolving the ocdbt base
    spec): a local `{'driver': 'file', 'path': ...}` spec resolves to itself (checked against
    tensorstore in tests/io/test_orbax_leaks.py), anything else goes to tensorstore."""

    def __new__(cls, spec):
        if isinstance(spec, dict) and set(spec) == {"driver", "path"} and spec["driver"] == "file":
            self = super().__new__(cls)
            self._spec = dict(spec)
            return self
        return ts.KvStore.Spec(spec)

    def to_json(self) -> dict:
        return dict(self._spec)


class _KvStore:
    Spec = _LocalFileSpec

    def __getattr__(self, name):
        return getattr(ts.KvStore, name)


class _TensorstoreForOrbax(types.ModuleType):
    """tensorstore as orbax's tensorstore_utils sees it: the module itself but for KvStore.Spec."""

    KvStore = _KvStore()

    def __getattr__(self, name):
        return getattr(ts, name)


def apply() -> None:
    if hasattr(tensorstore_utils, "get_tensorstore_raw_bytes"):
        tensorstore_utils.get_tensorstore_raw_bytes = _no_raw_io_bytes
    if getattr(tensorstore_utils, "ts", None) is ts:
        tensorstore_utils.ts = _TensorstoreForOrbax("tensorstore")


apply()
