"""scripts/profile_decode.py: the sampler's per-step profile (issue 38's profile of the sampler)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import profile_decode  # noqa: E402


def test_cache_copies_counts_copies_of_cache_sized_arrays():
    hlo = "\n".join(
        [
            "%copy.1 = f32[64,4,272,32]{3,2,1,0} copy(%p)",  # a whole slot
            "%transpose.2 = f32[64,4,32,80]{3,2,1,0} transpose(%p)",  # over a quarter of it
            "%copy.3 = f32[64,4,2,1,272]{4,3,2,1,0} copy(%s)",  # scores: small
            "%add.4 = f32[64,4,272,32]{3,2,1,0} add(%a, %b)",  # not a copy
            "%slice_bitcast_fusion.5 = f32[64,4,272,32]{3,2,1,0} fusion(%c), kind=kLoop",
        ]
    )
    assert profile_decode.cache_copies(hlo, 64 * 4 * 272 * 32) == 3


def test_the_step_reads_the_cache_in_place_and_prints_one_json_line():
    cmd = [sys.executable, "scripts/profile_decode.py", "--lengths", "72,136", "--repeats", "2"]
    proc = subprocess.run([*cmd, "--hlo"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["slots_read"] for r in out["rows"]] == [72, 136]
    # no copy of a (loop, layer) slot into attention's layout (the token-major cache: 16 per
    # step), only the slice of each slot's K and V out of the stacked cache
    assert all(r["ms_per_step"] > 0 for r in out["rows"]), out
    slots = 2 * 2 * 2  # loops x layers x (k, v) of the bench_peers model A
    assert all(r["cache_copies"] <= slots for r in out["rows"]), out


@pytest.mark.parametrize("bad", [["--lengths", "a,b"], ["--models", "C"], ["--repeats", "0"]])
def test_bad_arguments_exit_2(bad):
    proc = subprocess.run(
        [sys.executable, "scripts/profile_decode.py", *bad], cwd=REPO, capture_output=True
    )
    assert proc.returncode == 2
