"""Build a small byte-level BPE tokenizer offline (no downloads) and save it as an HF tokenizer dir.

    python scripts/build_tokenizer.py --out DIR [--data examples/gsm8k_tiny.jsonl ...]
        [--vocab-size 512]

Trained with the `tokenizers` library on the text of the given JSONL rows (every string value,
nested ones included) plus a built-in arithmetic corpus, so every byte and the usual digits,
operators and words have tokens. The dir holds what `transformers.AutoTokenizer` and jaxloop's
`data.tokenizer` read:

- tokenizer.json, tokenizer_config.json with a ChatML chat template (Qwen's layout:
  `<|im_start|>role\\ncontent<|im_end|>\\n`, generation prompt `<|im_start|>assistant\\n`);
- generation_config.json listing two EOS ids, `<|im_end|>` (the tokenizer's eos) and
  `<|endoftext|>`, as Qwen's does: a response ends at either.

The same inputs give the same files (BPE training is deterministic). Errors: one `error: ...`
line on stderr, exit code 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD, EOS = "<|endoftext|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class BuildError(ValueError):
    """A bad command line or input file."""


def builtin_corpus() -> list[str]:
    """Arithmetic sentences in the shape of GSM8K's questions and answers."""
    lines = []
    for a in range(0, 100, 7):
        for b in range(1, 30, 4):
            lines.append(f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}")
            lines.append(f"{a} * {b} = {a * b}. The answer is {a * b}. \\boxed{{{a * b}}}")
    lines.append("How many are left? How many does she have in total? Each, more, gave away.")
    return lines


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def corpus_from(files: Sequence[Path]) -> list[str]:
    texts = []
    for file in files:
        if not file.is_file():
            raise BuildError(f"--data {file}: no such file")
        for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.extend(_strings(json.loads(line)))
            except json.JSONDecodeError as err:
                raise BuildError(f"{file}:{n}: invalid JSON ({err.msg})") from None
    return texts


def build(out: Path, texts: list[str], vocab_size: int) -> Path:
    """Train the BPE on `texts` and write the HF tokenizer dir `out` (atomically)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        raw.save(str(tmp / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS,
            "pad_token": PAD,
            "bos_token": None,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": 4096,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        eos_ids = [raw.token_to_id(EOS), raw.token_to_id(PAD)]
        generation = {"eos_token_id": eos_ids, "pad_token_id": raw.token_to_id(PAD)}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/build_tokenizer.py", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", required=True, type=Path, help="HF tokenizer dir to write (new/empty)")
    p.add_argument("--data", type=Path, nargs="*", default=[], help="JSONL files to train on")
    p.add_argument("--vocab-size", type=int, default=512)
    args = p.parse_args(argv)
    try:
        if args.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise BuildError(
                f"--vocab-size {args.vocab_size}: a byte-level BPE needs at least "
                f"{256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} specials)"
            )
        if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
            raise BuildError(f"--out {args.out} exists and is not an empty directory")
        texts = corpus_from(args.data) + builtin_corpus()
        out = build(args.out.resolve(), texts, args.vocab_size)
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    size = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    print(f"wrote {out}: byte-level BPE, {len(size)} tokens, chat template, EOS {EOS} and {PAD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
