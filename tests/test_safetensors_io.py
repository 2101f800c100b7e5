"""The mmap-free safetensors reader (against the safetensors library) and the chunked content hash."""
from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from remote_payload.contract.contenthash import sha256_files
from remote_payload.contract.errors import CheckpointError
from remote_payload.eval.safetensors_io import read_header, read_tensors


# staged=True on the CPU runs the CUDA path's double-buffered staging logic (unpinned, no events); 100-byte
# buffers cut tensors mid-element, so any off-by-one in the chunking corrupts the comparison.
@pytest.mark.parametrize("staged,staging_bytes", [(False, 1 << 20), (True, 100), (True, 1 << 20)])
def test_reader_equals_load_file(st_file, staged, staging_bytes):
    ref = load_file(st_file)
    header = read_header(st_file)
    assert set(header.tensors) == set(ref) and header.metadata == {"format": "pt"}
    got = read_tensors(header, list(ref), staged=staged, staging_bytes=staging_bytes)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
        assert header.tensors[k].shape == tuple(v.shape) and header.tensors[k].dtype == v.dtype


def test_subset_and_dtype_conversion(st_file):
    ref = load_file(st_file)
    header = read_header(st_file)
    for staged in (False, True):
        got = read_tensors(header, ["bf16", "scalar_bf16", "empty_f16"], dtype=torch.float32, staged=staged,
                           staging_bytes=64)
        assert set(got) == {"bf16", "scalar_bf16", "empty_f16"}
        for k, v in got.items():
            assert v.dtype == torch.float32 and torch.equal(v, ref[k].float()), k


def _raw(tensors_json: dict, data: bytes) -> bytes:
    header = json.dumps(tensors_json).encode()
    return struct.pack("<Q", len(header)) + header + data


def _err(path) -> str:
    with pytest.raises(CheckpointError) as ei:
        read_header(path)
    msg = str(ei.value)
    assert ei.value.exit_code == 3 and "\n" not in msg and str(path) in msg and "Nothing was evaluated" in msg
    return msg


def test_bad_files_are_clear_errors(tmp_path, st_file):
    data = st_file.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[:-1])
    msg = _err(bad)
    assert "truncated or corrupt" in msg and "(truncated)" in msg and f"file has {len(data) - 1}" in msg
    bad.write_bytes(data + b"\0")
    assert "trailing bytes" in _err(bad)
    bad.write_bytes(data[:5])
    assert "fewer than the 8-byte header length" in _err(bad)
    bad.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    assert "header is said to be 1000000 bytes" in _err(bad)
    bad.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    assert "header is not JSON" in _err(bad)
    bad.write_bytes(b"\0" * 64)
    assert "header is not JSON" in _err(bad)
    bad.write_bytes(_raw({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0"))
    assert "dtype 'F4'" in _err(bad)
    bad.write_bytes(_raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4))
    assert "needs 8 bytes but its data_offsets [0, 4] span 4" in _err(bad)
    bad.write_bytes(_raw({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4))
    assert "malformed entry" in _err(bad)
    bad.write_bytes(_raw({"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, b"\0" * 4))
    assert "gap or overlap" in _err(bad)
    assert "does not exist" in _err(tmp_path / "missing.safetensors")
    good = _raw({"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]},
                 "b": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\1\2\3\4")
    bad.write_bytes(good)  # out-of-order entries are fine as long as they tile the data
    got = read_tensors(read_header(bad), ["a", "b"])
    assert got["a"].tolist() == [3, 4] and got["b"].tolist() == [1, 2]


@pytest.mark.parametrize("staged", [False, True])
def test_file_shrinking_after_the_header_is_named(st_file, staged):
    header = read_header(st_file)
    last = max((k for k, e in header.tensors.items() if e.end > e.begin), key=lambda k: header.tensors[k].end)
    with open(st_file, "r+b") as f:
        f.truncate(header.tensors[last].begin + 1)
    with pytest.raises(CheckpointError) as ei:
        read_tensors(header, list(header.tensors), staged=staged, staging_bytes=64)
    assert str(st_file) in str(ei.value) and repr(last) in str(ei.value)


# ---- content hash -------------------------------------------------------------------------------
MIB = 1 << 20


def _documented_tree_hash(paths, chunk: int) -> str:
    """The scheme exactly as sha256_files' docstring states it, computed the obvious way."""
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: p.name):
        data = p.read_bytes()
        h.update(p.name.encode() + b"\0" + str(len(data)).encode() + b"\0")
        for off in range(0, len(data), chunk):
            h.update(hashlib.sha256(data[off:off + chunk]).digest())
    return f"sha256-{chunk // MIB}MiB-tree:" + h.hexdigest()


@pytest.fixture
def hash_files(tmp_path):
    g = torch.Generator().manual_seed(3)
    sizes = {"b.safetensors": 5 * MIB // 2, "a.safetensors": MIB, "c.bin": 0, "d.bin": 17}
    paths = []
    for name, n in sizes.items():
        (tmp_path / name).write_bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes())
        paths.append(tmp_path / name)
    return paths


def test_tree_hash_is_the_documented_scheme_for_any_thread_count(hash_files):
    want = _documented_tree_hash(hash_files, MIB)
    assert sha256_files(hash_files, chunk_bytes=MIB, threads=1) == want
    assert sha256_files(list(reversed(hash_files)), chunk_bytes=MIB, threads=4) == want
    default = sha256_files(hash_files)
    assert default == _documented_tree_hash(hash_files, 64 * MIB) and default.startswith("sha256-64MiB-tree:")
    assert default != want
    with pytest.raises(ValueError):
        sha256_files(hash_files, chunk_bytes=1000)


def test_tree_hash_changes_with_one_byte_and_with_a_name(hash_files):
    before = sha256_files(hash_files, chunk_bytes=MIB, threads=3)
    p = hash_files[0]  # 2.5 MiB: flip a byte in its last (short) chunk
    data = bytearray(p.read_bytes())
    data[-100] ^= 1
    p.write_bytes(bytes(data))
    flipped = sha256_files(hash_files, chunk_bytes=MIB, threads=3)
    assert flipped != before
    data[-100] ^= 1
    p.write_bytes(bytes(data))
    assert sha256_files(hash_files, chunk_bytes=MIB, threads=2) == before
    renamed = p.rename(p.with_name("z.safetensors"))
    assert sha256_files([renamed, *hash_files[1:]], chunk_bytes=MIB, threads=3) not in (before, flipped)


def test_integer_weights_are_not_silently_cast_to_float(tmp_path):
    path = tmp_path / "q.safetensors"
    save_file({"w": torch.ones(4, 4, dtype=torch.int8), "f": torch.ones(2)}, path)
    h = read_header(path)
    assert read_tensors(h, ["f"], dtype=torch.bfloat16)["f"].dtype == torch.bfloat16
    assert read_tensors(h, ["w"])["w"].dtype == torch.int8  # no cast asked: read as stored
    with pytest.raises(CheckpointError, match=r"'w' is stored as int8, not a float type"):
        read_tensors(h, ["w"], dtype=torch.bfloat16)
