"""Where `--speedup`'s measured latencies are kept (`LatencyTable`), which target they were measured on
(`target_content_hash`, `target_signature`), and where the table lives (`table_path`).

The table is a small JSON file ({"schema", "entries": [Latencies.to_json(), ...]}) holding measured `Latencies`
by key (latency.latency_key: GPU, dtype, target content hash, drafter architecture, torch/transformers/payload
versions, the latency schema, context length, regime, block size, budgets, batches, repeats); an entry is
reused while its key matches and it passes `Latencies.from_json` (complete and sane), else it is a miss and
measured again. Beside the entries, "hashes" maps a target folder's `target_signature` to the content hash
last computed for it (the hash of a big target costs a full read). Where it lives, first that applies:

    eval --latency-table PATH
    $REVAL_LATENCY_TABLE          set by the run wrapper to <workdir>/latency.json: what `reval run` and sweeps use
    $REVAL_HOME/latency.json
    $XDG_CACHE_HOME/reval/latency.json, else ~/.cache/reval/latency.json

(never next to the run directory: a standalone `eval --run-dir /tmp/x` writes nothing outside the run but here).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from remote_payload.contract.runstate import read_regular

TABLE_SCHEMA = "reval.latency-table/1"
TABLE_MAX_ENTRIES = 64  # the oldest go first
TABLE_MAX_BYTES = 16 << 20  # a bigger file is damage, not a table
TABLE_ENV = "REVAL_LATENCY_TABLE"


def table_path(explicit: str | None = None) -> Path:
    """The latency table's path (module doc's order)."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(TABLE_ENV):
        return Path(os.environ[TABLE_ENV]).expanduser()
    if os.environ.get("REVAL_HOME"):
        return Path(os.environ["REVAL_HOME"]).expanduser() / "latency.json"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "reval" / "latency.json"


def target_content_hash(target_dir) -> str:
    """The target's content hash (`contract.contenthash`: config.json + the weight files the index names, or
    model.safetensors; every file of any other folder)."""
    from remote_payload.contract.contenthash import content_hash
    return content_hash(target_dir)


def target_signature(target_dir) -> str:
    """The folder's real path and, for each file the content hash covers, its name, size, inode, mtime and
    ctime (a stat each, no read). While it is unchanged, the hash a table entry was measured under still names
    the target. mtime alone is not enough (`cp -p`, `touch -r`, tar and container layers restore it): a write
    in place moves ctime, a copy gets a new inode, another folder another path — each a new signature, so
    the content is hashed again."""
    from remote_payload.contract.contenthash import content_files
    h = hashlib.sha256(f"{os.path.realpath(target_dir)}\n".encode())
    for f in content_files(target_dir):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n".encode())
    return "stat2-sha256:" + h.hexdigest()


def _norm(key: dict) -> dict:
    return json.loads(json.dumps(key, sort_keys=True, default=str))


class LatencyTable:
    """Measured Latencies by key in one small JSON file. `get` returns the entry whose key equals the asked one
    and passes `Latencies.from_json` (else None, the reason in `refused`); `put` adds or replaces by key (the
    newest TABLE_MAX_ENTRIES kept) with an atomic write. A damaged file (unreadable, not JSON, wrong shape, an
    entry out of shape, lacking a time, holding an absurd one) is a miss and replaced by the next `put`; neither
    raises on it. A `put` that cannot write returns False and says why in `error` (the numbers are then merely
    measured again next time)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.error: str | None = None
        self.refused: str | None = None

    def _entries(self) -> list:
        entries = self._data().get("entries")
        return entries if isinstance(entries, list) else []

    def get(self, key: dict):
        from remote_payload.eval.latency import Latencies
        want = _norm(key)
        self.refused = None
        for entry in reversed(self._entries()):
            if isinstance(entry, dict) and entry.get("key") == want:
                try:
                    return Latencies.from_json(entry)
                except (TypeError, ValueError) as e:
                    self.refused = f"the table's entry was refused ({e}): measured again"
                    return None
        return None

    def _data(self) -> dict:
        try:
            if self.path.stat().st_size > TABLE_MAX_BYTES:
                return {}
            data = json.loads(read_regular(self.path))
        except (OSError, ValueError, RecursionError):  # missing, a folder, not UTF-8, not JSON, nested too deep
            return {}
        return data if isinstance(data, dict) and data.get("schema") == TABLE_SCHEMA else {}

    def known_hash(self, signature: str) -> str | None:
        """The target content hash last computed for a folder whose files had `signature` (`target_signature`):
        a later run on the same files skips re-reading the whole target to hash it."""
        hashes = self._data().get("hashes")
        h = hashes.get(signature) if isinstance(hashes, dict) else None
        return h if isinstance(h, str) else None

    def put(self, lat, signature: str | None = None, target_hash: str | None = None) -> bool:
        """Add or replace `lat` by its key; with signature and target_hash, remember that hash for that folder
        signature too (`known_hash`)."""
        from remote_payload.contract.protocol import atomic_write_json
        data = self._data()
        want = _norm(lat.key)
        entries = [e for e in self._entries() if not (isinstance(e, dict) and e.get("key") == want)]
        entries = [*entries, _norm(lat.to_json())][-TABLE_MAX_ENTRIES:]
        hashes = data.get("hashes") if isinstance(data.get("hashes"), dict) else {}
        if signature and target_hash:
            hashes = {k: v for k, v in hashes.items() if k != signature}
            hashes = dict(list({**hashes, signature: target_hash}.items())[-TABLE_MAX_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, {"schema": TABLE_SCHEMA, "entries": entries, "hashes": hashes})
        except OSError as e:
            self.error = f"cannot write {self.path}: {e}"
            return False
        self.error = None
        return True
