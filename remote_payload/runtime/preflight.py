"""`python -m remote_payload preflight --drafter D --target T --cache C`: the eval's inputs checked on the
host before a run is created (stdlib only: no torch import, so it costs the launch round trip ~nothing).

Checks the drafter's layout (a z-lab folder: config.json + index or model.safetensors, every shard present;
or a .pt/.safetensors file), the target's weights index (embed/lm_head are borrowed from it), the cache's
index (cache.json or the seeds' completions.json, every prompt file present) and, when both configs say
so, that the drafter's fc layers and hidden size are in the cache (an EAGLE-3 head: its three taps on the target,
contract/eagle3config.py), and that an EAGLE-3 decoding (`--chain`, `--eagle-tree`) is not asked of a DFlash drafter.
Bad input: one line on stderr, exit 3.
The eval repeats every check on the real data; this only makes sure a bad path never becomes a run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from remote_payload.contract import protocol, spec
from remote_payload.contract.contenthash import INDEX_JSON, MASK_EMBEDDING, SINGLE_SAFETENSORS, content_files
from remote_payload.contract.drafterconfig import DrafterConfig, add_allow_unknown, check_features
from remote_payload.contract.eagle3config import Eagle3Config, check_taps, looks_like_eagle3, target_layers
from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular

CACHE_JSON, SEEDS_JSON, SEEDS_LAYERS_JSON = "cache.json", "completions.json", "layers.json"  # = cache.py's
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
EAGLE3_BIN = "pytorch_model.bin"  # SafeAILab's published EAGLE-3 heads (= eagle3/loader.py's PT_IN_FOLDER)


def add_arguments(p) -> None:
    p.add_argument("--drafter", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--cache", required=True, action="append", metavar="[NAME=]PATH")
    p.add_argument("--chain", type=int, default=None)
    p.add_argument("--eagle-tree", default=None)
    add_allow_unknown(p)


def _json(path: Path, what: str):
    try:
        return json.loads(read_regular(path))
    except (OSError, ValueError) as e:
        raise PayloadError(f"cannot read {what} {path}: {e}") from None


def drafter_config(path: str, allow_unknown=()) -> DrafterConfig | Eagle3Config | None:
    """The drafter's config (z-lab layout, or an EAGLE-3 head's), None for a .pt file (its config is inside the
    weights)."""
    p = Path(path)
    if not p.exists():
        raise PayloadError(f"drafter checkpoint {p} does not exist: pass a z-lab folder (config.json + "
                           f"*.safetensors) or a .pt file")
    if p.is_file() and p.suffix not in WEIGHT_SUFFIXES:
        raise PayloadError(f"drafter checkpoint {p}: unknown file type {p.suffix!r}; expected a folder, "
                           f".safetensors or .pt")
    if p.is_file() and p.suffix != ".safetensors":
        return None
    folder = p if p.is_dir() else p.parent
    if not (folder / "config.json").is_file():
        raise PayloadError(f"drafter {p} has no config.json next to its weights")
    raw = _json(folder / "config.json", "drafter config")
    eagle3 = looks_like_eagle3(raw)
    weights = (INDEX_JSON, SINGLE_SAFETENSORS) + ((EAGLE3_BIN,) if eagle3 else ())
    if p.is_dir() and not any((folder / w).exists() for w in weights):
        raise PayloadError(f"drafter folder {folder} has none of {', '.join(weights)}")
    for f in content_files(p):
        if f.exists() and not f.is_file():  # a FIFO hangs the reader that opens it, a device never ends
            raise PayloadError(f"drafter {p}: {f.name} is not a regular file; replace it with the real file")
        if not f.is_file():
            raise PayloadError(f"drafter {p}: {'file' if f.name == MASK_EMBEDDING else 'weight file'} {f.name} "
                               "is missing")
    if eagle3:
        return Eagle3Config.from_dict(raw, source=str(folder / "config.json"), allow_unknown=allow_unknown)
    return DrafterConfig.from_dict(raw, source=str(folder / "config.json"), allow_unknown=allow_unknown)


def check_target(path: str) -> None:
    d = Path(path)
    if not d.is_dir():
        raise PayloadError(f"target {d} is not a directory: pass the target model's folder")
    if (d / INDEX_JSON).exists():
        wm = _json(d / INDEX_JSON, "index").get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise PayloadError(f"{d / INDEX_JSON} has no 'weight_map'")
        missing = sorted({str(v) for v in wm.values() if not (d / str(v)).is_file()})
        if missing:
            raise PayloadError(f"target {d}: shard {missing[0]} named by {INDEX_JSON} is missing")
    elif not (d / SINGLE_SAFETENSORS).exists():
        raise PayloadError(f"target {d} has neither {INDEX_JSON} nor {SINGLE_SAFETENSORS}: pass the target "
                           f"model's folder (its embed_tokens and lm_head are needed)")


def cache_layers(path: str) -> tuple[list[int] | None, int | None, int]:
    """(layer ids, hidden size, number of prompts) of a cache; ids/size None where the index does not say."""
    d = Path(path)
    if not d.is_dir():
        raise PayloadError(f"cache: {d} is not a directory; pass the directory written by `extract`")
    if (d / CACHE_JSON).exists():
        meta = _json(d / CACHE_JSON, "cache index")
        try:
            prompts = [(str(p["name"]), str(p["file"])) for p in meta["prompts"]]
            layers, hidden = [int(x) for x in meta["layer_ids"]], int(meta["hidden_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"{d / CACHE_JSON}: missing or malformed field ({e!r}); re-extract") from None
        for name, f in prompts:
            if not (d / f).is_file():
                raise PayloadError(f"cache {d}: prompt {name!r} file {f} is missing; re-extract")
        if not prompts:
            raise PayloadError(f"cache: {d} holds no prompts; re-extract with a non-empty prompt file")
        return layers, hidden, len(prompts)
    if (d / SEEDS_JSON).exists():
        raw = _json(d / SEEDS_JSON, "completions")
        entries = raw.get("completions") if isinstance(raw, dict) else raw
        if not isinstance(entries, list) or not entries:
            raise PayloadError(f"{d / SEEDS_JSON}: no completions")
        side = d / SEEDS_LAYERS_JSON
        ids = _json(side, "layers").get("layer_ids") if side.exists() else None
        return ([int(x) for x in ids] if isinstance(ids, list) else None), None, len(entries)
    raise PayloadError(f"cache: {d} has neither {CACHE_JSON} nor {SEEDS_JSON}; "
                       "create one with `python -m remote_payload extract`")


def check(drafter: str, target: str, cache: str, allow_unknown=(), chain: int | None = None,
          eagle_tree: str | None = None) -> None:
    cfg = drafter_config(drafter, allow_unknown)
    if isinstance(cfg, DrafterConfig):  # a .pt file (cfg None) says its family only to the eval
        spec.refuse_eagle3_decoding(drafter, chain, eagle_tree)
    check_target(target)
    layers, hidden, _ = cache_layers(cache)
    if isinstance(cfg, Eagle3Config) and layers is not None and hidden is not None:
        check_taps(cfg, target_layers(_json(Path(target) / "config.json", "target config")), layers, hidden)
    elif cfg is not None and layers is not None and hidden is not None:
        check_features(cfg, layers, hidden)


def main(args) -> int:
    try:
        refs = spec.parse_caches(args.cache)
        for ref in refs:
            try:
                check(args.drafter, args.target, ref.path, args.allow_unknown_config, args.chain, args.eagle_tree)
            except PayloadError as e:  # which suite's cache, when there are several
                if len(refs) > 1 or ref.name:
                    raise type(e)(f"suite {ref.suite}: {e}") from None
                raise
    except (PayloadError, protocol.ProtocolError, spec.SpecError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return protocol.EXIT_BAD_INPUT
    return 0
