"""`python -m jaxloop.evaluate`: greedy reward and pass@k of a trained checkpoint. The greedy
reward equals the trainer's own eval reward (its producer's evaluate(), on the 8-device mesh) of
the same checkpoint; bad input is one line on stderr with exit code 2."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxloop.evaluate import main, pass_at_k
from tests.train.helpers import TINY, run_train

TASK = (
    "--config.data.task=reverse",
    "--config.data.num_digits=3",
    "--config.rollout.max_new_tokens=4",
    "--config.data.reward=format",
    "--config.eval_prompts=16",
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GRPO run of 3 updates with an eval before every update and a checkpoint after."""
    run_dir = tmp_path_factory.mktemp("evaluate") / "run"
    rows = run_train(
        run_dir,
        "grpo.py",
        *TINY,
        *TASK,
        "--config.total_updates=3",
        "--config.eval_every=1",
        "--config.checkpoint_every=1",
        "--config.keep_checkpoints=3",
        "--config.optim.lr=3e-3",
    )
    return run_dir, rows


def _eval(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_greedy_reward_matches_the_trainers_eval(trained, capsys):
    run_dir, rows = trained
    for step, expected in ((3, rows[-1]["final_eval_reward"]), (2, rows[2]["eval_reward"])):
        code, out, err = _eval(capsys, "--checkpoint", str(run_dir), "--step", str(step))
        assert code == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["step"] == step and result["prompts"] == 16
        assert result["reward"] == "format"
        assert result["greedy_reward"] == pytest.approx(expected, abs=1e-12), (step, rows)
        assert "greedy reward" in out and f"(step {step})" in out
    # the latest checkpoint by default; partial credit makes the comparison non-trivial
    code, out, _ = _eval(capsys, "--checkpoint", str(run_dir))
    assert code == 0 and json.loads(out.splitlines()[-1])["step"] == 3
    assert rows[-1]["final_eval_reward"] > 0


def test_samples_pass_at_k_and_other_rewards(trained, capsys):
    run_dir, _ = trained
    argv = ["--checkpoint", str(run_dir), "--samples", "4", "--prompts", "8"]
    code, out, err = _eval(capsys, *argv)
    assert code == 0, err
    r = json.loads(out.splitlines()[-1])
    assert r["prompts"] == 8 and r["samples"] == 4 and r["temperature"] == 1.0
    assert 0.0 <= r["pass@1"] <= r["pass@4"] <= 1.0
    assert 0.0 <= r["sample_reward"] <= 1.0 and "pass@4" in out
    # deterministic: the same seeds give the same samples
    assert json.loads(_eval(capsys, *argv)[1].splitlines()[-1]) == r
    # exact_match: nothing right after 3 updates of a tiny model, reward 0 or 1 only
    code, out, _ = _eval(capsys, "--checkpoint", str(run_dir), "--reward", "exact_match")
    r = json.loads(out.splitlines()[-1])
    assert code == 0 and r["reward"] == "exact_match"
    assert r["greedy_reward"] == r["greedy_correct"]


def test_data_file(trained, capsys, tmp_path):
    run_dir, _ = trained
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"{i}{i}{i + 1}:", "label": f"{i + 1}{i}{i}"} for i in range(5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = _eval(capsys, "--checkpoint", str(run_dir), "--data", str(data))
    assert code == 0, err
    r = json.loads(out.splitlines()[-1])
    assert r["prompts"] == 5 and str(data) in r["prompt_set"]
    code, out, _ = _eval(capsys, "--checkpoint", str(run_dir), "--data", str(data), "--prompts=2")
    assert json.loads(out.splitlines()[-1])["prompts"] == 2


def test_pass_at_k_hand_values():
    c = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], bool)
    assert pass_at_k(c, 1) == pytest.approx((0.25 + 0 + 0.5) / 3)
    assert pass_at_k(c, 4) == pytest.approx(2 / 3)
    # 1 - C(2, 2) / C(4, 2) for the last prompt; 1 - C(3, 2) / C(4, 2) for the first
    assert pass_at_k(c, 2) == pytest.approx((0.5 + 0 + 5 / 6) / 3)
    with pytest.raises(ValueError):
        pass_at_k(c, 5)


def test_bad_input_is_one_line_exit_2(trained, capsys, tmp_path):
    run_dir, _ = trained
    (tmp_path / "empty_run").mkdir()
    cases = [
        (["--checkpoint", str(tmp_path / "nope")], "does not exist"),
        (["--checkpoint", str(tmp_path / "empty_run")], "config.json"),
        (["--checkpoint", str(run_dir), "--step", "99"], "no checkpoint at step 99"),
        (["--checkpoint", str(run_dir), "--data", str(tmp_path / "no.jsonl")], "not found"),
        (["--checkpoint", str(run_dir), "--samples", "-1"], "--samples"),
        (["--checkpoint", str(run_dir), "--reward", "nope"], "unknown reward"),
        (["--checkpoint", str(run_dir), "--bogus"], "unrecognized arguments"),
        (["--step", "1"], "--checkpoint"),
    ]
    for argv, message in cases:
        code, out, err = _eval(capsys, *argv)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and out == "", (argv, out, err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_module_entry_point(trained):
    """As a user runs it: `python -m jaxloop.evaluate` in a fresh process."""
    run_dir, rows = trained
    cmd = [sys.executable, "-m", "jaxloop.evaluate", "--checkpoint", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["greedy_reward"] == pytest.approx(rows[-1]["final_eval_reward"], abs=1e-12)
    bad = subprocess.run(cmd + ["--step", "42"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
