"""MetricsWriter (JSONL + TensorBoard), read_metrics, the progress bar and the plot CLI."""

import io
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxloop.metrics import MetricsWriter, progress, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_tb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Minimal TFRecord reader for tensorboardX event files: {tag: [(step, value)]}; session
    START markers (which carry purge_step) are listed under the tag "__start__"."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    files = sorted((run_dir / "tb").glob("events.out.tfevents.*"))
    for f in files:
        data = f.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            record = data[i + 12 : i + 12 + n]
            i += 12 + n + 4
            ev = event_pb2.Event.FromString(record)
            if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START:
                out.setdefault("__start__", []).append((ev.step, 0.0))
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def write_updates(run_dir, updates, start_update=0, **kw):
    with MetricsWriter(run_dir, start_update=start_update, **kw) as w:
        for u in updates:
            w.write(u, {"reward_mean": u / 10, "kl": 0.01 * u})


def test_jsonl_rows_and_types(tmp_path):
    with MetricsWriter(tmp_path / "run") as w:
        row = w.write(0, {"reward_mean": np.float32(0.25), "n": 3, "flag": True, "x": None})
        w.write(1, {"reward_mean": 0.5, "update": 99})  # "update" in metrics is ignored
        with pytest.raises(TypeError, match="'bad' is not a number"):
            w.write(2, {"bad": "text"})
    assert row == {"update": 0, "reward_mean": 0.25, "n": 3.0, "flag": 1.0, "x": None}
    rows = read_metrics(tmp_path / "run")
    assert rows == [row, {"update": 1, "reward_mean": 0.5}]


def test_jax_scalars(tmp_path):
    import jax.numpy as jnp

    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(0, {"loss": jnp.asarray(1.5), "g": jnp.float32(2.0)})
    assert read_metrics(tmp_path) == [{"update": 0, "loss": 1.5, "g": 2.0}]


def test_nan_and_inf_written_as_null(tmp_path):
    with MetricsWriter(tmp_path) as w:
        w.write(0, {"a": float("nan"), "b": float("inf"), "c": -np.inf, "d": np.float64("nan")})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert row == {"update": 0, "a": None, "b": None, "c": None, "d": None}


def test_resume_truncates_without_duplicates(tmp_path):
    write_updates(tmp_path, range(10))
    # simulate a crash mid-line at the end of the file
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"update": 10, "reward_me')
    write_updates(tmp_path, range(6, 12), start_update=6)
    updates = [r["update"] for r in read_metrics(tmp_path)]
    assert updates == list(range(12))
    assert [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == []
    # a second resume from an earlier point
    write_updates(tmp_path, [3], start_update=3)
    assert [r["update"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
    # a fresh run (start_update=0) in the same dir starts a new file
    write_updates(tmp_path, [0, 1])
    assert [r["update"] for r in read_metrics(tmp_path)] == [0, 1]


def test_tensorboard_events(tmp_path):
    write_updates(tmp_path, range(5))
    with MetricsWriter(tmp_path, start_update=5) as w:  # a resume, within the same second
        w.write(5, {"reward_mean": float("nan"), "kl": 0.5})  # NaN not sent to TensorBoard
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    scalars = read_tb_scalars(tmp_path)
    assert [s for s, _ in scalars["reward_mean"]] == [0, 1, 2, 3, 4]
    assert scalars["reward_mean"][3][1] == pytest.approx(0.3)
    assert scalars["kl"][-1] == (5, 0.5)
    # the resumed writer tells TensorBoard to drop events from step 5 on (purge_step)
    assert scalars["__start__"] == [(5, 0.0)]


def test_read_metrics_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "nope")


def test_progress_disabled_prints_final_line():
    buf = io.StringIO()  # not a TTY -> bar disabled
    bar = progress(total=5, initial=2, desc="grpo", file=buf)
    assert bar.disable
    bar.step({"reward_mean": 0.5, "eval_reward": float("nan"), "kl": 3.0})
    bar.step({"reward_mean": 0.75, "eval_reward": 0.25})
    assert buf.getvalue() == ""
    bar.close()
    bar.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("grpo: 4/5 reward_mean=0.75 eval_reward=0.25 ")
    assert "kl" not in lines[0]


def test_progress_enabled_shows_postfix():
    buf = io.StringIO()
    with progress(total=3, desc="ppo", file=buf, disable=False) as bar:
        for i in range(3):
            bar.step({"reward_mean": i / 4})
    out = buf.getvalue()
    assert "3/3" in out and "reward_mean=0.5" in out
    assert out.count("ppo: 3/3 reward_mean") == 0  # no extra summary line when the bar shows


# ----- plot CLI ---------------------------------------------------------------------------------
def run_plot(*args):
    return subprocess.run(
        [sys.executable, "-m", "jaxloop.plot", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_plot_cli_writes_png(tmp_path):
    run = tmp_path / "run"
    with MetricsWriter(run, tensorboard=False) as w:
        for u in range(20):
            m = {"reward_mean": math.sin(u), "kl": float("nan") if u == 3 else u, "grad_norm": 1.0}
            if u % 5 == 0:
                m["eval_reward"] = u / 20
            w.write(u, m)
    res = run_plot(run)
    assert res.returncode == 0, res.stderr
    png = run / "curves.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    out = tmp_path / "sub" / "k.png"
    res = run_plot(run, "--out", out, "--keys", "kl,eval_reward")
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_cli_errors(tmp_path):
    res = run_plot(tmp_path / "missing")
    assert res.returncode == 2
    assert "run dir not found" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    (tmp_path / "nometrics").mkdir()
    res = run_plot(tmp_path / "nometrics")
    assert res.returncode == 2 and "no metrics.jsonl" in res.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    res = run_plot(tmp_path / "empty")
    assert res.returncode == 2 and "has no metrics" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    write_updates(tmp_path / "ok", range(3), tensorboard=False)
    res = run_plot(tmp_path / "ok", "--keys", "nonexistent")
    assert res.returncode == 2 and "present: ['kl', 'reward_mean']" in res.stderr
    assert not (tmp_path / "ok" / "curves.png").exists()
