"""A cache store on a host (`<workdir>/caches/`): each cache under its recipe's key (recipe.py), built once.

    caches/<key>/               a finished cache; its cache.json records "recipe" (with "key" = the folder's
                                name) and "store" (the suite name it was first asked under)
    caches/.<key>.partial/      an extract of it under way or interrupted (extract's work dir, resumed by the
                                next request for the same recipe); never listed, never read as a cache
    caches/.locks/<key>.lock    flock'd while it is built: a second request for the same recipe (another run,
                                sweep slot or laptop) waits for the first, then finds the cache and uses it
    caches/.hashes/             target content hashes under their stat signature (recipe.target_hash)

A cache appears under its key only whole: extract writes it in its work dir and renames it into place. An
entry that does not hold up (no or unreadable cache.json, a recipe whose key is not the folder's, a prompt
file missing) is damaged: reported in one line and never used (`entry_problem`); `caches --rm` removes it.
Stdlib only (listing, planning and removing never load torch); building calls extract (command.py).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from pathlib import Path

from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import probe, read_regular
from remote_payload.extract.recipe import Recipe

KEY = re.compile(r"^[0-9a-f]{64}$")
LOCKS, HASHES = ".locks", ".hashes"


def entry_problem(path: Path) -> str | None:
    """What is wrong with a store entry, in a few words; None when it holds up (cheap: no tensor is read)."""
    try:
        meta = json.loads(read_regular(path / "cache.json"))
    except FileNotFoundError:
        return "no cache.json"
    except (OSError, ValueError) as e:
        return f"cache.json unreadable ({type(e).__name__})"
    try:
        rec = meta["recipe"]
        if rec.get("key") != path.name or Recipe.from_dict(rec).key != path.name:
            return "its recipe's key is not the folder's name"
        files = [p["file"] for p in meta["prompts"]]
    except (KeyError, TypeError, AttributeError):
        return "cache.json lacks its recipe or prompts"
    if not files:
        return "no prompts"
    gone = [f for f in files if not isinstance(f, str) or "/" in f or not (path / f).is_file()]
    return f"{len(gone)} of {len(files)} prompt files missing ({gone[0]})" if gone else None


def _meta(path: Path) -> dict:
    return json.loads(read_regular(path / "cache.json"))


def summary(path: Path) -> dict:
    """One store entry as `caches` lists it (a damaged one: key, path, damage)."""
    out = {"key": path.name, "path": str(path)}
    damage = entry_problem(path)
    if damage:
        return {**out, "damaged": damage}
    meta = _meta(path)
    rec, prompts = meta["recipe"], meta["prompts"]
    agree = meta.get("argmax_agreement")
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    opts = rec.get("options", {})
    return {**out, "suite": (meta.get("store") or {}).get("suite"), "target": rec.get("target"),
            "target_path": (meta.get("target") or {}).get("path"), "layers": opts.get("layers"),
            "prompts": rec.get("prompts", {}).get("count"), "entries": len(prompts),
            "tokens": sum(int(p.get("seq_len", 0)) for p in prompts),
            "template": rec.get("template", {}).get("applied"),
            "thinking": rec.get("template", {}).get("enable_thinking"),
            "sampling": meta.get("sampling", opts.get("sampling", "greedy")),
            "max_new_tokens": opts.get("max_new_tokens"), "dtype": opts.get("dtype"), "bytes": size,
            "created_at": meta.get("created_at"),
            "agreement": agree.get("fraction") if isinstance(agree, dict) else None}


def entries(root: Path) -> list[Path]:
    """The store's entries (folders named by a key), damaged ones included; never the work dirs."""
    try:
        return sorted(p for p in root.iterdir() if KEY.match(p.name) and p.is_dir() and not p.is_symlink())
    except FileNotFoundError:
        return []


def readers(root: Path, runs_dir: Path) -> dict[str, list[str]]:
    """{key: [run names]}: the runs of `runs_dir` that are running (status.json says so and their process
    group lives) and name a store entry among their arguments (run.json's payload_argv)."""
    out: dict[str, list[str]] = {}
    prefix = str(root.resolve()) + os.sep
    for rec in probe(str(runs_dir), []):
        st = rec.get("status")
        if not (isinstance(st, dict) and st.get("state") == "running" and rec.get("alive")):
            continue
        try:
            argv = json.loads(read_regular(runs_dir / rec["name"] / "run.json")).get("payload_argv") or []
        except (OSError, ValueError, AttributeError):
            continue
        for a in argv:
            path = str(a).partition("=")[2] if "=" in str(a) and not str(a).startswith("/") else str(a)
            if path.startswith(prefix):
                key = path[len(prefix):].split(os.sep)[0]
                if KEY.match(key):
                    out.setdefault(key, []).append(rec["name"])
    return out


@contextlib.contextmanager
def building(root: Path, key: str, log=print):
    """Hold the recipe's build lock (flock on caches/.locks/<key>.lock; released when this process ends,
    however it ends); a request that finds it held says so and waits."""
    (root / LOCKS).mkdir(parents=True, exist_ok=True)
    with open(root / LOCKS / f"{key}.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting: another extract is building cache {key[:12]} (the same recipe); it is used once "
                "done")
            t = time.monotonic()
            fcntl.flock(f, fcntl.LOCK_EX)
            log(f"waited {time.monotonic() - t:.1f}s for cache {key[:12]}")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def being_built(root: Path, key: str) -> bool:
    """Whether some process holds the recipe's build lock now."""
    lock = root / LOCKS / f"{key}.lock"
    if not lock.is_file():
        return False
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def remove(root: Path, key: str, runs_dir: Path) -> Path:
    """Remove a store entry (a damaged one too): refused while a running eval reads it or it is being built;
    it leaves its key at once (renamed aside, then deleted), so no reader finds half of it."""
    path = root / key
    if not KEY.match(key) or not path.is_dir():
        raise PayloadError(f"no cache {key} in the store {root}; list them: caches --store {root}")
    using = readers(root, runs_dir).get(key)
    if using:
        raise PayloadError(f"cache {key[:12]} is read by running run(s) {', '.join(sorted(using))}; wait for "
                           "them to end (or kill them), then remove it")
    if being_built(root, key):
        raise PayloadError(f"cache {key[:12]} is being built by an extract now; remove it once that is over")
    aside = root / f".rm-{key}-{os.getpid()}"
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)
    return path


def add_arguments(p) -> None:
    p.add_argument("--store", required=True, metavar="DIR", help="the cache store (WORKDIR/caches)")
    p.add_argument("--runs", metavar="DIR", help="the runs whose readers are checked (default: DIR/../runs)")
    p.add_argument("--json", action="store_true", help="one JSON object: the entries, each with its readers")
    p.add_argument("--rm", nargs="+", metavar="KEY",
                   help="remove these entries (a key, or its first 8+ characters)")


def listing(root: Path, runs_dir: Path) -> list[dict]:
    """Every entry's summary, with the running runs that read it (`readers`) and whether it is being built."""
    using = readers(root, runs_dir)
    return [{**summary(p), "readers": sorted(using.get(p.name, [])), "building": being_built(root, p.name)}
            for p in entries(root)]


def full_key(root: Path, prefix: str) -> str:
    """A key given whole or by its first 8+ characters (one entry must match)."""
    hits = [p.name for p in entries(root) if len(prefix) >= 8 and p.name.startswith(prefix.lower())]
    if len(hits) != 1:
        why = "no cache" if not hits else f"{len(hits)} caches"
        raise PayloadError(f"{why} in the store {root} match {prefix!r}; give more of the key "
                           f"(caches --store {root} lists them)")
    return hits[0]


def main(args) -> int:
    root = Path(args.store)
    runs_dir = Path(args.runs) if args.runs else root.parent / "runs"
    try:
        if args.rm:
            keys = [full_key(root, k) for k in args.rm]
            for k in keys:
                remove(root, k, runs_dir)
                print(json.dumps({"removed": k}) if args.json else f"removed {k}")
            return 0
        rows = listing(root, runs_dir)
    except PayloadError as e:
        print(f"error: {e}")
        return e.exit_code
    if args.json:
        print(json.dumps({"store": str(root), "caches": rows}))
        return 0
    for r in rows:
        if r.get("damaged"):
            print(f"{r['key'][:12]}  DAMAGED: {r['damaged']} (never used; remove it: caches --store {root} "
                  f"--rm {r['key'][:12]})")
            continue
        print(f"{r['key'][:12]}  {r['suite'] or '-'}  {r['prompts']} prompts, {r['tokens']} tokens, layers "
              f"{r['layers']}, {r['bytes'] / 2**20:.1f} MiB" + (f", read by {', '.join(r['readers'])}"
                                                                   if r["readers"] else ""))
    return 0
