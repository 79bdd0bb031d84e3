"""Supervised fine-tuning as a user runs it, and the recipes built on it:

- `python -m jaxloop.sft`: a resumed run equals an uninterrupted one bit for bit (parameters,
  optimizer state, metrics); its run dir is a `model.init_checkpoint` for training and
  `conversion.to_hf` exports it; a key SFT does not read is refused (exit 2, nothing written).
- `warm_start.sft_steps` + `critic.warmup_updates` in one training run: the warm start's eval
  before / after is in update 0's row, a resume never repeats it (bitwise equal to the straight
  run), and the critic-only updates leave the actor, its optimizer state and the policy version
  untouched while the critic trains.
- `warm_start.stop_at_reward`: the warm start ends after the first step whose validation reward
  (held-out prompts past the reported ones) reaches it, and runs every step when none does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.train.helpers import TINY, read_rows, run_train, stable
from tests.train.test_resume import _checkpoint_arrays

ROOT = Path(__file__).resolve().parents[2]

SFT_ARGS = (
    "--config.model.hidden_size=32",
    "--config.model.intermediate_size=64",
    "--config.model.num_layers=1",
    "--config.model.head_dim=16",
    "--config.data.task=reverse",
    "--config.data.num_digits=2",
    "--config.rollout.max_new_tokens=3",
    "--config.sft.batch_size=16",
    "--config.micro_batch_size=8",
    "--config.eval_prompts=8",
    "--config.eval_every=2",
    "--config.checkpoint_every=2",
    "--config.keep_checkpoints=5",
    "--config.progress=false",
    "--config.curves=false",  # no test here reads curves.png
)


def _sft(run_dir, *extra, expect: int = 0):
    cmd = [sys.executable, "-m", "jaxloop.sft", "--config", "sft.py", f"--config.run_dir={run_dir}"]
    proc = subprocess.run([*cmd, *SFT_ARGS, *extra], capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def sft_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("sft")
    straight, resumed = base / "straight", base / "resumed"
    _sft(straight, "--config.sft.steps=4")
    _sft(resumed, "--config.sft.steps=4", "--config.stop_after=2")
    _sft(resumed, "--config.sft.steps=4")  # resumes at step 2
    return straight, resumed


def test_sft_resume_is_bitwise(sft_dirs):
    straight, resumed = sft_dirs
    a, b = _checkpoint_arrays(straight, 4), _checkpoint_arrays(resumed, 4)
    assert sorted(a) == sorted(b) and any(k.startswith("actor_opt") for k in a)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    rows_a, rows_b = stable(read_rows(straight)), stable(read_rows(resumed))
    assert rows_a == rows_b
    assert [r["update"] for r in rows_a] == [0, 1, 2, 3]
    assert {"sft_loss", "sft_token_accuracy", "eval_accuracy"} <= set(rows_a[0])
    assert "final_eval_accuracy" in rows_a[-1]
    assert rows_a[-1]["sft_loss"] < rows_a[0]["sft_loss"]


def test_sft_run_dir_starts_training_and_exports(sft_dirs, tmp_path):
    straight, _ = sft_dirs
    # one critic-only update: the trained actor is still the SFT actor, bit for bit
    run = tmp_path / "ppo"
    run_train(
        run,
        "ppo.py",
        *TINY,
        f"--config.model.init_checkpoint={straight}",
        "--config.data.task=reverse",
        "--config.data.num_digits=2",
        "--config.rollout.max_new_tokens=3",
        "--config.critic.warmup_updates=1",
        "--config.total_updates=1",
    )
    sft_actor = {
        k: v for k, v in _checkpoint_arrays(straight, 4).items() if k.startswith("actor_params")
    }
    trained = _checkpoint_arrays(run, 1)
    for key, value in sft_actor.items():
        np.testing.assert_array_equal(trained[key], value, err_msg=key)
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "conversion.to_hf", "--checkpoint", str(straight)]
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32
    assert any(out.glob("*.safetensors"))


def test_sft_refuses_keys_it_does_not_read(tmp_path):
    run = tmp_path / "never"
    proc = _sft(run, "--config.algo.clip_eps=0.3", expect=2)
    assert proc.stderr.count("\n") == 1 and "does not read" in proc.stderr
    assert not run.exists()


WARM = (
    *TINY,
    "--config.data.task=reverse",
    "--config.data.num_digits=2",
    "--config.rollout.max_new_tokens=3",
    "--config.data.reward=tests.train.rewards:char_code_reward",  # rewards that vary
    "--config.warm_start.sft_steps=3",
    "--config.sft.batch_size=8",
    "--config.critic.warmup_updates=2",
    "--config.total_updates=3",
    "--config.checkpoint_every=1",
    "--config.keep_checkpoints=5",
    "--config.eval_every=2",
)


def test_warm_start_and_critic_warmup_resume_bitwise(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    rows = run_train(straight, "ppo.py", *WARM)
    run_train(resumed, "ppo.py", *WARM, "--config.stop_after=1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxloop.train",
            "--config",
            "ppo.py",
            f"--config.run_dir={resumed}",
            *WARM,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warm start (sft)" not in proc.stderr  # the resume did not run it again
    assert stable(read_rows(resumed)) == stable(rows)
    for step in (1, 2, 3):
        a, b = _checkpoint_arrays(straight, step), _checkpoint_arrays(resumed, step)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{step} {key}")

    first = rows[0]
    assert first["warm_start_sft_steps"] == 3
    assert {"warm_start_eval_before", "warm_start_eval_after", "warm_start_sft_loss"} <= set(first)
    assert first["eval_reward"] == first["warm_start_eval_after"]  # update 0 evaluates after it
    # critic warm-up: updates 0 and 1 train the critic alone
    assert [r["critic_warmup"] for r in rows] == [1.0, 1.0, 0.0]
    assert [r["policy_version"] for r in rows] == [0.0, 0.0, 0.0]
    ckpt = {s: _checkpoint_arrays(straight, s) for s in (1, 2, 3)}
    actor = [k for k in ckpt[1] if k.startswith(("actor_params", "actor_opt"))]
    critic = [k for k in ckpt[1] if k.startswith("critic_params")]
    for key in actor:
        np.testing.assert_array_equal(ckpt[1][key], ckpt[2][key], err_msg=key)
    assert any(not np.array_equal(ckpt[1][k], ckpt[2][k]) for k in critic)
    assert any(not np.array_equal(ckpt[2][k], ckpt[3][k]) for k in actor)
    states = [
        json.loads((straight / "checkpoints" / str(s) / "train_state" / "metadata").read_text())
        for s in (2, 3)
    ]
    assert [s["policy_version"] for s in states] == [0, 1]
    assert states[0]["warm_start"]["warm_start_sft_steps"] == 3


def test_warm_start_and_critic_warmup_refusals(tmp_path):
    cmd = [sys.executable, "-m", "jaxloop.train", "--dry-run", "--config"]
    no_warm_start = "--config.warm_start.sft_steps=0"
    for config, *keys in (
        ("grpo.py", "--config.critic.warmup_updates=2"),
        ("ppo.py", "--config.warm_start.sft_steps=-1"),
        ("ppo.py", "--config.sft.batch_size=0"),
        ("ppo.py", "--config.warm_start.probe_prompts=0"),
        ("ppo.py", "--config.warm_start.stop_at_reward=-1"),
        # read only by a warm start: refused, not ignored, without one
        ("ppo.py", no_warm_start),  # the recipe's stop_at_reward stays
        ("ppo.py", no_warm_start, "--config.warm_start.stop_at_reward=None", "--config.sft.lr=0.1"),
        # the probe's keys are read only with stop_at_reward
        (
            "ppo.py",
            "--config.warm_start.stop_at_reward=None",
            "--config.warm_start.probe_prompts=8",
        ),
        (
            "ppo.py",
            "--config.warm_start.stop_at_reward=None",
            "--config.warm_start.probe_sampling=rollout",
        ),
        ("ppo.py", "--config.warm_start.probe_sampling=beam"),
    ):
        proc = subprocess.run([*cmd, config, *keys], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (keys, proc.stderr)
        assert proc.stderr.count("\n") == 1, proc.stderr


def test_warm_start_stops_at_the_validation_reward(tmp_path):
    # every response scores 1.0, so the validation reward is 1.0 from the first step on
    base = (
        *WARM,
        "--config.data.reward=tests.train.rewards:one_reward",
        "--config.critic.warmup_updates=0",
        "--config.warm_start.sft_steps=4",
        "--config.total_updates=1",
    )
    stopped = run_train(
        tmp_path / "stopped", "grpo.py", *base, "--config.warm_start.stop_at_reward=1"
    )
    unreached = run_train(
        tmp_path / "unreached", "grpo.py", *base, "--config.warm_start.stop_at_reward=1.5"
    )
    assert stopped[0]["warm_start_sft_steps"] == 1
    assert stopped[0]["warm_start_probe_reward"] == 1.0
    assert unreached[0]["warm_start_sft_steps"] == 4
    assert unreached[0]["warm_start_probe_reward"] == 1.0
    assert stopped[0]["warm_start_sft_loss"] != unreached[0]["warm_start_sft_loss"]


def test_warm_start_probe_sampling_changes_only_what_the_probe_measures(tmp_path):
    """probe_sampling=rollout probes with one sample per prompt at the rollout's temperature: the
    SFT steps and the greedy evals are those of the greedy probe's run (the target is never
    reached, so both run every step), the probe's reward is not the greedy one, and it follows
    rollout.temperature (near 0 it is the greedy answer's)."""
    base = (*WARM, "--config.warm_start.stop_at_reward=1.5", "--config.total_updates=1")
    base += ("--config.warm_start.probe_prompts=32", "--config.critic.warmup_updates=0")
    runs = {
        name: run_train(tmp_path / name, "grpo.py", *base, *keys)[0]
        for name, keys in (
            ("greedy", ()),
            ("rollout", ("--config.warm_start.probe_sampling=rollout",)),
            (
                "cold",
                ("--config.warm_start.probe_sampling=rollout", "--config.rollout.temperature=1e-4"),
            ),
        )
    }
    for name in ("rollout", "cold"):
        for key in ("warm_start_sft_steps", "warm_start_sft_loss", "warm_start_eval_after"):
            assert runs[name][key] == runs["greedy"][key], (name, key)
    assert runs["rollout"]["warm_start_probe_reward"] != runs["greedy"]["warm_start_probe_reward"]
    assert runs["cold"]["warm_start_probe_reward"] == runs["greedy"]["warm_start_probe_reward"]


def test_warm_start_probe_is_a_validation_set():
    from jaxloop.data.datasets import make_eval_examples
    from jaxloop.data.tasks import BuiltinTask, prompt_split
    from jaxloop.train.warm_start import probe_examples

    data = {"source": "builtin", "task": "reverse", "num_digits": 3, "seed": 0}
    probe = probe_examples(data, eval_prompts=64, seed=0, n=64)
    reported = {ex.prompt for ex in make_eval_examples(data, 64)}
    assert len(probe) == BuiltinTask("reverse", 3).num_eval_prompts - 64
    assert all(prompt_split(ex.prompt) == "eval" and ex.prompt not in reported for ex in probe)
    # reverse of 2 digits has 15 held-out prompts: none is left past 15 reported, so train ones
    data = {**data, "num_digits": 2}
    probe = probe_examples(data, eval_prompts=15, seed=0, n=8)
    assert len(probe) == 8
    assert all(prompt_split(ex.prompt) == "train" for ex in probe)


def test_sft_on_chat_rows_trains_on_the_response_tokens_only(tmp_path):
    """`sft.source` of chat rows ({messages}, {prompt: messages, response}, {prompt, response},
    TRL's {prompt, completion}) with a chat-template tokenizer: the run trains, and each step's
    loss covers exactly the responses' tokens and EOS (every row is in every step's batch), none
    of the system / user / template tokens."""
    from jaxloop.data.tokenizer import HFTokenizer
    from tests.data.test_chat_prompts import SFT_ROWS, build_bpe, write_jsonl

    tok_dir = build_bpe(tmp_path / "tok")
    rows = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS * 2)  # 8: the mesh divides it
    run = tmp_path / "chat_sft"
    cmd = [sys.executable, "-m", "jaxloop.sft", "--config", "sft.py", f"--config.run_dir={run}"]
    cmd += [*SFT_ARGS[:4], "--config.model.vocab_size=320", f"--config.data.tokenizer={tok_dir}"]
    cmd += [f"--config.sft.source={rows}", "--config.data.max_prompt_tokens=96"]
    cmd += ["--config.sft.steps=3", "--config.sft.batch_size=8", "--config.micro_batch_size=8"]
    cmd += ["--config.eval_prompts=8", "--config.rollout.max_new_tokens=2"]
    cmd += ["--config.progress=false", "--config.curves=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = HFTokenizer(tok_dir)
    targets = ["7", "5", "42", "2"]
    expected_tokens = 2 * sum(len(tok.encode(t)) + 1 for t in targets)
    metrics = read_rows(run)
    assert [r["sft_tokens"] for r in metrics] == [expected_tokens] * 3
    assert metrics[-1]["sft_loss"] < metrics[0]["sft_loss"]
    assert json.loads((run / "config.json").read_text())["sft"]["source"] == str(rows)


def test_warm_start_reads_sft_source_and_rl_runs_on_chat_prompts(tmp_path, capsys):
    """A GRPO run on verl-style chat rows (data.source: prompt messages, label at
    reward_model.ground_truth) whose warm start trains on sft.source's chat rows runs;
    jaxloop.evaluate --data on the same rows scores them and its samples show the chat-templated
    prompt the tokenizer renders; a bad sft.source row is refused by the dry run in one line (the
    warm start's rows are checked before anything is built)."""
    from jaxloop.data.tokenizer import HFTokenizer
    from jaxloop.data.types import Message
    from jaxloop.evaluate import main as evaluate_main
    from jaxloop.train.cli import main as train_main
    from tests.data.test_chat_prompts import SFT_ROWS, build_bpe, write_jsonl
    from tests.test_bad_inputs import one_error_line

    tok_dir = build_bpe(tmp_path / "tok")
    chat = ROOT / "examples" / "gsm8k_chat_tiny.jsonl"
    sft = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    args = (
        *TINY,
        "--config.model.vocab_size=320",
        f"--config.data.tokenizer={tok_dir}",
        f"--config.data.source={chat}",
        "--config.data.label_key=reward_model.ground_truth",
        "--config.data.max_prompt_tokens=160",
        "--config.data.reward=math_verify",
        "--config.rollout.max_new_tokens=4",
        "--config.warm_start.sft_steps=2",
        "--config.sft.batch_size=8",
        "--config.total_updates=1",
    )
    rows = run_train(tmp_path / "run", "grpo.py", *args, f"--config.sft.source={sft}")
    assert rows[0]["warm_start_sft_steps"] == 2 and rows[0]["num_samples"] == 8
    first = json.loads(open(chat).readline())
    messages = tuple(Message(m["role"], m["content"]) for m in first["prompt"])
    rendered = HFTokenizer(tok_dir).format_prompt(messages)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("assistant\n")
    # jaxloop.evaluate --data on the same chat rows, read with the run's row shape
    out = tmp_path / "eval_samples.jsonl"
    argv = ["--checkpoint", str(tmp_path / "run"), "--data", str(chat), "--prompts", "2"]
    capsys.readouterr()
    assert evaluate_main([*argv, "--samples-out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["prompts"] == 2  # its JSON line
    evaluated = [json.loads(x) for x in open(out)]
    assert evaluated[0]["prompt_text"] == rendered and evaluated[0]["label"] == "56"
    bad = write_jsonl(tmp_path / "bad.jsonl", [SFT_ROWS[0], {"messages": [{"role": "bot"}]}])
    never = tmp_path / "never"
    argv = ["--config", "grpo.py", *args, f"--config.sft.source={bad}"]
    capsys.readouterr()
    code = train_main([*argv, f"--config.run_dir={never}", "--dry-run"])
    one_error_line(capsys, code, f"{bad}: line 2 key messages[0].role is 'bot'")
    assert not never.exists()
