"""Writing a reval-layout cache (the layout: eval/cache.py), atomically and resumably: `CacheWriter` keeps the
books, `write_prompt` writes one prompt's file (in this process, or in an `extract` worker process).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular
from remote_payload.eval.cache import CACHE_FORMAT, CACHE_JSON, CachePrompt, check_prompt
from remote_payload.extract.recipe import differences

PARTIAL_JSON = "partial.json"
_PROMPT_FIELDS = ("name", "prompt_len", "seq_len", "file")


def write_prompt(directory: str | os.PathLike, index: int, name: str, prompt_len: int, ids: torch.Tensor,
                 features: torch.Tensor, *, num_layers: int, hidden_size: int, info: dict | None = None,
                 where: str | None = None, tensors: dict | None = None) -> dict:
    """Prompt `index`'s file p{index:04d}.safetensors in `directory` (under a temporary name, then renamed), as
    `CacheWriter.add` writes it; returns the entry for `CacheWriter.record`. Also what an `extract` worker process
    runs, writing into the writer's work dir while the writer's process keeps the books. `info`: per-prompt
    fields (JSON values) that cache.json lists beside name, prompt_len, seq_len and file. `tensors`: more
    tensors of the file (a sampled cache's `logp`)."""
    directory = Path(directory)
    p = CachePrompt(name, int(prompt_len), int(ids.shape[0]), f"p{int(index):04d}.safetensors")
    check_prompt(p, where or f"cache {directory}")
    if features.shape != (p.seq_len, num_layers, hidden_size):
        raise ValueError(f"features {tuple(features.shape)} != {(p.seq_len, num_layers, hidden_size)}")
    if info and set(info) & set(_PROMPT_FIELDS):
        raise ValueError(f"info may not replace a prompt's own fields {sorted(set(info) & set(_PROMPT_FIELDS))}")
    part = directory / f"{p.file}.part"
    more = {k: v.detach().to("cpu").contiguous() for k, v in (tensors or {}).items()}
    if set(more) & {"ids", "features"}:
        raise ValueError("tensors may not replace ids or features")
    save_file({"ids": ids.detach().to("cpu", torch.long).contiguous(),
               "features": features.detach().to("cpu").contiguous(), **more}, str(part))
    os.replace(part, directory / p.file)
    entry = {**vars(p), "index": int(index), "bytes": (directory / p.file).stat().st_size,
             "dtype": str(features.dtype).removeprefix("torch.")}
    return {**entry, "info": dict(info)} if info else entry


class CacheWriter:
    """Writes a reval-layout cache atomically: prompts go into a work dir beside `out`, renamed to `out` once
    all are in, so `open_cache` never sees a half-written cache.

    with CacheWriter(out, layer_ids=[1, 2], hidden_size=64, target_path=..., ...) as w:
        w.add(name, prompt_len, ids, features, index=i)   # ids [T] int, features [T, n_layers, H]

    Resumable (`resume_key`, a digest of everything that decides the content: target, prompts, options): the
    work dir is `.OUT.partial`; each prompt file is written under a temporary name and renamed, then
    partial.json (rewritten atomically) lists it, so only complete files count as done. An interrupted writer
    keeps that dir; a new writer with the same key continues it (`done`: the finished prompt indices), one with
    another key refuses, naming the fields that differ when both were given the `recipe` the key digests
    (extract/recipe.py; partial.json keeps it). Without a key the work dir is a fresh temp dir, removed on any
    error.
    `metadata`: extra top-level fields for cache.json (e.g. {"prompt_format": {...}}); readers ignore them, and
    they may not replace the format's own fields. Put what they describe into `resume_key` too. Fields added to
    `meta` later are extra fields as well; partial.json keeps them all, and a resuming writer finds the
    interrupted one's in `resumed_metadata`.
    `add` = `write_prompt` (the file) + `record` (the books): another process may write the file into `tmp`.
    """

    def __init__(self, out: str | os.PathLike, *, layer_ids: list[int], hidden_size: int,
                 target_path: str | None = None, target_config_sha256: str | None = None,
                 tokenizer_path: str | None = None, resume_key: str | None = None,
                 metadata: dict | None = None, recipe: dict | None = None):
        self.out = Path(out)
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise PayloadError(f"--out {self.out} already exists; remove it or choose another directory")
        self.layer_ids, self.hidden_size = list(layer_ids), hidden_size
        self.meta = {"format": CACHE_FORMAT,
                     "target": {"path": target_path, "config_sha256": target_config_sha256},
                     "layer_ids": self.layer_ids, "hidden_size": hidden_size, "dtype": None,
                     "tokenizer": tokenizer_path, "prompts": [], "created_at": None}
        clash = sorted(set(metadata or {}) & set(self.meta))
        if clash:
            raise ValueError(f"metadata may not replace the cache format's fields {clash}")
        self.meta.update(metadata or {})
        self._own_fields = set(self.meta) - set(metadata or {})
        self.resume_key, self.recipe = resume_key, recipe
        self.partial = self.out.parent / f".{self.out.name}.partial"
        self.resumed_metadata: dict = {}
        self.done: dict[int, dict] = self._read_partial() if resume_key else {}
        self.tmp: Path | None = None

    def _read_partial(self) -> dict[int, dict]:
        """The prompts an interrupted writer finished (its partial.json is untrusted: checked field by field)."""
        state_path = self.partial / PARTIAL_JSON
        if not state_path.is_file():
            return {}
        where = f"interrupted cache {self.partial}"
        try:
            state = json.loads(read_regular(state_path))
            if state.get("key") != self.resume_key:
                raise PayloadError(f"{where} was started with other inputs ({self._what_differs(state)}); "
                                   f"re-run that command to finish it, or remove {self.partial} to start over")
            done = {}
            for e in state["prompts"]:
                entry = {"name": str(e["name"]), "prompt_len": int(e["prompt_len"]), "seq_len": int(e["seq_len"]),
                         "file": str(e["file"]), "index": int(e["index"]), "bytes": int(e["bytes"])}
                f = self.partial / entry["file"]
                if entry["file"] != f"p{entry['index']:04d}.safetensors" or not f.is_file() \
                        or f.stat().st_size != entry["bytes"]:
                    continue  # not what we wrote: done again
                if isinstance(e.get("info"), dict):
                    entry["info"] = {str(k): v for k, v in e["info"].items() if k not in entry}
                done[entry["index"]] = entry
            self.meta["dtype"] = state.get("dtype") if isinstance(state.get("dtype"), str) else None
            if isinstance(state.get("metadata"), dict):
                self.resumed_metadata = state["metadata"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PayloadError(f"{where}: {state_path} is unreadable ({e}); remove {self.partial} to start "
                               "over") from e
        return done

    def _what_differs(self, state: dict) -> str:
        """Which of the recipe's fields differ from the interrupted writer's (or, without both recipes, what
        the key covers)."""
        old = state.get("recipe")
        if isinstance(old, dict) and isinstance(self.recipe, dict):
            diff = differences(old, self.recipe)
            if diff:
                return "; ".join(diff[:4]) + (f"; {len(diff) - 4} more" if len(diff) > 4 else "")
        return "target, prompts, layers or options"

    def done_ids(self, index: int) -> torch.Tensor:
        """The token ids [T] of prompt `index`, finished by an interrupted writer (resume: a multi-turn extract
        needs the earlier turns' completions)."""
        f = self.partial / self.done[index]["file"]
        try:
            with safe_open(str(f), framework="pt") as st:
                return st.get_tensor("ids").long()
        except Exception as e:  # safetensors' errors: corrupt header, missing tensor
            raise PayloadError(f"interrupted cache {self.partial}: cannot read {f.name} ({type(e).__name__}); "
                               f"remove {self.partial} to start over") from e

    def __enter__(self) -> CacheWriter:  # noqa: PYI034 (typing.Self needs Python 3.11)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if self.resume_key:
            self.partial.mkdir(exist_ok=True)
            self.tmp = self.partial
            self._sweep()  # what a killed writer left half-written
        else:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self

    def add(self, name: str, prompt_len: int, ids: torch.Tensor, features: torch.Tensor,
            index: int | None = None, info: dict | None = None, tensors: dict | None = None) -> None:
        """One prompt (ids [T] int; features [T, n_layers, H]); `index` = its place in the cache (default:
        after the last one added); `info`: per-prompt fields for cache.json (write_prompt)."""
        n = (max(self.done) + 1 if self.done else 0) if index is None else int(index)
        self.record(write_prompt(self.tmp, n, name, prompt_len, ids, features, num_layers=len(self.layer_ids),
                                 hidden_size=self.hidden_size, info=info, where=f"cache {self.out}",
                                 tensors=tensors))

    def record(self, entry: dict) -> None:
        """The books for a prompt file `write_prompt` wrote into `tmp` (in this process or another)."""
        entry = dict(entry)
        self.meta["dtype"] = entry.pop("dtype")
        self.done[entry["index"]] = entry
        if self.resume_key:
            state = {"key": self.resume_key, "recipe": self.recipe, "dtype": self.meta["dtype"],
                     "metadata": {k: v for k, v in self.meta.items() if k not in self._own_fields},
                     "prompts": [self.done[i] for i in sorted(self.done)]}
            (self.tmp / f"{PARTIAL_JSON}.part").write_text(json.dumps(state))
            os.replace(self.tmp / f"{PARTIAL_JSON}.part", self.tmp / PARTIAL_JSON)

    def _sweep(self) -> None:
        """Everything in the work dir that the books do not list goes: the temporary files of a writer killed
        mid-file (`p0003.safetensors.part`, safetensors' own `.tmpXXXXXX`), a prompt file never recorded. The
        work dir is this writer's (`.OUT.partial` or its temp dir), so nothing in it belongs to anyone else; a
        cache holds exactly cache.json and its prompts' files. Never called while other processes write into it."""
        keep = {e["file"] for e in self.done.values()} | {PARTIAL_JSON}
        for f in self.tmp.iterdir():
            if f.name not in keep:
                if f.is_dir() and not f.is_symlink():
                    shutil.rmtree(f, ignore_errors=True)
                else:
                    f.unlink(missing_ok=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            if not (self.resume_key and self.done):
                shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if not self.done:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise PayloadError(f"cache {self.out}: no prompts were written; nothing was created")
        self.meta["prompts"] = [{**{k: self.done[i][k] for k in _PROMPT_FIELDS}, **self.done[i].get("info", {})}
                                for i in sorted(self.done)]
        self.meta["created_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (self.tmp / PARTIAL_JSON).unlink(missing_ok=True)
        self._sweep()
        (self.tmp / CACHE_JSON).write_text(json.dumps(self.meta, indent=1) + "\n")
        if self.out.exists():
            self.out.rmdir()  # empty (checked in __init__)
        os.replace(self.tmp, self.out)
