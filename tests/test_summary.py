"""The end-of-run summary (jaxloop.summary): values from metrics rows, and the finished-update
count read from a checkpoint without opening orbax."""

import json
import re

import pytest

from jaxloop.io.run_dir import completed_update
from jaxloop.summary import finish_report, summary_rows


def _rows():
    rows = []
    for u in range(14):
        row = {"update": u, "reward_mean": float(u), "tokens_per_s": 100.0 + u}
        if u % 5 == 0:
            row["eval_reward"] = [0.2, 0.9, 0.5][u // 5]
        rows.append(row)
    rows[-1]["final_eval_reward"] = 0.6
    return rows


def test_summary_values():
    rows = _rows()
    for r in rows[12:]:
        r["engine_restarts"] = 2.0
    rows[13]["skipped_updates"] = 3.0
    table = dict(summary_rows(rows, start_update=10, wall_s=12.34))
    assert table["updates this process"] == "4 (updates 10 -> 14)"
    assert table["final eval reward"] == "0.6"  # the final eval, not the best or the last eval
    assert table["best eval reward"] == "0.9"  # over the whole run, earlier processes included
    assert table["mean reward, last 10 updates"] == format(sum(range(4, 14)) / 10, ".4g")
    assert table["tokens/s (mean per update)"] == "111.5"  # this process's updates only
    assert table["wall time"] == "12.3 s"
    assert table["engine restarts"] == "2" and table["skipped updates"] == "3"
    assert "manager restarts" not in table  # only rows of Ray rollouts have the metric
    for r in rows[11:]:
        r["manager_restarts"] = 1.0
    assert dict(summary_rows(rows, start_update=10, wall_s=1.0))["manager restarts"] == "1"


def test_summary_without_optional_metrics():
    rows = [{"update": 0, "reward_mean": 0.5}, {"update": 1, "reward_mean": None}]
    table = dict(summary_rows(rows, start_update=0, wall_s=1.0))
    assert table["final eval reward"] == "-" and table["best eval reward"] == "-"
    assert table["mean reward, last 2 updates"] == "0.5"  # null (non-finite) values are skipped
    assert table["engine restarts"] == "0" and table["skipped updates"] == "0"
    # no final eval: the last eval is the final one
    rows[0]["eval_reward"] = 0.25
    assert dict(summary_rows(rows, 0, 1.0))["final eval reward"] == "0.25"


def _checkpoint(run_dir, step, update=None):
    state = run_dir / "checkpoints" / str(step) / "train_state"
    state.mkdir(parents=True)
    if update is not None:
        (state / "metadata").write_text(json.dumps({"update": update, "policy_version": update}))


def test_completed_update(tmp_path):
    assert completed_update(tmp_path / "nothing") is None
    assert not (tmp_path / "nothing").exists()
    _checkpoint(tmp_path, 3, update=3)
    _checkpoint(tmp_path, 10, update=10)
    (tmp_path / "checkpoints" / "12.orbax-checkpoint-tmp-1700000000").mkdir()  # unfinished
    assert completed_update(tmp_path) == 10
    _checkpoint(tmp_path, 11)  # no readable train state: the step number
    assert completed_update(tmp_path) == 11


def test_finish_report_writes_curves(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for row in _rows():
            f.write(json.dumps(row) + "\n")
    _checkpoint(tmp_path, 14, update=14)
    text = finish_report(tmp_path, start_update=0, wall_s=2.0, total=20)
    assert text.splitlines()[0] == "run summary: update 14 of 20"
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert re.search(rf"^  curves +{re.escape(str(tmp_path / 'curves.png'))}$", text, re.M)
    assert str(tmp_path / "checkpoints" / "14") in text


def test_finish_report_with_curves_off_writes_no_png(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for row in _rows():
            f.write(json.dumps(row) + "\n")
    text = finish_report(tmp_path, start_update=0, wall_s=2.0, total=20, curves=False)
    assert re.search(r"^  curves +not written \(curves=False\)$", text, re.M), text
    assert not (tmp_path / "curves.png").exists()


@pytest.mark.parametrize("content", [None, ""])
def test_finish_report_without_metrics_does_not_fail(tmp_path, content):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    text = finish_report(tmp_path, start_update=0, wall_s=2.0, total=5)
    assert "curves" in text and "not written" in text and "checkpoint" in text
    assert not (tmp_path / "curves.png").exists()
