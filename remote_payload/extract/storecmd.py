"""`python -m remote_payload extract --store DIR --prompts NAME=FILE ...`: each suite's cache from a cache
store (store.py), built only when it is missing, once however many ask.

    --plan      print what each suite resolves to (JSON: key, state ready|missing|building|damaged, the
                estimated size of what is missing and the store's free space), build nothing; the pre-flight
                of `reval extract` and the lookup of `reval run --prompts` (no torch unless --dtype auto must
                ask CUDA). Bad input is exit 3: the target unreadable, a prompt file that does not parse,
                layers beyond the target's, a damaged entry, too little disk for the estimate.
    (default)   for each suite in turn: take its build lock, use the cache when it is there, else extract it
                into the store (under its work dir, renamed into place when whole); --run-dir: caches.json
                there (what each suite resolved to, with its cache.json) and progress events (the run's bar).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from remote_payload.contract import protocol
from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular
from remote_payload.contract.spec import usable_name
from remote_payload.extract import options, store
from remote_payload.extract.recipe import DTYPE_NAMES, recipe_of
from remote_payload.target.load import check_target

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ESTIMATE_MARGIN = 1.1  # the estimate counts raw-text tokens; a chat template adds a few per turn


def parse_suites(values: list[str]) -> list[tuple[str, str]]:
    """--prompts NAME=FILE values -> [(name, file)]: names usable and unique, no file given twice."""
    out = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not path or not usable_name(name):
            raise PayloadError(f"--prompts {v!r}: a store takes NAME=FILE (NAME: letters, digits, . _ -)")
        out.append((name, path))
    names = [n for n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PayloadError(f"--prompts: suite {dup[0]!r} is given twice; name each suite once")
    return out


def dtype_name(dtype: str, device: str, gpus: str | None) -> str:
    """--dtype resolved as extract resolves it (auto: bf16 on CUDA, fp32 on CPU); torch only for device auto
    on a host with an NVIDIA driver."""
    if dtype != "auto":
        return DTYPE_NAMES[dtype]
    where = gpus.split(",")[0].strip() if gpus else device
    if where == "auto" and (os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
                            or not os.path.exists("/dev/nvidiactl")):
        where = "cpu"  # no NVIDIA driver (or no device visible): torch would say the same, without its import
    if where == "auto":
        import torch
        where = "cuda" if torch.cuda.is_available() else "cpu"
    return "fp32" if where == "cpu" else "bf16"


def estimate_tokens(target: Path, prompts_file: str, num_prompts: int | None, max_new_tokens: int) -> int:
    """Tokens the cache will hold at most: per entry, its turn and the turns before it (raw text tokens) and a
    completion of max_new_tokens after each."""
    from remote_payload.prompts.files import read_prompts
    _, records = read_prompts(prompts_file, num_prompts)
    try:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(target / "tokenizer.json"))

        def count(text: str) -> int:
            return len(tok.encode(text).ids)
    except Exception:  # noqa: BLE001 - no tokenizers package, an unreadable tokenizer: ~3 characters a token
        def count(text: str) -> int:
            return len(text) // 3 + 1
    total = 0
    for _, turns in records:
        so_far = 0
        for k, t in enumerate(turns, 1):
            so_far += count(t)
            total += so_far + k * max_new_tokens
    return int(total * ESTIMATE_MARGIN)


def plan(root: Path, target: str, suites: list[tuple[str, str]], kw: dict) -> dict:
    """What each suite resolves to in the store (see the module doc); PayloadError for bad input."""
    tdir = Path(target)
    config = check_target(tdir, kw["layer_ids"])
    hidden = config.get("hidden_size") or config.get("text_config", {}).get("hidden_size")
    rows = []
    for name, f in suites:
        rec = recipe_of(tdir, f, memo=root / store.HASHES, **kw)
        path = root / rec.key
        damage = store.entry_problem(path) if path.exists() else None
        state = ("damaged" if damage else "ready") if path.exists() else (
            "building" if store.being_built(root, rec.key) else "missing")
        size = 0  # the estimate (a tokenizer's pass over the prompts) only for what is to be built
        if state in ("missing", "building"):
            tokens = estimate_tokens(tdir, f, kw.get("num_prompts"), kw["max_new_tokens"])
            size = tokens * (len(kw["layer_ids"]) * int(hidden) * DTYPE_BYTES[kw["dtype"]] + 8)
        rows.append({"suite": name, "file": f, "key": rec.key, "path": str(path), "state": state,
                     "damage": damage, "prompts": rec.prompts["count"], "entries": rec.prompts["entries"],
                     "estimated_bytes": size, "recipe": rec.as_dict()})
    free = shutil.disk_usage(_existing(root)).free
    need = sum(r["estimated_bytes"] for r in rows if r["state"] in ("missing", "building"))
    return {"store": str(root), "caches": rows, "free_bytes": free, "needed_bytes": need}


def _existing(p: Path) -> Path:
    p = p.absolute()
    while not p.exists():
        p = p.parent
    return p


def refusal(planned: dict) -> str | None:
    """Why the plan cannot be built (a damaged entry; too little disk), or None."""
    for r in planned["caches"]:
        if r["state"] == "damaged":
            return damaged(r["suite"], r["path"], r["damage"], r["key"])
    if planned["needed_bytes"] > planned["free_bytes"]:
        free, need = planned["free_bytes"] / 2**30, planned["needed_bytes"] / 2**30
        return (f"the store {planned['store']} has {free:.1f} GiB free and the missing caches need about "
                f"{need:.1f} GiB (tokens x layers x hidden x bytes); free some space (reval caches rm) or "
                "use fewer prompts")
    return None


def damaged(suite: str, path, damage: str, key: str) -> str:
    return (f"cache {suite}: the store's entry {path} is damaged ({damage}) and is not used; remove it "
            f"(reval caches rm HOST {key[:12]}) and ask again")


def build(root: Path, target: str, suites: list[tuple[str, str]], kw: dict, run_kw: dict, *,
          run_dir: Path | None = None, log=print) -> list[dict]:
    """Each suite's cache: used when it is in the store, else extracted into it (under its build lock)."""
    from remote_payload.extract.command import extract
    done: list[dict] = []
    events = run_dir / protocol.EVENTS_JSONL if run_dir else None
    for step, (name, f) in enumerate(suites, 1):
        key = recipe_of(Path(target), f, memo=root / store.HASHES, **kw).key
        path = root / key
        if events:
            protocol.append_event(events, {"stage": "extract", "step": step, "steps": len(suites),
                                           "message": f"suite {name}"})
        with store.building(root, key, log):
            built = not path.exists()
            if not built:
                damage = store.entry_problem(path)
                if damage:
                    raise PayloadError(damaged(name, path, damage, key))
                log(f"cache {name}: in the store ({key[:12]}), reused")
            else:
                log(f"cache {name}: not in the store; extracting it ({key[:12]})")

                def progress(i: int, n: int, entry: str, suite=name) -> None:
                    if events:
                        protocol.append_event(events, {"stage": "extract", "i": i, "n": n, "suite": suite,
                                                       "message": f"{suite} {entry}"})
                extract(target, f, path, **kw, **run_kw, hash_memo=root / store.HASHES,
                        labels={"store": {"suite": name}}, progress=progress, log=log)
        meta = json.loads(read_regular(path / "cache.json"))
        if meta.get("recipe", {}).get("key") != key:  # the store's key and extract's recipe are one function
            held = meta.get("recipe", {}).get("key")
            raise PayloadError(f"cache {name}: {path} holds recipe {held}, not {key}")
        done.append({"suite": name, "file": f, "key": key, "path": str(path), "built": built, "cache": meta})
        if run_dir:
            _write_json(run_dir / protocol.CACHES_JSON, {"store": str(root), "caches": done})
    return done


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """extract's options (command.py), --store and --plan among them: this module is the command's entry."""
    options.add_arguments(p)


def main(args: argparse.Namespace) -> int:
    """`extract --store DIR ...` here; `extract --out DIR` is command.main's (torch is imported only then)."""
    if not args.store:
        from remote_payload.extract import command
        return command.main(args)
    try:
        if args.out:
            raise PayloadError("--store and --out: give one (a store names each cache by its recipe)")
        root = Path(args.store)
        suites = parse_suites(args.prompts)
        kw = {**options.data_kwargs(args), "dtype": dtype_name(args.dtype, args.device, args.gpus)}
        planned = plan(root, args.target, suites, kw)
        why = refusal(planned)
        if args.plan:
            print(json.dumps(planned))
        if why:
            raise PayloadError(why)
        if args.plan:
            return 0
        done = build(root, args.target, suites, kw, options.run_kwargs(args),
                     run_dir=Path(args.run_dir) if args.run_dir else None)
    except PayloadError as e:
        print(f"error: {e}", file=sys.stderr)  # stderr: a pre-flight (--plan) answers there
        return e.exit_code
    for d in done:
        print(f"{'built' if d['built'] else 'reused'} {d['suite']}: {len(d['cache']['prompts'])} prompts -> "
              f"{d['path']}")
    return 0
