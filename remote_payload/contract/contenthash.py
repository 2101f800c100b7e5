"""Checkpoint identity (stdlib only): the training step in its name, and its content hash, one scheme
everywhere: `sha256-64MiB-tree:<hex>` over the drafter's files (its config and the weights the loader reads,
checkpoint.py). The eval records it in results.json (`drafter.content_hash`); the sweep's ledger names
checkpoints by it, computed where the checkpoint lives by

    python -m remote_payload hash PATH...      # one `<hash><TAB><path>` line per PATH; exit 3 on bad input

so "this run evaluated exactly this checkpoint" is one string comparison.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from remote_payload.contract.errors import CheckpointError
from remote_payload.contract.runstate import open_regular, read_regular

HASH_CHUNK_BYTES = 64 << 20
INDEX_JSON = "model.safetensors.index.json"
SINGLE_SAFETENSORS = "model.safetensors"
MASK_EMBEDDING = "mask_embedding.pt"  # a separately trained mask embedding beside config.json (vLLM's convention)
NOTHING_DONE = "Nothing was evaluated."  # = safetensors_io.NOTHING_DONE (that module needs torch)


# a training step in a checkpoint name: step-4000, step4000, checkpoint-4000, ckpt_4000, iter4000
STEP_PATTERN = re.compile(r"(?:step|checkpoint|ckpt|iter)[-_]?(\d+)", re.IGNORECASE)


def parse_step(path: str | Path, field_value=None) -> int | None:
    """A `step` field wins; else `step-4000`, `step4000`, `checkpoint-4000`, ... in the path's last 3 parts."""
    if isinstance(field_value, int) and not isinstance(field_value, bool):
        return field_value
    p = Path(path)
    for part in [p.stem, *[q.name for q in list(p.parents)[:2]]]:
        m = STEP_PATTERN.search(part)
        if m:
            return int(m.group(1))
    return None


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint folders or weight files")


def content_files(path: str | os.PathLike) -> list[Path]:
    """The files a checkpoint's hash covers — what decides the drafter: a z-lab folder's config.json and its
    index shards or model.safetensors (what the loader reads), and mask_embedding.pt when there is one; a
    .safetensors file with the config.json (and mask_embedding.pt) beside it; a .pt file itself; any other
    folder: every regular file under it."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if not p.is_dir():
        cfg = p.parent / "config.json"
        return [cfg, *_mask(p.parent), p] if p.suffix == ".safetensors" and cfg.is_file() else [p]
    cfg = [p / "config.json"] if (p / "config.json").is_file() else []
    cfg += _mask(p) if cfg else []
    index = p / INDEX_JSON
    if index.exists():
        try:
            weight_map = json.loads(read_regular(index)).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"cannot read {index}: {e}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map'")
        return cfg + sorted({p / str(v) for v in weight_map.values()})
    if (p / SINGLE_SAFETENSORS).exists():
        return cfg + [p / SINGLE_SAFETENSORS]
    return sorted(f for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def _mask(folder: Path) -> list[Path]:
    """mask_embedding.pt when anything is there: a FIFO or a device in its place is hashed, and so refused
    (sha256_files reads regular files only), instead of left out of the hash while the loader reads it."""
    f = folder / MASK_EMBEDDING
    return [f] if f.exists() or f.is_symlink() else []


def content_hash(path: str | os.PathLike) -> str:
    """The checkpoint's content hash (see the module doc). Files of a folder that is not a z-lab drafter
    are named by their path inside it (the loader's files by their name, as the eval records them)."""
    p = Path(path)
    files = content_files(p)
    drafter = not p.is_dir() or (p / INDEX_JSON).exists() or (p / SINGLE_SAFETENSORS).exists()
    return sha256_files(files, root=None if drafter else p)


def sha256_files(paths: list[Path], *, chunk_bytes: int = HASH_CHUNK_BYTES, threads: int | None = None,
                 root: Path | None = None) -> str:
    """Content hash `sha256-<C>MiB-tree:<hex>` (C = chunk_bytes in MiB, 64 by default) of weight files.

    Each file is cut into C MiB chunks (the last one shorter, none for an empty file) and every chunk is
    sha256'd on its own, in a thread pool (hashlib releases the GIL; os.preadv keeps threads off a shared file
    position). <hex> = sha256 over, per file in name order: the name (UTF-8), NUL, the size in decimal ASCII,
    NUL, then the raw 32-byte digests of its chunks in order. The value does not depend on `threads`; it is
    not `sha256sum` of anything. With `root`, a file's name is its path under root (POSIX, UTF-8).
    """
    if chunk_bytes <= 0 or chunk_bytes % (1 << 20):
        raise ValueError(f"chunk_bytes must be a positive multiple of 1 MiB, got {chunk_bytes}")
    def name(p: Path) -> str:
        return p.relative_to(root).as_posix() if root is not None else p.name
    files = sorted((Path(p) for p in paths), key=name)
    local = threading.local()

    def chunk_digest(job: tuple[Path, int, int, int]) -> bytes:
        path, fd, offset, n = job
        # one buffer per thread, reused (no allocation a chunk), as large as the largest chunk it read: a small
        # checkpoint never zeroes chunk_bytes (64 MiB) per thread per hash
        if len(getattr(local, "buf", b"")) < n:
            local.buf = memoryview(bytearray(n))
        pos = 0
        while pos < n:
            got = os.preadv(fd, [local.buf[pos:n]], offset + pos)
            if got == 0:
                raise CheckpointError(f"{path} shrank while it was being hashed; re-copy it. {NOTHING_DONE}")
            pos += got
        return hashlib.sha256(local.buf[:n]).digest()

    fds: list[int] = []
    try:
        jobs, sizes = [], []
        for p in files:
            with open_regular(p) as f:  # a FIFO would block the open, /dev/zero never end the hash
                fds.append(os.dup(f.fileno()))
            sizes.append(os.fstat(fds[-1]).st_size)
            jobs += [(p, fds[-1], off, min(chunk_bytes, sizes[-1] - off)) for off in range(0, sizes[-1], chunk_bytes)]
        with ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1),
                                thread_name_prefix="reval-hash") as ex:
            digests = iter(ex.map(chunk_digest, jobs))
            h = hashlib.sha256()
            for p, size in zip(files, sizes):
                h.update(name(p).encode() + b"\0" + str(size).encode() + b"\0")
                for _ in range(0, size, chunk_bytes):
                    h.update(next(digests))
    finally:
        for fd in fds:
            os.close(fd)
    return f"sha256-{chunk_bytes >> 20}MiB-tree:{h.hexdigest()}"


def main(args) -> int:
    rc = 0
    for path in args.paths:
        try:
            print(f"{content_hash(path)}\t{path}", flush=True)
        except (CheckpointError, OSError) as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            rc = 3
    return rc
