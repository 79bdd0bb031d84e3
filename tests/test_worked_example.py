"""docs/worked_example.md runs as written: every command of its bash block, in order, in a fresh
directory that holds the repository's examples/ and scripts/ (GSM8K-shaped rows -> tokenizer ->
SFT -> GRPO with math_verify -> evaluate -> to_hf -> loaded by transformers and jaxloop)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "worked_example.md"


def doc_commands() -> list[str]:
    """The lines of the doc's first ```bash block."""
    text = DOC.read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def _argv(line: str) -> list[str]:
    argv = shlex.split(line)
    assert argv[0] == "python", line
    return [sys.executable, *argv[1:]]


def test_the_worked_example_runs_as_written(tmp_path):
    from jaxloop.launch import process_env

    for name in ("examples", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    # one CPU device, as a user's `python -m jaxloop.train` sees a CPU machine
    env = {**process_env(1, dict(os.environ)), "HF_HUB_OFFLINE": "1"}
    outputs = []
    for line in doc_commands():
        proc = subprocess.run(
            _argv(line), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"{line}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    runs = tmp_path / "runs" / "example"
    sft_rows = [json.loads(x) for x in open(runs / "sft" / "metrics.jsonl")]
    assert sft_rows and all(0.0 <= r.get("eval_accuracy", 0.0) <= 1.0 for r in sft_rows)
    rl_rows = [json.loads(x) for x in open(runs / "grpo" / "metrics.jsonl")]
    assert len(rl_rows) == 2 and all(0.0 <= r["eval_reward"] <= 1.0 for r in rl_rows)
    # the GRPO run took the SFT run's tokenizer (data.tokenizer=auto): its prompts are the
    # chat-templated questions, which the char tokenizer could not even encode
    hf = runs / "hf"
    generation = json.loads((hf / "generation_config.json").read_text())
    tokenizer_config = json.loads((hf / "tokenizer_config.json").read_text())
    assert len(generation["eos_token_id"]) == 2 and "chat_template" in tokenizer_config
    assert "<|im_start|>assistant" in outputs[-2]  # transformers rendered the chat template
    assert "vocab_size=512" in outputs[-1]  # jaxloop loaded the converted dir
    assert os.path.isfile(hf / "config.json")
