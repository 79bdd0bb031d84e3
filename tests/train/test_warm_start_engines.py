"""The recipe on vLLM engines (issue 36, item 9): an algorithm config with a warm start
(`warm_start.sft_steps`) runs with `--config.rollout.engine=vllm`. The warm start's evaluations
and its probe use the embedded sampler beside the engines; the engines get the warm-started
policy by the run's first publication, so update 0's evaluation through them is that policy's."""

from __future__ import annotations

import json

import pytest

from tests.train.helpers import UNIT, run_train
from tests.train.rewards import char_code_reward

pytestmark = pytest.mark.slow

TINY = (
    *UNIT,
    "--config.model.hidden_size=64",
    "--config.model.intermediate_size=64",
    "--config.model.num_layers=1",
    "--config.model.head_dim=32",  # the smallest the vLLM CPU attention supports
    "--config.prompts_per_update=4",
    "--config.n_samples_per_prompt=2",
    "--config.micro_batch_size=8",
    "--config.eval_every=1",
    "--config.eval_prompts=8",
    "--config.total_updates=1",
    "--config.progress=false",
    "--config.curves=false",
    "--config.data.task=reverse",
    "--config.data.num_digits=3",
    "--config.rollout.max_new_tokens=4",
    "--config.data.reward=tests.train.rewards:char_code_reward",  # dense: any response scores
    # a warm start of 4 steps, probed after each (the reward is never reached)
    "--config.warm_start.sft_steps=4",
    "--config.warm_start.stop_at_reward=1.5",
    "--config.warm_start.probe_prompts=8",
    "--config.sft.batch_size=16",
    "--config.sft.lr=0.01",
)


def test_a_warm_start_on_vllm_engines(tmp_path, one_device_env):
    run_dir = tmp_path / "run"
    (row,) = run_train(
        run_dir, "grpo.py", *TINY, "--config.rollout.engine=vllm", env=one_device_env
    )
    assert row["warm_start_sft_steps"] == 4.0  # every step ran, each one probed
    assert 0.0 <= row["warm_start_probe_reward"] <= 1.0
    assert row["warm_start_eval_after"] != row["warm_start_eval_before"]  # the SFT steps acted
    # the engines evaluate the warm-started policy: the embedded sampler's greedy reward of it
    assert row["eval_reward"] == pytest.approx(row["warm_start_eval_after"], abs=1e-6)
    assert row["engine_restarts"] == 0.0
    # the evaluations through the engines wrote their samples (the Ray manager's rows)
    for step, mean in ((0, row["eval_reward"]), (1, row["final_eval_reward"])):
        samples = [json.loads(x) for x in (run_dir / "samples" / f"{step}.jsonl").open()]
        assert len(samples) == 8
        assert all(s["reward"] == char_code_reward(s["response"], s["label"]) for s in samples)
        assert sum(s["reward"] for s in samples) / 8 == pytest.approx(mean, abs=1e-12)
