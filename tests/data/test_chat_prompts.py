"""Chat-message prompts (issue 36, items 2, 5 and 8): a prompt that is a list of {role, content}
messages is rendered by the tokenizer's chat template with its generation prompt, in one place
(`format_prompt`), for data.source, data.eval_source, jaxloop.sft and jaxloop.evaluate --data; the
char tokenizer and a tokenizer without a chat template refuse it in one line naming file and row;
a bad message names file, row and key; a prompt longer than data.max_prompt_tokens names its row
and length. SFT rows ({prompt, response} or {messages}) give exactly the prompt tokens that the
RL rollout gives the same prompt, and the loss is on the response and EOS only."""

from __future__ import annotations

import importlib.util
import json
import shutil
from argparse import Namespace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxloop.config import parse_args
from jaxloop.data.datasets import (
    DataError,
    RowShape,
    encode_prompts,
    load_examples,
    make_eval_examples,
)
from jaxloop.data.tokenizer import CharTokenizer, HFTokenizer
from jaxloop.data.types import Example, Message
from jaxloop.rollout.producer import RolloutProducer
from jaxloop.train.setup import producer_settings
from jaxloop.train.warm_start import sft_batches
from tests.test_bad_inputs import one_error_line
from tests.train.helpers import TINY

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "Tom has 3 apples and buys 4. How many?"
SYSTEM = "Answer with a number."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
VERL_ROW = {
    "data_source": "gsm8k",
    "prompt": [{"role": "user", "content": QUESTION}],
    "reward_model": {"ground_truth": "72", "style": "rule"},
}
VERL_KEYS = ("--config.data.prompt_key=prompt", "--config.data.label_key=reward_model.ground_truth")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_tokenizer(argv: list[str]) -> int:
    """`python scripts/build_tokenizer.py ARGV` in this process (a byte-level BPE built offline,
    with a ChatML chat template)."""
    spec = importlib.util.spec_from_file_location("bt", ROOT / "scripts/build_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def build_bpe(out: Path) -> Path:
    """A BPE of 320 tokens on examples/gsm8k_tiny.jsonl in `out`."""
    data = ["--data", str(ROOT / "examples/gsm8k_tiny.jsonl"), "--vocab-size", "320"]
    assert build_tokenizer(["--out", str(out), *data]) == 0
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_bpe(tmp_path_factory.mktemp("tok") / "bpe")


@pytest.fixture(scope="module")
def plain_tok_dir(tok_dir, tmp_path_factory):
    """The same tokenizer without a chat template."""
    out = tmp_path_factory.mktemp("tok") / "plain"
    shutil.copytree(tok_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _cfg(*overrides):
    return parse_args(["--config", "grpo.py", *overrides])


# ---- rendering ----------------------------------------------------------------------------------
def test_messages_render_with_the_chat_template_and_its_generation_prompt(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": CHAT, "label": 7}])
    (example,) = load_examples(path)
    assert example.prompt == (Message("system", SYSTEM), Message("user", QUESTION))
    assert example.origin == f"{path}: line 1" and example.label == "7"
    tok = HFTokenizer(tok_dir)
    assert tok.format_prompt(example.prompt) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # a string prompt is the same text as one user message
    user_only = (Message("user", QUESTION),)
    assert tok.encode_prompt(QUESTION) == tok.encode_prompt(user_only)
    assert tok.encode_prompt(example.prompt) == tok.encode(tok.format_prompt(example.prompt))


def test_verl_parquet_row_loads_and_train_dry_run_works(tok_dir, tmp_path, capsys):
    from jaxloop.train.cli import main as train_main

    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist([VERL_ROW] * 3), path)
    shape = RowShape(prompt_key="prompt", label_key="reward_model.ground_truth")
    (example, *_) = load_examples(path, shape)
    assert example.prompt == (Message("user", QUESTION),) and example.label == "72"
    assert example.origin == f"{path}: row 0"
    run_dir = tmp_path / "run"
    argv = ["--config", "grpo.py", *TINY, f"--config.data.source={path}", *VERL_KEYS]
    argv += [f"--config.data.tokenizer={tok_dir}", "--config.model.vocab_size=320"]
    argv += ["--config.data.max_prompt_tokens=128", f"--config.run_dir={run_dir}", "--dry-run"]
    assert train_main(argv) == 0
    assert "nothing was written" in capsys.readouterr().out
    assert not run_dir.exists()


# ---- refusals: a tokenizer without a template, bad messages, a prompt too long ------------------
def test_char_tokenizer_refuses_messages_in_one_line_before_anything_is_written(tmp_path, capsys):
    from jaxloop.train.cli import main as train_main

    rows = [{"prompt": "3+4=", "label": "7"}, {"prompt": CHAT, "label": "7"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    run_dir = tmp_path / "run"
    argv = ["--config", "grpo.py", *TINY, f"--config.data.source={path}"]
    code = train_main([*argv, "--config.data.tokenizer=char", f"--config.run_dir={run_dir}"])
    line = one_error_line(capsys, code, f"{path}: line 2: a chat-message prompt needs a tokenizer")
    assert "the char tokenizer has none" in line
    assert not run_dir.exists()


def test_a_tokenizer_without_a_chat_template_refuses_messages(plain_tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": CHAT, "label": "7"}])
    examples = load_examples(path)
    with pytest.raises(DataError) as err:
        encode_prompts(HFTokenizer(plain_tok_dir), examples, 128)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}: line 1: a chat-message prompt needs")
    assert "has none (tokenizer_config.json without chat_template)" in text
    # string prompts still encode as plain text there
    assert HFTokenizer(plain_tok_dir).format_prompt(QUESTION) == QUESTION


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([{"role": "tool", "content": "x"}], "key prompt[0].role is 'tool'; a message's role"),
        ([{"role": "user"}], "key prompt[0].content is missing; a message's content is a string"),
        (
            [{"role": "system", "content": "s"}, {"role": "user", "content": 3}],
            "key prompt[1].content is a int",
        ),
        (["hello"], "key prompt[0] is a str, expected a chat message {role, content}"),
        ([], "key prompt is an empty list of chat messages"),
    ],
)
def test_a_bad_message_names_file_row_and_key(tmp_path, prompt, message):
    good = {"prompt": CHAT, "label": "1"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, {"prompt": prompt, "label": "1"}])
    with pytest.raises(DataError) as err:
        load_examples(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}: line 2 {message}"), text


def test_prompt_template_applies_to_string_prompts_and_is_refused_with_messages(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "3+4=", "label": "7"}])
    shape = RowShape(prompt_template="{prompt} Put the final answer in \\boxed{}.")
    assert load_examples(path, shape)[0].prompt == "3+4= Put the final answer in \\boxed{}."
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": CHAT, "label": "7"}])
    with pytest.raises(DataError, match=r"line 1 key prompt is a list of chat messages, and "):
        load_examples(chat, shape)


def test_a_prompt_too_long_names_file_row_and_its_length(tok_dir, tmp_path, capsys):
    from jaxloop.train.cli import main as train_main

    tok = HFTokenizer(tok_dir)
    long_chat = [{"role": "user", "content": QUESTION * 3}]
    rows = [{"prompt": CHAT, "label": "7"}, {"prompt": long_chat, "label": "7"}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    length = len(tok.encode_prompt((Message("user", QUESTION * 3),)))
    limit = len(tok.encode_prompt(load_examples(path)[0].prompt))
    assert length > limit
    run_dir = tmp_path / "run"
    argv = ["--config", "grpo.py", *TINY, f"--config.data.source={path}"]
    argv += [f"--config.data.tokenizer={tok_dir}", "--config.model.vocab_size=320"]
    argv += [f"--config.data.max_prompt_tokens={limit}", f"--config.run_dir={run_dir}"]
    one_error_line(
        capsys,
        train_main(argv),
        f"{path}: line 2: prompt of {length} tokens (after data.prompt_template and the chat "
        f"template) is longer than data.max_prompt_tokens={limit}",
    )
    assert not run_dir.exists()
    # a string prompt of an eval file through the template: the same check, named by its row
    eval_rows = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "3+4=", "label": "7"}])
    examples = make_eval_examples({"eval_source": str(eval_rows), "prompt_template": "{prompt}"}, 4)
    with pytest.raises(
        DataError, match=r"eval.jsonl: line 1: prompt of 5 tokens .* data\.max_prompt_tokens=4$"
    ):
        encode_prompts(CharTokenizer(), examples, 4)  # bos + 4 characters


def test_eval_source_and_evaluate_data_render_messages(tok_dir, tmp_path):
    """data.eval_source, and jaxloop.evaluate --data (its settings over the producer, the prompts
    it evaluates on): the chat-templated ids, or the one-line refusal of the char tokenizer."""
    from jaxloop.evaluate import eval_settings

    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist([VERL_ROW] * 2), path)
    keys = (*VERL_KEYS, "--config.data.max_prompt_tokens=128")
    cfg = _cfg(*keys, f"--config.data.tokenizer={tok_dir}", f"--config.data.eval_source={path}")
    producer = RolloutProducer(producer_settings(cfg, requires_groups=True), engine=None)
    expected = producer.tokenizer.encode_prompt((Message("user", QUESTION),))
    assert [producer.encode(e.prompt) for e in producer.eval_examples] == [tuple(expected)] * 2
    args = Namespace(data=str(path), prompts=0, reward="", temperature=0.0, max_new_tokens=0)
    settings, _ = eval_settings(_cfg(*keys, f"--config.data.tokenizer={tok_dir}"), args, 320)
    evaluated = RolloutProducer(settings, engine=None).eval_examples
    assert [e.label for e in evaluated] == ["72", "72"]
    char_settings, _ = eval_settings(_cfg(*keys, "--config.data.tokenizer=char"), args, 64)
    with pytest.raises(DataError, match=rf"^{path}: row 0: a chat-message prompt needs"):
        RolloutProducer(char_settings, engine=None)


# ---- SFT rows -----------------------------------------------------------------------------------
SFT_ROWS = [
    {"messages": [*CHAT, {"role": "assistant", "content": "7"}]},
    {"prompt": [{"role": "user", "content": "2 + 3 = ?"}], "response": "5"},
    {"prompt": "What is 6 * 7?", "response": "42"},
    {"prompt": "1 + 1 = ?", "completion": [{"role": "assistant", "content": "2"}]},  # TRL's
]


def test_sft_rows_read_prompt_response_and_messages(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    examples = load_examples(path, rows="sft")
    assert [e.label for e in examples] == ["7", "5", "42", "2"]
    assert examples[0].prompt == (Message("system", SYSTEM), Message("user", QUESTION))
    assert examples[1].prompt == (Message("user", "2 + 3 = ?"),)
    assert examples[2].prompt == "What is 6 * 7?"
    assert examples[3].origin == f"{path}: line 4"
    parquet = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(SFT_ROWS[:1] * 2), parquet)
    assert load_examples(parquet, rows="sft")[1].label == "7"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"messages": CHAT}, "key messages must end in an assistant message"),
        ({"messages": [{"role": "assistant", "content": "7"}]}, "must end in an assistant"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},
            "key messages[1].role is 'bot'",
        ),
        ({"prompt": "q", "response": ""}, "key response has no target text"),
        ({"prompt": "q", "label": "7"}, "is not an SFT row: expected {prompt, response}"),
        (
            {"prompt": "q", "completion": [{"role": "user", "content": "a"}]},
            "an SFT target is one assistant message",
        ),
    ],
)
def test_a_bad_sft_row_names_file_row_and_key(tmp_path, row, message):
    path = write_jsonl(tmp_path / "sft.jsonl", [SFT_ROWS[0], row])
    with pytest.raises(DataError) as err:
        load_examples(path, rows="sft")
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}: line 2 ") and message in text, text


def _prompt_and_target(batch, i: int) -> tuple[list[int], list[int]]:
    """Row i of an SFT batch: its prompt tokens (before the first loss target) and its targets."""
    where = np.flatnonzero(np.asarray(batch.loss_mask[i]))
    tokens = np.asarray(batch.tokens[i])
    return tokens[: where[0] + 1].tolist(), tokens[1:][where].tolist()


def test_sft_prompt_tokens_are_the_rollouts_token_for_token(tok_dir, tmp_path):
    """The same prompts as RL rows ({prompt, label}, data.source) and as SFT rows (sft.source):
    the ids the rollout producer sends to the engine (its requests) are the SFT rows' prompt
    tokens, and the loss covers exactly the response's tokens and EOS."""
    template = "--config.data.prompt_template={prompt}"
    rl_rows = [
        {"prompt": CHAT, "label": "7"},
        {"prompt": [{"role": "user", "content": "2 + 3 = ?"}], "label": "5"},
        {"prompt": "What is 6 * 7?", "label": "42"},
        {"prompt": "1 + 1 = ?", "label": "2"},
    ]
    rl = write_jsonl(tmp_path / "rl.jsonl", rl_rows)
    sft = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    cfg = _cfg(
        f"--config.data.tokenizer={tok_dir}",
        f"--config.data.source={rl}",
        "--config.data.max_prompt_tokens=128",
        "--config.prompts_per_update=4",
        "--config.n_samples_per_prompt=2",
        template,
        f"--config.sft.source={sft}",
        "--config.sft.batch_size=4",
    )
    settings = producer_settings(cfg, requires_groups=True)
    producer = RolloutProducer(settings, engine=None)
    rollout = {}
    for request in producer.requests(0):
        rollout[request.label] = list(request.prompt_ids)
    tok = producer.tokenizer
    data = sft_batches(cfg, settings.data, tok)  # jaxloop.sft's and the warm start's batches
    batch = data.next_batch()
    seen = {}
    for i in range(4):
        prompt, target = _prompt_and_target(batch, i)
        label = tok.decode(target)
        assert target == [*tok.encode(label), tok.eos_id]  # the response and EOS only
        seen[label] = prompt
    assert sorted(seen) == sorted(rollout) == ["2", "42", "5", "7"]
    for label, ids in rollout.items():
        assert seen[label] == ids, label
    assert tok.decode(seen["7"]).startswith(f"system\n{SYSTEM}")  # specials dropped by decode


def test_sft_dry_run_reads_chat_rows_and_refuses_them_with_the_char_tokenizer(
    tok_dir, tmp_path, capsys
):
    from jaxloop.sft import main as sft_main

    path = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    run_dir = tmp_path / "run"
    base = ["--config", "sft.py", f"--config.sft.source={path}", f"--config.run_dir={run_dir}"]
    base += ["--config.data.max_prompt_tokens=128", "--dry-run"]
    ok = sft_main([*base, f"--config.data.tokenizer={tok_dir}", "--config.model.vocab_size=320"])
    assert ok == 0 and "nothing was written" in capsys.readouterr().out
    code = sft_main([*base, "--config.data.tokenizer=char"])
    one_error_line(capsys, code, f"{path}: line 1: a chat-message prompt needs a tokenizer")
    assert not run_dir.exists()


def test_a_prompt_without_a_file_row_shows_its_text():
    ex = Example("3+4=" * 10, "7")
    with pytest.raises(
        DataError, match=r"^prompt of 41 tokens .* data\.max_prompt_tokens=8: '3\+4="
    ):
        encode_prompts(CharTokenizer(), [ex], 8)


def test_the_docs_chat_and_sft_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """docs/data.md's chat-prompt and SFT-row dry runs on examples/gsm8k_chat_tiny.jsonl and
    examples/gsm8k_sft_tiny.jsonl, with the doc's tokenizer, pass as written (in-process)."""
    import shlex

    from jaxloop.sft import main as sft_main
    from jaxloop.train.cli import main as train_main

    lines = (ROOT / "docs" / "data.md").read_text().splitlines()
    tokenizer = next(x for x in lines if x.startswith("python scripts/build_tokenizer.py"))
    commands = [x for x in lines if x.startswith("python -m") and "gsm8k_chat_tiny" in x]
    commands += [x for x in lines if x.startswith("python -m") and "gsm8k_sft_tiny" in x]
    assert [shlex.split(c)[2] for c in commands] == ["jaxloop.train", "jaxloop.sft"]
    for name in ("examples", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    assert build_tokenizer(shlex.split(tokenizer)[2:]) == 0
    for command, main in zip(commands, (train_main, sft_main), strict=True):
        assert main(shlex.split(command)[3:]) == 0, command
        assert "dry run: the config is valid" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["data_doc"]  # the tokenizer only
