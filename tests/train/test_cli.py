"""`python -m jaxloop.train`: bad input is one line on stderr, exit code 2, nothing written;
non-finite rewards are dropped and counted; training starts from an HF directory."""

import json
import math

import pytest
from flax import nnx

from jaxloop.models import LoopedConfig, LoopedLM, save_hf, tiny_hf_config
from jaxloop.train import main
from tests.train.helpers import TINY, run_train


def _run_main(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "grpo.py", "--config.nope=1"], "unknown config key 'nope'"),
        (["--config", "grpo.py", "--config.algo.nope=1"], "unknown config key 'algo.nope'"),
        (["--config", "grpo.py", "--config.total_updates=many"], "expected an integer"),
        (["--config", "grpo.py", "--config.n_samples_per_prompt=1"], "n_samples_per_prompt >= 2"),
        (["--config", "no_such_config.py"], "not found"),
        (["--config", "ppo.py", "--config.model.hf_dir=/no/such/dir"], "hf_dir"),
        (["--config", "ppo.py", "--config.algorithm=sac"], "algorithm='sac'"),
        (["--config", "ppo.py", "--config.data.max_prompt_tokens=3"], "longer than"),
        (["--config", "ppo.py", "--config.rollout.engine_timeout_s=0"], "engine_timeout_s must"),
        (["--config", "ppo.py", "--config.algo.dual_clip=0.5"], "dual_clip must be > 1"),
        (["--config", "ppo.py", "--config.data.task=nope"], "unknown builtin task"),
        (["--config", "ppo.py", "--config.data.reward=nope"], "unknown reward"),
        (["--config", "ppo.py", "--config.optim.schedule=nope"], "optim.schedule"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, args, message):
    run_dir = tmp_path / "run"
    code, err = _run_main(capsys, *TINY, f"--config.run_dir={run_dir}", *args)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not run_dir.exists()


def test_empty_dataset_is_an_error(tmp_path, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    run_dir = tmp_path / "run"
    code, err = _run_main(
        capsys,
        "--config",
        "ppo.py",
        f"--config.run_dir={run_dir}",
        f"--config.data.source={data}",
        *TINY,
    )
    assert code == 2 and err.count("\n") == 1 and "empty" in err, err
    assert not run_dir.exists()


def test_help_exits_2_without_writing(capsys):
    code, err = _run_main(capsys, "--help")
    assert code == 2 and "usage" in err


def nan_for_odd_seeds(response: str, label: str) -> float:
    return float("nan") if response and ord(response[0]) % 2 else 1.0


def test_nan_rewards_dropped_and_counted(tmp_path):
    rows = run_train(
        tmp_path / "run",
        "ppo.py",
        "--config.total_updates=2",
        *TINY,
        "--config.data.reward=tests.train.test_cli:nan_for_odd_seeds",
    )
    assert len(rows) == 2
    for row in rows:
        assert row["dropped_samples"] + row["num_samples"] == 8
        assert math.isfinite(row["reward_mean"]) and math.isfinite(row["policy_loss"])
    assert sum(r["dropped_samples"] for r in rows) > 0


def test_train_from_hf_dir(tmp_path):
    hf = tiny_hf_config("ouro", vocab_size=64, hidden_size=32, head_dim=16, num_hidden_layers=1)
    model = LoopedLM(LoopedConfig.from_hf_dict(hf), rngs=nnx.Rngs(0))
    save_hf(model, tmp_path / "hf", dtype="float32")
    run_dir = tmp_path / "run"
    rows = run_train(
        run_dir,
        "grpo.py",
        "--config.total_updates=1",
        *TINY,
        f"--config.model.hf_dir={tmp_path / 'hf'}",
    )
    stored = json.loads((run_dir / "actor_config.json").read_text())
    assert stored["model_type"] == "ouro" and stored["total_ut_steps"] == 4
    assert len(rows) == 1


def test_jsonl_prompts_hf_tokenizer_math_reward(tmp_path):
    from tests.data.test_tokenizer import _build_hf_tokenizer

    tok_dir = _build_hf_tokenizer(tmp_path / "tok")
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"what is {a}+{a}?", "label": str(2 * a)} for a in range(1, 5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    metrics = run_train(
        run_dir,
        "grpo.py",
        "--config.total_updates=2",
        *TINY,
        "--config.model.vocab_size=320",
        f"--config.data.source={data}",
        f"--config.data.tokenizer={tok_dir}",
        "--config.data.reward=math_verify",
        "--config.data.max_prompt_tokens=64",
        "--config.rollout.max_new_tokens=4",
    )
    assert len(metrics) == 2 and metrics[0]["num_samples"] == 8
    assert metrics[0]["eval_reward"] is None  # a file source without eval_source has no eval


def test_logprob_mismatch_stops_the_run(tmp_path, capsys):
    code, err = _run_main(
        capsys,
        "--config",
        "ppo.py",
        *TINY,
        f"--config.run_dir={tmp_path}",
        "--config.rollout.max_logprob_diff=1e-12",
    )
    assert code == 3
    assert "update 0" in err and "exceeds rollout.max_logprob_diff=1e-12" in err, err


def test_half_written_checkpoint_is_not_resumed(tmp_path):
    run_dir = tmp_path / "run"
    common = (
        *TINY,
        "--config.total_updates=3",
        "--config.checkpoint_every=1",
        "--config.keep_checkpoints=5",
    )
    run_train(run_dir, "ppo.py", *common, "--config.stop_after=2")
    # what a save killed half-way leaves: orbax's temporary directory for step 3
    partial = run_dir / "checkpoints" / "3.orbax-checkpoint-tmp-1700000000"
    (partial / "actor_params").mkdir(parents=True)
    (partial / "actor_params" / "garbage").write_bytes(b"\x00" * 16)
    rows = run_train(run_dir, "ppo.py", *common)
    assert [r["update"] for r in rows] == [0, 1, 2]
    assert (run_dir / "checkpoints" / "3").is_dir()


def test_bf16_compute_trains(tmp_path):
    rows = run_train(
        tmp_path / "run",
        "grpo.py",
        *TINY,
        "--config.total_updates=2",
        "--config.model.compute_dtype=bfloat16",
        "--config.rollout.max_new_tokens=3",
        "--config.data.reward=tests.train.rewards:char_code_reward",
    )
    assert len(rows) == 2
    for row in rows:  # within the bf16 default bound, and a real gradient
        assert row["logprob_diff_max"] <= 0.03
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
