"""docs/worked_example.md runs as written: every command of its bash block, in order, in a fresh
directory that holds the repository's examples/ and scripts/ (raw GSM8K rows read with
data.prompt_key / label_key / label_extract=gsm8k / prompt_template -> ChatML BPE tokenizer ->
SFT on {question, response} rows -> GRPO with math_verify -> evaluate --samples-out -> to_hf ->
loaded by transformers and jaxloop). The samples files show the chat-templated prompts, and
math_verify recomputed from each row's response and label gives the row's reward."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "worked_example.md"
TEST_ROWS = ROOT / "examples" / "gsm8k_tiny_test.jsonl"
INSTRUCTION = " Put the final answer after ####."  # the doc's data.prompt_template after {prompt}
USER, ASSISTANT = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"  # ChatML


def doc_commands() -> list[str]:
    """The lines of the doc's first ```bash block."""
    text = DOC.read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def _argv(line: str) -> list[str]:
    argv = shlex.split(line)
    assert argv[0] == "python", line
    return [sys.executable, *argv[1:]]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_samples(rows: list[dict], mean: float) -> None:
    """`rows` (a samples file) are the held-out GSM8K questions in order, each as the model saw
    it (the prompt template, then the ChatML chat template with its generation prompt), the
    label cut from the answer's `####`, and the reward math_verify gives the response and label
    (what a user recomputes from the file); their mean is the run's reported reward."""
    from jaxloop.data.datasets import extract_gsm8k
    from jaxloop.data.rewards import get_reward

    verify = get_reward("math_verify")
    held_out = _rows(TEST_ROWS)
    assert len(rows) == len(held_out) == 8
    for row, source in zip(rows, held_out, strict=True):
        assert set(row) == {"prompt_text", "response", "label", "reward"}
        assert row["prompt_text"] == f"{USER}{source['question']}{INSTRUCTION}{ASSISTANT}"
        assert row["label"] == extract_gsm8k(source["answer"]) and row["label"].isdigit()
        assert "<|im_end|>" not in row["response"] and "<|endoftext|>" not in row["response"]
        assert row["reward"] == verify(row["response"], row["label"])
    assert math.fsum(r["reward"] for r in rows) / len(rows) == pytest.approx(mean, abs=1e-12)


def test_the_worked_example_runs_as_written(tmp_path):
    from jaxloop.launch import process_env

    commands = doc_commands()
    # the doc reads the raw rows with the feature keys, not through a conversion script
    assert not any("gsm8k_to_prompt_label" in line for line in commands)
    template = f'--config.data.prompt_template="{{prompt}}{INSTRUCTION}"'
    runs_of = [
        c for c in commands if c.startswith(("python -m jaxloop.sft ", "python -m jaxloop.train "))
    ]
    assert len(runs_of) == 2 and all(template in line for line in runs_of)  # the same prompts
    for name in ("examples", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    # one CPU device, as a user's `python -m jaxloop.train` sees a CPU machine
    env = {**process_env(1, dict(os.environ)), "HF_HUB_OFFLINE": "1"}
    outputs = []
    for line in commands:
        proc = subprocess.run(
            _argv(line), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"{line}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    runs = tmp_path / "runs" / "example"
    sft_rows = _rows(runs / "sft" / "metrics.jsonl")
    assert len(sft_rows) == 20 and all(0.0 <= r.get("eval_accuracy", 0.0) <= 1.0 for r in sft_rows)
    assert all(r["sft_tokens"] > 0 for r in sft_rows)  # the worked answers were trained on
    rl_rows = _rows(runs / "grpo" / "metrics.jsonl")
    assert len(rl_rows) == 2 and all(0.0 <= r["eval_reward"] <= 1.0 for r in rl_rows)
    # every evaluation wrote its samples: before update 0, after update 1, the final one
    assert sorted(p.name for p in (runs / "grpo" / "samples").iterdir()) == [
        "0.jsonl",
        "1.jsonl",
        "2.jsonl",
    ]
    means = [rl_rows[0]["eval_reward"], rl_rows[1]["eval_reward"], rl_rows[1]["final_eval_reward"]]
    for update, mean in enumerate(means):
        check_samples(_rows(runs / "grpo" / "samples" / f"{update}.jsonl"), mean)
    # evaluate --samples-out: the same rows for the latest checkpoint (step 2, greedy)
    result = json.loads(outputs[3].strip().splitlines()[-1])
    assert result["step"] == 2 and result["reward"] == "math_verify"
    eval_samples = _rows(runs / "eval_samples.jsonl")
    check_samples(eval_samples, result["greedy_reward"])
    assert eval_samples == _rows(runs / "grpo" / "samples" / "2.jsonl")
    # the converted dir is one HF dir: weights, config, the run's tokenizer and its EOS ids
    hf = runs / "hf"
    generation = json.loads((hf / "generation_config.json").read_text())
    tokenizer_config = json.loads((hf / "tokenizer_config.json").read_text())
    assert len(generation["eos_token_id"]) == 2 and "chat_template" in tokenizer_config
    printed_eos, rendered = outputs[-2].split("\n", 1)
    assert json.loads(printed_eos) == generation["eos_token_id"]  # GenerationConfig read it
    assert rendered.startswith(f"{USER}What is 2 + 3?{ASSISTANT}")  # transformers' chat template
    assert "vocab_size=512" in outputs[-1]  # jaxloop loaded the converted dir
    assert os.path.isfile(hf / "config.json")
