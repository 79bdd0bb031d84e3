"""Named registries (policy losses, advantage estimators, rewards, algorithms): one small class.

A registry is a read-only mapping name -> entry that fills as modules register into it, so
`name in REG`, `REG[name]` and `sorted(REG)` work as on a dict; `get` is the lookup whose error
names the known entries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Entries of one `kind` ('policy loss', 'algorithm', ...) by name; `plural` names them in
    errors (default: kind + 's')."""

    def __init__(self, kind: str, plural: str | None = None):
        self.kind = kind
        self.plural = plural or f"{kind}s"
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Register `entry` under `name`; the same entry again is a no-op (a module re-imported),
        another one a ValueError."""
        if name in self._entries and self._entries[name] is not entry:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of add."""
        return lambda entry: self.add(name, entry)

    def get(self, name: str) -> T:  # type: ignore[override]  (raises instead of a default)
        """The entry named `name`; ValueError naming the valid ones otherwise."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; valid {self.plural}: {self.names()}")
        return self._entries[name]

    def pop(self, name: str) -> T:
        """Unregister `name` (a test's temporary entry); returns its entry."""
        return self._entries.pop(name)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
