"""How a publication travels to the engine actors.

- A transport (`rollout.transport`, chosen once by `make_transport`) stages a publication's
  safetensors buckets where the engines can fetch them (Ray object store: object refs; disk:
  files) and reads one back on the engine's side.
- A `Publication` is what an engine actor receives: the manifest, the staged buckets, the
  transport that reads them and the transaction's finish message (count and digest: the
  manifest's).
- A `ReplayChain` is the committed version as publications: the last full one and the deltas
  since. An engine (or a whole manager) started now replays it to serve that version. The
  trainer's client owns it (it outlives managers and engines, and owns the buckets); the engine
  group serves the chain the client hands it with each publication.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np
import ray

from jaxloop.rollout.publication.transaction import Manifest


class Transport(Protocol):
    name: ClassVar[str]

    def stage(self, buckets: Iterable[bytes], label: str) -> tuple[list, str | None]:
        """(what the engines fetch the buckets by, a directory to remove with them or None)."""

    def read(self, chunk):
        """One bucket's bytes (a buffer) on the engine's side."""


class ObjectStoreTransport:
    """Buckets as uint8 arrays in the Ray object store (the refs are the publisher's: they
    live as long as the publication is held)."""

    name: ClassVar[str] = "object_store"

    def stage(self, buckets: Iterable[bytes], label: str) -> tuple[list, str | None]:
        return [ray.put(np.frombuffer(c, np.uint8)) for c in buckets], None

    def read(self, chunk):
        return ray.get(chunk)


@dataclasses.dataclass(frozen=True)
class DiskTransport:
    """Buckets as files under `root`/<label>/ (a directory every engine can read)."""

    root: str
    name: ClassVar[str] = "disk"

    def stage(self, buckets: Iterable[bytes], label: str) -> tuple[list, str | None]:
        where = Path(self.root) / label
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        paths = []
        for i, c in enumerate(buckets):
            path = where / f"chunk-{i:05d}.safetensors"
            path.write_bytes(c)
            paths.append(str(path))
        return paths, str(where)

    def read(self, chunk):
        return Path(chunk).read_bytes()


def make_transport(name: str, root: str | Path) -> Transport:
    """The transport `rollout.transport` names ('object_store' | 'disk': files under root)."""
    if name == ObjectStoreTransport.name:
        return ObjectStoreTransport()
    if name == DiskTransport.name:
        return DiskTransport(str(root))
    raise ValueError(f"rollout.transport={name!r}: expected object_store or disk")


@dataclasses.dataclass(frozen=True, eq=False)  # one publication is itself (buckets by identity)
class Publication:
    """One publication as the engines receive it (see the module docstring)."""

    manifest: Manifest
    chunks: tuple
    transport: Transport
    count: int
    digest: str
    where: str | None = None  # the staged files' directory (disk), removed by release()

    @classmethod
    def stage(
        cls, manifest: Manifest, buckets: Iterable[bytes], transport: Transport, label: str
    ) -> Publication:
        chunks, where = transport.stage(buckets, label)
        return cls(manifest, tuple(chunks), transport, manifest.count, manifest.digest, where)

    @property
    def version(self) -> int:
        return self.manifest.version

    def release(self) -> None:
        """Drop what was staged on disk (object refs go with the last reference)."""
        if self.where is not None:
            shutil.rmtree(self.where, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class ReplayChain:
    """The committed version as the publications an engine started now replays (the last full
    publication and the deltas since); empty before the first publication."""

    publications: tuple[Publication, ...] = ()

    @property
    def version(self) -> int | None:
        return self.publications[-1].version if self.publications else None

    @property
    def delta_bytes(self) -> int:
        """The bytes its deltas carry (what a replay sends beyond the full publication)."""
        return sum(p.manifest.sent_bytes for p in self.publications[1:])

    def after(self, publication: Publication, replay: Publication | None = None) -> ReplayChain:
        """The chain once `publication` commits: a full publication starts a new chain, a delta
        extends it; `replay` (a full publication of the same version, staged, not sent)
        rebases it."""
        if replay is not None:
            return ReplayChain((replay,))
        if publication.manifest.base_version is None:
            return ReplayChain((publication,))
        return ReplayChain((*self.publications, publication))

    def __iter__(self) -> Iterator[Publication]:
        return iter(self.publications)

    def __len__(self) -> int:
        return len(self.publications)

    def __getitem__(self, index: int) -> Publication:
        return self.publications[index]
