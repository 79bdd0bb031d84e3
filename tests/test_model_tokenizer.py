"""The model's own tokenizer (issue 36, items 3 and 4): data.tokenizer=auto takes the tokenizer of
model.hf_dir (or of model.init_checkpoint's tokenizer/), a tokenizer larger than the model's
vocabulary is refused before anything is built, every EOS id of generation_config.json ends a
response and is stripped from its text, and conversion.to_hf writes the run's tokenizer and a
generation_config.json beside the weights, so the output loads as one HF dir."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from flax import nnx

from conversion import from_hf, to_hf
from jaxloop.config import parse_args
from jaxloop.data.tokenizer import HFTokenizer, TokenizerError
from jaxloop.io.hf import load_hf, save_hf
from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.rollout.producer import RolloutProducer
from jaxloop.rollout.types import PromptRequest, Sample
from jaxloop.train.setup import producer_settings, tokenizer_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gsm8k_tiny.jsonl"


def _script():
    spec = importlib.util.spec_from_file_location(
        "build_tokenizer", ROOT / "scripts/build_tokenizer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "bpe"
    assert _script().main(["--out", str(out), "--data", str(EXAMPLE), "--vocab-size", "320"]) == 0
    return out


def _hf_model_dir(path: Path, tok_dir: Path | None, vocab_size: int) -> Path:
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config("nanbeige", vocab_size=vocab_size))
    return save_hf(LoopedLM(cfg, rngs=nnx.Rngs(0)), path, dtype="float32", tokenizer_dir=tok_dir)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok_dir):
    return _hf_model_dir(tmp_path_factory.mktemp("hf") / "model", tok_dir, 320)


def _cfg(*overrides):
    return parse_args(["--config", "grpo.py", *overrides])


# ---- EOS ids ------------------------------------------------------------------------------------
def test_every_eos_id_of_generation_config_stops_and_is_stripped(tok_dir, tmp_path):
    tok = HFTokenizer(tok_dir)
    im_end, endoftext = tok.tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.eos_id == im_end and tok.eos_ids == (im_end, endoftext)
    ids = tok.encode("the answer is 42")
    assert tok.decode([*ids, endoftext]) == tok.decode([*ids, im_end]) == "the answer is 42"
    assert tok.decode([*ids[:2], endoftext, *ids[2:]]) == "the answer is 42"  # nowhere inside
    # an int eos_token_id is one id; a wrong one is a one-line error
    one = tmp_path / "one"
    shutil.copytree(tok_dir, one)
    (one / "generation_config.json").write_text(json.dumps({"eos_token_id": endoftext}))
    assert HFTokenizer(one).eos_ids == (im_end, endoftext)
    (one / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(TokenizerError, match="eos_token_id must be an id or a list of ids"):
        HFTokenizer(one)


def test_the_producer_stops_at_every_eos_id_and_strips_it(tok_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "what is 2 + 2?", "label": "4"}) + "\n")
    cfg = _cfg(
        f"--config.data.tokenizer={tok_dir}",
        f"--config.data.source={data}",
        "--config.data.max_prompt_tokens=64",
        "--config.data.reward=math_verify",
    )
    producer = RolloutProducer(producer_settings(cfg, requires_groups=True), engine=None)
    eos_ids = producer.tokenizer.eos_ids
    assert len(eos_ids) == 2
    assert producer.sampling.stop_token_ids == eos_ids == producer.eval_sampling.stop_token_ids
    answer = producer.tokenizer.encode("4")
    request = PromptRequest(producer.encode("what is 2 + 2?"), seed=0, group_id=0, sample_index=0)
    for eos in eos_ids:
        sample = Sample.from_request(request, [*answer, eos], [0.0] * 3, "stop", 0)
        assert producer.response_text(sample) == "4"
        assert producer.score(producer.response_text(sample), "4") == 1.0


# ---- data.tokenizer=auto and the vocabulary check ----------------------------------------------
def test_auto_is_the_model_dirs_tokenizer(model_dir, tok_dir, tmp_path):
    assert _cfg().data.tokenizer == "auto"
    assert tokenizer_spec(_cfg()) == "char"  # the built-in model: the char tokenizer
    hf = _cfg(f"--config.model.hf_dir={model_dir}")
    assert tokenizer_spec(hf) == str(model_dir)
    assert producer_settings(hf, requires_groups=True).tokenizer == str(model_dir)
    # an explicit choice is honoured
    assert (
        tokenizer_spec(_cfg(f"--config.model.hf_dir={model_dir}", "--config.data.tokenizer=char"))
        == "char"
    )
    other = tmp_path / "other_tok"
    shutil.copytree(tok_dir, other)
    explicit = _cfg(f"--config.model.hf_dir={model_dir}", f"--config.data.tokenizer={other}")
    assert tokenizer_spec(explicit) == str(other)
    # a model dir without tokenizer files: char
    bare = _hf_model_dir(tmp_path / "bare", None, 64)
    assert tokenizer_spec(_cfg(f"--config.model.hf_dir={bare}")) == "char"
    # conversion.from_hf's run dir carries the tokenizer in tokenizer/
    run = tmp_path / "converted"
    assert from_hf.main(["--hf-dir", str(model_dir), "--out", str(run)]) == 0
    assert tokenizer_spec(_cfg(f"--config.model.init_checkpoint={run}")) == str(run / "tokenizer")


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tok_dir, tmp_path, capsys):
    from jaxloop.train.cli import main

    small = _hf_model_dir(tmp_path / "small", tok_dir, 64)  # 320 tokens, 64 embeddings
    run_dir = tmp_path / "run"
    code = main(
        ["--config", "grpo.py", f"--config.model.hf_dir={small}", f"--config.run_dir={run_dir}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "has 320 tokens, more than the model's vocabulary of 64" in err[0]
    assert not run_dir.exists()


# ---- conversion.to_hf --------------------------------------------------------------------------
def _loads_as_one_hf_dir(out: Path, eos_ids) -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert auto.chat_template and auto.eos_token == "<|im_end|>"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(eos_ids)
    model = load_hf(out, dtype="float32")
    assert model.config.vocab_size == 320


def test_to_hf_writes_the_tokenizer_and_generation_config(model_dir, tok_dir, tmp_path):
    eos_ids = HFTokenizer(tok_dir).eos_ids
    run = tmp_path / "run"
    assert from_hf.main(["--hf-dir", str(model_dir), "--out", str(run)]) == 0
    out = tmp_path / "out"
    assert to_hf.main(["--checkpoint", str(run), "--out", str(out)]) == 0
    _loads_as_one_hf_dir(out, eos_ids)
    # a run dir without tokenizer/ (a training or SFT run): the tokenizer its config.json names
    shutil.rmtree(run / "tokenizer")
    (run / "config.json").write_text(
        json.dumps({"data": {"tokenizer": str(tok_dir)}, "model": {"hf_dir": ""}})
    )
    # ... which is also what a run started from it takes (an RL run from an SFT run)
    assert tokenizer_spec(_cfg(f"--config.model.init_checkpoint={run}")) == str(tok_dir)
    out2 = tmp_path / "out2"
    assert to_hf.main(["--checkpoint", str(run), "--out", str(out2)]) == 0
    _loads_as_one_hf_dir(out2, eos_ids)


def test_the_sft_target_ends_with_the_tokenizers_eos_and_the_prompt_is_the_rollouts(tok_dir):
    from jaxloop.data.types import Example
    from jaxloop.rl.sft import sft_sequences

    tok = HFTokenizer(tok_dir)
    prompts, answers = sft_sequences(tok, [Example("What is 2 + 3?", "5")])
    assert answers == [[*tok.encode("5"), tok.eos_id]]
    assert prompts == [tok.encode_prompt("What is 2 + 3?")]  # the chat-templated prompt
    assert tok.decode(answers[0]) == "5"


def test_the_chat_template_renders_on_the_base_install(tok_dir):
    """`pip install -e .` (no extras) must render a chat template: transformers needs jinja2 for
    apply_chat_template and does not depend on it, so the base dependencies name it."""
    import re
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    base = {
        re.split(r"[<>=!~ \[]", dep, maxsplit=1)[0].lower()
        for dep in pyproject["project"]["dependencies"]
    }
    assert "jinja2" in base
    tok = HFTokenizer(str(tok_dir))
    text = tok.tok.apply_chat_template(
        [{"role": "user", "content": "2+3="}], tokenize=False, add_generation_prompt=True
    )
    assert "2+3=" in text and text != "2+3="
