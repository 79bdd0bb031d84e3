"""Learning, not just running (short version of scripts/learning_check.py): GRPO from random
init lifts the greedy eval reward on a multi-token task (reverse of 2 digits, `format` reward)
from <= 0.2 to >= 0.8, and the final checkpoint's greedy answers are then exactly right
(jaxloop.evaluate with exact_match), not only their first digit."""

import json
import subprocess
import sys

from tests.train.helpers import run_train


def test_grpo_learns_multi_token_reverse(tmp_path):
    run_dir = tmp_path / "grpo_reverse"
    rows = run_train(
        run_dir,
        "grpo.py",
        "--config.data.task=reverse",
        "--config.data.num_digits=2",
        "--config.data.reward=format",
        "--config.rollout.max_new_tokens=2",
        "--config.optim.lr=2e-3",
        "--config.total_updates=120",
        "--config.eval_every=20",
        "--config.progress=false",
        "--config.checkpoint_every=1000",
        timeout=1200,
    )
    curve = [r.get("eval_reward") for r in rows if "eval_reward" in r]
    assert len(rows) == 120
    assert rows[0]["eval_reward"] <= 0.2
    assert rows[-1]["final_eval_reward"] >= 0.8, curve
    cmd = [sys.executable, "-m", "jaxloop.evaluate", "--checkpoint", str(run_dir)]
    proc = subprocess.run(
        [*cmd, "--reward", "exact_match"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    exact = json.loads(proc.stdout.strip().splitlines()[-1])
    assert exact["greedy_reward"] >= 0.7, (exact, curve)  # both digits right, not just the first
