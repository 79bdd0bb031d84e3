"""Samples to read (issue 36, item 6): every evaluation of a run writes
<run_dir>/samples/<update>.jsonl, one row per eval prompt with the text the model saw (prompt
template and chat template applied), its response, the label and the reward; the reward
recomputed from each row's response and label is the stored one, and the rows' mean is the
metrics' eval reward. `jaxloop.evaluate --samples-out FILE` writes the same rows. A resumed run
drops the files of evaluations past its checkpoint."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from jaxloop.data.datasets import RowShape, load_examples
from jaxloop.data.rewards import get_reward
from jaxloop.data.tokenizer import HFTokenizer
from jaxloop.evaluate import main as evaluate_main
from jaxloop.train.samples import SamplesWriter, sample_steps, write_samples
from tests.train.helpers import TINY, read_rows, train_process

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gsm8k_tiny_test.jsonl"
TEMPLATE = "{prompt} Put the final answer in \\boxed{}."
REWARD = "tests.train.test_samples:checksum_reward"


def checksum_reward(response: str, label: str) -> float:
    """A dense reward of the whole response and label: any other text gives another value."""
    return (sum(map(ord, response + "|" + label)) % 97) / 96


def _read(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("bt", ROOT / "scripts/build_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("tok") / "bpe"
    assert module.main(["--out", str(out), "--data", str(EXAMPLE), "--vocab-size", "320"]) == 0
    return out


def _args(tok_dir) -> tuple[str, ...]:
    return (
        *TINY,
        f"--config.data.source={EXAMPLE}",
        f"--config.data.eval_source={EXAMPLE}",
        "--config.data.prompt_key=question",
        "--config.data.label_key=answer",
        "--config.data.label_extract=gsm8k",
        f"--config.data.prompt_template={TEMPLATE}",
        f"--config.data.tokenizer={tok_dir}",
        f"--config.data.reward={REWARD}",
        "--config.data.max_prompt_tokens=128",
        "--config.model.vocab_size=320",
        "--config.rollout.max_new_tokens=6",
        "--config.eval_prompts=6",
        "--config.total_updates=2",
        "--config.eval_every=1",
        "--config.checkpoint_every=1",
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory, tok_dir, one_device_env):
    """Two updates, an evaluation before each and a final one; stopped after the first update and
    resumed, with a file of an evaluation past the checkpoint left behind as a crash would."""
    run_dir = tmp_path_factory.mktemp("samples") / "run"
    train_process(run_dir, "grpo.py", *_args(tok_dir), "--config.stop_after=1", env=one_device_env)
    assert sample_steps(run_dir) == [0]  # the evaluation before update 0; checkpoint 1 saved
    (run_dir / "samples" / "2.jsonl").write_text("not this run's\n")
    (run_dir / "samples" / "7.jsonl").write_text("not this run's\n")
    train_process(run_dir, "grpo.py", *_args(tok_dir), env=one_device_env)
    return run_dir


def test_every_evaluation_writes_its_samples(run, tok_dir):
    rows = read_rows(run)
    assert sample_steps(run) == [0, 1, 2]  # 7.jsonl, past the resumed checkpoint 1, is gone
    tok = HFTokenizer(tok_dir)
    examples = load_examples(EXAMPLE, RowShape("question", "answer", TEMPLATE, "gsm8k"))[:6]
    reported = {0: rows[0]["eval_reward"], 1: rows[1]["eval_reward"]}
    reported[2] = rows[1]["final_eval_reward"]
    for step, mean in reported.items():
        samples = _read(run / "samples" / f"{step}.jsonl")
        assert [set(s) for s in samples] == [{"prompt_text", "response", "label", "reward"}] * 6
        # the text the model saw: the question in prompt_template, in the chat template
        assert [s["prompt_text"] for s in samples] == [
            tok.format_prompt(e.prompt) for e in examples
        ]
        assert samples[0]["prompt_text"].startswith("<|im_start|>user\n")
        assert samples[0]["prompt_text"].endswith("\\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
        assert [s["label"] for s in samples] == [e.label for e in examples]  # 56, 2, ... of ####
        for s in samples:  # the configured reward, recomputed from the row
            assert s["reward"] == checksum_reward(s["response"], s["label"])
            assert "<|im_end|>" not in s["response"] and "<|endoftext|>" not in s["response"]
        assert math.fsum(s["reward"] for s in samples) / 6 == pytest.approx(mean, abs=1e-12)


def test_evaluate_samples_out_writes_the_same_rows(run, tmp_path, capsys):
    out = tmp_path / "eval_samples.jsonl"
    code = evaluate_main(["--checkpoint", str(run), "--step", "2", "--samples-out", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(stdout.strip().splitlines()[-1])
    samples = _read(out)
    assert len(samples) == result["prompts"] == 6
    assert math.fsum(s["reward"] for s in samples) / 6 == pytest.approx(result["greedy_reward"])
    # the checkpoint after 2 updates is the policy of the run's final evaluation: the same rows
    assert samples == _read(run / "samples" / "2.jsonl")
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left beside it
    # another reward (--reward math_verify): its rows recompute with it too
    out.unlink()
    argv = ["--checkpoint", str(run), "--reward", "math_verify", "--samples-out", str(out)]
    assert evaluate_main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    verify = get_reward("math_verify")
    samples = _read(out)
    assert [s["reward"] for s in samples] == [verify(s["response"], s["label"]) for s in samples]
    assert math.fsum(s["reward"] for s in samples) / 6 == pytest.approx(result["greedy_reward"])


def test_a_bad_samples_out_is_one_line_and_writes_nothing(run, tmp_path, capsys):
    for bad, why in ((tmp_path, "is a directory"), (tmp_path / "no" / "x.jsonl", "is in")):
        code = evaluate_main(["--checkpoint", str(run), "--samples-out", str(bad)])
        err = capsys.readouterr().err
        assert code == 2 and why in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_the_writer_drops_later_files_and_writes_whole_files(tmp_path):
    folder = tmp_path / "samples"
    folder.mkdir()
    for step in (0, 3, 4, 12):
        (folder / f"{step}.jsonl").write_text("{}\n")
    (folder / "notes.jsonl").write_text("kept\n")
    writer = SamplesWriter(tmp_path, start_update=3)
    assert sample_steps(tmp_path) == [0, 3]  # 4 and 12 came from policies past the checkpoint
    assert (folder / "notes.jsonl").exists()
    row = {"prompt_text": "q", "response": "r", "label": "1", "reward": float("nan"), "extra": 1}
    writer.write(5, [row, {**row, "reward": 0.5}])
    assert _read(folder / "5.jsonl") == [
        {"prompt_text": "q", "response": "r", "label": "1", "reward": None},  # as metrics: null
        {"prompt_text": "q", "response": "r", "label": "1", "reward": 0.5},
    ]
    write_samples(folder / "5.jsonl", [])
    assert (folder / "5.jsonl").read_text() == ""
    assert sorted(p.name for p in folder.iterdir()) == [
        "0.jsonl",
        "3.jsonl",
        "5.jsonl",
        "notes.jsonl",
    ]


def verl_row_reward(response: str, label: str, *, row: dict) -> float:
    """Reads the verl row's own columns: 1 when the label is its reward_model.ground_truth."""
    return float(label == row["reward_model"]["ground_truth"] and row["data_source"] == "toy")


def test_chat_message_prompts_are_rendered_in_the_rows(tok_dir, tmp_path):
    """verl's shape: `prompt` a list of chat messages, the label under
    reward_model.ground_truth; the rows' prompt_text is the chat template of the messages."""
    from flax import nnx

    from jaxloop.config import parse_args
    from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
    from jaxloop.rollout.api import Policy
    from jaxloop.rollout.jax_sampler import JaxSamplerEngine
    from jaxloop.rollout.producer import RolloutProducer
    from jaxloop.train.setup import producer_settings

    data = tmp_path / "verl.jsonl"
    messages = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}],
        [{"role": "user", "content": "What is 7 times 6?"}],
    ]
    rows = [
        {"data_source": "toy", "prompt": m, "reward_model": {"ground_truth": answer}}
        for m, answer in zip(messages, ("5", "42"), strict=True)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_args(
        [
            "--config",
            "grpo.py",
            f"--config.data.source={data}",
            f"--config.data.eval_source={data}",
            "--config.data.label_key=reward_model.ground_truth",
            f"--config.data.tokenizer={tok_dir}",
            "--config.data.max_prompt_tokens=128",
            f"--config.data.reward={__name__}:verl_row_reward",
            "--config.rollout.max_new_tokens=4",
            "--config.eval_prompts=2",
        ]
    )
    settings = producer_settings(cfg, requires_groups=True)
    model = LoopedLM(
        LoopedConfig.from_hf_dict(tiny_hf_config("nanbeige", vocab_size=320)), rngs=nnx.Rngs(0)
    )
    producer = RolloutProducer(settings, JaxSamplerEngine(model))
    producer.publish(Policy(nnx.state(model), 0, model.config))
    mean, samples = producer.evaluate_samples()
    assert samples[0]["prompt_text"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert samples[1]["prompt_text"] == (
        "<|im_start|>user\nWhat is 7 times 6?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert [s["label"] for s in samples] == ["5", "42"]
    assert [s["reward"] for s in samples] == [1.0, 1.0] and mean == 1.0  # the rows' own columns
    path = tmp_path / "samples.jsonl"
    write_samples(path, samples)
    assert _read(path) == samples
