"""Prompt sources: a deterministic, resumable stream of (prompt, label) examples.

A `PromptSource` hands out batches with `next_batch(n)` and advances a cursor (epoch, position).
`state()` is a JSON-serialisable dict; `restore(state)` puts the cursor back so the continuation is
identical. Finite sources visit their rows in a permutation seeded by (seed, epoch), and a batch
may span two epochs.

- `BuiltinSource(task, seed)`: infinite, example i = `task.prompt('train', i, seed=seed)`;
  `len()` is the task's prompt-space size, used as a nominal epoch length for `state()`.
- `FileSource(path, seed, shape, rows)`: JSONL (`.jsonl`, `.json` with one object per line) or
  Parquet (`.parquet`, `.pq`) rows; `RowShape` says where the prompt and label are (dotted paths),
  the template of string prompts and how the label is extracted (docs/data.md). A prompt is a
  string or a list of {role, content} chat messages (`Message`), which the tokenizer renders
  (`format_prompt`). `rows="sft"`: SFT rows, {prompt, response} or {messages}, the response (the
  last assistant message) as the example's label.
- `make_source(cfg)`; `make_eval_examples(cfg, n)` for the held-out prompts; `sft_data(data,
  sft_source)` for the SFT batches; `encode_prompts(tokenizer, examples, max_prompt_tokens)`:
  every prompt's ids, or one error naming the file and row of a prompt that cannot be rendered
  or is too long.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxloop.data.tasks import DEFAULT_TASK, BuiltinTask
from jaxloop.data.tokenizer import TokenizerError
from jaxloop.data.types import ROLES, DataError, Example, Message, Prompt, PromptSource
from jaxloop.textfile import utf8_lines

__all__ = [
    "BuiltinSource",
    "DataError",
    "Example",
    "FileSource",
    "PromptSource",
    "RowShape",
    "encode_prompts",
    "load_examples",
    "make_eval_examples",
    "make_source",
    "sft_data",
]


class BuiltinSource(PromptSource):
    """Infinite stream of training prompts of a `BuiltinTask`; cursor i -> task example i."""

    kind = "builtin"

    def __init__(self, task, seed: int = 0):
        super().__init__(seed)
        self.task = task

    def __len__(self) -> int:
        return self.task.num_prompts

    def _example(self, epoch: int, position: int) -> Example:
        return self.task.prompt("train", epoch * len(self) + position, seed=self.seed)

    def _extra_state(self) -> dict[str, Any]:
        return {"task": self.task.name, "num_digits": self.task.num_digits}

    def eval_examples(self, n: int) -> list[Example]:
        return self.task.eval_examples(n)


@dataclass(frozen=True)
class RowShape:
    """Where a row keeps its prompt and label (dotted paths into nested rows), the template of
    a string prompt and how the label is read (`none` | `gsm8k`)."""

    prompt_key: str = "prompt"
    label_key: str = "label"
    prompt_template: str = "{prompt}"
    label_extract: str = "none"

    @classmethod
    def of(cls, cfg: Any) -> RowShape:
        return cls(
            prompt_key=str(_get(cfg, "prompt_key", "prompt")),
            label_key=str(_get(cfg, "label_key", "label")),
            prompt_template=str(_get(cfg, "prompt_template", "{prompt}")),
            label_extract=str(_get(cfg, "label_extract", "none")),
        )


_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.]*)\}")


def fill_template(template: str, prompt: str, row: Mapping[str, Any]) -> str:
    """`template` with {prompt} and {NAME} (a field of the row, dotted paths too) replaced; every
    other brace, such as `\\boxed{}` or {x} of a field the row lacks, stays as written (not
    str.format, which would reject them)."""

    def one(match: re.Match) -> str:
        name = match.group(1)
        if name == "prompt":
            return prompt
        found, value = _lookup(row, name)
        return str(value) if found and not isinstance(value, dict | list) else match.group(0)

    return _FIELD.sub(one, template)


def extract_gsm8k(answer: str) -> str | None:
    """The text after the last `####` of a GSM8K answer, thousands separators removed."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def _lookup(row: Any, dotted: str) -> tuple[bool, Any]:
    value = row
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False, None
        value = value[part]
    return True, value


class FileSource(PromptSource):
    """All rows of a JSONL or Parquet file, reshuffled every epoch."""

    kind = "file"

    def __init__(
        self,
        path: str | os.PathLike,
        seed: int = 0,
        shape: RowShape | None = None,
        rows: str = "rl",
    ):
        super().__init__(seed)
        self.path = Path(path)
        self.examples = load_examples(self.path, shape, rows)
        h = hashlib.sha256()
        for ex in self.examples:
            h.update(json.dumps([_plain(ex.prompt), ex.label]).encode("utf-8"))
            h.update(b"\n")
        self.digest = h.hexdigest()
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def _example(self, epoch: int, position: int) -> Example:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, epoch])
            self._perm = rng.permutation(len(self.examples))
            self._perm_epoch = epoch
        return self.examples[int(self._perm[position])]

    def _extra_state(self) -> dict[str, Any]:
        return {"digest": self.digest}

    def restore(self, state: Mapping[str, Any]) -> None:
        super().restore(state)
        self._perm_epoch = -1


def _plain(prompt: Prompt) -> Any:
    """A prompt as JSON: a string as itself (the digest of string rows is an older run's)."""
    return prompt if isinstance(prompt, str) else [[m.role, m.content] for m in prompt]


def load_examples(
    path: str | os.PathLike, shape: RowShape | None = None, rows: str = "rl"
) -> list[Example]:
    """The rows of a JSONL or Parquet file as examples (`shape`: where the prompt and label are;
    `rows="sft"`: SFT rows, `_to_sft_example`); DataError naming the file, row and key
    otherwise."""
    shape = shape or RowShape()
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        records = _read_jsonl(path)
    elif suffix in (".parquet", ".pq"):
        records = _read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported data file type {suffix!r} (use .jsonl or .parquet)")
    if rows == "sft":
        if not records:
            raise DataError(
                f"{path}: no rows (expected {{{shape.prompt_key}, response}} or {{messages}})"
            )
        return [_to_sft_example(path, where, row, shape) for where, row in records]
    if not records:
        raise DataError(
            f"{path}: no rows (expected records with {shape.prompt_key}, {shape.label_key})"
        )
    return [_to_example(path, where, row, shape) for where, row in records]


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    for lineno, line in utf8_lines(path, DataError):
        try:
            rows.append((f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from None
    return rows


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types
        raise DataError(f"{path}: cannot read Parquet ({type(e).__name__}: {e})") from None
    # whole rows: prompt_key / label_key may reach into struct columns, templates into others
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]


def _to_example(path: Path, where: str, row: Any, shape: RowShape) -> Example:
    if not isinstance(row, dict):
        raise DataError(f"{path}: {where} is a {type(row).__name__}, expected an object")
    missing = [key for key in (shape.prompt_key, shape.label_key) if _lookup(row, key)[1] is None]
    if missing:
        raise DataError(
            f"{path}: {where} is missing field(s) {missing} (data.prompt_key / "
            f"data.label_key; the row's keys: {sorted(row)})"
        )
    prompt = _prompt(path, where, row, shape)
    label = _lookup(row, shape.label_key)[1]
    if isinstance(label, bool) or not isinstance(label, str | int | float):
        raise DataError(
            f"{path}: {where} key {shape.label_key} is a label of type "
            f"{type(label).__name__}, expected a string or a number"
        )
    label = label if isinstance(label, str) else str(label)
    if shape.label_extract == "gsm8k":
        extracted = extract_gsm8k(label)
        if extracted is None:
            raise DataError(
                f"{path}: {where} key {shape.label_key} has no '####' (data.label_extract=gsm8k)"
            )
        label = extracted
    if not label.strip():
        raise DataError(f"{path}: {where} key {shape.label_key} is an empty label")
    return Example(prompt, label, origin=f"{path}: {where}", row=row)


def _prompt(path: Path, where: str, row: dict, shape: RowShape) -> Prompt:
    """The row's prompt: a string through data.prompt_template, or chat messages as written
    (the template applies to string prompts only: set with messages, it is refused rather than
    ignored)."""
    key = shape.prompt_key
    value = _lookup(row, key)[1]
    if isinstance(value, list):
        messages = _messages(path, where, key, value)
        _no_template(path, where, key, shape)
        return messages
    if not isinstance(value, str) or not value:
        raise DataError(
            f"{path}: {where} key {key} is not a non-empty string or a list of chat messages"
        )
    return fill_template(shape.prompt_template, value, row)


def _no_template(path: Path, where: str, key: str, shape: RowShape) -> None:
    if shape.prompt_template != "{prompt}":
        raise DataError(
            f"{path}: {where} key {key} is a list of chat messages, and "
            f"data.prompt_template={shape.prompt_template!r} applies to string prompts only "
            "(leave it at {prompt} for chat rows)"
        )


def _messages(path: Path, where: str, key: str, value: list) -> tuple[Message, ...]:
    """`value` as chat messages: each a {role, content} object, role system | user |
    assistant, content a string; DataError naming file, row and key (`KEY[i].role`)."""
    if not value:
        raise DataError(f"{path}: {where} key {key} is an empty list of chat messages")
    out = []
    for i, message in enumerate(value):
        at = f"{key}[{i}]"
        if not isinstance(message, Mapping):
            raise DataError(
                f"{path}: {where} key {at} is a {type(message).__name__}, expected a chat "
                "message {role, content}"
            )
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DataError(
                f"{path}: {where} key {at}.role is {role!r}; a message's role is "
                f"{', '.join(ROLES[:-1])} or {ROLES[-1]}"
            )
        if not isinstance(content, str):
            what = "missing" if content is None else f"a {type(content).__name__}"
            raise DataError(
                f"{path}: {where} key {at}.content is {what}; a message's content is a string"
            )
        out.append(Message(role, content))
    return tuple(out)


SFT_TARGET_KEYS = ("response", "completion")  # jaxloop's / verl's name, and TRL's


def _to_sft_example(path: Path, where: str, row: Any, shape: RowShape) -> Example:
    """An SFT row as an example whose label is the target: {PROMPT_KEY, response} (TRL's
    `completion` too; a string, or one assistant message), the prompt a string (through
    data.prompt_template) or chat messages; or {messages}, the last one an assistant message
    (the target) and the ones before it the prompt."""
    if not isinstance(row, dict):
        raise DataError(f"{path}: {where} is a {type(row).__name__}, expected an object")
    target_key = next((k for k in SFT_TARGET_KEYS if row.get(k) is not None), None)
    if _lookup(row, shape.prompt_key)[1] is not None and target_key is not None:
        prompt = _prompt(path, where, row, shape)
        target = row[target_key]
        if isinstance(target, list):  # TRL's conversational completion: [assistant message]
            messages = _messages(path, where, target_key, target)
            if len(messages) != 1 or messages[0].role != "assistant":
                raise DataError(
                    f"{path}: {where} key {target_key} is a list of messages; an SFT target "
                    "is one assistant message"
                )
            target = messages[0].content
    elif row.get("messages") is not None:
        target_key = "messages"
        value = row["messages"]
        if not isinstance(value, list):
            raise DataError(f"{path}: {where} key messages is not a list of chat messages")
        messages = _messages(path, where, "messages", value)
        if len(messages) < 2 or messages[-1].role != "assistant":
            raise DataError(
                f"{path}: {where} key messages must end in an assistant message (the target) "
                "after at least one prompt message"
            )
        _no_template(path, where, "messages", shape)
        prompt, target = messages[:-1], messages[-1].content
    else:
        raise DataError(
            f"{path}: {where} is not an SFT row: expected {{{shape.prompt_key}, response}} "
            f"(data.prompt_key; or TRL's completion) or {{messages}}; the row's keys: "
            f"{sorted(row)}"
        )
    if not isinstance(target, str) or not target.strip():
        raise DataError(
            f"{path}: {where} key {target_key} has no target text (an empty or non-string response)"
        )
    return Example(prompt, target, origin=f"{path}: {where}", row=row)


def encode_prompts(tokenizer, examples: list[Example], max_prompt_tokens: int) -> list[list[int]]:
    """Each example's prompt ids (`tokenizer.encode_prompt`: the one rendering of a prompt, as
    the rollout and SFT both use it); DataError naming the example's file and row when the
    tokenizer cannot render it (chat messages without a chat template, characters it cannot
    encode) or it is longer than `max_prompt_tokens` tokens (its length, after
    data.prompt_template and the chat template)."""
    out = []
    for ex in examples:
        where = f"{ex.origin}: " if ex.origin else ""
        try:
            ids = list(tokenizer.encode_prompt(ex.prompt))
        except TokenizerError as err:
            raise DataError(f"{where}{err}") from None
        if len(ids) > max_prompt_tokens:
            shown = "" if ex.origin else f": {str(_plain(ex.prompt))[:40]!r}"
            raise DataError(
                f"{where}prompt of {len(ids)} tokens (after data.prompt_template and the chat "
                f"template) is longer than data.max_prompt_tokens={max_prompt_tokens}{shown}"
            )
        out.append(ids)
    return out


def sft_data(data: Mapping[str, Any], sft_source: str | None) -> dict[str, Any]:
    """The data settings of SFT batches: `sft.source`'s rows ({prompt, response} or {messages})
    when it is set, else `data`'s own {prompt, label} rows (data.source: the built-in task's train
    split or a file)."""
    if not sft_source:
        return dict(data)
    return {**data, "source": str(sft_source), "rows": "sft"}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    try:
        value = cfg[key]
    except (KeyError, AttributeError, TypeError):
        value = getattr(cfg, key, default)
    return default if value is None else value


def make_source(cfg: Any) -> PromptSource:
    """`cfg` (dict-like): source ('builtin' or a file path), task, num_digits, seed."""
    source = str(_get(cfg, "source", "builtin"))
    seed = int(_get(cfg, "seed", 0))
    if source == "builtin":
        task = BuiltinTask(
            name=str(_get(cfg, "task", DEFAULT_TASK)),
            num_digits=int(_get(cfg, "num_digits", 4)),
            seed=seed,
        )
        return BuiltinSource(task, seed=seed)
    rows = str(_get(cfg, "rows", "rl"))
    return FileSource(source, seed=seed, shape=RowShape.of(cfg), rows=rows)


def make_eval_examples(cfg: Any, n: int) -> list[Example]:
    """Held-out examples: the builtin task's eval split, or the first `n` rows of
    `cfg['eval_source']` for file sources (an empty list when there is none)."""
    eval_source = _get(cfg, "eval_source", None)
    if eval_source:
        return load_examples(eval_source, RowShape.of(cfg))[:n]
    if str(_get(cfg, "source", "builtin")) == "builtin":
        task = BuiltinTask(
            name=str(_get(cfg, "task", DEFAULT_TASK)),
            num_digits=int(_get(cfg, "num_digits", 4)),
            seed=int(_get(cfg, "seed", 0)),
        )
        return task.eval_examples(n)
    return []
