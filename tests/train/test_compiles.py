"""No recompilation between updates: once an update of a given row length has run, a later update
of the same length lowers no new program (counted with jax.monitoring's lowering events), for
the fused one-step update (GRPO) and the separate old-log-prob pass + critic (PPO)."""

import pytest

from jaxloop.rl.batch import RolloutBatch
from jaxloop.train import cli as train_cli
from jaxloop.train.loop import Trainer
from tests.lowerings import counting_lowerings
from tests.train.helpers import TINY


@pytest.mark.parametrize(
    "config, extra",
    [("grpo.py", ()), ("ppo.py", ("--config.updates_per_rollout=2",))],
)
def test_updates_of_a_seen_length_compile_nothing(tmp_path, monkeypatch, config, extra):
    rows = []

    from_samples = RolloutBatch.from_samples

    def recorded(*args, **kwargs):
        batch = from_samples(*args, **kwargs)
        rows.append(batch.tokens.shape[1])
        return batch

    one_update = Trainer.one_update
    per_update = []

    def counted(self, update, last, bar):
        before = lowerings[0]
        one_update(self, update, last, bar)
        per_update.append((update, rows[-1], lowerings[0] - before))

    monkeypatch.setattr(RolloutBatch, "from_samples", staticmethod(recorded))
    monkeypatch.setattr(Trainer, "one_update", counted)
    with counting_lowerings() as lowerings:
        code = train_cli.main(
            [
                "--config",
                config,
                *TINY,
                *extra,
                "--config.total_updates=6",
                "--config.eval_every=None",  # one evaluation, after the last update (excluded)
                "--config.rollout.max_new_tokens=3",
                f"--config.run_dir={tmp_path / 'run'}",
            ]
        )
    assert code == 0
    assert per_update[0][2] > 0  # the counter sees compilations
    seen, checked = set(), 0
    for update, length, compiled in per_update[:-1]:
        if length in seen:
            assert compiled == 0, f"update {update} (rows of {length}) lowered {compiled} programs"
            checked += 1
        seen.add(length)
    assert checked >= 3
