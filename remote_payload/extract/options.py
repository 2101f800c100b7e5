"""extract's options (`add_arguments`) and the two groups extract() takes them in: `data_kwargs` (what changes
the data: the recipe's, recipe.recipe_of) and `run_kwargs` (where and how fast). Torch-free: a store's plan
(storecmd.py) reads them without loading torch (a .pt drafter's layers aside, whose config is in its weights).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from remote_payload.contract.drafterconfig import DrafterConfig, parse_layer_ids
from remote_payload.contract.eagle3config import Eagle3Config, looks_like_eagle3
from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular
from remote_payload.eval.regime import regime_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF model directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--prompts", required=True, action="append",
                   help='.jsonl of {"turns": [...]} (z-lab, multi-turn) or {"prompt": ...} (optional "name"), '
                        "or .txt with one prompt a line; with --store: NAME=FILE, once per suite")
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"],
                   help="render prompts with the target's chat template: auto = when it has one (tokenizer_config."
                        "json chat_template or chat_template.jinja), on = refuse without one, off = raw text")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=False,
                   help="enable_thinking passed to the chat template (Qwen3 reads it; default off, as the papers)")
    p.add_argument("--out", help="cache directory to create (must not exist); or --store")
    p.add_argument("--store", metavar="DIR",
                   help="a cache store (e.g. WORKDIR/caches): each suite's cache under its recipe's key, "
                        "built only when missing, once however many ask (extract/store.py)")
    p.add_argument("--plan", action="store_true",
                   help="with --store: print each suite's key and whether it is there (JSON), build nothing")
    p.add_argument("--run-dir", help="with --store: write caches.json (what each suite resolved to) and "
                                     "progress events there (reval's run directory)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="greedy completion length cap (default 512)")
    p.add_argument("--layers", help="tapped decoder layers, e.g. 1,16,31,46,61 (default: --for-drafter's); layer l = "
                                    "decoder block l's output = HF hidden_states[l+1] (cache.json records both)")
    p.add_argument("--for-drafter", metavar="PATH",
                   help="take --layers from this drafter: a DFlash config's target_layer_ids (its config.json, or "
                        "the .pt's config), or an EAGLE-3 head's three taps on --target: HF hidden_states[2, L//2, "
                        "L-3] by default, explicit eagle_aux_hidden_state_layer_ids read as vLLM does (id k = HF k; "
                        "SGLang's explicit id k is HF k+1); --layers for HF k is k-1")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--gpus", metavar="IDS",
                   help="several GPUs of this host: 0,1,... or all = one process a GPU, the prompts split between "
                        "them and merged into one cache equal to a one-GPU run's (with --shard: one process, the "
                        "target spread over them). cpu,cpu or cuda:0,cuda:0: processes on named devices (tests)")
    p.add_argument("--shard", action="store_true",
                   help="with --gpus: load the target across those GPUs (device_map) instead of one copy a GPU; for "
                        "a target too big for one (chosen by itself when its weights exceed 80%% of a GPU's memory)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="auto = bf16 on GPU, fp32 on CPU")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="only the first N prompts (conversations, for a multi-turn file)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts generated together (default 32)")
    p.add_argument("--batch-tokens", type=int, default=32768,
                   help="padded tokens per batch, prompt + max new tokens per prompt (default 32768)")
    p.add_argument("--compile", action="store_true",
                   help="trace the CUDA graph's decode step through torch.compile instead of the default's Triton "
                        "passes (RMSNorm, SiLU * up, RoPE): a few %% faster decoding, about a minute of compilation "
                        "per batch shape (pays off only for very long runs; make bench-decode has the numbers). "
                        "CUDA only")
    g = p.add_argument_group("sampling (a cache at T > 0; docs/sampling.md)")
    g.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sample the completions at temperature T (then --top-k, then --top-p, as z-lab's sample) "
                        "instead of greedy; 0 or absent: greedy, today's cache")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="keep the K most probable tokens (0: off)")
    g.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="keep the most probable tokens up to mass P (1: off)")
    g.add_argument("--seed", type=int, default=None, metavar="S",
                   help="the draws' seed (needed with --temperature > 0): one generator per (prompt, sample), so "
                        "the cache is the same whatever the batches or --gpus")
    g.add_argument("--samples", type=int, default=None, metavar="N",
                   help="completions sampled per prompt (default 1), each its own entry <prompt>~s<i>")


def layers_arg(layers: str | None, for_drafter: str | None, target: str | None = None) -> list[int]:
    """--layers, else --for-drafter's: a DFlash config's target_layer_ids, an EAGLE-3 head's three taps on
    `target` (HF hidden_states[k] = cache layer k-1); neither is bad input. A drafter folder's config is read
    without torch (the store's plan runs this on a login node); a .pt's config is inside its weights."""
    if layers:
        return parse_layer_ids(layers)
    if not for_drafter:
        raise PayloadError("extract needs the tapped layers: --layers 1,16,31,46,61, or --for-drafter PATH to take "
                           "the drafter's target_layer_ids")
    p = Path(for_drafter)
    cfg_path = (p / "config.json" if p.is_dir() else
                p.parent / "config.json" if p.suffix == ".safetensors" else None)
    if cfg_path is not None and cfg_path.is_file():  # what eval.checkpoint.peek_config reads, without torch
        try:
            d = json.loads(read_regular(cfg_path))
        except (OSError, ValueError) as e:
            raise PayloadError(f"--for-drafter {for_drafter}: cannot read {cfg_path} ({e})") from None
        if looks_like_eagle3(d):
            return Eagle3Config.from_dict(d, str(cfg_path)).cache_layer_ids(_target_layers(for_drafter, target))
        return list(DrafterConfig.from_dict(d, source=str(cfg_path)).target_layer_ids)
    from remote_payload.eagle3.loader import is_eagle3, peek_eagle3_config
    if is_eagle3(for_drafter):
        return peek_eagle3_config(for_drafter).cache_layer_ids(_target_layers(for_drafter, target))
    from remote_payload.eval.checkpoint import load_drafter
    return list(load_drafter(for_drafter)[0].cfg.target_layer_ids)  # .pt: its config is inside the file


def _target_layers(for_drafter: str, target: str | None) -> int:
    """The target's decoder layer count, which an EAGLE-3 head's default taps depend on."""
    if target is None:
        raise PayloadError(f"--for-drafter {for_drafter} is an EAGLE-3 head: its taps need the target's layers")
    from remote_payload.target.load import num_layers_of
    try:
        return num_layers_of(json.loads(read_regular(Path(target) / "config.json")))
    except (OSError, ValueError) as e:
        raise PayloadError(f"--target {target}: cannot read its config.json ({e}); the EAGLE-3 head "
                           f"{for_drafter}'s taps depend on its layer count") from None


def data_kwargs(args: argparse.Namespace) -> dict:
    """The extract options that change the data (extract's keyword arguments; the recipe's, recipe.recipe_of),
    built here once for the command and the store (store.py): an option that changes the data joins here."""
    return {"layer_ids": layers_arg(args.layers, args.for_drafter, args.target), "max_new_tokens": args.max_new_tokens,
            "dtype": args.dtype, "chat_template": args.chat_template, "enable_thinking": args.enable_thinking,
            "num_prompts": args.num_prompts,
            "regime": regime_of(args.temperature, args.top_k, args.top_p, args.seed, args.samples)}


def run_kwargs(args: argparse.Namespace) -> dict:
    """The extract options that decide only where and how fast it runs (never the data)."""
    return {"device": args.device, "batch_size": args.batch_size, "batch_tokens": args.batch_tokens,
            "gpus": args.gpus, "shard": args.shard, "compile": args.compile}
