"""Remote engines under two trainer processes, the parts that need no engine (real jax.distributed
processes, 4 fake CPU devices each; tests/rollout/processes_worker.py): a policy sharded over
both processes is published with the tensors, hence the digests, of a one-process publication of
the same parameters; process 0's values and errors reach process 1 (LeaderChannel)."""

import json
import subprocess
import sys
from pathlib import Path

from jaxloop.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_two_process_staging_and_channel(tmp_path):
    coordinator = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "tests.rollout.processes_worker"]
    procs = [
        subprocess.Popen(
            [*cmd, str(rank), coordinator, str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    first, second = (json.loads((tmp_path / f"process{r}.json").read_text()) for r in range(2))
    assert first["buckets"] > 1
    assert first["hashes"] == first["ref_hashes"] and len(first["hashes"]) > 5
    assert first["bytes"] == first["ref_bytes"]
    want = {"update": 7, "ids": [1, 2, 3]}
    assert first["shared"] == second["shared"] == want
    line = "engine 0: no node has room for its bundle"
    assert first["error"] == second["error"] == ["EngineFailedError", line]
