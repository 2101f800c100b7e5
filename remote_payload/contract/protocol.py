"""The run-directory contract: the only thing the two halves share.

Stdlib only. The payload (server side) writes a run directory; the orchestrator (laptop side)
reads it, and may import this module for the names, the validation and the atomic helpers.

    <workdir>/runs/<run>/
      run.json       what was asked (argv, hashes, paths, host, GPUs, created_at, controller version)
      status.json    state, pid, pgid, started_at, finished_at, exit_code   (owned by the wrapper)
      eval.log       stdout+stderr of the payload, append-only
      events.jsonl   structured progress, one JSON object a line
      results.json   written once, atomically, at the end
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from remote_payload.contract import runstate

PROTOCOL_VERSION = 1
RESULTS_SCHEMA = "reval.results/2"  # remote_payload/contract/results.py (the schema); /1 files still load
# Bump when any metric definition changes: runs with different versions are not comparable.
METRICS_VERSION = "dflash-metrics/1"

RUN_JSON = "run.json"
STATUS_JSON = "status.json"
EVAL_LOG = "eval.log"
EVENTS_JSONL = "events.jsonl"
RESULTS_JSON = "results.json"
CACHES_JSON = "caches.json"  # an extract run's: what each suite resolved to in the host's cache store
RUN_FILES = (RUN_JSON, STATUS_JSON, EVAL_LOG, EVENTS_JSONL, RESULTS_JSON, CACHES_JSON)

# status.json "state"
QUEUED = "queued"  # accepted by a scheduler, not started (a backend's verdict; the wrapper never writes it)
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
LOST = "lost"  # never written by the server: the controller's verdict for `running` with no live process
TERMINAL_STATES = (SUCCEEDED, FAILED, CANCELLED)

# Exit codes of the payload (`python -m remote_payload ...`), a subset of reval's documented set.
EXIT_OK = 0
EXIT_FAILED = 1  # the eval failed (crash, or a suspect result under --strict)
EXIT_BAD_INPUT = 3  # bad input: missing key, shape mismatch, bad cache, bad option
EXIT_CANCELLED = 103

_RUN_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class ProtocolError(ValueError):
    """A run name, path or file that breaks the contract."""


def validate_run_name(name: str) -> str:
    """Return `name` if it is a legal run name, else raise with the rule and the fix."""
    # Not starting with '-' either: a name is an argument of commands (`reval logs NAME`, rm, find) and must
    # never be read as an option.
    if not isinstance(name, str) or not _RUN_NAME.match(name) or name.startswith((".", "-")):
        raise ProtocolError(
            f"invalid run name {name!r}: use 1-64 characters from A-Z a-z 0-9 . _ - (not starting with '.' or '-')"
        )
    return name


def default_run_name(drafter_path: str, now: float | None = None) -> str:
    """`<drafter-name>-<UTC timestamp>`, sanitised to the run-name alphabet."""
    base = Path(str(drafter_path).rstrip("/")).name or "run"
    base = base.removesuffix(".pt")
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", base).lstrip(".-") or "run"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    return validate_run_name(f"{base[: 64 - len(stamp) - 1]}-{stamp}")


def safe_join(root: str | os.PathLike, *parts: str) -> Path:
    """Join `parts` under `root` and refuse anything that would land outside it (`..`, absolute parts)."""
    root_p = Path(root).resolve()
    p = root_p.joinpath(*parts).resolve()
    if p != root_p and root_p not in p.parents:
        raise ProtocolError(f"path {'/'.join(parts)!r} escapes {str(root_p)!r}")
    return p


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def umask() -> int:
    """This process's umask, read without setting it (/proc/self/status; os.umask would change it for a moment
    under other threads creating files); elsewhere set and put back."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write via a temp file in the same directory + fsync + os.replace: readers see old or new, never half.
    The file gets the mode open() would give it (0666 less the umask), not mkstemp's private 0600."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o666 & ~umask())
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | os.PathLike, limit: int | None = None) -> Any:
    """A file's JSON; nesting past runstate.MAX_JSON_DEPTH is a ValueError, as any other damage is, and so is a
    file over `limit` bytes (never read whole: a state file is KBs, a planted one may be a sparse 10 GB)."""
    raw = runstate.read_regular(path) if limit is None else runstate.read_limited(path, limit)
    return runstate.loads(raw.decode("utf-8"))  # UnicodeDecodeError: a ValueError


def tail_text(path: str | os.PathLike, nbytes: int) -> str:
    """The text of a file's last `nbytes` (a log may be GBs), less a partial first line; "" when it cannot be
    read (missing, or not a regular file: runstate.open_regular)."""
    try:
        with runstate.open_regular(path) as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - nbytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return text.split("\n", 1)[1] if size > nbytes and "\n" in text else text


def append_event(path: str | os.PathLike, event: dict) -> None:
    """Append one event line; one write() call so a reader never sees half a line from us."""
    event = {"t": round(time.time(), 3), **event}
    line = json.dumps(event, default=str) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def read_events(path: str | os.PathLike) -> list[dict]:
    """Parse events.jsonl, ignoring a trailing partial line (a writer may be mid-line)."""
    out = []
    try:
        text = runstate.read_regular(path).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return out
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            out.append(runstate.loads(line))
        except ValueError:  # JSONDecodeError, too deep
            continue
    return out


boot_id = runstate.boot_id
loads = runstate.loads  # json.loads for untrusted text: nesting past 64 levels is a ValueError, not a RecursionError


def run_alive(status) -> bool:
    """Is the run of this status.json still running? Only a live process group that proves it is the run's
    counts (remote_payload/contract/runstate.py: pgid > 1, same boot, the leader's recorded start time or the run id in
    a member's environment); zombies do not. The controller's probes run the same module on the host."""
    return runstate.run_alive(status)
