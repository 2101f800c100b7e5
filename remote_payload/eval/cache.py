"""The hidden-state cache: a target's greedy completions plus its tapped features, one format.

reval layout (written by `extract` and `import-cache`):

    CACHE/cache.json          {"format": "reval.cache/1", "target": {"path", "config_sha256"},
                               "layer_ids": [1, 16, ...],   # hs[l+1] = output of decoder block l
                               "hidden_size": H, "dtype": "bfloat16", "tokenizer": path | null,
                               "prompts": [{"name", "prompt_len", "seq_len", "file"}], "created_at",
                               "prompt_format": {...},   # optional: how `extract` formed the prompts
                                                          # (source, shape, chat_template, enable_thinking)
                               "generation": {...},      # optional: how `extract` generated the completions
                                                          # (generator, batch size, dtype, attention, versions)
                               "argmax_agreement": {"fraction", "matches", "positions"}}  # optional: exactness
                              # (the target's argmax over its own prefill = the cached next token, over every
                              # completion position; per prompt "argmax_agree": [matches, positions])
    CACHE/p0000.safetensors   ids int64 [T]; features [T, n_layers, H] (dtype as written)

Seeds layout (the team's older caches, read directly or converted with `import-cache`):

    SRC/completions.json      [{"name", "prompt_len", "token_ids", "file"?}, ...]  (or {"completions": [...]})
                              aliases: token_ids | ids | tokens | full_ids; file | hs_file | hidden_states_file;
                              prompt_len | prompt_length | num_prompt_tokens. Without a file: `<name>.pt`, else `<i>.pt`.
    SRC/<name>.pt             torch dict: aux_hidden [1, T, k*H] (the first k tapped layers), last_hidden [1, T, H]
    SRC/layers.json           optional sidecar {"layer_ids": [...]} (k+1 ids); or pass seeds_layer_ids / --layers

`open_cache` auto-detects the layout. `Cache.load` returns the requested layers concatenated in the
requested order, reading only those layers' slices from the reval layout.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from remote_payload.contract.errors import FeatureMismatchError, PayloadError
from remote_payload.contract.runstate import open_regular, read_regular
from remote_payload.eval.checkpoint import torch_load_cpu

CACHE_FORMAT = "reval.cache/1"
CACHE_JSON = "cache.json"
SEEDS_JSON = "completions.json"
SEEDS_LAYERS_JSON = "layers.json"
_IDS_KEYS = ("token_ids", "ids", "tokens", "full_ids")
_FILE_KEYS = ("file", "hs_file", "hidden_states_file")
_PROMPT_LEN_KEYS = ("prompt_len", "prompt_length", "num_prompt_tokens")


@dataclass
class CachePrompt:
    name: str
    prompt_len: int
    seq_len: int
    file: str


@dataclass
class FeatureStats:
    mean: float
    std: float


def parse_layer_ids(text: str) -> list[int]:
    """'1,16,31' -> [1, 16, 31]; PayloadError on anything else."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PayloadError(f"--layers {text!r}: expected comma-separated layer ids, e.g. --layers 1,16,31,46,61")
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise PayloadError(f"--layers {text!r}: need distinct non-negative layer ids, e.g. --layers 1,16,31,46,61")
    return ids


def _first(entry: dict, keys: tuple[str, ...], what: str, where: str):
    for k in keys:
        if k in entry:
            return entry[k]
    raise PayloadError(f"{where}: entry has no {what} (expected one of {', '.join(keys)})")


def _read_json(path: Path):
    if not path.is_file():
        raise PayloadError(f"cache: {path} is missing; point --cache at a directory written by `extract`")
    try:
        return json.loads(read_regular(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PayloadError(f"cache: {path} is not valid JSON ({e}); re-extract or fix the file") from e


def _torch_load(f: Path):
    """A seeds .pt (checkpoint.torch_load_cpu), its read errors as one-line PayloadErrors."""
    try:
        return torch_load_cpu(f)
    except RuntimeError as e:
        raise PayloadError(f"seeds cache: cannot read {f} ({str(e).splitlines()[0]}); re-save it with torch.save")


def _check_prompt(p: CachePrompt, where: str) -> None:
    if not (0 < p.prompt_len < p.seq_len):
        raise PayloadError(f"{where}: prompt {p.name!r} has prompt_len {p.prompt_len} and seq_len {p.seq_len}; "
                           "need 0 < prompt_len < seq_len (no completion?) — re-extract it")


class Cache:
    """A cache directory opened for reading (either layout). Features stay on disk until `load`."""

    @property
    def argmax_agreement(self) -> float | None:
        """The fraction of completion positions where the target's argmax over its own prefill is the cached next
        token, as `extract` recorded it (1.0: tokens and hidden states agree exactly); None: not recorded."""
        rec = self.meta.get("argmax_agreement") if isinstance(self.meta, dict) else None
        f = rec.get("fraction") if isinstance(rec, dict) else None
        return float(f) if isinstance(f, (int, float)) and not isinstance(f, bool) and 0 <= f <= 1 else None

    def __init__(self, path: Path, layout: str, layer_ids: list[int], hidden_size: int,
                 prompts: list[CachePrompt], meta: dict):
        self.path, self.layout = path, layout
        self.layer_ids, self.hidden_size, self.prompts, self.meta = layer_ids, hidden_size, prompts, meta
        self.dtype = meta.get("dtype")
        self.tokenizer = meta.get("tokenizer")
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def fingerprint(self) -> str:
        """sha256 over the index json, the layer ids and each data file's size + first 64 KiB (headers)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(read_regular(self.path / (CACHE_JSON if self.layout == "reval" else SEEDS_JSON)))
            h.update(json.dumps(self.layer_ids).encode())
            for p in self.prompts:
                f = self.path / p.file
                h.update(f"{p.file}:{f.stat().st_size}".encode())
                with open_regular(f) as fh:
                    h.update(fh.read(1 << 16))
            self._fingerprint = "sha256:" + h.hexdigest()
        return self._fingerprint

    def _indices(self, layer_ids: list[int] | None) -> list[int]:
        wanted = self.layer_ids if layer_ids is None else list(layer_ids)
        if not wanted:
            raise FeatureMismatchError(f"cache {self.path}: no layers requested; pick from {self.layer_ids}")
        missing = [l for l in wanted if l not in self.layer_ids]
        if missing:
            raise FeatureMismatchError(
                f"cache {self.path} holds layers {self.layer_ids}; layers {missing} of {wanted} were requested. "
                f"Re-extract with --layers {','.join(str(l) for l in sorted(set(self.layer_ids) | set(wanted)))}")
        return [self.layer_ids.index(l) for l in wanted]

    def load(self, i: int, *, layer_ids: list[int] | None = None, device: str | torch.device = "cpu",
             dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt i -> (ids LongTensor [T], feats [T, len(layer_ids) * H]) in the requested layer order."""
        idx = self._indices(layer_ids)
        p = self.prompts[i]
        f = self.path / p.file
        if not f.is_file():
            raise PayloadError(f"cache {self.path}: prompt {p.name!r} file {p.file} is missing; re-extract")
        if self.layout == "reval":
            try:
                ids, parts = self._load_reval(f, idx)
            except Exception as e:  # safetensors' errors: corrupt header, missing tensor, truncated file
                raise PayloadError(f"cache {self.path}: cannot read prompt {p.name!r} from {p.file} "
                                   f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); re-extract") from e
        else:
            ids, parts = self._load_seeds(i, f, idx)
        if ids.shape[0] != p.seq_len or any(x.shape != (p.seq_len, self.hidden_size) for x in parts):
            raise PayloadError(f"cache {self.path}: prompt {p.name!r} has ids {tuple(ids.shape)} / features "
                               f"{[tuple(x.shape) for x in parts]}, expected T={p.seq_len}, H={self.hidden_size}")
        for j, x in zip(idx, parts):
            if not torch.isfinite(x).all():
                raise PayloadError(f"cache {self.path}: prompt {p.name!r} layer {self.layer_ids[j]} has NaN/inf "
                                   "features; re-extract it (check the target's dtype)")
        feats = torch.cat(parts, dim=-1)  # [T, n*H]
        return ids.to(device), feats.to(device=device, dtype=dtype or feats.dtype)

    def _load_reval(self, f: Path, idx: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with safe_open(str(f), framework="pt") as st:
            ids = st.get_tensor("ids").long()
            sl = st.get_slice("features")
            if idx == list(range(idx[0], idx[-1] + 1)):  # contiguous run: one read
                x = sl[:, idx[0]:idx[-1] + 1, :]
                return ids, list(x.unbind(1))
            return ids, [sl[:, j:j + 1, :][:, 0] for j in idx]

    def _load_seeds(self, i: int, f: Path, idx: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        d = _torch_load(f)
        if not isinstance(d, dict) or "aux_hidden" not in d or "last_hidden" not in d:
            raise PayloadError(f"seeds cache: {f} must hold a dict with aux_hidden and last_hidden")
        aux, last = d["aux_hidden"].reshape(-1, d["aux_hidden"].shape[-1]), d["last_hidden"].reshape(-1, self.hidden_size)
        n_aux = len(self.layer_ids) - 1
        ids = torch.tensor(self.meta["ids"][i], dtype=torch.long)
        parts = [aux[:, j * self.hidden_size:(j + 1) * self.hidden_size] if j < n_aux else last for j in idx]
        return ids, parts

    def stats(self, i: int) -> FeatureStats:
        """Mean/std over all cached features of prompt i (the log's aux_mean= aux_std=)."""
        _, x = self.load(i)
        x = x.float()
        return FeatureStats(mean=x.mean().item(), std=x.std().item())


def open_cache(path: str | os.PathLike, *, seeds_layer_ids: list[int] | None = None) -> Cache:
    """Open a cache directory of either layout (auto-detected); validates the index, not the features."""
    path = Path(path)
    if not path.is_dir():
        raise PayloadError(f"cache: {path} is not a directory; pass the directory written by `extract`")
    if (path / CACHE_JSON).exists():
        cache = _open_reval(path)
    elif (path / SEEDS_JSON).exists():
        cache = _open_seeds(path, seeds_layer_ids)
    else:
        raise PayloadError(f"cache: {path} has neither {CACHE_JSON} nor {SEEDS_JSON}; "
                           "create one with `python -m remote_payload extract`")
    if not cache.prompts:
        raise PayloadError(f"cache: {path} holds no prompts; re-extract with a non-empty prompt file")
    for p in cache.prompts:
        _check_prompt(p, f"cache {path}")
        if not (path / p.file).is_file():
            raise PayloadError(f"cache {path}: prompt {p.name!r} file {p.file} is missing; re-extract")
    return cache


def _open_reval(path: Path) -> Cache:
    meta = _read_json(path / CACHE_JSON)
    where = str(path / CACHE_JSON)
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT:
        raise PayloadError(f"{where}: format {meta.get('format') if isinstance(meta, dict) else None!r} "
                           f"is not {CACHE_FORMAT!r}; re-extract with this payload")
    try:
        prompts = [CachePrompt(str(p["name"]), int(p["prompt_len"]), int(p["seq_len"]), str(p["file"]))
                   for p in meta["prompts"]]
        layer_ids, hidden_size = [int(x) for x in meta["layer_ids"]], int(meta["hidden_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise PayloadError(f"{where}: missing or malformed field ({e!r}); re-extract") from e
    return Cache(path, "reval", layer_ids, hidden_size, prompts, meta)


def _open_seeds(path: Path, layer_ids: list[int] | None) -> Cache:
    where = str(path / SEEDS_JSON)
    raw = _read_json(path / SEEDS_JSON)
    entries = raw.get("completions") if isinstance(raw, dict) else raw
    if not isinstance(entries, list):
        raise PayloadError(f"{where}: expected a list of completions (or {{\"completions\": [...]}})")
    if layer_ids is None:
        side = path / SEEDS_LAYERS_JSON
        if not side.exists():
            raise PayloadError(f"seeds cache {path}: which layers are cached is unknown; pass --layers 1,16,31,46,61 "
                               f"(first k = aux_hidden, last = last_hidden) or write {side}")
        layer_ids = [int(x) for x in _read_json(side)["layer_ids"]]
    if len(layer_ids) < 2:
        raise PayloadError(f"seeds cache {path}: need >= 2 layer ids (aux layers + the last), got {layer_ids}")
    prompts, all_ids = [], []
    for i, e in enumerate(entries):
        name = str(e.get("name", f"prompt-{i:03d}"))
        ids = [int(t) for t in _first(e, _IDS_KEYS, "token ids", where)]
        file = next((e[k] for k in _FILE_KEYS if k in e), None)
        if file is None:
            file = f"{name}.pt" if (path / f"{name}.pt").exists() else f"{i}.pt"
        prompts.append(CachePrompt(name, int(_first(e, _PROMPT_LEN_KEYS, "prompt length", where)), len(ids), file))
        all_ids.append(ids)
    hidden_size = 0
    if prompts and (path / prompts[0].file).is_file():
        d = _torch_load(path / prompts[0].file)
        hidden_size = int(d["last_hidden"].shape[-1])
        if d["aux_hidden"].shape[-1] != (len(layer_ids) - 1) * hidden_size:
            raise PayloadError(f"seeds cache {path}: aux_hidden has {d['aux_hidden'].shape[-1]} features = "
                               f"{d['aux_hidden'].shape[-1] / hidden_size:g} layers of {hidden_size}, but layer ids "
                               f"{layer_ids} say {len(layer_ids) - 1} aux layers + 1 last; fix --layers")
    meta = {"dtype": None, "tokenizer": None, "ids": all_ids}
    return Cache(path, "seeds", layer_ids, hidden_size, prompts, meta)


PARTIAL_JSON = "partial.json"
_PROMPT_FIELDS = ("name", "prompt_len", "seq_len", "file")


def write_prompt(directory: str | os.PathLike, index: int, name: str, prompt_len: int, ids: torch.Tensor,
                 features: torch.Tensor, *, num_layers: int, hidden_size: int, info: dict | None = None,
                 where: str | None = None) -> dict:
    """Prompt `index`'s file p{index:04d}.safetensors in `directory` (under a temporary name, then renamed), as
    `CacheWriter.add` writes it; returns the entry for `CacheWriter.record`. Also what an `extract` worker process
    runs, writing into the writer's work dir while the writer's process keeps the books. `info`: per-prompt
    fields (JSON values) that cache.json lists beside name, prompt_len, seq_len and file."""
    directory = Path(directory)
    p = CachePrompt(name, int(prompt_len), int(ids.shape[0]), f"p{int(index):04d}.safetensors")
    _check_prompt(p, where or f"cache {directory}")
    if features.shape != (p.seq_len, num_layers, hidden_size):
        raise ValueError(f"features {tuple(features.shape)} != {(p.seq_len, num_layers, hidden_size)}")
    if info and set(info) & set(_PROMPT_FIELDS):
        raise ValueError(f"info may not replace a prompt's own fields {sorted(set(info) & set(_PROMPT_FIELDS))}")
    part = directory / f"{p.file}.part"
    save_file({"ids": ids.detach().to("cpu", torch.long).contiguous(),
               "features": features.detach().to("cpu").contiguous()}, str(part))
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
    another key refuses. Without a key the work dir is a fresh temp dir, removed on any error.
    `metadata`: extra top-level fields for cache.json (e.g. {"prompt_format": {...}}); readers ignore them, and
    they may not replace the format's own fields. Put what they describe into `resume_key` too. Fields added to
    `meta` later are extra fields as well; partial.json keeps them all, and a resuming writer finds the
    interrupted one's in `resumed_metadata`.
    `add` = `write_prompt` (the file) + `record` (the books): another process may write the file into `tmp`.
    """

    def __init__(self, out: str | os.PathLike, *, layer_ids: list[int], hidden_size: int,
                 target_path: str | None = None, target_config_sha256: str | None = None,
                 tokenizer_path: str | None = None, resume_key: str | None = None,
                 metadata: dict | None = None):
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
        self.resume_key = resume_key
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
                raise PayloadError(f"{where} was started with other inputs (target, prompts, layers or options); "
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
            index: int | None = None, info: dict | None = None) -> None:
        """One prompt (ids [T] int; features [T, n_layers, H]); `index` = its place in the cache (default:
        after the last one added); `info`: per-prompt fields for cache.json (write_prompt)."""
        n = (max(self.done) + 1 if self.done else 0) if index is None else int(index)
        self.record(write_prompt(self.tmp, n, name, prompt_len, ids, features, num_layers=len(self.layer_ids),
                                 hidden_size=self.hidden_size, info=info, where=f"cache {self.out}"))

    def record(self, entry: dict) -> None:
        """The books for a prompt file `write_prompt` wrote into `tmp` (in this process or another)."""
        entry = dict(entry)
        self.meta["dtype"] = entry.pop("dtype")
        self.done[entry["index"]] = entry
        if self.resume_key:
            state = {"key": self.resume_key, "dtype": self.meta["dtype"],
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


def import_seeds(src: str | os.PathLike, out: str | os.PathLike, layer_ids: list[int] | None = None,
                 log=print) -> Cache:
    """Convert a seeds-layout cache to the reval layout; returns the new cache."""
    cache = open_cache(src, seeds_layer_ids=layer_ids)
    if cache.layout != "seeds":
        raise PayloadError(f"import-cache: {src} is already a reval cache ({CACHE_JSON}); use it directly")
    with CacheWriter(out, layer_ids=cache.layer_ids, hidden_size=cache.hidden_size) as w:
        for i, p in enumerate(cache.prompts):
            ids, feats = cache.load(i)  # [T], [T, n*H]
            w.add(p.name, p.prompt_len, ids, feats.view(p.seq_len, len(cache.layer_ids), cache.hidden_size))
            log(f"[{i + 1}/{len(cache)}] {p.name}: {p.seq_len} tokens")
    return open_cache(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="seeds-layout cache directory (completions.json + <name>.pt)")
    p.add_argument("--out", required=True, help="new reval-layout cache directory")
    p.add_argument("--layers", help="tapped layer ids, aux layers then the last, e.g. 1,16,31,46,61 "
                                    f"(default: SRC/{SEEDS_LAYERS_JSON})")


def main(args: argparse.Namespace) -> int:
    try:
        layer_ids = parse_layer_ids(args.layers) if args.layers else None
        c = import_seeds(args.src, args.out, layer_ids)
    except PayloadError as e:
        print(f"error: {e}")
        return e.exit_code
    print(f"imported {len(c)} prompts, layers {c.layer_ids}, H={c.hidden_size} -> {c.path}")
    return 0

