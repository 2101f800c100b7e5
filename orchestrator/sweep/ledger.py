"""The sweep ledger: which checkpoint was evaluated how, so that a re-run does nothing new unless something
changed. A local JSON file (default `sweeps/ledger.json`), keyed by `ledger_key(...)` = sha256 over the
checkpoint content hash, the cache fingerprint, the payload version and the eval options.

An entry is written when a run is launched (state `launched`, with host + run name) and updated when it
ends, so the ledger alone is enough to re-attach after the controller was killed. It also caches content
hashes by (location, size, mtime) so an unchanged multi-GB checkpoint is not re-hashed every night.
One controller at a time: `Ledger.lock()` holds an flock for the sweep's life.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from remote_payload.contract import protocol

from ..errors import ConfigError

LEDGER_SCHEMA = "reval.ledger/1"

LAUNCHED = "launched"  # on top of the run states in protocol (succeeded, failed, cancelled, lost)


def ledger_key(content_hash: str, cache_fingerprint: str, payload_version: str, options: dict) -> str:
    """Pure: the identity of one evaluation. `options` are the eval options that change the numbers."""
    blob = json.dumps({"checkpoint": content_hash, "cache": cache_fingerprint, "payload": payload_version,
                       "options": options}, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class LedgerEntry:
    key: str
    checkpoint: str              # display name, e.g. step-4000
    source: str                  # where it was found: HOST:/path or a local path
    content_hash: str
    step: int | None = None
    host: str | None = None      # where it ran
    run: str | None = None       # run name on that host
    state: str = LAUNCHED        # launched | succeeded | failed | cancelled | lost
    sweep: str = ""              # the sweep that ran it
    updated_at: str = ""
    exit_code: int | None = None
    error: str | None = None
    tau: float | None = None
    suspect: bool = False
    local_path: str | None = None  # the pulled run directory
    config: str = ""             # ledger_key without the checkpoint: runs with the same config are a series
    also: list[str] = field(default_factory=list)  # the other names of the same content (evaluated once, as this)


def _parse(data, path: Path) -> tuple[dict[str, LedgerEntry], dict[str, dict]]:
    """The ledger file's entries and hash cache, validated: a damaged one is one line (exit 3), never a
    traceback or a silently emptied ledger."""
    hint = "restore it from a backup, or move it away to start a fresh ledger (everything would be evaluated again)"
    entries = data.get("entries", {}) if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise ConfigError(f"ledger {path} is not a reval ledger (no entries mapping)", hint=hint)
    names = {f.name for f in fields(LedgerEntry)}
    out = {}
    for k, e in entries.items():
        try:
            out[k] = LedgerEntry(**{n: v for n, v in e.items() if n in names})
            if not (isinstance(out[k].also, list) and all(isinstance(x, str) for x in out[k].also)):
                out[k].also = []
        except (AttributeError, TypeError):
            raise ConfigError(f"ledger {path}: entry {k[:24]!r} is damaged (not an entry with all its fields)",
                              hint=hint) from None
    hashes = data.get("hashes", {})
    return out, {k: v for k, v in hashes.items() if isinstance(v, dict)} if isinstance(hashes, dict) else {}


class Ledger:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._mutex = threading.Lock()
        self._lock_fd: int | None = None
        self.entries: dict[str, LedgerEntry] = {}
        self.hashes: dict[str, dict] = {}
        if self.path.exists():
            try:
                data = protocol.read_json(self.path)  # a regular file only
            except OSError as e:  # a FIFO would block the read; a folder
                raise ConfigError(f"ledger {self.path} cannot be read ({e.strerror})",
                                  hint="move it away to start a fresh ledger (everything would be evaluated "
                                       "again), or give another --sweep-dir") from e
            except ValueError as e:  # not JSON, or nested too deep
                raise ConfigError(f"ledger {self.path} is not valid JSON ({e})",
                                  hint="restore it from a backup, or move it away to start a fresh ledger "
                                       "(everything would be evaluated again)") from e
            self.entries, self.hashes = _parse(data, self.path)

    def lock(self) -> None:
        """Take the controller lock (non-blocking): a second `reval sweep` on the same ledger is refused.
        unlock() deletes the lock file; a lock taken on a file deleted meanwhile is retaken on the new one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = f"{self.path}.lock"
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                try:
                    holder = Path(lock).read_text(errors="replace").strip() or "another process"
                except OSError:
                    holder = "another process"
                os.close(fd)
                raise ConfigError(f"another reval sweep is using {self.path} ({holder})",
                                  hint="wait for it to finish (or stop it); a killed one releases the lock") from None
            try:
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder deleted it between our open and our flock: take the new file
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}".encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(f"{self.path}.lock")  # while still holding it (see lock())
            os.close(self._lock_fd)
            self._lock_fd = None

    def get(self, key: str) -> LedgerEntry | None:
        return self.entries.get(key)

    def put(self, entry: LedgerEntry) -> None:
        with self._mutex:
            entry.updated_at = protocol.now_iso()
            self.entries[entry.key] = entry
            self._save()

    def restore(self, key: str, entry: LedgerEntry | None) -> None:
        """Put back what `key` held before (None: nothing), as it was (a launch that started nothing)."""
        with self._mutex:
            if entry is None:
                self.entries.pop(key, None)
            else:
                self.entries[key] = entry
            self._save()

    def of_sweep(self, sweep: str) -> dict[tuple[str, str], LedgerEntry]:
        """One sweep's entry per checkpoint, keyed (source, content hash); the newest wins. A resumed sweep
        plans from these, not from a recomputed key: the key moves when the payload or cache changed since."""
        mine = sorted((e for e in self.entries.values() if e.sweep == sweep), key=lambda e: e.updated_at)
        return {(e.source, e.content_hash): e for e in mine}

    def series(self, config: str) -> list[LedgerEntry]:
        """Finished entries of one eval configuration (same cache/payload/options), oldest step first."""
        done = [e for e in self.entries.values() if e.config == config and e.state != LAUNCHED]
        return sorted(done, key=lambda e: (e.step is None, e.step or 0, e.updated_at))

    def cached_hash(self, location: str, size: int, mtime: float) -> str | None:
        h = self.hashes.get(location)
        return h["hash"] if h and h.get("size") == size and h.get("mtime") == mtime else None

    def remember_hash(self, location: str, size: int, mtime: float, content_hash: str) -> None:
        with self._mutex:
            self.hashes[location] = {"size": size, "mtime": mtime, "hash": content_hash}
            self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        protocol.atomic_write_json(self.path, {"schema": LEDGER_SCHEMA,
                                               "entries": {k: asdict(e) for k, e in self.entries.items()},
                                               "hashes": self.hashes})


