"""Reading safetensors files without mmap: our own header parser plus large positional reads.

`safe_open(..., device="cuda").get_tensor` goes through mmap page faults and a pageable host copy; here each
tensor's bytes go disk -> destination in large `os.preadv` calls:
- CPU: straight into the destination tensor's memory (one copy, done by the kernel).
- CUDA: into one of two pinned staging buffers, then a non_blocking H2D copy; while buffer i is being copied
  the next chunk is read into the other one, and an event per buffer says when its last copy is done.
The dtype is converted (on the device) only when the file's dtype differs from the requested one.

Format: 8-byte little-endian u64 N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}, then the data; offsets are relative to the data start 8+N, and the tensors
cover the data exactly (contiguous, no gaps, nothing after). Any violation is a CheckpointError naming the file.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from remote_payload.contract.errors import CheckpointError
from remote_payload.contract.runstate import open_regular

NOTHING_DONE = "Nothing was evaluated."
STAGING_BYTES = 128 << 20  # per staging buffer (two of them, pinned, on CUDA)
MAX_HEADER_BYTES = 100 << 20  # the limit the safetensors library enforces
MAX_READ_BYTES = 1 << 30   # one preadv call (Linux caps a single read just under 2 GiB)
DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


@dataclass
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorEntry]  # in file order
    metadata: dict
    file_size: int


def corrupt(path, reason: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {reason}. "
                           f"Re-copy the file. {NOTHING_DONE}")


def read_header(path) -> SafetensorsHeader:
    """Parse and validate the header against the file size (no tensor data is read)."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise corrupt(path, f"the file has {size} bytes, fewer than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise corrupt(path, f"the header is said to be {n} bytes but the file has {size - 8} after the length"
                              if n > size - 8 else f"a {n}-byte header is implausible (limit {MAX_HEADER_BYTES})")
            raw = f.read(n)
    except FileNotFoundError as e:
        raise CheckpointError(f"weight file {path} does not exist. {NOTHING_DONE}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read weight file {path}: {e}. {NOTHING_DONE}") from e
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise corrupt(path, f"the {n}-byte header is not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise corrupt(path, "the header is not a JSON object")
    data_start = 8 + n
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise corrupt(path, "'__metadata__' is not a JSON object")
    tensors: dict[str, TensorEntry] = {}
    for name, d in doc.items():
        code = d.get("dtype") if isinstance(d, dict) else None
        if isinstance(code, str) and code not in DTYPES:
            raise corrupt(path, f"tensor {name!r} has dtype {code!r}, which this reader does not know "
                                f"(known: {', '.join(DTYPES)})")
        shape, offsets = (d.get("shape"), d.get("data_offsets")) if isinstance(d, dict) else (None, None)
        if not (isinstance(code, str) and isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
                and all(type(x) is int and x >= 0 for x in shape + offsets)):
            raise corrupt(path, f"tensor {name!r} has a malformed entry {json.dumps(d)[:200]}")
        dtype, shape, (begin, end) = DTYPES[code], tuple(shape), offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise corrupt(path, f"tensor {name!r} ({code} {list(shape)}) needs {nbytes} bytes but its "
                                f"data_offsets {[begin, end]} span {end - begin}")
        tensors[name] = TensorEntry(dtype, shape, data_start + begin, data_start + end)
    pos = data_start
    for name, e in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != pos:
            raise corrupt(path, f"tensor {name!r} starts at data byte {e.begin - data_start}, expected "
                                f"{pos - data_start} (gap or overlap)")
        pos = e.end
    if pos != size:
        what = "truncated" if pos > size else "has trailing bytes"
        raise corrupt(path, f"the tensors end at byte {pos} but the file has {size} ({what})")
    return SafetensorsHeader(path, tensors, metadata, size)


def _pread_full(fd: int, path: Path, name: str, buf: memoryview, offset: int) -> None:
    pos = 0
    while pos < len(buf):
        try:
            n = os.preadv(fd, [buf[pos:pos + MAX_READ_BYTES]], offset + pos)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read {name!r} ({e}); the file is corrupt. {NOTHING_DONE}") from e
        if n == 0:
            raise corrupt(path, f"the file ends at byte {offset + pos}, inside tensor {name!r} (did it shrink?)")
        pos += n


def _read_staged(fd: int, path: Path, jobs: list[tuple[str, int, Tensor]], staging_bytes: int, pin: bool) -> None:
    """jobs: (name, file offset, destination bytes [nbytes] uint8). Disk -> staging buffer k%2 -> destination."""
    size = min(staging_bytes, max(dst.numel() for _, _, dst in jobs))
    bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
    views = [memoryview(b.numpy()) for b in bufs]
    dev = jobs[0][2].device
    events = [torch.cuda.Event() for _ in bufs] if dev.type == "cuda" else None
    k = 0
    for name, offset, dst in jobs:
        for pos in range(0, dst.numel(), size):
            n, i = min(size, dst.numel() - pos), k % 2
            k += 1
            if events:
                events[i].synchronize()  # buffer i's previous H2D copy is done: it may be overwritten
            _pread_full(fd, path, name, views[i][:n], offset + pos)
            dst[pos:pos + n].copy_(bufs[i][:n], non_blocking=True)
            if events:
                events[i].record(torch.cuda.current_stream(dev))
    for ev in events or ():
        ev.synchronize()  # the buffers go back to the host allocator with no copy pending


def read_tensors(header: SafetensorsHeader, names, *, device="cpu", dtype: torch.dtype | None = None,
                 staging_bytes: int = STAGING_BYTES, staged: bool | None = None) -> dict[str, Tensor]:
    """The named tensors on `device` (converted to `dtype` there when given and different from the file's).
    staged=None: through the staging buffers exactly when `device` is not the CPU (pinned when CUDA)."""
    dev = torch.device(device)
    staged = dev.type != "cpu" if staged is None else staged
    out: dict[str, Tensor] = {}
    jobs: list[tuple[str, int, Tensor]] = []
    for name in names:
        e = header.tensors[name]
        if dtype is not None and dtype.is_floating_point and not e.dtype.is_floating_point:
            # a cast would turn quantised/integer weights into garbage without a word
            raise CheckpointError(f"{header.path}: {name!r} is stored as {str(e.dtype).removeprefix('torch.')}, "
                                  f"not a float type (a quantised checkpoint?): dequantise it first. {NOTHING_DONE}")
        t = torch.empty(e.shape, dtype=e.dtype, device=dev)
        out[name] = t
        if t.numel():
            jobs.append((name, e.begin, t.view(-1).view(torch.uint8)))  # [nbytes] over t's memory
    with open_regular(header.path) as f:
        fd = f.fileno()
        for name, offset, dst in ([] if staged else jobs):
            _pread_full(fd, header.path, name, memoryview(dst.numpy()), offset)
        if staged and jobs:
            _read_staged(fd, header.path, jobs, staging_bytes, pin=dev.type == "cuda")
    if dtype is not None:
        out = {k: v.to(dtype) for k, v in out.items()}
    return out
