"""Model files in the safetensors format (https://huggingface.co/docs/safetensors), NumPy only.

A file is an 8-byte little-endian header length N, N bytes of JSON header, then the raw data:
the header maps each tensor's name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
into the data, which the tensors cover without holes or overlaps), plus an optional
"__metadata__" of string values. The project's model files hold F32 tensors named after the
model's parameters and facts about where they came from, as JSON, in the metadata; this module
reads and writes F32 and refuses other dtypes, naming the tensor.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

__all__ = ["SafetensorsError", "load_file", "load_metadata", "save_file"]

_DTYPES = {"F32": np.dtype("<f4")}
_METADATA = "__metadata__"
_MAX_HEADER_BYTES = 100 << 20  # the reference implementation's limit


class SafetensorsError(ValueError):
    """A file that is not valid safetensors, or a tensor this module does not read or write."""


def _read_header(path: str | os.PathLike, data: bytes | bytearray) -> tuple[dict, int]:
    """The parsed header and where the data starts."""
    if len(data) < 8:
        raise SafetensorsError(f"{path}: {len(data)} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", data[:8])
    if length > _MAX_HEADER_BYTES or 8 + length > len(data):
        raise SafetensorsError(f"{path}: header length {length} does not fit the file of {len(data)} bytes")
    try:
        header = json.loads(bytes(data[8:8 + length]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object")
    return header, 8 + length


def _metadata_of(path: str | os.PathLike, header: dict) -> dict[str, str]:
    metadata = header.get(_METADATA, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{path}: {_METADATA} must map names to strings")
    return metadata


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of the file by name, in header order, as writable float32 arrays.

    Raises SafetensorsError for a malformed file or a dtype other than F32 (naming the tensor),
    OSError if the file cannot be read."""
    data = bytearray(Path(path).read_bytes())
    header, start = _read_header(path, data)
    _metadata_of(path, header)
    size = len(data) - start
    tensors, spans = {}, []
    for name, entry in header.items():
        if name == _METADATA:
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise SafetensorsError(f"{path}: tensor '{name}' needs dtype, shape and data_offsets")
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise SafetensorsError(f"{path}: tensor '{name}' has dtype {entry['dtype']}; "
                                   f"only {', '.join(_DTYPES)} is supported")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):
            raise SafetensorsError(f"{path}: tensor '{name}': bad shape {shape} or data_offsets {offsets}")
        begin, end = offsets
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not 0 <= begin <= end <= size or end - begin != expected:
            raise SafetensorsError(f"{path}: tensor '{name}' of shape {shape} needs {expected} bytes, "
                                   f"its data_offsets {offsets} give {end - begin} of a {size}-byte buffer")
        tensors[name] = np.frombuffer(data, dtype=dtype, count=expected // dtype.itemsize,
                                      offset=start + begin).reshape(shape)
        spans.append((begin, end, name))
    # The tensors must cover the data exactly: no holes, no overlaps (no polyglot files).
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise SafetensorsError(f"{path}: tensor '{name}' starts at byte {begin} of the data, "
                                   f"expected {position} (a hole or an overlap)")
        position = end
    if position != size:
        raise SafetensorsError(f"{path}: the tensors cover {position} bytes of a {size}-byte data buffer")
    return tensors


def load_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The file's "__metadata__" ({} if it has none), without reading the tensors."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        head = prefix + f.read(min(length, _MAX_HEADER_BYTES + 1))
    header, _ = _read_header(path, head)
    return _metadata_of(path, header)


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike,
              metadata: Mapping[str, str] | None = None) -> None:
    """Writes float32 tensors (in the mapping's order) and string metadata to `path` atomically:
    a temporary file in the same folder, then a rename, so a reader never sees half a file.

    Raises SafetensorsError naming the tensor for a dtype other than float32, and for metadata
    that is not str -> str."""
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise SafetensorsError(f"{_METADATA} must map strings to strings")
        header[_METADATA] = dict(metadata)
    arrays, offset = [], 0
    for name, tensor in tensors.items():
        if name == _METADATA:
            raise SafetensorsError(f"'{_METADATA}' cannot name a tensor")
        array = np.asarray(tensor)
        if array.dtype.kind != "f" or array.dtype.itemsize != 4:
            raise SafetensorsError(f"tensor '{name}' has dtype {array.dtype}; only float32 (F32) is supported")
        array = array.astype("<f4", order="C", copy=False)
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        arrays.append(array)
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the reference writes it

    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for array in arrays:
                f.write(array.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
