"""Sharded safetensors read/write driven by a family's HF name table.

Import streams shard by shard into one preallocated buffer per parameter (peak RAM about the
model's size plus one parameter). Export plans shards and their headers from shapes, then streams
each tensor straight to its shard file as it is produced (peak RAM: the model plus a tensor or
two). bf16 is handled through ml_dtypes, so the round trip is byte-exact. `progress=True` shows a
tqdm bar (bytes) on stderr, erased when done.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxloop import safetensors_format as st
from jaxloop.models.config import ConfigError, LoopedConfig
from jaxloop.models.families import hf_table
from jaxloop.models.hf_mapping import expand, get_param, hf_shape, iter_hf_tensors, to_param
from jaxloop.models.looped import LoopedLM

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
    hf = model.config.to_hf_dict()
    if model.role == "critic":
        hf[ROLE_KEY] = "critic"
    else:
        hf.pop(ROLE_KEY, None)
    return hf


class CheckpointError(ValueError):
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
        weight_map = json.loads(index.read_text())["weight_map"]
        return [hf_dir / f for f in sorted(set(weight_map.values()))]
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


def _data_bytes(files: list[Path]) -> int:
    """Bytes of tensor data in safetensors files (file size less the header), for a bar's total;
    malformed files count 0 here (reading them raises the real error)."""
    total = 0
    for file in files:
        with open(file, "rb") as f:
            head = f.read(8)
        if len(head) == 8:
            total += max(0, file.stat().st_size - 8 - struct.unpack("<Q", head)[0])
    return total


# ---- shapes
def abstract_model(cfg: LoopedConfig, role: str = "actor") -> LoopedLM:
    return nnx.eval_shape(lambda: LoopedLM(cfg, rngs=nnx.Rngs(0), role=role))


def hf_tensor_shapes(cfg: LoopedConfig, role: str = "actor") -> dict[str, tuple[int, ...]]:
    """Every HF tensor name and shape of a model, from shapes alone (no memory for weights)."""
    model = abstract_model(cfg, role)
    shapes = {}
    for t in expand(hf_table(cfg, role), cfg):
        shape = tuple(get_param(model, t.path).shape)
        if t.layer is not None:
            shape = shape[1:]
        shapes[t.name] = hf_shape(t.layout, shape)
    return shapes


# ---- import
def read_hf_config(path: str | Path) -> tuple[LoopedConfig, str]:
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory")
    cfg = LoopedConfig.from_hf_dir(path)
    return cfg, cfg.hf_config.get(ROLE_KEY, "actor")


def load_hf(
    path: str | Path,
    dtype: str | None = "float32",
    compute_dtype: str | None = None,
    progress: bool = False,
    **config_overrides,
) -> LoopedLM:
    """Load an HF checkpoint (sharded or single-file safetensors) as a LoopedLM.

    dtype: parameter dtype (None keeps the checkpoint's); compute_dtype defaults to dtype.
    Unknown, missing or mis-shaped tensors raise CheckpointError naming the tensor.
    progress: a bar over the bytes read, on stderr.
    """
    path = Path(path)
    cfg, role = read_hf_config(path)
    files = checkpoint_files(path)
    if dtype is None:
        dtype = _first_float_dtype(files)
    cfg = cfg.replace(param_dtype=dtype, compute_dtype=compute_dtype or dtype, **config_overrides)
    model = abstract_model(cfg, role)
    targets = {t.name: t for t in expand(hf_table(cfg, role), cfg)}
    np_dtype = np.dtype(jnp.dtype(dtype))
    buffers: dict[tuple[str, ...], np.ndarray] = {}
    seen: set[str] = set()
    bar = progress_bar(_data_bytes(files) if progress else 0, "reading HF", progress)
    with bar:
        for file in files:
            _read_into(file, targets, model, np_dtype, buffers, seen, bar)
    missing = [n for n in targets if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]}{more} in {path}")
    return _materialise(model, buffers)


def _read_into(file: Path, targets: dict, model, np_dtype, buffers: dict, seen: set, bar) -> None:
    """Copy every tensor of one file into its parameter's buffer (allocated on first use).

    A function of its own so that no view of the file outlives it: a loop variable left in
    load_hf kept the last file's memory map (up to a whole shard of RSS) alive to the end.
    """
    for name, arr in read_safetensors(file):
        if name not in targets:
            if name.endswith(NON_PERSISTENT_SUFFIXES):
                bar.update(arr.nbytes)
                continue
            raise CheckpointError(f"unexpected tensor {name} in {file.name}")
        t = targets[name]
        full_shape = tuple(get_param(model, t.path).shape)
        slice_shape = full_shape[1:] if t.layer is not None else full_shape
        want = hf_shape(t.layout, slice_shape)
        if tuple(arr.shape) != want:
            raise CheckpointError(f"tensor {name} has shape {tuple(arr.shape)}, expected {want}")
        if t.path not in buffers:
            buffers[t.path] = np.empty(full_shape, np_dtype)
        value = to_param(arr, t.layout, slice_shape).astype(np_dtype)
        if t.layer is None:
            buffers[t.path][...] = value
        else:
            buffers[t.path][t.layer] = value
        seen.add(name)
        bar.update(arr.nbytes)


def _first_float_dtype(files: list[Path]) -> str:
    for _, arr in read_safetensors(files[0]):
        return str(jnp.dtype(arr.dtype))
    raise CheckpointError(f"{files[0]} holds no tensors")


def _materialise(model: LoopedLM, buffers: dict) -> LoopedLM:
    """Move host buffers into the abstract model one at a time (freeing each host copy)."""
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path in list(buffers):
        var = flat[path]
        # Block before the next copy: the copy is asynchronous and keeps its host buffer alive
        # until done, so without it all host buffers and all copies coexist (2x the model).
        # set_value, not `var[...] =`: the variable still holds a ShapeDtypeStruct.
        var.set_value(jnp.asarray(buffers.pop(path)).block_until_ready())
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---- export
def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = text.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
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
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty")
    cfg = model.config
    table = hf_table(cfg, model.role)
    np_dtype = np.dtype(jnp.dtype(dtype))
    limit = parse_size(max_shard_size)
    shapes = hf_tensor_shapes(cfg, model.role)
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
        tensors = iter_hf_tensors(model, table)
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
        hf = model_hf_config(model)
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
