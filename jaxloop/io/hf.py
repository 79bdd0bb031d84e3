"""Sharded safetensors read/write driven by a family's HF name table.

Import reads each tensor in slices (plain reads, no memory map) into one preallocated buffer per
parameter, which becomes a device array as soon as it is complete (peak RAM about the model's
size plus one parameter; `mesh=` places each one straight onto its sharding). Export plans shards
and their headers from shapes, then streams each tensor straight to its shard file as it is
produced (peak RAM: the model plus a tensor or two; `write_hf` takes the tensors from any
iterator, e.g. one parameter restored at a time). bf16 is handled through ml_dtypes, so the round
trip is byte-exact. `progress=True` shows a tqdm bar (bytes) on stderr, erased when done.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxloop.errors import UsageError
from jaxloop.families import hf_tensor_shapes
from jaxloop.io import safetensors as st
from jaxloop.io.hf_walk import expected_hf_shape, hf_targets, iter_hf, writable_hf_view
from jaxloop.models.config import ConfigError, LoopedConfig
from jaxloop.models.looped import LoopedLM
from jaxloop.parallel.mesh import shardings_for

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
NON_PERSISTENT_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
ROLE_KEY = "jaxloop_role"


def model_hf_config(model: LoopedLM) -> dict:
    """The config.json dict of a model: every original key, head_dim explicit, and
    `jaxloop_role: critic` exactly when the model is a critic."""
    return hf_config_dict(model.config, model.role)


def hf_config_dict(cfg: LoopedConfig, role: str = "actor") -> dict:
    """model_hf_config from a config and a role (no model needed)."""
    hf = cfg.to_hf_dict()
    if role == "critic":
        hf[ROLE_KEY] = "critic"
    else:
        hf.pop(ROLE_KEY, None)
    return hf


class CheckpointError(UsageError):
    """An HF checkpoint does not match the model it claims to be."""


# ---- safetensors files
def read_safetensors(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) from one safetensors file, memory-mapped (no full read)."""
    try:
        yield from st.read_file(path)
    except st.FormatError as e:
        raise CheckpointError(f"{Path(path).name}: {e}") from e


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata=None) -> None:
    st.write_file(path, tensors, metadata)


def checkpoint_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        missing = [n for n in names if not (hf_dir / n).is_file()]
        if missing:
            raise CheckpointError(f"{INDEX_FILE} names {missing[0]}, which is not in {hf_dir}")
        return [hf_dir / f for f in names]
    if (hf_dir / SINGLE_FILE).is_file():
        return [hf_dir / SINGLE_FILE]
    raise CheckpointError(f"{hf_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    """A byte-counting bar on stderr, disabled unless `enabled`; erased when closed."""
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        leave=False,
        dynamic_ncols=True,
        disable=not enabled,
        file=sys.stderr,
    )


# ---- shapes
def abstract_model(cfg: LoopedConfig, role: str = "actor") -> LoopedLM:
    return nnx.eval_shape(lambda: LoopedLM(cfg, rngs=nnx.Rngs(0), role=role))


# ---- import
READ_CHUNK_BYTES = 64 * 2**20  # source bytes read (and converted) at a time by load_hf
_ALIGN = 4096  # host buffers aligned like this become CPU device arrays without a copy


def read_hf_config(path: str | Path) -> tuple[LoopedConfig, str]:
    path = Path(path).resolve()
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory")
    cfg = LoopedConfig.from_hf_dir(path)
    role = cfg.hf_config.get(ROLE_KEY, "actor")
    if role not in ("actor", "critic"):
        raise ConfigError(f"{path / 'config.json'}: {ROLE_KEY}={role!r}; expected 'critic' or none")
    return cfg, role


def load_hf(
    path: str | Path,
    dtype: str | None = "float32",
    compute_dtype: str | None = None,
    progress: bool = False,
    *,
    mesh: jax.sharding.Mesh | None = None,
    **config_overrides,
) -> LoopedLM:
    """Load an HF checkpoint (sharded or single-file safetensors) as a LoopedLM.

    dtype: parameter dtype (None keeps the checkpoint's); compute_dtype defaults to dtype.
    Unknown, missing or mis-shaped tensors raise CheckpointError naming the tensor (all checked
    from the file headers before any tensor data is read); so does a tensor holding a NaN or an
    infinity (checked as its bytes are read, naming the first index).
    mesh: every parameter goes straight onto parallel.mesh.shardings_for(its variable), built
    with jax.make_array_from_callback from its host buffer (each device takes only its slices);
    default: the default device.
    progress: a bar over the bytes read, on stderr.

    Memory: each parameter has one host buffer, filled from the source files with plain reads of
    READ_CHUNK_BYTES at a time (no memory map: the files' pages never count in the process's
    RSS), cast and re-laid-out on the way, and becomes a device array as soon as its last tensor
    is read. On CPU without a mesh the (page-aligned) buffer becomes the device array without a
    copy; elsewhere the buffer is freed once its device copy is made. Peak: the model plus about
    one parameter.
    """
    path = Path(path).resolve()
    dtype, headers, graphdef, flat, targets, plan = _plan_load(
        path, dtype, compute_dtype, config_overrides
    )
    pending = collections.Counter(t.path for t in targets.values())
    buffers: dict[tuple[str, ...], np.ndarray] = {}
    np_dtype = np.dtype(jnp.dtype(dtype))
    total = sum(e.nbytes for entries in headers for e in entries)
    with progress_bar(total if progress else 0, "reading HF", progress) as bar:
        for file, entries in plan:
            with open(file, "rb", buffering=0) as f:
                for entry, t in entries:
                    if t is None:  # a non-persistent extra (rotary inv_freq): skipped
                        bar.update(entry.nbytes)
                        continue
                    var = flat[t.path]
                    if t.path not in buffers:
                        buffers[t.path] = _aligned_empty(var.shape, np_dtype)
                    _fill(f, file, entry, writable_hf_view(buffers[t.path], t))
                    bar.update(entry.nbytes)
                    pending[t.path] -= 1
                    if pending[t.path] == 0:
                        var.set_value(_place(buffers.pop(t.path), var, mesh))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def check_hf_dir(path: str | Path) -> None:
    """Every check load_hf makes before it reads tensor data: config.json, the index and the
    files it names, each file's header (well-formed, offsets inside the file), tensor names,
    shapes and dtypes. Reads headers only; raises ConfigError / CheckpointError."""
    _plan_load(Path(path).resolve(), None, None, {})


def _plan_load(path: Path, dtype, compute_dtype, config_overrides: dict):
    """(dtype, headers, graphdef, flat abstract state, targets, read plan) of load_hf, from the
    config and the file headers alone."""
    cfg, role = read_hf_config(path)
    files = checkpoint_files(path)
    headers = [_read_header(file) for file in files]
    if dtype is None:
        dtype = _first_float_dtype(files[0], headers[0])
    cfg = cfg.replace(param_dtype=dtype, compute_dtype=compute_dtype or dtype, **config_overrides)
    model = abstract_model(cfg, role)
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    targets = hf_targets(cfg, role)
    plan = _plan_reads(files, headers, targets, flat)
    missing = [n for n in targets if n not in {e.name for _, entries in plan for e, _ in entries}]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]}{more} in {path}")
    return dtype, headers, graphdef, flat, targets, plan


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file, from its header."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


def _read_header(file: Path) -> list[_Entry]:
    """A safetensors file's tensors from its header alone, in header order, validated by
    io.safetensors.parse (over a memory map of which only the header pages are touched)."""
    try:
        if file.stat().st_size == 0:
            raise st.FormatError(f"{file.name} is empty")
        mm = np.memmap(file, dtype=np.uint8, mode="r")
        base = mm.ctypes.data
        entries = [
            _Entry(
                name, arr.dtype, arr.shape, arr.__array_interface__["data"][0] - base, arr.nbytes
            )
            for name, arr in st.parse(memoryview(mm))
        ]
    except st.FormatError as e:
        raise CheckpointError(f"{file.name}: {e}") from e
    return entries


def _plan_reads(files: list[Path], headers: list, targets: dict, flat: dict) -> list:
    """[(file, [(entry, HFTensor or None to skip)] in file-offset order)]; unknown, repeated or
    mis-shaped tensors raise CheckpointError."""
    plan, seen = [], set()
    for file, entries in zip(files, headers, strict=True):
        reads = []
        for e in entries:
            if e.name not in targets:
                if e.name.endswith(NON_PERSISTENT_SUFFIXES):
                    reads.append((e, None))
                    continue
                raise CheckpointError(f"unexpected tensor {e.name} in {file.name}")
            if e.name in seen:
                raise CheckpointError(f"tensor {e.name} appears twice ({file.name})")
            seen.add(e.name)
            t = targets[e.name]
            want = expected_hf_shape(flat[t.path].shape, t)
            if e.shape != want:
                raise CheckpointError(f"tensor {e.name} has shape {e.shape}, expected {want}")
            if not jnp.issubdtype(e.dtype, jnp.floating):
                raise CheckpointError(
                    f"tensor {e.name} in {file.name} has dtype {e.dtype}; weights must be "
                    "floating point (F32, F16, BF16, F64)"
                )
            reads.append((e, t))
        plan.append((file, sorted(reads, key=lambda r: r[0].offset)))
    return plan


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """np.empty, but starting on an _ALIGN boundary (what lets jax.device_put on CPU alias it)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _fill(f, file: Path, entry: _Entry, dest: np.ndarray) -> None:
    """Read one tensor's bytes into `dest` (its HF shape) READ_CHUNK_BYTES at a time along axis 0,
    straight into `dest` when it is contiguous with the source dtype, else through a bounce
    buffer, casting and scattering as numpy assigns."""
    if entry.nbytes == 0:
        return
    if dest.ndim == 0:
        dest = dest.reshape(1)
    rows = dest.shape[0]
    row_bytes = entry.nbytes // rows
    step = max(1, READ_CHUNK_BYTES // row_bytes)
    direct = dest.dtype == entry.dtype and dest.flags.c_contiguous
    bounce = None if direct else np.empty(min(rows, step) * row_bytes, np.uint8)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n = (r1 - r0) * row_bytes
        target = dest[r0:r1].reshape(-1).view(np.uint8) if direct else bounce[:n]
        f.seek(entry.offset + r0 * row_bytes)
        view, done = memoryview(target), 0
        while done < n:
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{file.name}: tensor {entry.name} is truncated")
            done += got
        _check_finite(target, entry, file, r0 * row_bytes)
        if not direct:
            dest[r0:r1] = target.view(entry.dtype).reshape((r1 - r0, *dest.shape[1:]))


def _check_finite(raw: np.ndarray, entry: _Entry, file: Path, start_byte: int) -> None:
    """CheckpointError when a chunk of a tensor's source bytes holds a NaN or an infinity (an
    integer test of the exponent bits: no float pass over the weights)."""
    dtype = np.dtype(entry.dtype)
    flat = raw.reshape(-1).view(np.uint8)
    if dtype.itemsize == 2:
        # float16: 5 exponent bits; bfloat16: 8 (all set: inf or NaN)
        bits, uint = (0x7C00 if dtype == np.float16 else 0x7F80), np.uint16
    elif dtype.itemsize == 4:
        bits, uint = 0x7F800000, np.uint32
    elif dtype.itemsize == 8:
        bits, uint = 0x7FF0000000000000, np.uint64
    else:
        return
    words = flat.view(uint)
    bad = np.flatnonzero((words & uint(bits)) == uint(bits))
    if bad.size:
        first = start_byte // dtype.itemsize + int(bad[0])
        index = np.unravel_index(first, entry.shape) if entry.shape else ()
        raise CheckpointError(
            f"{file.name}: tensor {entry.name} holds non-finite values (NaN or inf; the first at "
            f"index {tuple(int(i) for i in index)}): refusing to load it"
        )


def _place(buffer: np.ndarray, var, mesh: jax.sharding.Mesh | None) -> jax.Array:
    """A filled host buffer as a device array: on `mesh` by the variable's logical axes (each
    device takes its slices of the buffer), else on the default device (no copy on CPU).
    Blocks, so that the buffer is free (or owned by the array) when this returns."""
    if mesh is None:
        return jax.device_put(buffer).block_until_ready()
    sharding = shardings_for(var, mesh)
    return jax.make_array_from_callback(
        buffer.shape, sharding, lambda i: buffer[i]
    ).block_until_ready()


def _first_float_dtype(file: Path, entries: list[_Entry]) -> str:
    for entry in entries:
        if jnp.issubdtype(entry.dtype, jnp.floating):
            return str(jnp.dtype(entry.dtype))
    raise CheckpointError(f"{file} holds no floating-point tensors")


# ---- export
def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = text.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(unit):
            number = float(s[: -len(unit)])
            if not math.isfinite(number):  # int() of inf is an OverflowError, of NaN a ValueError
                raise ValueError(f"{text!r} is not a finite size")
            return int(number * mult)
    if s.endswith("B"):
        s = s[:-1]
    return int(s)


def save_hf(
    model: LoopedLM,
    path: str | Path,
    dtype: str = "bfloat16",
    max_shard_size: str | int = "5GB",
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Write config.json, sharded safetensors and the index; atomically (temp dir, then rename).

    Each tensor goes straight to its shard file as it is produced (headers are planned from
    shapes), so peak RAM is the model plus a tensor or two. progress: a bar over the bytes
    written, on stderr.
    """
    return write_hf(
        path,
        model_hf_config(model),
        hf_tensor_shapes(model.config, model.role),
        iter_hf(model, model.config, model.role),
        dtype=dtype,
        max_shard_size=max_shard_size,
        tokenizer_dir=tokenizer_dir,
        overwrite=overwrite,
        progress=progress,
    )


def write_hf(
    path: str | Path,
    hf_config: dict,
    shapes: dict[str, tuple[int, ...]],
    tensors: Iterator[tuple[str, np.ndarray]],
    dtype: str = "bfloat16",
    max_shard_size: str | int = "5GB",
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """save_hf from parts: the config.json dict, every HF tensor's shape (in order) and an
    iterator of (name, array) in that order, each consumed and dropped before the next is asked
    for (so a producer that builds them one at a time bounds the peak: see io.orbax.export_hf).
    """
    path = Path(path).resolve()
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty")
    np_dtype = np.dtype(jnp.dtype(dtype))
    limit = parse_size(max_shard_size)
    shards: list[list[str]] = [[]]
    size = 0
    total = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * np_dtype.itemsize
        total += nbytes
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    shard_of = {name: i for i, names in enumerate(shards) for name in names}
    file_names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    if n == 1:
        file_names = [SINGLE_FILE]

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        with progress_bar(total, "writing HF", progress) as bar:
            for names, file_name in zip(shards, file_names, strict=True):
                specs = [(name, shapes[name]) for name in names]
                _write_shard(tmp / file_name, specs, np_dtype, tensors, bar)
        if n > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {name: file_names[shard_of[name]] for name in shapes},
            }
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        hf = dict(hf_config)
        hf["torch_dtype"] = str(jnp.dtype(dtype))
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_shard(file: Path, specs: list, np_dtype: np.dtype, tensors: Iterator, bar) -> None:
    """One safetensors file: the header from (name, shape) specs, then the next len(specs)
    tensors of `tensors`, cast and written one at a time (st.write_file's exact bytes)."""
    # Zero-stride stand-ins carry shape and dtype (all header_bytes reads) without memory.
    header = st.header_bytes([(n, np.broadcast_to(np.zeros((), np_dtype), s)) for n, s in specs])
    with open(file, "wb") as f:
        f.write(header)
        for name, shape in specs:
            got, arr = next(tensors)
            if got != name or tuple(arr.shape) != tuple(shape):
                raise RuntimeError(f"expected tensor {name} {shape}, got {got} {arr.shape}")
            arr = np.ascontiguousarray(arr.astype(np_dtype, copy=False))
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))
            bar.update(arr.nbytes)
            del arr  # before the next tensor is produced


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.is_file():
            shutil.copy2(f, Path(dst) / name)
            copied.append(name)
    return copied


def init_model(cfg: LoopedConfig, seed: int = 0, role: str = "actor") -> LoopedLM:
    return LoopedLM(cfg, rngs=nnx.Rngs(seed), role=role)


def count_params(model: LoopedLM) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
