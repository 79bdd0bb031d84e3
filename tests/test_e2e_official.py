"""scripts/e2e_official.py at the reduced shape: every real-shape config setting (bf16 compute,
full remat, chunked LM head, critic / optimizer / reference offloaded) through 2 updates of each
algorithm with the embedded sampler; the table's JSON reports every phase."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxloop.launch import process_env

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # four trainer processes
USES_REAL_ENGINES = False  # trainer processes only: its own xdist group (conftest)


def test_e2e_official_reduced(tmp_path):
    env = process_env(1)  # one device, the session's other XLA flags
    cmd = [sys.executable, str(ROOT / "scripts" / "e2e_official.py"), "--reduced"]
    cmd += ["--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["algorithm"] for r in result["results"]] == ["ppo", "grpo", "dppo", "flow_dppo"]
    for r in result["results"]:
        assert r["ok"], r
        for phase in ("generate", "old_logprobs", "update", "publish"):
            assert len(r[f"{phase}_s"]) == 2 and all(t >= 0 for t in r[f"{phase}_s"]), phase
        assert 0 <= r["logprob_diff_max"] <= 0.03  # the bf16 bound
        assert r["host_peak_rss_gb"] > 0
    # the offloaded parts moved: the metrics of a critic algorithm carry the moves
    rows = [json.loads(x) for x in open(tmp_path / "ppo" / "metrics.jsonl")]
    assert rows[0]["offload_critic_to_device_gb"] > 0
    assert rows[0]["offload_optimizer_to_host_gb"] > 0


def test_e2e_official_refuses_the_full_shape_on_cpu():
    cmd = [sys.executable, str(ROOT / "scripts" / "e2e_official.py"), "--config", "nanbeige-3b"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "needs an accelerator" in proc.stderr
