"""Conversion at the real size: HF -> from_hf -> to_hf -> HF byte for byte, and load_hf + a forward.

    python scripts/check_full_size.py [--family nanbeige|ouro] [--workdir DIR] [--keep]

Builds an HF checkpoint of the real shape from the fixture's tensor table
(../shared/fixtures/{nanbeige4.2-3b,ouro-1.4b}/tensors.json and config.json; random finite bf16
values, in the fixture's tensor order, 5 GB shards and an index), then runs, each step in its own
process so that its peak RSS is its own:

    build      write that checkpoint
    from_hf    python -m conversion.from_hf --hf-dir hf --out ck      (relative paths, in DIR)
    to_hf      python -m conversion.to_hf --checkpoint ck --out out
    compare    every tensor of out/ against hf/ (name, dtype, shape, bytes) and the index
               (total_size, the same names, each mapped to the file holding it)
    load_hf    load_hf(hf, dtype="bfloat16") and a 16-token forward (logits finite), with XLA's
               loop-invariant code motion off (NO_LICM below; --hoist-converts keeps it)

and prints seconds and peak RSS (/usr/bin/time -v when present, else the kernel's per-child
ru_maxrss: the same counter) of each step, and the seconds of those spent on checkpoint digests
(from_hf hashing its step, to_hf verifying it: JAXLOOP_DIGEST_TIMING lines), as a table and one
JSON line. Exit code 0 when every
step works within --max-ratio (1.5) times the checkpoint's bytes of peak RSS. Needs about 3x the
checkpoint of disk (Nanbeige4.2-3B: 8.3 GB each for hf/, ck/ and out/) and 1.5x of RAM; the
three directories are deleted at the end unless --keep. A script, not a CI test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FIXTURES = (REPO / ".." / "shared" / "fixtures").resolve()
FAMILIES = {"nanbeige": "nanbeige4.2-3b", "ouro": "ouro-1.4b"}
SHARD_BYTES = 5 * 10**9  # what to_hf writes by default (--max-shard-size 5GB)
CHUNK = 64 * 2**20  # bytes generated / compared at a time
INDEX = "model.safetensors.index.json"
# XLA:CPU has no bf16 dot: it converts each weight to f32, and loop-invariant code motion then
# hoists those converts out of the layer scan, i.e. an f32 copy of every stacked weight (2x the
# bf16 model: Ouro-1.4B's 16-token forward peaked at 3.9x the checkpoint, 11.2 GB). With the pass
# off, each layer's slice is converted inside the loop (temp 0.2 GB). Forward step only.
NO_LICM = "--xla_disable_hlo_passes=while-loop-invariant-code-motion"


# ---- steps (each runs in a child process: `check_full_size.py --step NAME ...`) -----------------
def build(fixture: Path, hf: Path, seed: int) -> None:
    """An HF checkpoint of the fixture's shapes: random bf16 bit patterns with a bounded exponent
    (|x| in [2^-7, 2^-3), random sign: finite, a forward stays finite), written chunk by chunk."""
    table = json.loads((fixture / "tensors.json").read_text())
    assert table["dtype"] == "bfloat16", table["dtype"]
    tensors = [(name, tuple(shape)) for name, shape in table["tensors"].items()]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = 2 * int(np.prod(shape, dtype=np.int64))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    n = len(shards)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    if n == 1:
        files = ["model.safetensors"]  # as HF (and save_hf) write a checkpoint under one shard
    hf.mkdir(parents=True)
    shutil.copy(fixture / "config.json", hf / "config.json")
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for file, specs in zip(files, shards, strict=True):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in specs:
            nbytes = 2 * int(np.prod(shape, dtype=np.int64))
            header[name] = {
                "dtype": "BF16",
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[name] = file
        total += offset
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(hf / file, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            left = offset
            while left:
                n_vals = min(left, CHUNK) // 2
                bits = rng.integers(0, 2**16, n_vals, dtype=np.uint16)
                # sign and mantissa random; exponent 120 + (two random bits): 2^-7 .. 2^-3
                bits = (bits & 0x807F) | ((120 + ((bits >> 7) & 3)) << 7)
                f.write(bits.tobytes())
                left -= 2 * n_vals
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (hf / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    assert total == table["total_bytes"], (total, table["total_bytes"])


def _header(file: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """name -> (dtype tag, shape, absolute start, nbytes), from a safetensors header (read here
    independently of jaxloop's reader)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {
        name: (h["dtype"], tuple(h["shape"]), 8 + n + h["data_offsets"][0],
               h["data_offsets"][1] - h["data_offsets"][0])
        for name, h in header.items()
    }  # fmt: skip


def _index(hf: Path) -> dict:
    """The index of a sharded checkpoint, or the one a single model.safetensors implies."""
    if (hf / INDEX).is_file():
        return json.loads((hf / INDEX).read_text())
    names = _header(hf / "model.safetensors")
    total = sum(h[3] for h in names.values())
    return {
        "metadata": {"total_size": total},
        "weight_map": dict.fromkeys(names, "model.safetensors"),
    }


def compare(want_dir: Path, got_dir: Path) -> None:
    """Every tensor byte for byte (streamed), and the index (the same total_size and names, each
    mapped to the file that holds it; a checkpoint under 5 GB is one model.safetensors on both
    sides); raises AssertionError on the first difference, prints a one-line summary."""
    assert (want_dir / INDEX).is_file() == (got_dir / INDEX).is_file(), "index on one side only"
    want_index, got_index = _index(want_dir), _index(got_dir)
    assert got_index["metadata"]["total_size"] == want_index["metadata"]["total_size"]
    assert sorted(got_index["weight_map"]) == sorted(want_index["weight_map"])
    files = sorted(p.name for p in got_dir.glob("*.safetensors"))
    assert sorted(set(got_index["weight_map"].values())) == files, files
    want = {n: (want_dir / f, h) for f in set(want_index["weight_map"].values())
            for n, h in _header(want_dir / f).items()}  # fmt: skip
    got = {}
    for f in files:
        for name, h in _header(got_dir / f).items():
            assert got_index["weight_map"][name] == f, f"index maps {name} elsewhere than {f}"
            got[name] = (got_dir / f, h)
    assert sorted(got) == sorted(want) == sorted(want_index["weight_map"])
    compared = 0
    handles: dict[Path, object] = {}
    try:
        for name, (wfile, (wtag, wshape, wstart, wn)) in want.items():
            gfile, (gtag, gshape, gstart, gn) = got[name]
            assert (gtag, gshape, gn) == (wtag, wshape, wn), (name, gtag, gshape, wtag, wshape)
            for file in (wfile, gfile):
                if file not in handles:
                    handles[file] = open(file, "rb")  # noqa: SIM115
            w, g = handles[wfile], handles[gfile]
            for at in range(0, wn, CHUNK):
                k = min(CHUNK, wn - at)
                w.seek(wstart + at)
                g.seek(gstart + at)
                assert w.read(k) == g.read(k), f"{name}: bytes differ at {at}"
            compared += wn
    finally:
        for h in handles.values():
            h.close()
    print(f"compared {len(want)} tensors, {compared:,} bytes, and the index: identical")


def load_and_forward(hf: Path, tokens: int) -> None:
    import resource

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxloop.io.hf import load_hf

    t0 = time.perf_counter()
    model = load_hf(hf, dtype="bfloat16")
    t1 = time.perf_counter()
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ids = jax.random.randint(jax.random.key(0), (1, tokens), 0, model.config.vocab_size)
    # jax.jit over the split state: nnx.jit would also return (copy) every parameter
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids)
    finite = bool(jnp.isfinite(logits).all())
    t2 = time.perf_counter()
    print(
        f"load_hf {t1 - t0:.1f} s (peak RSS {load_peak / 1e9:.2f} GB), forward of {tokens} "
        f"tokens {t2 - t1:.1f} s: logits "
        f"{tuple(logits.shape)}, finite={finite}"
    )
    assert logits.shape == (1, tokens, model.config.vocab_size) and finite


# ---- the driver ------------------------------------------------------------------------------
def _run(name: str, argv: list[str], cwd: Path, log: Path, xla_flags: str = "") -> dict:
    """Run one step as a child process; wall seconds and peak RSS (bytes) of that process."""
    timed = Path("/usr/bin/time").is_file()
    stats = log.with_suffix(".time")
    cmd = ["/usr/bin/time", "-v", "-o", str(stats), *argv] if timed else argv
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "JAXLOOP_DIGEST_TIMING": "1",  # the checkpoint digests' passes, one line each
    }
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    rss = usage.ru_maxrss * 1024  # KiB on Linux; with /usr/bin/time, its own (small) peak
    if timed:
        for line in stats.read_text().splitlines():
            if "Maximum resident set size" in line:
                rss = int(line.split(":")[1]) * 1024
    text = log.read_text().strip()
    last = text.splitlines()[-1] if text else ""
    # seconds spent hashing checkpoint files (from_hf: writing the digests; to_hf: verifying)
    digest = sum(float(line.split()[-2]) for line in text.splitlines()
                 if line.startswith("digests: "))  # fmt: skip
    return {"step": name, "ok": proc.returncode == 0, "seconds": round(seconds, 1),
            "peak_rss_bytes": rss, "last_line": last[-160:],
            "digest_seconds": round(digest, 1)}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="nanbeige")
    p.add_argument("--workdir", type=Path, default=None, help="default: a new dir in /tmp")
    p.add_argument("--keep", action="store_true", help="keep hf/, ck/ and out/")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--max-ratio", type=float, default=1.5)
    p.add_argument(
        "--hoist-converts",
        action="store_true",
        help="leave XLA's loop-invariant code motion on for the forward (see NO_LICM)",
    )
    p.add_argument("--step", choices=["build", "compare", "forward"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    fixture = FIXTURES / FAMILIES[args.family]
    if args.step == "build":
        build(fixture, Path("hf").resolve(), args.seed)
        return 0
    if args.step == "compare":
        compare(Path("hf").resolve(), Path("out").resolve())
        return 0
    if args.step == "forward":
        load_and_forward(Path("hf").resolve(), args.tokens)
        return 0

    table = json.loads((fixture / "tensors.json").read_text())
    ckpt_bytes = int(table["total_bytes"])
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="check_full_size-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    dirs = [workdir / d for d in ("hf", "ck", "out")]
    if any(d.exists() for d in dirs):
        p.error(f"{workdir} already holds hf/, ck/ or out/")
    free = shutil.disk_usage(workdir).free
    if free < 3 * ckpt_bytes + 2 * 10**9:
        p.error(f"{workdir}: {free / 1e9:.1f} GB free, needs {(3 * ckpt_bytes + 2e9) / 1e9:.1f}")
    me = [sys.executable, str(Path(__file__).resolve()), "--family", args.family]
    steps = [
        ("build", [*me, "--step", "build", "--seed", str(args.seed)]),
        ("from_hf", [sys.executable, "-m", "conversion.from_hf", "--hf-dir", "hf", "--out", "ck"]),
        ("to_hf", [sys.executable, "-m", "conversion.to_hf", "--checkpoint", "ck", "--out", "out"]),
        ("compare", [*me, "--step", "compare"]),
        ("load_hf", [*me, "--step", "forward", "--tokens", str(args.tokens)]),
    ]
    results = []
    try:
        for name, cmd in steps:
            flags = NO_LICM if name == "load_hf" and not args.hoist_converts else ""
            r = _run(name, cmd, workdir, workdir / f"{name}.log", flags)
            r["rss_ratio"] = round(r["peak_rss_bytes"] / ckpt_bytes, 3)
            results.append(r)
            print(f"{name}: {'works' if r['ok'] else 'FAILED'} ({r['seconds']} s) {r['last_line']}",
                  file=sys.stderr, flush=True)  # fmt: skip
            if not r["ok"]:
                break
    finally:
        if not args.keep:
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
    print(
        f"\n{FAMILIES[args.family]}: {table['num_tensors']} tensors, {ckpt_bytes:,} bytes of bf16"
    )
    print("| step | result | seconds | of which digests (s) | peak RSS (GB) | x checkpoint |")
    print("|---|---|---|---|---|---|")
    for r in results:
        result = "works" if r["ok"] else f"fails: {r['last_line']}"
        print(f"| {r['step']} | {result} | {r['seconds']} | {r['digest_seconds']} "
              f"| {r['peak_rss_bytes'] / 1e9:.2f} | {r['rss_ratio']:.2f} |")  # fmt: skip
    conversion = [r for r in results if r["step"] in ("from_hf", "to_hf")]
    total = sum(r["seconds"] for r in conversion)
    digest = sum(r["digest_seconds"] for r in conversion)
    if total:
        print(f"checkpoint digests: {digest:.1f} s of the conversion's {total:.1f} s "
              f"(from_hf + to_hf): {digest / total:.1%}")  # fmt: skip
    ok = len(results) == len(steps) and all(
        r["ok"] and r["rss_ratio"] <= args.max_ratio for r in results
    )
    summary = {
        "family": args.family,
        "forward_xla_flags": "" if args.hoist_converts else NO_LICM,
        "checkpoint_bytes": ckpt_bytes,
        "max_ratio": args.max_ratio,
        "ok": ok,
        "workdir": str(workdir),
        "steps": {r["step"]: {k: r[k] for k in ("ok", "seconds", "digest_seconds",
                                                "peak_rss_bytes", "rss_ratio")}
                  for r in results},
    }  # fmt: skip
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
