"""Checkpoint digests' hashing (jaxloop/models/digests.py): the sums of hashlib over files of
every size around the read chunk, and a process that hashes a step at every save keeps no
megabytes behind (each save's fresh pool threads once left an 8 MiB buffer apiece in glibc's
per-thread arenas: a soak's RSS rose 5-8 % and held)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys

import pytest

from jaxloop.models import digests

CHUNK = digests._CHUNK


@pytest.mark.parametrize("n", [0, 100, CHUNK - 1, CHUNK, 2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 2])
def test_each_file_hashes_as_hashlib_does(tmp_path, n):
    """Files under a chunk (one buffer of their size) and from one chunk on (the mapping)."""
    data = os.urandom(n)
    (tmp_path / "f").write_bytes(data)
    assert digests._hash_file(tmp_path / "f") == (n, hashlib.sha256(data).hexdigest())


# 40 saves' worth of digest passes over a step of 8 small files (each pass a fresh thread pool,
# as every save's): the MiB of RSS the process holds afterwards beyond what it held before.
HELD_AFTER_SAVES = """
import json, sys
from pathlib import Path
from jaxloop.models.digests import compute_digests
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
before = rss_mib()
for _ in range(40):
    compute_digests(Path(sys.argv[1]))
print(json.dumps(rss_mib() - before))
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="VmRSS of /proc/self/status")
def test_hashing_at_every_save_keeps_no_megabytes(tmp_path):
    step = tmp_path / "7"
    for item in ("actor_params", "actor_opt"):
        (step / item).mkdir(parents=True)
        for i in range(4):
            (step / item / f"part{i}").write_bytes(os.urandom(4096))
    out = subprocess.run(
        [sys.executable, "-c", HELD_AFTER_SAVES, str(step)],
        capture_output=True,
        text=True,
        check=True,
    )
    held = json.loads(out.stdout)
    assert held < 4, held  # an 8 MiB read buffer per file held 8 MiB or more per pool thread
