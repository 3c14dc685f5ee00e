"""decoupled_diloco.safetensors: the project's model file format, read and written with NumPy."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from decoupled_diloco.safetensors import SafetensorsError, load_file, load_metadata, save_file


def write_raw(path: Path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def test_round_trip(tmp_path: Path) -> None:
    tensors = {
        "token_embedding": np.arange(12, dtype=np.float32).reshape(3, 4),
        "transposed": np.arange(6, dtype=np.float32).reshape(2, 3).T,  # not contiguous
        "big_endian": np.array([1.5, -2.0], dtype=">f4"),
        "scalar": np.array(7.0, dtype=np.float32),
        "empty": np.zeros((0, 5), dtype=np.float32),
    }
    metadata = {"info": json.dumps({"run_id": "tiny", "versions": [3, 4]})}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata)
    loaded = load_file(path)
    assert list(loaded) == list(tensors)
    for name, array in tensors.items():
        assert loaded[name].dtype == np.float32 and loaded[name].shape == array.shape
        np.testing.assert_array_equal(loaded[name], array)
    loaded["token_embedding"][0, 0] = 1.0  # writable
    assert load_metadata(path) == metadata
    assert (struct.unpack("<Q", path.read_bytes()[:8])[0] + 8) % 8 == 0  # data 8-byte aligned
    save_file({"x": np.ones(2, np.float32)}, path)  # replaces the file, leaves no temporary
    assert list(load_file(path)) == ["x"] and load_metadata(path) == {}
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_other_dtypes_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "half.safetensors"
    write_raw(path, {"ok": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                     "blocks.0.attn.qkv.weight": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}},
              bytes(8))
    with pytest.raises(SafetensorsError, match=r"tensor 'blocks\.0\.attn\.qkv\.weight' has dtype F16"):
        load_file(path)
    with pytest.raises(SafetensorsError, match=r"tensor 'head\.weight' has dtype float64"):
        save_file({"head.weight": np.zeros(3)}, tmp_path / "double.safetensors")
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("header, data, message", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4), "needs 8 bytes"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), "a hole or an overlap"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8), "cover 4 bytes of a 8-byte"),
    ({"__metadata__": {"n": 1}}, b"", "must map names to strings"),
])
def test_malformed_files_are_refused(tmp_path: Path, header: dict, data: bytes, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, data)
    with pytest.raises(SafetensorsError, match=message):
        load_file(path)


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(SafetensorsError, match="does not fit"):
        load_file(path)
