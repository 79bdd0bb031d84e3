"""Sequence packing (learner.pack_tokens): the packed learner equals the padded one (log-probs,
values, metrics, new parameters; <= 1e-6 fp32) for every algorithm, segments do not see each
other, and the packing plan is a lossless, deterministic re-layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxloop.rl.batch import RolloutBatch
from jaxloop.rl.packing import pack_groups, row_bucket
from jaxloop.train.cli import main
from tests.rl.test_learner import CFG, _Run
from tests.train.helpers import TINY, UNIT, read_rows, stable

PACK = 24  # the longest sample below has 23 input tokens
RESPONSE_LENGTHS = (2, 3, 19, 2, 5, 2, 8, 3)  # long-tailed: one long answer, many short ones


def _batch(seed=0) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, CFG.vocab_size, 4).tolist() for _ in RESPONSE_LENGTHS]
    responses = [rng.integers(3, CFG.vocab_size, n).tolist() for n in RESPONSE_LENGTHS]
    logprobs = [(-rng.random(n)).tolist() for n in RESPONSE_LENGTHS]
    groups = np.repeat(np.arange(len(prompts) // 2), 2)
    return RolloutBatch.from_sequences(
        prompts, responses, logprobs, rng.normal(size=len(prompts)), groups
    )


def _max_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.abs(x - y).max()), a, b)))


def test_plan_is_a_lossless_deterministic_relayout():
    batch = _batch()
    groups = np.arange(8).reshape(2, 4)
    plan = pack_groups(batch.tokens, batch.attention_mask, groups, PACK, row_multiple=2)
    again = pack_groups(batch.tokens, batch.attention_mask, groups, PACK, row_multiple=2)
    for value, other in zip(
        jax.tree.leaves(plan.packed_rows()), jax.tree.leaves(again.packed_rows()), strict=True
    ):
        np.testing.assert_array_equal(value, other)
    assert plan.rows == 2 and plan.tokens.shape == (4, PACK)  # 8 samples in 4 rows, not 8
    inputs = batch.attention_mask[:, :-1]
    for g, group in enumerate(groups):  # every input token and target comes back in place
        rows = slice(g * plan.rows, (g + 1) * plan.rows)
        for name, source in (("tokens", batch.tokens[:, :-1]), ("targets", batch.tokens[:, 1:])):
            flat = np.concatenate([[0], getattr(plan, name)[rows].ravel()])
            np.testing.assert_array_equal(
                flat[plan.index[group]], np.where(inputs, source, 0)[group]
            )
    assert ((plan.index > 0) == inputs).all()
    assert [row_bucket(n, 8, 64) for n in (1, 8, 9, 17, 40, 64)] == [8, 8, 16, 32, 64, 64]
    with pytest.raises(ValueError, match="does not fit learner.pack_tokens=22"):
        pack_groups(batch.tokens, batch.attention_mask, groups, 22)


@pytest.mark.parametrize(
    "name, micro, kl, updates, chunk",
    [
        ("ppo", 4, 0.1, 0, None),  # critic values and steps, reference
        ("grpo", 2, 0.1, 0, None),  # groups split over micro-batches, reference
        ("dppo", 2, 0.0, 3, None),  # 3 uneven steps: their micro-batches differ from the passes'
        ("flow_dppo", 4, 0.0, 0, 4),  # full-vocabulary KL, chunked LM head
    ],
)
def test_packed_update_equals_padded(name, micro, kl, updates, chunk):
    batch = _batch()
    padded = _Run(name, micro, kl, updates=updates)
    packed = _Run(name, micro, kl, logits_chunk=chunk, pack_tokens=PACK, updates=updates)
    packed_batch = batch.with_length(PACK + 1)  # the trainer's one static shape
    assert not batch.response_mask[:, PACK:].any()  # compare on the packed batch's T = PACK
    mask = batch.response_mask[:, :PACK] > 0
    lp_padded = np.asarray(padded.old_logprobs(batch))
    lp_packed = np.asarray(packed.old_logprobs(packed_batch))
    assert np.abs(lp_packed[mask] - lp_padded[:, :PACK][mask]).max() <= 1e-6

    learner = packed.learner
    placed = learner.place_batch(packed_batch.train_batch())
    rows = placed.pack.tokens.shape[0]  # micro 4: 2 rows per micro-batch of 4 samples
    assert rows == (4 if micro == 4 else 8) and placed.tokens.shape == (8, PACK + 1)
    if padded.state.critic_params is not None:  # values and reference log-probs (ppo)
        p_out, _ = padded.learner._prepare(
            padded.state.ref_params,
            padded.state.critic_params,
            padded.learner.place_batch(batch.train_batch().replace(old_logprobs=lp_padded)),
        )
        q_out, _ = learner._prepare(
            packed.state.ref_params,
            packed.state.critic_params,
            placed.replace(old_logprobs=lp_packed),
        )
        for key in ("ref_logprobs", "values"):
            if getattr(p_out, key) is None:
                continue
            q, p = np.asarray(getattr(q_out, key)), np.asarray(getattr(p_out, key))
            diff = np.abs(q - p[:, :PACK])[mask]
            assert diff.max() <= 1e-6, key

    m_padded, m_packed = padded.update(batch), packed.update(packed_batch)
    assert set(m_padded) == set(m_packed)
    for key, value in m_padded.items():
        if key == "outward_frac":
            # Flow-DPPO's first step has pi == pi_old: the fraction of tokens whose ratio is on
            # the advantage's side of 1 counts the signs of fp32 rounding noise (ratio = 1 +-
            # 1e-7), which differs between any two layouts; nothing is blocked by it (D = 0)
            continue
        assert abs(m_packed[key] - value) <= 1e-6 * max(1.0, abs(value)), (key, value)
    assert m_padded["grad_norm"] > 0
    assert _max_diff(padded.state.actor_params, _Run(name, micro).state.actor_params) > 1e-4
    assert _max_diff(packed.state.actor_params, padded.state.actor_params) <= 1e-6
    if padded.state.critic_params is not None:
        assert m_padded["value_loss"] > 0
        assert _max_diff(packed.state.critic_params, padded.state.critic_params) <= 1e-6


def test_a_segment_cannot_see_another():
    """Sample 6 shares a packed row with sample 4: changing its response tokens
    changes its own log-probs and leaves every other sample's exactly as they were."""
    batch = _batch()
    run = _Run("grpo", 8, pack_tokens=PACK)
    placed = run.learner.place_batch(batch.train_batch())
    index, width = np.asarray(placed.pack.index), PACK
    row_of = lambda i: set((index[i][index[i] > 0] - 1) // width)  # noqa: E731
    assert row_of(6) == row_of(4)
    before = np.asarray(run.old_logprobs(batch))
    changed = batch.with_length(batch.tokens.shape[1])
    response = changed.response_mask[6] > 0
    row = changed.tokens[6, 1:]
    row[response] = 3 + (row[response] - 2) % (CFG.vocab_size - 3)
    after = np.asarray(run.old_logprobs(changed))
    others = np.arange(8) != 6
    np.testing.assert_array_equal(after[others], before[others])
    assert np.abs(after[6] - before[6])[response].max() > 1e-3


def test_pack_tokens_shorter_than_the_longest_sample_is_a_one_line_error(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(
        [
            "--config",
            "grpo.py",
            *UNIT,
            "--config.learner.pack_tokens=32",
            f"--config.run_dir={run_dir}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "learner.pack_tokens=32" in err and "= 33" in err  # 32 prompt + 1 response token
    assert not run_dir.exists()


def test_trainer_packed_run_equals_padded(tmp_path):
    """One update of the CLI on the 8-device mesh (rows sharded over 'fsdp'), with sampled
    responses of several lengths: the same metrics as the padded run."""
    args = ["--config", "grpo.py", *TINY, "--config.total_updates=1", "--config.eval_every=100"]
    args += ["--config.data.task=reverse", "--config.rollout.max_new_tokens=6"]
    for name, extra in (("padded", []), ("packed", ["--config.learner.pack_tokens=40"])):
        assert main([*args, f"--config.run_dir={tmp_path / name}", *extra]) == 0
    padded, packed = (stable(read_rows(tmp_path / name))[0] for name in ("padded", "packed"))
    assert padded.keys() == packed.keys() and padded["response_length"] > 1
    for key, value in padded.items():
        assert abs(packed[key] - value) <= 1e-6 * max(1.0, abs(value)), (key, value, packed[key])


def test_interleaved_steps_take_part_of_every_group_and_pack_as_padded():
    """learner.step_split=interleaved: step i gets samples i, i + steps, ... (each step part of
    every group), packed or padded alike, and the update differs from the contiguous split's."""
    from jaxloop.rl.microbatch import step_plan

    plan = step_plan(8, 2, 2, "interleaved")
    np.testing.assert_array_equal(plan, [[0, 2, 4, 6], [1, 3, 5, 7]])
    np.testing.assert_array_equal(step_plan(8, 2, 2), [[0, 1, 2, 3], [4, 5, 6, 7]])
    np.testing.assert_array_equal(step_plan(5, 2, 2, "interleaved"), [[0, 2, 4, 5], [1, 3, 5, 5]])
    with pytest.raises(ValueError, match="valid: contiguous, interleaved"):
        step_plan(8, 2, 2, "shuffled")
    batch = _batch()
    padded = _Run("grpo", 2, updates=2, step_split="interleaved")
    packed = _Run("grpo", 2, pack_tokens=PACK, updates=2, step_split="interleaved")
    contiguous = _Run("grpo", 2, updates=2)
    m_padded = padded.update(batch)
    m_packed = packed.update(batch.with_length(PACK + 1))
    contiguous.update(batch)
    for key, value in m_padded.items():
        assert abs(m_packed[key] - value) <= 1e-6 * max(1.0, abs(value)), (key, value)
    assert _max_diff(packed.state.actor_params, padded.state.actor_params) <= 1e-6
    assert _max_diff(contiguous.state.actor_params, padded.state.actor_params) > 1e-4
