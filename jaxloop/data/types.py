"""The data layer's shared types: an example, the data error and the prompt-source base class.

Both the sources (datasets.py) and the builtin tasks (tasks.py) import them from here, so neither
imports the other to get them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxloop.errors import UsageError

__all__ = ["ROLES", "DataError", "Example", "Message", "Prompt", "PromptSource"]


class DataError(UsageError):
    """A data file is missing, empty or malformed, or a saved cursor does not fit the source."""


@dataclass(frozen=True)
class Message:
    """One chat message of a prompt: role system | user | assistant."""

    role: str
    content: str


# a string prompt, or chat messages that the tokenizer's chat template renders
Prompt = str | tuple[Message, ...]
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Example:
    prompt: Prompt
    label: str
    # where a file row came from ("FILE: line N" / "FILE: row N"), for errors found later (a
    # prompt the tokenizer cannot render, or one too long); "" for built-in prompts
    origin: str = field(default="", compare=False)
    # the data file's row as read, handed to a reward function that takes it (rewards.with_row);
    # None for a built-in task, whose row is {prompt, label} (`reward_row`). Not compared: two
    # examples are the same prompt and label.
    row: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def reward_row(self) -> Mapping[str, Any]:
        return self.row if self.row is not None else {"prompt": self.prompt, "label": self.label}


class PromptSource:
    """Base class: subclasses implement `__len__` and `_example(epoch, position)`."""

    kind = "base"

    def __init__(self, seed: int = 0):
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _example(self, epoch: int, position: int) -> Example:  # pragma: no cover - abstract
        raise NotImplementedError

    def next_batch(self, n: int) -> list[Example]:
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        out = []
        size = len(self)
        for _ in range(n):
            out.append(self._example(self.epoch, self.position))
            self.position += 1
            if self.position >= size:
                self.epoch += 1
                self.position = 0
        return out

    def state(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "size": len(self),
            **self._extra_state(),
        }

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        try:
            kind, seed = state["kind"], int(state["seed"])
            epoch, position, size = int(state["epoch"]), int(state["position"]), int(state["size"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"bad data-source state {dict(state)!r}: {e}") from None
        if kind != self.kind:
            raise DataError(f"cannot restore a {kind!r} source state into a {self.kind!r} source")
        if size != len(self):
            raise DataError(
                f"saved data-source state has size {size} but this {self.kind} source has "
                f"{len(self)} examples; the data changed since the checkpoint"
            )
        for key, value in self._extra_state().items():
            if state.get(key) != value:
                raise DataError(
                    f"saved data-source state has {key}={state.get(key)!r} but this source has "
                    f"{value!r}; the data changed since the checkpoint"
                )
        if epoch < 0 or not 0 <= position < size:
            raise DataError(f"bad data-source cursor epoch={epoch} position={position}")
        self.seed, self.epoch, self.position = seed, epoch, position
