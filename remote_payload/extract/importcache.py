"""`python -m remote_payload import-cache`: a seeds-layout cache (completions.json + <name>.pt, read by
eval/cache.py) converted to the reval layout.
"""
from __future__ import annotations

import argparse
import os

from remote_payload.contract.drafterconfig import parse_layer_ids
from remote_payload.contract.errors import PayloadError
from remote_payload.eval.cache import CACHE_JSON, SEEDS_LAYERS_JSON, Cache, open_cache
from remote_payload.extract.writer import CacheWriter


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
