"""The target model: greedy completions + tapped hidden states -> a cache (`python -m remote_payload extract`).

Per prompt: greedy-complete (max_new_tokens, stop after eos), then ONE causal prefill of prompt + completion
with output_hidden_states=True and keep hs[l+1] for each tapped layer l (hs[0] is the embedding output, so
hs[l+1] is decoder block l's output; for the last block HF returns it after the final norm).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch

from remote_payload.cache import Cache, CacheWriter, open_cache, parse_layer_ids
from remote_payload.devices import resolve_device_dtype
from remote_payload.errors import PayloadError

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def read_prompts(path: str | os.PathLike, num_prompts: int | None = None) -> list[tuple[str, str]]:
    """A .jsonl of {name, prompt} or a .txt with one prompt a line -> [(name, prompt)], first num_prompts."""
    path = Path(path)
    if not path.is_file():
        raise PayloadError(f"--prompts {path}: no such file; pass a .jsonl ({{name, prompt}} per line) or a .txt")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    prompts = []
    if path.suffix == ".jsonl":
        for n, ln in enumerate(lines, 1):
            try:
                d = json.loads(ln)
                prompts.append((str(d.get("name", f"prompt-{len(prompts):03d}")), str(d["prompt"])))
            except (json.JSONDecodeError, KeyError, AttributeError) as e:
                raise PayloadError(f"--prompts {path} line {n}: expected {{\"name\": ..., \"prompt\": ...}} ({e})")
    else:
        prompts = [(f"prompt-{i:03d}", ln) for i, ln in enumerate(lines)]
    if not prompts:
        raise PayloadError(f"--prompts {path} holds no prompts; add one prompt per line")
    names = [n for n, _ in prompts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PayloadError(f"--prompts {path}: duplicate names {dup}; give every prompt its own name")
    return prompts[:num_prompts] if num_prompts else prompts


def num_layers_of(config: dict) -> int:
    """Decoder layer count from a config.json dict (plain or multimodal with text_config)."""
    n = config.get("num_hidden_layers") or config.get("text_config", {}).get("num_hidden_layers")
    if not n:
        raise PayloadError("target config.json has no num_hidden_layers (nor text_config.num_hidden_layers)")
    return int(n)


def eos_ids_of(target: Path) -> set[int]:
    ids: set[int] = set()
    for f in ("generation_config.json", "config.json"):
        if (target / f).is_file():
            e = json.loads((target / f).read_text()).get("eos_token_id")
            ids |= set(e) if isinstance(e, list) else ({e} if e is not None else set())
    return ids


def check_target(target: str | os.PathLike, layer_ids: list[int]) -> dict:
    """Validate a target dir before loading anything big; returns its config.json dict."""
    target = Path(target)
    if not (target / "config.json").is_file():
        raise PayloadError(f"--target {target}: no config.json; point --target at a HF model directory")
    if not any((target / f).is_file() for f in _WEIGHT_FILES):
        raise PayloadError(f"--target {target}: no weights ({' / '.join(_WEIGHT_FILES)}); copy the full model")
    if not (target / "tokenizer.json").is_file():
        raise PayloadError(f"--target {target}: no tokenizer.json; copy the model's tokenizer files too")
    config = json.loads((target / "config.json").read_text())
    n = num_layers_of(config)
    bad = [l for l in layer_ids if l >= n]
    if bad:
        raise PayloadError(f"--layers {','.join(map(str, layer_ids))}: layer ids {bad} >= the target's {n} layers; "
                           f"use ids in 0..{n - 1}")
    return config


def load_target(target: str | os.PathLike, device: torch.device, dtype: torch.dtype):
    """HF causal LM from local files only, eval mode, on device."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    # `torch_dtype` was renamed `dtype` in 4.56; pass whichever this version knows.
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), local_files_only=True,
                                                              **{dtype_kw: dtype})
    return model.to(device).eval()


@torch.no_grad()
def greedy_complete(model, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int]) -> torch.Tensor:
    """prompt_ids [P] -> prompt + greedy completion [P + C], C <= max_new_tokens, eos kept if produced."""
    from transformers import DynamicCache
    try:  # hybrid (linear-attention) targets such as Qwen3.5/3.6 need the config to lay out their cache
        kv = DynamicCache(config=model.config)
    except TypeError:  # older transformers
        kv = DynamicCache()
    # The KV cache is passed positionally: the keyword is `past_key_values` or `cache` by transformers version.
    logits = model(prompt_ids[None], None, None, kv, use_cache=True).logits  # [1, P, V]
    out = [int(t) for t in prompt_ids]
    for _ in range(max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt in eos_ids:
            break
        logits = model(torch.tensor([[nxt]], device=prompt_ids.device), None, None, kv, use_cache=True).logits
    return torch.tensor(out, dtype=torch.long)


@torch.no_grad()
def tapped_features(model, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """ids [T] -> features [T, len(layer_ids), H]: hs[l+1] of one causal prefill."""
    hs = model(ids[None], output_hidden_states=True, use_cache=False).hidden_states
    n = model.config.get_text_config().num_hidden_layers
    if len(hs) != n + 1:
        raise RuntimeError(f"expected {n + 1} hidden states (embeddings + {n} blocks), got {len(hs)}")
    return torch.stack([hs[l + 1][0] for l in layer_ids], dim=1)


def extract(target: str | os.PathLike, prompts_file: str | os.PathLike, out: str | os.PathLike, *,
            max_new_tokens: int, layer_ids: list[int], device: str = "auto", dtype: str = "auto",
            num_prompts: int | None = None, log=print) -> Cache:
    """Run the target over the prompts and write a reval cache at `out` (atomically)."""
    target = Path(target)
    if num_prompts is not None and num_prompts < 1:
        raise PayloadError(f"--num-prompts {num_prompts}: need at least 1 (or leave it out for all)")
    if max_new_tokens < 1:
        raise PayloadError(f"--max-new-tokens {max_new_tokens}: need at least 1")
    prompts = read_prompts(prompts_file, num_prompts)
    config = check_target(target, layer_ids)
    H = config.get("hidden_size") or config.get("text_config", {}).get("hidden_size")
    writer = CacheWriter(out, layer_ids=layer_ids, hidden_size=int(H), target_path=str(target.resolve()),
                         target_config_sha256=hashlib.sha256((target / "config.json").read_bytes()).hexdigest(),
                         tokenizer_path=str((target / "tokenizer.json").resolve()))  # checks --out before loading
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    dev, dt = resolve_device_dtype(device, dtype)
    log(f"loading target {target} on {dev} ({str(dt).removeprefix('torch.')})")
    model = load_target(target, dev, dt)
    eos = eos_ids_of(target)
    with writer as w:
        for i, (name, text) in enumerate(prompts):
            p_ids = tok.encode(text).ids
            if not p_ids:
                raise PayloadError(f"prompt {name!r} tokenizes to nothing; remove it from {prompts_file}")
            ids = greedy_complete(model, torch.tensor(p_ids, device=dev), max_new_tokens, eos)
            feats = tapped_features(model, ids.to(dev), layer_ids)  # [T, n, H]
            w.add(name, len(p_ids), ids, feats)
            log(f"[{i + 1}/{len(prompts)}] {name}: {len(ids)} tokens ({len(p_ids)} prompt + "
                f"{len(ids) - len(p_ids)} completion)")
    return open_cache(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF model directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--prompts", required=True, help=".jsonl of {name, prompt} or .txt with one prompt a line")
    p.add_argument("--out", required=True, help="cache directory to create (must not exist)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="greedy completion length cap (default 512)")
    p.add_argument("--layers", required=True, help="tapped decoder layers, e.g. 1,16,31,46,61")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="auto = bf16 on GPU, fp32 on CPU")
    p.add_argument("--num-prompts", type=int, default=None, help="only the first N prompts")


def main(args: argparse.Namespace) -> int:
    try:
        c = extract(args.target, args.prompts, args.out, max_new_tokens=args.max_new_tokens,
                    layer_ids=parse_layer_ids(args.layers), device=args.device, dtype=args.dtype,
                    num_prompts=args.num_prompts)
    except PayloadError as e:
        print(f"error: {e}")
        return e.exit_code
    print(f"wrote {len(c)} prompts, layers {c.layer_ids}, H={c.hidden_size} -> {c.path}")
    return 0
