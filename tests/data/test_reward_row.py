"""A `module:function` reward receives the example's whole row (issue 36, item 2), as TRL passes a
dataset's extra columns: a function that takes a keyword `row` (or **kwargs) gets the data file's
row as read ({prompt, label} for a built-in task), decided by its signature at load. The rewards
here come from a real producer around the embedded sampler on a tiny model."""

from __future__ import annotations

import json

import pytest
from flax import nnx

from jaxloop.config import parse_args, unit_overrides
from jaxloop.data.datasets import load_examples
from jaxloop.data.rewards import get_reward, takes_row, with_row
from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.rollout.api import Policy
from jaxloop.rollout.jax_sampler import JaxSamplerEngine
from jaxloop.rollout.producer import DataError, RolloutProducer
from jaxloop.train.setup import producer_settings

HERE = "tests.data.test_reward_row"
WEIGHTS = {"ab:": 0.25, "cd:": 0.5, "ef:": 0.75, "gh:": 1.0}


# ---- user reward functions (imported by name, as a user's module would be) ----
def row_weight(response: str, label: str, *, row: dict) -> float:
    """A reward that is a column of the row alone: it depends on nothing else."""
    return float(row["meta"]["weight"])


def kwargs_weight(response, label, **kwargs):
    return float(kwargs["row"]["meta"]["weight"])


def changes_row(response, label, row):
    """Positional `row` (passed by keyword); a function that changes the row it is handed."""
    row["meta"]["weight"] = -1.0
    row.clear()
    return 0.0


def prompt_length(response, label, row):
    return float(len(row["prompt"]))


def plain(response, label):
    return 0.5


def no_label(response):
    return 0.0


def _rows_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": p, "label": "1", "meta": {"weight": w}} for p, w in WEIGHTS.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _setup(*overrides: str):
    small = ("--config.prompts_per_update=4", "--config.n_samples_per_prompt=2")
    small += ("--config.eval_prompts=4",)
    cfg = parse_args(["--config", "grpo.py", *unit_overrides(), *small, *overrides])
    settings = producer_settings(cfg, requires_groups=True)
    model_cfg = LoopedConfig.from_hf_dict(
        tiny_hf_config("nanbeige", vocab_size=settings.vocab_size)
    )
    model = LoopedLM(model_cfg, rngs=nnx.Rngs(0))
    return cfg, settings, model


def _producer(*overrides: str) -> RolloutProducer:
    _, settings, model = _setup(*overrides)
    producer = RolloutProducer(settings, JaxSamplerEngine(model))
    producer.publish(Policy(nnx.state(model), 0, model.config))
    return producer


def test_which_functions_take_the_row():
    assert takes_row(row_weight) and takes_row(kwargs_weight) and takes_row(changes_row)
    assert not takes_row(plain) and not takes_row(len)  # a builtin: no signature to read
    assert not takes_row(lambda response, label, row=None, /: 0.0)  # cannot be passed by name
    assert not takes_row(lambda response, label, *rows: 0.0)
    assert not takes_row(get_reward("exact_match"))  # the built-in rewards: (response, label)
    assert with_row(plain)("x", "y", {"anything": 1}) == 0.5
    with pytest.raises(ValueError, match=r"cannot be called as fn\(response, label\)"):
        get_reward(f"{HERE}:no_label")
    assert get_reward(f"{HERE}:changes_row") is changes_row


def test_a_file_row_is_kept_whole(tmp_path):
    examples = load_examples(_rows_file(tmp_path))
    assert [e.row["meta"]["weight"] for e in examples] == list(WEIGHTS.values())
    assert examples[0].reward_row() == {"prompt": "ab:", "label": "1", "meta": {"weight": 0.25}}


def test_a_reward_that_reads_a_row_column(tmp_path):
    data = _rows_file(tmp_path)
    producer = _producer(
        f"--config.data.source={data}",
        f"--config.data.eval_source={data}",
        f"--config.data.reward={HERE}:row_weight",
    )
    samples, stats = producer.produce(0)
    assert len(samples) == 8
    # every sample's reward is its own prompt's column: the rows reached the scorer, each its own
    assert {(s.prompt_text, s.reward) for s in samples} == set(WEIGHTS.items())
    assert stats["reward_mean"] == pytest.approx(sum(WEIGHTS.values()) / 4)
    mean, rows = producer.evaluate_samples()
    assert [r["reward"] for r in rows] == list(WEIGHTS.values())
    assert mean == pytest.approx(sum(WEIGHTS.values()) / 4) == producer.evaluate()


def test_kwargs_and_a_reward_that_changes_its_row(tmp_path):
    data = _rows_file(tmp_path)
    producer = _producer(
        f"--config.data.source={data}", f"--config.data.reward={HERE}:kwargs_weight"
    )
    assert sorted(s.reward for s in producer.produce(0)[0]) == sorted([*WEIGHTS.values()] * 2)
    changer = _producer(f"--config.data.source={data}", f"--config.data.reward={HERE}:changes_row")
    changer.produce(0)
    changer.produce(1)  # the rows it changed were copies: the data is as read
    assert [e.row["meta"]["weight"] for e in changer.source.examples] == list(WEIGHTS.values())


def test_a_builtin_tasks_row_is_its_prompt_and_label():
    producer = _producer(f"--config.data.reward={HERE}:prompt_length", "--config.data.num_digits=3")
    samples, _ = producer.produce(0)
    assert {s.reward for s in samples} == {4.0}  # "729:" of 3 digits and the colon
    assert {r["reward"] for r in producer.evaluate_samples()[1]} == {4.0}


def test_a_reward_whose_row_key_is_missing_is_one_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "ab:", "label": "1"}) + "\n")
    with pytest.raises(DataError, match="raised KeyError") as caught:
        _producer(f"--config.data.source={path}", f"--config.data.reward={HERE}:row_weight")
    assert len(str(caught.value).splitlines()) == 1


def test_the_docs_row_reward_runs_as_written(tmp_path):
    """docs/data.md's reward-function example: examples/row_rewards.py reads the worked answer
    of a raw GSM8K row, and the doc's dry-run command loads it and passes (rc 0)."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from jaxloop.data.datasets import RowShape

    root = Path(__file__).resolve().parents[2]
    reward = with_row(get_reward("examples.row_rewards:gsm8k_steps"))
    shape = RowShape("question", "answer", "{prompt}", "gsm8k")
    first = load_examples(root / "examples" / "gsm8k_tiny.jsonl", shape)[0]  # 3 + 53 = 56
    assert first.label == "56" and "<<3+53=56>>" in first.row["answer"]
    assert reward("so it is 56", first.label, first.row) == 1.0
    assert reward("3 + 53 = 56, plus one: 57", first.label, first.row) == 0.5  # a right step
    assert reward("57", first.label, first.row) == 0.0
    text = (root / "docs" / "data.md").read_text()
    lines = [x for x in text.splitlines() if x.startswith(("python -m jaxloop", "python scripts"))]
    tokenizer_line = next(x for x in lines if x.startswith("python scripts/build_tokenizer.py"))
    command = next(x for x in lines if "row_rewards:gsm8k_steps" in x)
    for name in ("examples", "scripts"):
        (tmp_path / name).symlink_to(root / name)
    for line in (tokenizer_line, command):
        argv = [sys.executable, *shlex.split(line)[1:]]
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{line}\n{proc.stderr[-2000:]}"
    assert "dry run: the config is valid" in proc.stdout


@pytest.mark.slow
def test_the_rows_reach_the_scorer_behind_ray_engines(tmp_path):
    """rollout.engine=ray_jax (the Ray manager and an engine actor; vLLM engines sit behind the
    same manager): the rows stay in the manager's producer, which scores, and come back as
    rewards and evaluation rows equal to the in-process producer's."""
    from jaxloop.config import run_config
    from jaxloop.rollout.ray.client import RayRolloutClient

    data = _rows_file(tmp_path)
    args = (f"--config.data.source={data}", f"--config.data.eval_source={data}")
    args += (f"--config.data.reward={HERE}:row_weight", "--config.rollout.engine=ray_jax")
    cfg, settings, model = _setup(*args)
    client = RayRolloutClient(run_config(cfg).rollout, model.config, settings)
    try:
        client.publish(Policy(nnx.state(model), 0, model.config))
        samples, _ = client.produce(0)
        assert {(s.prompt_text, s.reward) for s in samples} == set(WEIGHTS.items())
        mean, rows = client.evaluate_samples()
    finally:
        client.close()
    assert [r["reward"] for r in rows] == list(WEIGHTS.values())
    local = _producer(*args)
    assert (mean, rows) == local.evaluate_samples()
