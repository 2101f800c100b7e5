"""GPU listing from `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` (stdlib): the one parser the
wrapper (which GPU is free) and `reval hosts check` (what a host has) share; and `gpu_indices`, a list of GPU
indices as a user types it (`extract --gpus 0,1`)."""
from __future__ import annotations

import re
from dataclasses import dataclass

INVENTORY_FIELDS = ["index", "name", "memory.total", "memory.used", "utilization.gpu"]


@dataclass
class Gpu:
    index: int
    memory_used_mib: int
    memory_total_mib: int
    utilization_pct: int


SMI_KEYS = {"index": "index", "name": "name", "memory.total": "memory_total_mib", "memory.used": "memory_used_mib",
            "utilization.gpu": "utilization_pct"}


def _smi_num(s: str) -> int | None:
    try:
        return int(float(s))
    except ValueError:
        return None  # "[N/A]" on some boards


def smi_rows(text: str, fields: list[str]) -> list[dict]:
    """Rows of `nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits` as dicts keyed by SMI_KEYS
    (numbers as int, None where the board says [N/A]; a name may hold commas). The one nvidia-smi parser:
    the wrapper's GPU choice (`usage`) and `reval hosts check` (`inventory`) both read through it."""
    rows = []
    for line in text.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        extra = len(parts) - len(fields)
        if extra < 0 or (extra and "name" not in fields):
            continue
        if extra:
            i = fields.index("name")
            parts = parts[:i] + [",".join(parts[i:i + extra + 1])] + parts[i + extra + 1:]
        rows.append({SMI_KEYS[f]: v if f == "name" else _smi_num(v) for f, v in zip(fields, parts)})
    return rows


def usage(text: str) -> list[Gpu]:
    """The wrapper's view: `index, memory.used, memory.total, utilization.gpu` rows (csv, noheader, nounits)
    as Gpu, rows without index or memory dropped."""
    gpus = []
    for r in smi_rows(text, ["index", "memory.used", "memory.total", "utilization.gpu"]):
        if None in (r["index"], r["memory_used_mib"], r["memory_total_mib"]):
            continue
        gpus.append(Gpu(r["index"], r["memory_used_mib"], r["memory_total_mib"], r["utilization_pct"] or 0))
    return gpus


def inventory(text: str) -> list[dict]:
    """`reval hosts check`'s view: INVENTORY_FIELDS rows as dicts (MiB, %; None where the board says [N/A])."""
    return smi_rows(text, INVENTORY_FIELDS)



_INDEX = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit() holds for '²', and int() reads '٣' as 3


def gpu_indices(text: str) -> list[int]:
    """"0,1,3" -> [0, 1, 3] (spaces around an index allowed); ValueError saying what is wrong: an item that is
    not an ASCII index, or an index given twice."""
    items = [x.strip() for x in text.split(",")]
    if not all(_INDEX.fullmatch(x) for x in items):
        raise ValueError("expected GPU indices such as 0,1,2,3")
    ids = [int(x) for x in items]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ValueError(f"GPU {twice[0]} is given twice; name each GPU once")
    return ids
