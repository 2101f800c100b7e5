"""Strict loading of EAGLE-3 heads (SafeAILab/EAGLE, SpecForge and speculators layouts: their configs are told
apart and read by contract/eagle3config.py), and telling them from DFlash drafters.

Layouts (`load_eagle3`):
- a folder: config.json + model.safetensors, or shards listed in model.safetensors.index.json, or
  pytorch_model.bin (SafeAILab's published heads; a torch file, read weights-only);
- a .safetensors file with config.json beside it; a .pt / .pth / .bin file whose "config" entry, else the
  config.json beside it, describes the head (a state dict bare or wrapped as {"model": sd} / {"state_dict": sd}).
Keys: `fc.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight` [Vd, H], `d2t` [Vd] (int offsets), `t2d` [V] (bool; optional: vLLM does not read it, checked
against d2t when present), `embed_tokens.weight` [V, H] (optional: else the target's embedding, which must be
[V, H]); with the layout's variants `fc_norm.{0,1,2}.weight` [Ht], `input_norm.weight` [3Ht] (norm_before_fc),
`fc.bias` [H] (SGLang's bias). vLLM's and speculators' names are read as ours (`layers.0.` = `midlayer.`,
`draft_id_to_target_id` = `d2t`). Every key must be one of those with its exact shape: a missing or extra key is a
CheckpointError naming it and the closest names there are; nothing is evaluated after one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from remote_payload.contract.contenthash import INDEX_JSON, SINGLE_SAFETENSORS, parse_step, sha256_files
from remote_payload.contract.eagle3config import Eagle3Config, looks_like_eagle3
from remote_payload.contract.errors import CheckpointError, ConfigError
from remote_payload.contract.runstate import read_regular
from remote_payload.eagle3.model import Eagle3Drafter
from remote_payload.eval.checkpoint import PT_WRAPPERS, _closest, _strip_prefixes, canonical_names, torch_load_cpu
from remote_payload.eval.checkpoint import check_keys as strict_keys
from remote_payload.eval.safetensors_io import NOTHING_DONE, read_header, read_tensors

TORCH_FILES = (".pt", ".pth", ".bin")
PT_IN_FOLDER = "pytorch_model.bin"
RENAMED = (("layers.0.", "midlayer."), ("draft_id_to_target_id", "d2t"))  # vLLM's names -> SafeAILab's
OPTIONAL = ("t2d", "embed_tokens.weight")
INT_KEYS = ("d2t", "t2d")


@dataclass
class Eagle3Info:
    """What results.json records of the head (the fields eval's DrafterInfo has, plus the family's own)."""
    path: str
    layout: str  # the config's layout (eagle | specforge | speculators), + "-pt" for a torch file
    name: str
    step: int | None
    content_hash: str
    num_parameters: int
    weight_stats: dict
    config_source: str
    weight_files: list[str] = field(default_factory=list)
    renamed: list[str] = field(default_factory=list)
    embed_source: str = "target"  # "checkpoint" when it ships embed_tokens.weight
    mask_embedding: str | None = None  # (DFlash only; always None here)


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(read_regular(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from e


def config_path(path) -> Path | None:
    """The config.json that describes a drafter path (folder, or a weight file beside one)."""
    p = Path(path)
    c = p / "config.json" if p.is_dir() else p.parent / "config.json"
    return c if c.is_file() else None


def is_eagle3(path) -> bool:
    """Whether `path` is an EAGLE-3 head (its config.json, or a torch file's "config" entry, says so)."""
    p = Path(path)
    c = config_path(p)
    if c is not None and (p.is_dir() or p.suffix in (".safetensors", *TORCH_FILES)):
        try:
            return looks_like_eagle3(json.loads(read_regular(c)))
        except (OSError, ValueError):
            return False  # the family's own loader reports an unreadable config
    if p.is_file() and p.suffix in TORCH_FILES:
        try:
            obj = torch_load_cpu(p)
        except Exception:  # noqa: BLE001 - not a torch file: the DFlash loader says why
            return False
        return isinstance(obj, dict) and looks_like_eagle3(obj.get("config"))
    return False


def peek_eagle3_config(path, allow_unknown=()) -> Eagle3Config:
    """The head's config without its weights (a torch file's own "config" entry wins, as in `load_eagle3`)."""
    p = Path(path)
    if p.is_file() and p.suffix in TORCH_FILES:
        obj = torch_load_cpu(p)
        if isinstance(obj, dict) and isinstance(obj.get("config"), dict):
            return Eagle3Config.from_dict(obj["config"], f"{p} ['config']", allow_unknown)
    c = config_path(p)
    if c is None:
        raise ConfigError(f"EAGLE-3 head {p} has no config.json beside its weights")
    return Eagle3Config.from_dict(_read_json(c, "drafter config"), str(c), allow_unknown)


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple]:
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Eagle3Drafter(cfg).state_dict().items()}
    shapes["embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def check_keys(cfg: Eagle3Config, found: dict[str, tuple], source: str, cfg_source: str) -> None:
    """Every required key present with its shape, nothing else (module doc; eval/checkpoint.check_keys, the
    DFlash loader's rule)."""
    sizes = (f" (hidden_size {cfg.hidden_size}, target_hidden_size {cfg.target_hidden_size}, draft_vocab_size "
             f"{cfg.draft_vocab_size}, vocab_size {cfg.vocab_size})")
    strict_keys(expected_shapes(cfg), found, source, what="EAGLE-3 head", optional=OPTIONAL, needed_by=cfg_source,
                described=f"EAGLE-3 head described by {cfg_source}", shape_hint=lambda key: sizes)


def check_vocab_map(cfg: Eagle3Config, d2t: Tensor, t2d: Tensor | None, source: str) -> None:
    """d2t maps the draft vocabulary into the target's, one to one; t2d (when shipped) marks exactly those ids."""
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise CheckpointError(f"{source}: 'd2t' is {d2t.dtype}, expected integer offsets. {NOTHING_DONE}")
    tgt = torch.arange(cfg.draft_vocab_size) + d2t.long().cpu()
    if bool((tgt < 0).any()) or bool((tgt >= cfg.vocab_size).any()) or tgt.unique().numel() != tgt.numel():
        raise CheckpointError(f"{source}: 'd2t' maps the draft vocabulary outside 0..{cfg.vocab_size - 1} or onto "
                              f"one target id twice: not an i + d2t[i] map. {NOTHING_DONE}")
    if t2d is not None:
        t2d = t2d.bool().cpu()
        if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[tgt].all()):
            raise CheckpointError(f"{source}: 't2d' marks {int(t2d.sum())} target ids, not the "
                                  f"{cfg.draft_vocab_size} that d2t maps to. {NOTHING_DONE}")


def _files(p: Path) -> tuple[list[Path], dict[str, Path] | None, Path]:
    """(weight files, key -> file from an index or None, the config.json) of a head path."""
    folder = p if p.is_dir() else p.parent
    cfg = folder / "config.json"
    if p.is_file():
        return [p], None, cfg
    if (p / INDEX_JSON).exists():
        weight_map = _read_json(p / INDEX_JSON, "index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{p / INDEX_JSON} has no 'weight_map'. {NOTHING_DONE}")
        key_file = {k: p / v for k, v in weight_map.items()}
        return sorted(set(key_file.values())), key_file, cfg
    for name in (SINGLE_SAFETENSORS, PT_IN_FOLDER):
        if (p / name).is_file():
            return [p / name], None, cfg
    present = ", ".join(sorted(x.name for x in p.iterdir())[:8]) or "nothing"
    raise CheckpointError(f"EAGLE-3 head {p} has none of {INDEX_JSON}, {SINGLE_SAFETENSORS}, {PT_IN_FOLDER} "
                          f"(it holds: {present}). {NOTHING_DONE}")


def _read_torch(f: Path) -> tuple[dict[str, Tensor], dict | None]:
    try:
        obj = torch_load_cpu(f)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read {f} as a weights-only torch file: {first}. {NOTHING_DONE}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{f} holds a {type(obj).__name__}, not a state dict. {NOTHING_DONE}")
    wrapper = next((w for w in PT_WRAPPERS if isinstance(obj.get(w), dict)), None)
    sd = obj[wrapper] if wrapper else {k: v for k, v in obj.items() if isinstance(v, Tensor)}
    sd, _ = _strip_prefixes(sd)
    bad = [k for k, v in sd.items() if not isinstance(v, Tensor)]
    if bad:
        raise CheckpointError(f"{f}: entry {bad[0]!r} of the state dict is not a tensor. {NOTHING_DONE}")
    return sd, obj.get("config") if isinstance(obj.get("config"), dict) else None


def _read_state(p: Path, device, dtype) -> tuple[dict[str, Tensor], list[Path], dict | None, str]:
    """(state dict as stored, the weight files, a torch file's own config or None, a name for errors)."""
    files, key_file, _ = _files(p)
    if files[0].suffix in TORCH_FILES:
        sd, own_cfg = _read_torch(files[0])
        return sd, files, own_cfg, str(files[0])
    sd: dict[str, Tensor] = {}
    for f in files:
        h = read_header(f)
        names = [k for k in h.tensors if key_file is None or key_file.get(k) == f]
        if key_file is not None:
            lost = [k for k, kf in key_file.items() if kf == f and k not in h.tensors]
            if lost:
                raise CheckpointError(f"{p / INDEX_JSON} maps {lost[0]!r} to {f.name}, which has no such key. "
                                      f"Closest: {_closest(lost[0], h.tensors)}. {NOTHING_DONE}")
        floats = [k for k in names if h.tensors[k].dtype.is_floating_point]
        sd.update(read_tensors(h, floats, device=device, dtype=dtype))
        sd.update(read_tensors(h, [k for k in names if k not in floats], device=device))
    source = str(files[0]) if len(files) == 1 else f"{p / INDEX_JSON} (+{len(files)} shards)"
    return sd, files, None, source


def load_eagle3(path, *, device="cpu", dtype=torch.float32, allow_unknown=(),
                embed: Tensor | None = None) -> tuple[Eagle3Drafter, Eagle3Info]:
    """The head at `path`, strictly (module doc). `embed`: the target's [V, H] embedding, used when the
    checkpoint ships none (then required)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"EAGLE-3 head {p} does not exist")
    sd, files, own_cfg, source = _read_state(p, device, dtype)
    if own_cfg is not None:
        cfg, cfg_source = Eagle3Config.from_dict(own_cfg, f"{p} ['config']", allow_unknown), f"{p} ['config']"
    else:
        c = config_path(p)
        if c is None:
            raise ConfigError(f"EAGLE-3 head {p} has no config.json beside its weights (nor a 'config' entry)")
        cfg, cfg_source = Eagle3Config.from_dict(_read_json(c, "drafter config"), str(c), allow_unknown), str(c)
    names, renamed = canonical_names(sd, source, RENAMED, "the head's")
    sd = {names[k]: v for k, v in sd.items()}
    check_keys(cfg, {k: tuple(v.shape) for k, v in sd.items()}, source, cfg_source)
    check_vocab_map(cfg, sd["d2t"], sd.get("t2d"), source)
    own_embed = sd.pop("embed_tokens.weight", None)
    sd["d2t"] = sd["d2t"].long()
    sd["t2d"] = sd["t2d"].bool() if "t2d" in sd else _t2d(cfg, sd["d2t"])
    sd = {k: v.to(device=device, dtype=v.dtype if k in INT_KEYS else dtype) for k, v in sd.items()}
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    model = model.eval().requires_grad_(False)
    if own_embed is not None:
        model.embed = own_embed.to(device=device, dtype=dtype)
    elif embed is None:
        raise CheckpointError(f"{source} ships no embed_tokens.weight and no target embedding was given: pass the "
                              f"target (its embedding must be [{cfg.vocab_size}, {cfg.hidden_size}]). {NOTHING_DONE}")
    elif tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"the target's embedding is {list(embed.shape)} but the EAGLE-3 head needs "
                              f"[{cfg.vocab_size}, {cfg.hidden_size}] (vocab_size, hidden_size): it ships no "
                              f"embed_tokens.weight of its own. {NOTHING_DONE}")
    else:
        model.embed = embed.to(device=device, dtype=dtype)
    hashed = ([Path(cfg_source)] if own_cfg is None else []) + list(files)
    stats = {k: {"mean": round(float(sd[k].float().mean()), 6), "std": round(float(sd[k].float().std()), 6)}
             for k in ("fc.weight", "norm.weight", "lm_head.weight")}
    generic = p.stem in ("model", "pytorch_model", "drafter", "state_dict", "checkpoint", "weights")
    info = Eagle3Info(
        path=str(p), layout=cfg.layout + ("-pt" if files[0].suffix in TORCH_FILES else ""),
        name=p.name if p.is_dir() else (p.parent.name if generic else p.stem), step=parse_step(p),
        content_hash=sha256_files(hashed), num_parameters=sum(v.numel() for k, v in sd.items() if k not in INT_KEYS),
        weight_stats=stats, config_source=cfg_source, weight_files=[str(f) for f in files], renamed=renamed,
        embed_source="checkpoint" if own_embed is not None else "target")
    return model, info


def _t2d(cfg: Eagle3Config, d2t: Tensor) -> Tensor:
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(cfg.draft_vocab_size) + d2t.cpu()] = True
    return t2d
