"""CharTokenizer and HFTokenizer (on a tiny byte-level BPE built here, no downloads)."""

import json
import subprocess
import sys

import pytest

from jaxloop.data.tokenizer import (
    CHAR_ALPHABET,
    UNUSED_CHAR,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
)

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _digest_in_subprocess(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.strip().splitlines()[-1]


# ----- CharTokenizer ------------------------------------------------------------------------------
def test_char_layout_and_round_trip():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 64)
    assert isinstance(tok, Tokenizer)
    ids = tok.encode(CHAR_ALPHABET)
    assert ids == list(range(3, 3 + len(CHAR_ALPHABET)))
    assert max(ids) < 64 and len(set(ids)) == len(ids)
    for text in ["7294:", "3+5=", "the answer is 42.", "", " a,b?(c)!"]:
        assert tok.decode(tok.encode(text)) == text
    for needed in "0123456789abcdefghijklmnopqrstuvwxyz +-=*<>?:,.":
        assert needed in CHAR_ALPHABET


def test_char_no_specials_and_decode_skips_specials_everywhere():
    tok = CharTokenizer()
    assert tok.encode("12") == [4, 5]  # no bos / eos added
    assert tok.decode([1, 4, 2, 5, 0, 0]) == "12"  # does not stop at eos
    assert tok.format_prompt("12:") == "12:"
    assert tok.encode_prompt("12:") == [1, 4, 5, tok.encode(":")[0]]


def test_char_errors():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"cannot encode \['A', 'é'\]"):
        tok.encode("Aé1")
    # ids the alphabet leaves unused can be sampled by a policy: they decode to a marker that no
    # label contains; ids outside the vocabulary are an error.
    assert tok.decode([4, 63, 56]) == "1" + UNUSED_CHAR * 2
    with pytest.raises(TokenizerError, match="cannot decode id 64"):
        tok.decode([64])
    with pytest.raises(TokenizerError, match="cannot decode id -1"):
        tok.decode([-1])
    with pytest.raises(TokenizerError, match="vocab_size >= 56"):
        CharTokenizer(vocab_size=40)
    assert CharTokenizer(vocab_size=56).encode("_") == [55]


def test_char_digest_stable_across_processes():
    d = CharTokenizer().digest()
    assert len(d) == 64 and int(d, 16) >= 0
    code = "from jaxloop.data.tokenizer import CharTokenizer; print(CharTokenizer().digest())"
    assert _digest_in_subprocess(code) == d
    assert CharTokenizer(vocab_size=80).digest() != d


# ----- HFTokenizer --------------------------------------------------------------------------------
def _build_hf_tokenizer(path, *, chat_template=TEMPLATE, extra_text=""):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["what is 2+2? the answer is 4.", "hello world", "the quick brown fox " + extra_text]
    raw.train_from_iterator(corpus * 5, trainer)
    # A post-processor that adds <s>: encode() must still not add it.
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))]
    )
    path.mkdir(parents=True, exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _build_hf_tokenizer(tmp_path_factory.mktemp("hftok"))


def test_hf_round_trip_and_specials(hf_dir):
    tok = HFTokenizer(hf_dir)
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert 260 <= tok.vocab_size <= 300
    for text in ["what is 2+2?", "Ünïcödé ✓ and\nnewlines", "  spaces  ", ""]:
        ids = tok.encode(text)
        assert tok.bos_id not in ids and tok.eos_id not in ids
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    ids = tok.encode("hello world")
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id, tok.pad_id]) == "hello world"
    # eos in the middle is skipped, not a stop
    assert tok.decode([*ids, tok.eos_id, *ids]) == "hello worldhello world"


def test_hf_chat_template_and_encode_prompt(hf_dir):
    tok = HFTokenizer(hf_dir)
    assert tok.has_chat_template
    assert tok.format_prompt("what is 2+2?") == "<s><|user|>what is 2+2?<|assistant|>"
    ids = tok.encode_prompt("what is 2+2?")
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id  # the template's bos is not doubled
    assert ids == tok.encode(tok.format_prompt("what is 2+2?"))


def test_hf_without_chat_template_is_identity(tmp_path):
    tok = HFTokenizer(_build_hf_tokenizer(tmp_path / "plain", chat_template=None))
    assert not tok.has_chat_template
    assert tok.format_prompt("what is 2+2?") == "what is 2+2?"
    assert tok.encode_prompt("hello") == [tok.bos_id, *tok.encode("hello")]


def test_hf_digest_stable_and_sensitive(hf_dir, tmp_path):
    d = HFTokenizer(hf_dir).digest()
    code = (
        "import os; os.environ['HF_HUB_OFFLINE']='1';"
        "from jaxloop.data.tokenizer import HFTokenizer;"
        f"print(HFTokenizer({str(hf_dir)!r}).digest())"
    )
    assert _digest_in_subprocess(code) == d
    other = _build_hf_tokenizer(tmp_path / "other", extra_text="zebra jumps xylophone")
    assert HFTokenizer(other).digest() != d
    no_template = _build_hf_tokenizer(tmp_path / "nt", chat_template=None)
    assert HFTokenizer(no_template).digest() != d


def test_hf_missing_dir(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        HFTokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no HF tokenizer in .*empty: it holds none of"):
        HFTokenizer(tmp_path / "empty")
