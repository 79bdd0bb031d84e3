"""The safetensors byte format, written and read by hand (numpy + ml_dtypes only).

`safetensors.numpy` cannot load bfloat16, and both HF checkpoints (jaxloop.io.hf) and
policy-publication buckets (jaxloop.rollout.publication) need it; this module serves both.
Layout: 8-byte little-endian header length, JSON header (padded to 8 bytes), raw data.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

# safetensors dtype tag <-> numpy dtype
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
TAGS: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}


class FormatError(ValueError):
    """Bytes that are not a well-formed safetensors blob, or an unsupported dtype."""


def header_bytes(items: list[tuple[str, np.ndarray]], metadata: dict | None = None) -> bytes:
    """The 8-byte length plus padded JSON header for contiguous arrays `items`, in order."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, arr in items:
        if name in header:
            raise FormatError(f"tensor {name} appears twice")
        if arr.dtype not in TAGS:
            raise FormatError(f"tensor {name}: dtype {arr.dtype} has no safetensors tag")
        header[name] = {
            "dtype": TAGS[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def _contiguous(tensors) -> list[tuple[str, np.ndarray]]:
    pairs = tensors.items() if isinstance(tensors, dict) else tensors
    return [(name, np.ascontiguousarray(arr)) for name, arr in pairs]


def _raw(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))


def serialize(tensors: Iterable[tuple[str, np.ndarray]] | dict, metadata=None) -> bytes:
    """One safetensors blob in memory (one copy of the data)."""
    items = _contiguous(tensors)
    return b"".join([header_bytes(items, metadata)] + [_raw(arr) for _, arr in items])


def write_file(
    path: str | Path, tensors: Iterable[tuple[str, np.ndarray]] | dict, metadata=None
) -> None:
    """Stream tensors to a file (no in-memory blob)."""
    items = _contiguous(tensors)
    with open(path, "wb") as f:
        f.write(header_bytes(items, metadata))
        for _, arr in items:
            f.write(_raw(arr))


def parse(data) -> list[tuple[str, np.ndarray]]:
    """Zero-copy views of every tensor in a safetensors buffer (bytes, memoryview or a uint8
    memmap); anything malformed raises FormatError."""
    try:
        if len(data) < 8:
            raise FormatError("shorter than its 8-byte header length")
        (header_len,) = struct.unpack("<Q", bytes(data[:8]))
        if 8 + header_len > len(data):
            raise FormatError("header runs past the end")
        header = json.loads(bytes(data[8 : 8 + header_len]))
        if not isinstance(header, dict):
            raise FormatError("header is not a JSON object")
        body = data[8 + header_len :]
        out = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(info, dict):
                raise FormatError(f"tensor {name}: header entry is not a JSON object")
            tag = info.get("dtype")
            if not isinstance(tag, str) or tag not in DTYPES:
                raise FormatError(f"tensor {name} has unsupported dtype {tag!r}")
            dtype = DTYPES[tag]
            shape = _ints(info.get("shape"), f"tensor {name} has shape")
            offsets = _ints(info.get("data_offsets"), f"tensor {name} has data offsets")
            if len(offsets) != 2:
                raise FormatError(
                    f"tensor {name} has data offsets {list(offsets)}, not [start, end]"
                )
            start, end = offsets
            if not 0 <= start <= end <= len(body):
                raise FormatError(f"tensor {name} has data offsets out of range")
            # exact (Python ints): a product of huge dimensions must not wrap around
            if end - start != math.prod(shape) * dtype.itemsize:
                raise FormatError(f"tensor {name}: {end - start} bytes do not fit shape {shape}")
            arr = np.frombuffer(body[start:end], dtype=dtype).reshape(shape)
            out.append((name, arr))
        return out
    except FormatError:
        raise
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError, struct.error) as e:
        raise FormatError(str(e)) from e


def _ints(value, what: str) -> tuple[int, ...]:
    """A header's list of non-negative integers (a shape or data offsets), else FormatError."""
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        text = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise FormatError(f"{what} {text}, not a list of integers >= 0")
    return tuple(value)


def read_file(path: str | Path) -> list[tuple[str, np.ndarray]]:
    """Every tensor of a safetensors file, memory-mapped (nothing is read until used)."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise FormatError(f"{path.name} is empty")
    return parse(memoryview(np.memmap(path, dtype=np.uint8, mode="r")))
