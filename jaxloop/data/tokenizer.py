"""Tokenizers: a fixed character tokenizer for the built-in tasks and a local HF tokenizer wrapper.

Both follow the `Tokenizer` protocol:

- `encode(text)` -> ids, never adding special tokens;
- `decode(ids)` -> text, dropping pad/bos/eos ids wherever they occur (it does not stop at eos);
- `pad_id`, `bos_id`, `eos_id`, `vocab_size`;
- `eos_ids`: every id that ends a response (`eos_id` first, then any other EOS id of the model's
  `generation_config.json`, which may list several, as Qwen's does);
- `format_prompt(prompt)` -> the text the model should see: the one place a prompt is rendered.
  A string prompt is itself (char tokenizer, or an HF tokenizer without a chat template) or the
  chat template applied to it as one user message; chat messages (a tuple of `Message`) are the
  chat template applied to them, with its generation prompt, and need a tokenizer that has one
  (`TokenizerError` otherwise);
- `encode_prompt(prompt)` -> `[bos] + encode(format_prompt(prompt))`, adding bos only when the
  tokenizer has one and the formatted text does not already start with it;
- `digest()` -> sha256 hex of the vocabulary and config, identical across processes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from jaxloop.data.types import Message, Prompt
from jaxloop.errors import UsageError

__all__ = [
    "CHAR_ALPHABET",
    "GENERATION_CONFIG",
    "UNUSED_CHAR",
    "CharTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerError",
    "generation_eos_ids",
]


class TokenizerError(UsageError):
    """A tokenizer cannot be built or cannot represent the given text / ids."""


@runtime_checkable
class Tokenizer(Protocol):
    pad_id: int
    bos_id: int | None
    eos_id: int
    eos_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def format_prompt(self, prompt: Prompt) -> str: ...

    def encode_prompt(self, prompt: Prompt) -> list[int]: ...

    def digest(self) -> str: ...


# 10 digits + 26 letters + space + 16 symbols = 53 characters; with pad/bos/eos: 56 ids.
CHAR_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-=*/<>?:,.()!'_"
_CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>")


UNUSED_CHAR = "\N{REPLACEMENT CHARACTER}"


class CharTokenizer:
    """One id per character: pad=0, bos=1, eos=2, then `CHAR_ALPHABET` from id 3.

    `vocab_size` (default 64) is the model's vocabulary size; ids above the alphabet are unused
    and are never produced by `encode`, but a policy can sample them: they decode to
    `UNUSED_CHAR` (so a reward sees a wrong answer), while ids outside the vocabulary raise
    `TokenizerError`.
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2
    eos_ids = (2,)

    def __init__(self, vocab_size: int = 64):
        need = len(_CHAR_SPECIALS) + len(CHAR_ALPHABET)
        if vocab_size < need:
            raise TokenizerError(
                f"CharTokenizer needs vocab_size >= {need} (3 specials + {len(CHAR_ALPHABET)} "
                f"characters), got {vocab_size}"
            )
        self.vocab_size = int(vocab_size)
        self._to_id = {c: i + len(_CHAR_SPECIALS) for i, c in enumerate(CHAR_ALPHABET)}
        self._to_char = {i: c for c, i in self._to_id.items()}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._to_id[c] for c in text]
        except KeyError:
            bad = sorted({c for c in text if c not in self._to_id})
            raise TokenizerError(
                f"CharTokenizer cannot encode {bad!r} in {text[:40]!r}; the alphabet is "
                f"{CHAR_ALPHABET!r} (lowercase only)"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in (self.pad_id, self.bos_id, self.eos_id):
                continue
            c = self._to_char.get(i)
            if c is None:
                if not 0 <= i < self.vocab_size:
                    raise TokenizerError(
                        f"CharTokenizer cannot decode id {i}: vocab_size is {self.vocab_size}"
                    )
                c = UNUSED_CHAR
            out.append(c)
        return "".join(out)

    def format_prompt(self, prompt: Prompt) -> str:
        if not isinstance(prompt, str):
            raise TokenizerError(
                "a chat-message prompt needs a tokenizer with a chat template; the char "
                "tokenizer has none (set data.tokenizer to an HF tokenizer dir with one)"
            )
        return prompt

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return [self.bos_id, *self.encode(self.format_prompt(prompt))]

    def digest(self) -> str:
        blob = {
            "type": "char",
            "vocab_size": self.vocab_size,
            "specials": list(_CHAR_SPECIALS),
            "alphabet": CHAR_ALPHABET,
        }
        return _sha256_json(blob)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# the files AutoTokenizer builds a tokenizer from (a directory with none of them has none)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class HFTokenizer:
    """`transformers.AutoTokenizer` loaded from a local directory (never from the network).

    `pad_id` falls back to `eos_id` when the tokenizer has no pad token. `bos_id` is None when the
    tokenizer has no BOS token (e.g. Qwen); use `encode_prompt` to get correctly-prefixed ids.
    `decode` drops pad/bos/eos and any other special token (e.g. `<|im_end|>`).
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if not path.is_dir():
            raise TokenizerError(f"tokenizer directory not found: {path}")
        if not any((path / name).is_file() for name in HF_TOKENIZER_FILES):
            raise TokenizerError(
                f"no HF tokenizer in {path}: it holds none of {', '.join(HF_TOKENIZER_FILES)}"
            )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its warnings would add lines to a one-line error
        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - surface one clear error
            why = " ".join(str(e).split()) or type(e).__name__  # transformers: several lines
            raise TokenizerError(f"cannot load a tokenizer from {path}: {why}") from e
        finally:
            hf_logging.set_verbosity(verbosity)
        self.path = path
        self.tok = tok
        if tok.eos_token_id is None:
            raise TokenizerError(f"tokenizer in {path} has no eos token")
        self.eos_id = int(tok.eos_token_id)
        self.bos_id = None if tok.bos_token_id is None else int(tok.bos_token_id)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.eos_ids = tuple(dict.fromkeys([self.eos_id, *generation_eos_ids(path)]))
        self.vocab_size = len(tok)
        self._skip = {i for i in (self.pad_id, self.bos_id, *self.eos_ids) if i is not None}

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        keep = [int(i) for i in ids if int(i) not in self._skip]
        return self.tok.decode(keep, skip_special_tokens=True)

    def format_prompt(self, prompt: Prompt) -> str:
        if isinstance(prompt, str):
            if not self.has_chat_template:
                return prompt
            return self.format_messages((Message("user", prompt),))
        if not self.has_chat_template:
            raise TokenizerError(
                f"a chat-message prompt needs a tokenizer with a chat template; {self.path} "
                "has none (tokenizer_config.json without chat_template)"
            )
        return self.format_messages(prompt)

    def format_messages(self, messages: Sequence[Message]) -> str:
        """The chat template applied to `messages`, ending in the generation prompt (the
        assistant turn the model continues)."""
        chat = [{"role": m.role, "content": m.content} for m in messages]
        return self.tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        ids = self.encode(self.format_prompt(prompt))
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def digest(self) -> str:
        tok = self.tok
        blob = {
            "type": "hf",
            "class": type(tok).__name__,
            "vocab": sorted(tok.get_vocab().items(), key=lambda kv: (kv[1], kv[0])),
            "specials": [self.pad_id, self.bos_id, self.eos_id, *self.eos_ids[1:]],
            "chat_template": getattr(tok, "chat_template", None),
        }
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:  # normalizer / pre-tokenizer / merges of fast tokenizers
            full = json.loads(backend.to_str())
            full.pop("added_tokens", None)
            model = full.get("model", {})
            if isinstance(model.get("vocab"), dict):
                model["vocab"] = None  # already covered (ordered) above
            blob["backend"] = full
        return _sha256_json(blob)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


GENERATION_CONFIG = "generation_config.json"


def generation_eos_ids(path: str | os.PathLike) -> tuple[int, ...]:
    """The `eos_token_id` of `path/generation_config.json` (an int or a list of ints) as a tuple;
    () without the file or the key."""
    file = Path(path) / GENERATION_CONFIG
    if not file.is_file():
        return ()
    try:
        value = json.loads(file.read_text()).get("eos_token_id")
    except (ValueError, AttributeError) as err:
        raise TokenizerError(f"{file}: not a JSON object ({err})") from None
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerError(f"{file}: eos_token_id must be an id or a list of ids, got {value!r}")
    return tuple(values)


def _sha256_json(obj) -> str:
    text = json.dumps(obj, sort_keys=True, ensure_ascii=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
