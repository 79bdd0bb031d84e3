"""Row shapes of data files (issue 36): dotted prompt/label keys, prompt templates that keep
other braces, GSM8K label extraction, and one-line errors for bad rows."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxloop.data.datasets import (
    DataError,
    RowShape,
    extract_gsm8k,
    fill_template,
    load_examples,
    make_eval_examples,
    make_source,
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4.", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A car costs 1,200 and a bike 72.", "answer": "1,200 + 72\n#### 1,272"},
]


def test_gsm8k_rows_with_keys_template_and_extraction(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    shape = RowShape(
        prompt_key="question",
        label_key="answer",
        prompt_template="{prompt} Put the final answer in \\boxed{}.",
        label_extract="gsm8k",
    )
    examples = load_examples(path, shape)
    assert [e.label for e in examples] == ["7", "1272"]
    assert examples[0].prompt == "Tom has 3 apples and buys 4. Put the final answer in \\boxed{}."


def test_verl_nested_label_in_parquet(tmp_path):
    rows = [
        {"question": "1+1?", "reward_model": {"ground_truth": "2", "style": "rule"}},
        {"question": "2+3?", "reward_model": {"ground_truth": "5", "style": "rule"}},
    ]
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    shape = RowShape(prompt_key="question", label_key="reward_model.ground_truth")
    examples = load_examples(path, shape)
    assert [(e.prompt, e.label) for e in examples] == [("1+1?", "2"), ("2+3?", "5")]


def test_template_fills_row_fields_and_keeps_other_braces():
    row = {"prompt": "x", "meta": {"level": 3}, "topic": "sums"}
    out = fill_template("[{topic}/{meta.level}] {prompt} {unknown} \\boxed{} {0} {", "x", row)
    assert out == "[sums/3] x {unknown} \\boxed{} {0} {"


def test_extract_gsm8k_takes_the_last_marker():
    assert extract_gsm8k("a #### 3 then #### 1,000,000 ") == "1000000"
    assert extract_gsm8k("no marker") is None


def test_config_keys_reach_train_and_eval_sources(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", GSM8K_ROWS)
    cfg = {
        "source": str(path),
        "eval_source": str(path),
        "prompt_key": "question",
        "label_key": "answer",
        "label_extract": "gsm8k",
        "prompt_template": "Q: {prompt}",
    }
    batch = make_source(cfg).next_batch(2)
    assert sorted(e.label for e in batch) == ["1272", "7"]
    held_out = make_eval_examples(cfg, 5)
    assert held_out[0].prompt == "Q: Tom has 3 apples and buys 4."


@pytest.mark.parametrize(
    ("rows", "shape", "message"),
    [
        (
            [{"question": "q"}],
            RowShape("question", "answer"),
            "line 1 is missing field(s) ['answer']",
        ),
        (
            [{"q": "a", "r": {"gt": [1]}}],
            RowShape("q", "r.gt"),
            "line 1 key r.gt is a label of type list, expected a string or a number",
        ),
        (
            [{"question": "q", "answer": "7"}],
            RowShape("question", "answer", label_extract="gsm8k"),
            "line 1 key answer has no '####'",
        ),
        (
            [{"prompt": [{"role": "robot", "content": "hi"}], "label": "1"}],
            RowShape(),
            "line 1 key prompt[0].role is 'robot'",  # chat prompts: tests/data/test_chat_prompts
        ),
    ],
)
def test_bad_rows_name_file_row_and_key(tmp_path, rows, shape, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_examples(path, shape)
    text = str(err.value)
    assert "\n" not in text and str(path) in text and message in text, text


def test_invalid_json_and_empty_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "label": "1"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 2 is not valid JSON"):
        load_examples(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty.jsonl: no rows"):
        load_examples(empty)


def test_train_dry_run_reads_gsm8k_rows_and_refuses_a_bad_one(tmp_path, capsys):
    from jaxloop.train.cli import main as train_main
    from tests.test_bad_inputs import one_error_line
    from tests.train.helpers import TINY

    rows = [{"question": "3+4=", "answer": "3 + 4 = 7\n#### 7"}] * 3
    good = write_jsonl(tmp_path / "good.jsonl", rows)
    bad = write_jsonl(tmp_path / "bad.jsonl", [*rows, {"question": "1+1=", "answer": "2"}])
    keys = [
        "--config.data.prompt_key=question",
        "--config.data.label_key=answer",
        "--config.data.label_extract=gsm8k",
    ]

    def dry_run(path, run_dir):
        argv = ["--config", "grpo.py", *TINY, f"--config.data.source={path}", *keys]
        return train_main([*argv, f"--config.run_dir={run_dir}", "--dry-run"])

    assert dry_run(good, tmp_path / "run_good") == 0
    capsys.readouterr()
    code = dry_run(bad, tmp_path / "run_bad")
    line = one_error_line(capsys, code, "bad.jsonl: line 4 key answer has no '####'")
    assert "data.label_extract=gsm8k" in line
    assert not (tmp_path / "run_bad").exists()
