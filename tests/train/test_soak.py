"""The soak's short version (issue 39 item 4): 100 updates of the unit model with checkpoints,
evaluations and samples on (scripts/soak.py, one trainer in one process): no file descriptor or
thread is leaked, and keep_checkpoints holds at every row while samples files accumulate."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_short_soak_leaks_no_files_and_keeps_retention(tmp_path, one_device_env):
    run_dir = tmp_path / "soak"
    cmd = [sys.executable, str(REPO / "scripts" / "soak.py"), "--out", str(run_dir)]
    cmd += ["--updates", "100", "--every", "10", "--checkpoint-every", "5", "--eval-every", "20"]
    cmd += ["--keep", "2", "--baseline", "20"]
    proc = subprocess.run(cmd, env=one_device_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(run_dir / "soak.jsonl")]
    assert [r["update"] for r in rows] == list(range(10, 101, 10))
    settled = rows[1:]  # from update 20: every writer (metrics, TensorBoard, samples) is open
    assert len({r["open_fds"] for r in settled}) == 1, [r["open_fds"] for r in rows]
    assert len({r["threads"] for r in settled}) == 1, [r["threads"] for r in rows]
    assert all(r["checkpoints"] == 2 for r in rows), [r["checkpoints"] for r in rows]
    # evaluations at 0, 20, ..., 100 (the last one final) each wrote their samples file
    assert rows[-1]["sample_files"] > rows[0]["sample_files"] >= 1
    assert (run_dir / "soak.png").stat().st_size > 0
    assert "soak: open_fds" in proc.stdout


def _lists() -> int:
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is list)


def test_checkpoint_saves_keep_no_objects(tmp_path):
    """tensorstore 0.1.86 leaks the metrics orbax collects around every array write (~0.34 MB
    per trainer checkpoint: the soak's host RSS rose steadily); jaxloop.io.orbax stops orbax
    from collecting them. 20 saves of a tiny model leave 22 lists (480 without that)."""
    from flax import nnx

    from jaxloop.families import tiny_hf_config
    from jaxloop.io.orbax import save_model
    from jaxloop.models.config import LoopedConfig
    from jaxloop.models.looped import LoopedLM

    hf = tiny_hf_config("nanbeige", num_hidden_layers=1, intermediate_size=64)
    model = LoopedLM(LoopedConfig.from_hf_dict(hf), rngs=nnx.Rngs(0))
    for step in range(5):  # orbax's and tensorstore's one-time state
        save_model(tmp_path / "run", model, step=step)
    before = _lists()
    for step in range(5, 25):
        save_model(tmp_path / "run", model, step=step)
    assert _lists() - before < 100
