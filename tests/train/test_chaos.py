"""Kill -9 anywhere, in CI: scripts/chaos.py with 3 SIGKILLs per algorithm (docs/reliability.md's
`python scripts/chaos.py --algorithm ALL --points 20` is the full version). Each kill lands in a
different window (checkpoint write, its commit rename, old-checkpoint deletion, publication,
rollout, restore, metrics, ...); after every kill the newest checkpoint must equal the reference
run's and be the one restored, and the finished run's final checkpoint must be byte-identical to
an uninterrupted run's, with metrics.jsonl holding each update exactly once."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about a minute per algorithm (a dozen trainer processes)
USES_REAL_ENGINES = False  # trainer processes only: its own xdist group (conftest)

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"
_spec = importlib.util.spec_from_file_location("chaos", _PATH)
chaos = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = chaos  # its dataclasses look their module up
_spec.loader.exec_module(chaos)


@pytest.mark.parametrize("algorithm", chaos.ALGORITHMS)
def test_kill_9_anywhere(tmp_path, algorithm, env):
    result = chaos.run_chaos(algorithm, 3, tmp_path, seed=0, total=4, env=env, plot=False)
    assert not result.failures and result.survived == 3, result.line()
    assert result.rounds >= 1 and sum(result.by_kind.values()) == 3
