"""Strict loading of drafters and of the target's embedding/lm_head, plus drafter/cache feature checks.

The seeds' worst bug was a key that did not resolve being skipped silently (zero accuracy after "Loaded").
Here every parameter is loaded exactly once with the right shape, or a `CheckpointError` names the key,
the file and the closest keys that do exist. Nothing is evaluated after an error.

Drafter layouts (`load_drafter`):
(a) z-lab folder: config.json + model.safetensors, or model-0000x-of-0000y.safetensors listed in
    model.safetensors.index.json; bare keys (fc.weight, hidden_norm.weight, norm.weight, layers.i.*).
    A single .safetensors file with config.json beside it is read the same way.
(b) team .pt/.pth file (torch.load weights_only=True): a state dict, bare or wrapped as {"model": sd} or
    {"state_dict": sd}; the prefixes "module." then "drafter." are stripped, each only when EVERY key has it.
    Config: the file's "config" entry, else config.json next to the file.
    fc_layer_ids rule: the config's `fc_layer_ids` if present; else, if fc.weight is [H, k*H] with
    k < len(target_layer_ids), the FIRST k target layers (the team's 4-of-5 layout); else all of them.
Weight names other engines load (vLLM's DFlash mapper): `midlayer.*` is `layers.0.*` (EAGLE-style one-layer
heads), `encoder.fc.*` is `fc.*`, `encoder.output_norm_enc.*` is `hidden_norm.*`; a renamed key that collides
with one already there is an error. Extra tensors (`attention_sink_bias`, `d2t`, `lm_head`, `embed_tokens`,
domino's `prefix_gru.*`, ...) fail the strict key check: reval implements none of them.
`mask_embedding.pt` beside config.json (vLLM's convention): a tensor of hidden_size values, or
{"mask_token_id": id, "embedding": tensor} whose id must be the config's; it replaces the embedding of
`mask_token_id` in the drafted block. Its bytes are part of the content hash; it is read as every other input
is (a regular file, bounded in size: a FIFO or a device there is exit 3, never a hang).
"""
from __future__ import annotations

import contextlib
import difflib
import io
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from remote_payload.contract.contenthash import (
    INDEX_JSON,
    MASK_EMBEDDING,
    SINGLE_SAFETENSORS,
    content_files,
    parse_step,
    sha256_files,
)
from remote_payload.contract.drafterconfig import DrafterConfig
from remote_payload.contract.errors import CheckpointError, ConfigError
from remote_payload.contract.runstate import TooLarge, read_limited, read_regular
from remote_payload.eval.drafter import DFlashDrafter, TargetHead
from remote_payload.eval.safetensors_io import NOTHING_DONE, read_header, read_tensors

STRIPPED_PREFIXES = ("module.", "drafter.")
PT_WRAPPERS = ("model", "state_dict")
EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "language_model.model.embed_tokens.weight")
LM_HEAD_KEYS = ("lm_head.weight", "model.language_model.lm_head.weight", "language_model.lm_head.weight")
STATS_KEYS = ("fc.weight", "hidden_norm.weight", "norm.weight")
# other engines' names for the same tensors (vLLM DFlashQwen3Model.hf_to_vllm_mapper): old prefix -> ours
RENAMED_PREFIXES = (("midlayer.", "layers.0."), ("encoder.output_norm_enc.", "hidden_norm."), ("encoder.fc.", "fc."))


@dataclass
class DrafterInfo:
    path: str
    layout: str  # "zlab" | "pt"
    name: str
    step: int | None
    content_hash: str  # "sha256-64MiB-tree:<hex>" over config + weight files (contenthash.content_files)
    num_parameters: int
    weight_stats: dict  # key -> {"mean", "std"} for fc / hidden_norm / norm
    config_source: str
    weight_files: list[str] = field(default_factory=list)
    stripped_prefix: str = ""
    fc_layer_ids: list[int] = field(default_factory=list)
    renamed: list[str] = field(default_factory=list)  # "midlayer. -> layers.0." for each rule that applied
    mask_embedding: str | None = None  # the mask_embedding.pt file honoured


@dataclass
class HeadInfo:
    source: str  # the index file (or the single model.safetensors)
    embed_key: str
    embed_file: str
    lm_head_key: str | None  # None when tied
    lm_head_file: str | None
    tied: bool
    vocab_size: int
    hidden_size: int


# ---- small helpers ------------------------------------------------------------------------------
def _closest(key: str, keys, n: int = 3) -> str:
    keys = list(keys)
    close = difflib.get_close_matches(key, keys, n=n, cutoff=0.5) or difflib.get_close_matches(key, keys, n=n,
                                                                                                cutoff=0.0)
    return ", ".join(repr(k) for k in close) if close else "(the file has no keys)"


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(read_regular(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from e


def hash_in_background(paths: list[Path]) -> Future:
    """The content hash reads every byte once more; it runs beside the load instead of after it."""
    ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reval-hash")
    fut = ex.submit(sha256_files, list(paths))
    ex.shutdown(wait=False)
    return fut


def check_keys(expected: dict[str, tuple], found: dict[str, tuple], source: str, *, what: str, described: str,
               needed_by: str, optional=(), shape_hint=lambda key: "") -> None:
    """The one strict-keys rule of every drafter family: each key of `expected` (all but `optional`) is in `found`
    with its exact shape, and nothing else is; else a CheckpointError naming the first offender and the closest
    names there are (`what` needs a key; the `described` model has no such key; `needed_by` fixes a shape,
    `shape_hint(key)` says why)."""
    missing = [k for k in expected if k not in found and k not in optional]
    unexpected = [k for k in found if k not in expected]
    if missing:
        more = f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""
        raise CheckpointError(f"{what} needs {missing[0]!r} but {source} has no such key{more}. "
                              f"Closest: {_closest(missing[0], found)}. {NOTHING_DONE}")
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{source} has {unexpected[0]!r}{more}, which the {described} does not have. "
                              f"Closest: {_closest(unexpected[0], expected)}. {NOTHING_DONE}")
    for k, shape in expected.items():
        if k in found and tuple(found[k]) != tuple(shape):
            raise CheckpointError(f"{source}: {k!r} has shape {list(found[k])} but {needed_by} needs "
                                  f"{list(shape)}{shape_hint(k)}. {NOTHING_DONE}")


def _check_keys(expected: dict[str, tuple], found: dict[str, tuple], source: str, cfg: DrafterConfig,
                cfg_source: str) -> None:
    def hint(k: str) -> str:
        return (f" (fc.weight is [hidden_size, n_layers*hidden_size]; {cfg_source} says fc_layer_ids="
                f"{cfg.fc_layer_ids}, hidden_size={cfg.hidden_size})") if k == "fc.weight" else ""
    check_keys(expected, found, source, what="drafter", needed_by=cfg_source, shape_hint=hint,
               described=f"drafter described by {cfg_source} ({cfg.num_hidden_layers} layers)")


def _strip_prefixes(sd: dict) -> tuple[dict, str]:
    stripped = ""
    for prefix in STRIPPED_PREFIXES:
        if sd and all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix):]: v for k, v in sd.items()}
            stripped += prefix
    return sd, stripped


def canonical_names(keys, source: str, rules=RENAMED_PREFIXES, whose: str = "the drafter's"
                    ) -> tuple[dict[str, str], list[str]]:
    """{key as stored: our name} under `rules` ((stored prefix, ours), first match wins; the DFlash drafter's
    RENAMED_PREFIXES by default, the EAGLE-3 loader passes its own), and the rules that applied; a key renamed
    onto another one is a CheckpointError (two tensors for one parameter of `whose`)."""
    out, used, by = {}, [], {}
    for k in keys:
        new = k
        for old, ours in rules:
            if k.startswith(old):
                new = ours + k[len(old):]
                rule = f"{old} -> {ours}"
                if rule not in used:
                    used.append(rule)
                by[k] = (old, ours)
                break
        out[k] = new
    clash = sorted({v for v in out.values() if list(out.values()).count(v) > 1})
    if clash:
        both = [k for k, v in out.items() if v == clash[0]]
        old, ours = next((by[k] for k in both if k in by), rules[0])
        raise CheckpointError(f"{source} holds {both[0]!r} and {both[1]!r}, two tensors for {whose} "
                              f"{clash[0]!r} (vLLM reads {old!r} as {ours!r}). {NOTHING_DONE}")
    return out, used


MASK_EMBEDDING_OVERHEAD = 64 << 10  # torch.save's zip of one tensor or a two-key dict: ~1-2 KiB beside the values


def read_mask_embedding(folder: Path, cfg: DrafterConfig, device, dtype) -> tuple[Tensor | None, str | None]:
    """`mask_embedding.pt` beside the config (module doc) -> ([H] tensor, its path), or (None, None)."""
    f = folder / MASK_EMBEDDING
    if not (f.exists() or f.is_symlink()):
        return None, None
    limit = MASK_EMBEDDING_OVERHEAD + 8 * cfg.hidden_size  # fp64 values and the zip's bookkeeping
    try:  # through the regular-file check every reader uses: a FIFO hung torch.load, /dev/zero never ended it
        raw = read_limited(f, limit)
    except (OSError, TooLarge) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CheckpointError(f"cannot read {f}: {why} (a mask embedding is a torch file of {cfg.hidden_size} "
                              f"floats); replace it or remove it. {NOTHING_DONE}") from None
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read {f} as a weights-only torch file: {first}. {NOTHING_DONE}") from e
    if isinstance(obj, dict):
        mid = obj.get("mask_token_id", cfg.mask_token_id)
        if isinstance(mid, Tensor) and mid.numel() == 1:
            mid = int(mid.item())
        if mid != cfg.mask_token_id or isinstance(mid, bool):
            raise CheckpointError(f"{f} is for mask_token_id {mid!r} but the drafter's config says "
                                  f"{cfg.mask_token_id}: it belongs to another checkpoint. {NOTHING_DONE}")
        unknown = sorted(set(obj) - {"mask_token_id", "embedding"})
        if unknown or "embedding" not in obj:
            raise CheckpointError(f"{f} must hold a tensor or {{'mask_token_id', 'embedding'}}; it has "
                                  f"{sorted(map(str, obj))}. {NOTHING_DONE}")
        obj = obj["embedding"]
    if not isinstance(obj, Tensor) or not obj.is_floating_point() or obj.numel() != cfg.hidden_size:
        what = f"{list(obj.shape)} {obj.dtype}" if isinstance(obj, Tensor) else type(obj).__name__
        raise CheckpointError(f"{f} holds {what}; the mask embedding must be {cfg.hidden_size} floats "
                              f"(hidden_size). {NOTHING_DONE}")
    if not bool(torch.isfinite(obj).all()):
        raise CheckpointError(f"{f} holds NaN or infinite values. {NOTHING_DONE}")
    return obj.reshape(-1).to(device=device, dtype=dtype), str(f)


def _build(cfg: DrafterConfig, sd: dict[str, Tensor]) -> DFlashDrafter:
    """Parameters are the loaded tensors themselves (meta init + assign): no second copy."""
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval().requires_grad_(False).fuse_projections()


def _expected_shapes(cfg: DrafterConfig) -> dict[str, tuple]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in DFlashDrafter(cfg).state_dict().items()}


def _stats(sd: dict[str, Tensor]) -> dict:
    out = {}
    for k in STATS_KEYS:
        std, mean = torch.std_mean(sd[k].float())
        out[k] = {"mean": round(float(mean), 6), "std": round(float(std), 6)}
    return out


# ---- drafters -----------------------------------------------------------------------------------
def peek_config(path, allow_unknown=()) -> DrafterConfig | None:
    """The drafter's config without its weights, when the layout keeps it in a config.json (z-lab folder or
    .safetensors file); None for the .pt layout, whose config may live inside the file."""
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p.parent / "config.json" if p.suffix == ".safetensors" else None
    if cfg_path is None or not cfg_path.exists():
        return None
    return DrafterConfig.from_dict(_read_json(cfg_path, "drafter config"), source=str(cfg_path),
                                   allow_unknown=allow_unknown)


def load_drafter(path, *, device="cpu", dtype=torch.float32,
                 allow_unknown=()) -> tuple[DFlashDrafter, DrafterInfo]:
    """Load a drafter strictly (layouts in the module doc). Raises a PayloadError subclass on bad input."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"drafter checkpoint {p} does not exist: pass a z-lab folder (config.json + "
                              f"*.safetensors) or a .pt file")
    if p.is_dir():
        return _load_zlab(p, p / "config.json", device, dtype, allow_unknown)
    if p.suffix == ".safetensors":
        return _load_zlab(p, p.parent / "config.json", device, dtype, allow_unknown)
    if p.suffix in (".pt", ".pth", ".bin"):
        return _load_pt(p, device, dtype, allow_unknown)
    raise CheckpointError(f"drafter checkpoint {p}: unknown file type {p.suffix!r}; expected a folder, "
                          f".safetensors or .pt")


def _load_zlab(p: Path, cfg_path: Path, device, dtype, allow_unknown=()) -> tuple[DFlashDrafter, DrafterInfo]:
    folder = p if p.is_dir() else p.parent
    if not cfg_path.exists():
        pts = sorted(x.name for x in folder.glob("*.pt"))
        hint = f"; for the .pt layout pass the file itself ({pts[0]})" if pts else ""
        raise ConfigError(f"drafter {p} has no {cfg_path.name} next to its weights{hint}")
    cfg = DrafterConfig.from_dict(_read_json(cfg_path, "drafter config"), source=str(cfg_path),
                                  allow_unknown=allow_unknown)
    if p.is_file():
        key_file = None
        files = [p]
    elif (folder / INDEX_JSON).exists():
        weight_map = _read_json(folder / INDEX_JSON, "index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{folder / INDEX_JSON} has no 'weight_map'. {NOTHING_DONE}")
        key_file = {k: folder / v for k, v in weight_map.items()}
        files = sorted(set(key_file.values()))
    elif (folder / SINGLE_SAFETENSORS).exists():
        key_file = None
        files = [folder / SINGLE_SAFETENSORS]
    else:
        present = ", ".join(sorted(x.name for x in folder.iterdir())[:8]) or "nothing"
        raise CheckpointError(f"drafter folder {folder} has neither {INDEX_JSON} nor {SINGLE_SAFETENSORS} "
                              f"(it holds: {present})")
    headers = {f: read_header(f) for f in files}
    content_hash = hash_in_background(content_files(p))  # config + weights: the sweep's ledger names it so
    found: dict[str, tuple] = {}
    owner: dict[str, Path] = {}
    for f, h in headers.items():
        for k, entry in h.tensors.items():
            if key_file is not None and key_file.get(k) != f:
                continue  # a key the index places elsewhere (or not at all) is not read from this shard
            found[k] = entry.shape
            owner[k] = f
    if key_file is not None:
        for k, f in key_file.items():
            if k not in found:
                raise CheckpointError(f"{folder / INDEX_JSON} maps {k!r} to {f.name}, which has no such key. "
                                      f"Closest: {_closest(k, headers[f].tensors)}. {NOTHING_DONE}")
    source = str(files[0]) if len(files) == 1 else f"{folder / INDEX_JSON} (+{len(files)} shards)"
    names, renamed = canonical_names(found, source)
    _check_keys(_expected_shapes(cfg), {names[k]: v for k, v in found.items()}, source, cfg, str(cfg_path))
    mask_emb, mask_file = read_mask_embedding(folder, cfg, device, dtype)
    sd = {}
    for f, h in headers.items():
        got = read_tensors(h, [k for k, o in owner.items() if o == f], device=device, dtype=dtype)
        sd.update({names[k]: v for k, v in got.items()})
    model = _build(cfg, sd)
    model.mask_embedding = mask_emb
    info = DrafterInfo(
        path=str(p), layout="zlab", name=p.stem if p.is_file() and p.stem != "model" else folder.name,
        step=parse_step(p),
        content_hash=content_hash.result(), num_parameters=sum(t.numel() for t in sd.values()),
        weight_stats=_stats(sd), config_source=str(cfg_path), weight_files=[str(f) for f in files],
        fc_layer_ids=list(cfg.fc_layer_ids), renamed=renamed, mask_embedding=mask_file)
    return model, info


def torch_load_cpu(p: Path):
    """A weights-only torch file on the CPU, memory-mapped when it is in the zip format (legacy files are
    read whole). Other errors propagate: callers say which file and what to do."""
    try:
        return torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):  # legacy (non-zip) format cannot be memory-mapped: read it whole
            raise
        return torch.load(p, map_location="cpu", weights_only=True)


def _load_pt(p: Path, device, dtype, allow_unknown=()) -> tuple[DFlashDrafter, DrafterInfo]:
    content_hash = hash_in_background([p])
    try:
        obj = torch_load_cpu(p)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read {p} as a weights-only torch checkpoint: {first}. Save it with plain "
                              f"tensors/dicts (torch.save({{'model': state_dict, 'config': cfg}})). "
                              f"{NOTHING_DONE}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{p} holds a {type(obj).__name__}, not a state dict. {NOTHING_DONE}")
    wrapper = next((w for w in PT_WRAPPERS if isinstance(obj.get(w), dict)), None)
    sd = obj[wrapper] if wrapper else {k: v for k, v in obj.items() if isinstance(v, Tensor)}
    sd, stripped = _strip_prefixes(sd)
    names, renamed = canonical_names(sd, str(p))
    sd = {names[k]: v for k, v in sd.items()}
    bad = [k for k, v in sd.items() if not isinstance(v, Tensor)]
    if bad:
        raise CheckpointError(f"{p}: entry {bad[0]!r} of the state dict is not a tensor. {NOTHING_DONE}")

    if isinstance(obj.get("config"), dict):
        raw_cfg, cfg_source = obj["config"], f"{p} ['config']"
    elif (p.parent / "config.json").exists():
        raw_cfg, cfg_source = _read_json(p.parent / "config.json", "drafter config"), str(p.parent / "config.json")
    else:
        raise ConfigError(f"{p} has no 'config' entry and there is no config.json next to it: put the drafter's "
                          f"config.json in {p.parent}")
    cfg = DrafterConfig.from_dict(raw_cfg, source=cfg_source, allow_unknown=allow_unknown)
    if (p.parent / MASK_EMBEDDING).exists() and p.name != MASK_EMBEDDING:
        raise CheckpointError(f"{p.parent / MASK_EMBEDDING} lies beside the .pt drafter {p.name}: reval honours a "
                              f"mask embedding in a z-lab folder (config.json + safetensors) only; move the "
                              f"drafter into such a folder, or the file away. {NOTHING_DONE}")
    fc = sd.get("fc.weight")
    if "fc_layer_ids" not in raw_cfg and fc is not None and fc.dim() == 2 and fc.shape[0] == cfg.hidden_size:
        k, rem = divmod(fc.shape[1], cfg.hidden_size)
        if rem == 0 and 0 < k < len(cfg.target_layer_ids):
            cfg.fc_layer_ids = cfg.target_layer_ids[:k]  # documented rule: the first k tapped layers

    _check_keys(_expected_shapes(cfg), {k: tuple(v.shape) for k, v in sd.items()}, str(p), cfg, cfg_source)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}  # one copy out of the mmap
    model = _build(cfg, sd)
    generic = p.stem in ("model", "pytorch_model", "drafter", "state_dict", "checkpoint", "weights")
    info = DrafterInfo(
        path=str(p), layout="pt", name=p.parent.name if generic else p.stem, step=parse_step(p, obj.get("step")),
        content_hash=content_hash.result(), num_parameters=sum(t.numel() for t in sd.values()),
        weight_stats=_stats(sd), config_source=cfg_source, weight_files=[str(p)], stripped_prefix=stripped,
        fc_layer_ids=list(cfg.fc_layer_ids), renamed=renamed)
    return model, info


# ---- the target's embedding and lm_head ---------------------------------------------------------
def _tie_flag(target_dir: Path) -> bool:
    cfg_path = target_dir / "config.json"
    if not cfg_path.exists():
        return False
    cfg = _read_json(cfg_path, "target config")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    return cfg.get("tie_word_embeddings") is True or text.get("tie_word_embeddings") is True


def load_target_head(target_dir, *, vocab_size: int, hidden_size: int, device="cpu",
                     dtype=torch.float32) -> tuple[TargetHead, HeadInfo]:
    """Borrow embed_tokens and lm_head from the target's safetensors (only those two tensors are read)."""
    d = Path(target_dir)
    if (d / INDEX_JSON).exists():
        source = d / INDEX_JSON
        weight_map = _read_json(source, "index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{source} has no 'weight_map'. {NOTHING_DONE}")
    elif (d / SINGLE_SAFETENSORS).exists():
        source = d / SINGLE_SAFETENSORS
        weight_map = dict.fromkeys(read_header(source).tensors, SINGLE_SAFETENSORS)
    else:
        raise CheckpointError(f"target {d} has neither {INDEX_JSON} nor {SINGLE_SAFETENSORS}: pass the target "
                              f"model's folder (its embed_tokens and lm_head are needed)")

    embed_key = next((k for k in EMBED_KEYS if k in weight_map), None)
    if embed_key is None:
        raise CheckpointError(f"{source} has no embedding: tried {', '.join(map(repr, EMBED_KEYS))}. "
                              f"Closest: {_closest(EMBED_KEYS[0], weight_map)}. {NOTHING_DONE}")
    lm_key = next((k for k in LM_HEAD_KEYS if k in weight_map), None)
    tied = lm_key is None and _tie_flag(d)
    if lm_key is None and not tied:
        raise CheckpointError(f"{source} has no lm_head: tried {', '.join(map(repr, LM_HEAD_KEYS))}, and "
                              f"{d / 'config.json'} does not say tie_word_embeddings: true. "
                              f"Closest: {_closest(LM_HEAD_KEYS[0], weight_map)}. {NOTHING_DONE}")

    def load(key: str) -> Tensor:
        f = d / weight_map[key]
        h = read_header(f)
        if key not in h.tensors:
            raise CheckpointError(f"{source} maps {key!r} to {f.name}, which has no such key. "
                                  f"Closest: {_closest(key, h.tensors)}. {NOTHING_DONE}")
        if h.tensors[key].shape != (vocab_size, hidden_size):
            raise CheckpointError(f"target {key!r} in {f} is {list(h.tensors[key].shape)} but the drafter needs "
                                  f"[{vocab_size}, {hidden_size}] (vocab_size, hidden_size): is this the drafter's "
                                  f"target model? {NOTHING_DONE}")
        return read_tensors(h, [key], device=device, dtype=dtype)[key]  # [vocab_size, hidden_size]

    if tied:
        embed = lm_head = load(embed_key)
    else:  # two readers: page-cached reads are CPU-bound per thread (the second on the caller's CUDA stream)
        stream = torch.cuda.current_stream(device) if torch.device(device).type == "cuda" else None

        def load_lm_head() -> Tensor:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                return load(lm_key)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reval-head") as ex:
            lm_f = ex.submit(load_lm_head)
            embed = load(embed_key)
            lm_head = lm_f.result()
    info = HeadInfo(source=str(source), embed_key=embed_key, embed_file=str(d / weight_map[embed_key]),
                    lm_head_key=lm_key, lm_head_file=None if tied else str(d / weight_map[lm_key]), tied=tied,
                    vocab_size=vocab_size, hidden_size=hidden_size)
    return TargetHead(embed=embed, lm_head=lm_head), info
