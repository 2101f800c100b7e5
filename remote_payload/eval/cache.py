"""The hidden-state cache: a target's greedy completions plus its tapped features, one format.

reval layout (written by `extract` and `import-cache` through extract/writer.py):

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
                              "sampling": {...}, "sampled_agreement": {...}  # a sampled cache (eval/regime.py):
                              # per prompt "prompt", "sample", "sampled_agree", "logp_sha256"
    CACHE/p0000.safetensors   ids int64 [T]; features [T, n_layers, H] (dtype as written); a sampled cache's
                              logp fp32 [T - prompt_len] (log p of each completion token under the transform)

Seeds layout (the team's older caches, read directly or converted with `import-cache`):

    SRC/completions.json      [{"name", "prompt_len", "token_ids", "file"?}, ...]  (or {"completions": [...]})
                              aliases: token_ids | ids | tokens | full_ids; file | hs_file | hidden_states_file;
                              prompt_len | prompt_length | num_prompt_tokens. Without a file: `<name>.pt`,
                              else `<i>.pt`.
    SRC/<name>.pt             torch dict: aux_hidden [1, T, k*H] (the first k tapped layers), last_hidden [1, T, H]
    SRC/layers.json           optional sidecar {"layer_ids": [...]} (k+1 ids); or pass seeds_layer_ids / --layers

`open_cache` auto-detects the layout. `Cache.load` returns the requested layers concatenated in the
requested order, reading only those layers' slices from the reval layout.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from remote_payload.contract.errors import FeatureMismatchError, PayloadError
from remote_payload.contract.runstate import open_regular, read_regular
from remote_payload.eval.checkpoint import torch_load_cpu
from remote_payload.eval.regime import Regime, from_meta

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


def check_prompt(p: CachePrompt, where: str) -> None:
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

    @property
    def agreement(self) -> float | None:
        """The exactness figure of this cache's regime: the argmax agreement (greedy), or for a sampled cache the
        fraction of completion positions whose token has probability > 0 under the transform."""
        if self.regime is None:
            return self.argmax_agreement
        rec = self.meta.get("sampled_agreement")
        f = rec.get("fraction") if isinstance(rec, dict) else None
        return float(f) if isinstance(f, (int, float)) and not isinstance(f, bool) and 0 <= f <= 1 else None

    @property
    def regime(self) -> Regime | None:
        """How the completions were sampled (cache.json "sampling"); None: greedy."""
        return from_meta(self.meta, str(self.path / CACHE_JSON)) if self.layout == "reval" else None

    def sample_of(self, i: int) -> tuple[str, int]:
        """(the prompt's name, the sample index) of entry i; a greedy cache: (its name, 0)."""
        rec = self.meta["prompts"][i] if self.regime is not None else {}
        if "prompt" not in rec:
            return self.prompts[i].name, 0
        return str(rec["prompt"]), int(rec["sample"])

    def load_logp(self, i: int) -> torch.Tensor:
        """A sampled cache's entry i -> log p(y) [seq_len - prompt_len] fp32 (checked against cache.json)."""
        p = self.prompts[i]
        try:
            with safe_open(str(self.path / p.file), framework="pt") as st:
                logp = st.get_tensor("logp").float()
        except Exception as e:  # safetensors: no such tensor, a corrupt file
            raise PayloadError(f"cache {self.path}: prompt {p.name!r} has no readable log-probs in {p.file} "
                               f"({type(e).__name__}); re-extract it") from e
        want = self.meta["prompts"][i].get("logp_sha256")
        if logp.shape != (p.seq_len - p.prompt_len,) or hashlib.sha256(logp.numpy().tobytes()).hexdigest() != want:
            raise PayloadError(f"cache {self.path}: prompt {p.name!r}: its log-probs are not the ones cache.json "
                               "records (logp_sha256, one per completion token); re-extract it")
        return logp

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
                first = str(e).splitlines()[0] if str(e) else ""
                raise PayloadError(f"cache {self.path}: cannot read prompt {p.name!r} from {p.file} "
                                   f"({type(e).__name__}: {first}); re-extract") from e
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
        aux = d["aux_hidden"].reshape(-1, d["aux_hidden"].shape[-1])
        last = d["last_hidden"].reshape(-1, self.hidden_size)
        n_aux = len(self.layer_ids) - 1
        ids = torch.tensor(self.meta["ids"][i], dtype=torch.long)
        parts = [aux[:, j * self.hidden_size:(j + 1) * self.hidden_size] if j < n_aux else last for j in idx]
        return ids, parts


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
        check_prompt(p, f"cache {path}")
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
