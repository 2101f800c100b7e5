"""The target model: greedy completions + tapped hidden states -> a cache (`python -m remote_payload extract`).

Per prompt: greedy-complete (max_new_tokens, stop after eos), then ONE causal prefill of prompt + completion
with output_hidden_states=True and keep hs[l+1] for each tapped layer l (hs[0] is the embedding output, so
hs[l+1] is decoder block l's output; for the last block HF returns it after the final norm).
`extract` does both for batches of prompts (`greedy_complete_batch`, `tapped_features_batch`: left padding
for the generation, right padding for the prefill, each row equal to its batch-1 run) and is resumable.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch

from remote_payload.contract.errors import PayloadError
from remote_payload.eval.cache import Cache, CacheWriter, open_cache, parse_layer_ids
from remote_payload.eval.devices import resolve_device_dtype

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
    """HF causal LM from local files only, eval mode, on device. On a GPU with `accelerate` installed the
    weights are read straight onto the device (device_map), with no full copy in host memory first."""
    import importlib.util

    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    # `torch_dtype` was renamed `dtype` in 4.56; pass whichever this version knows.
    kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
    if device.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
        kw["device_map"] = {"": str(device)}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), local_files_only=True, **kw)
    return model.to(device).eval()


def _new_kv(model):
    from transformers import DynamicCache
    try:  # hybrid (linear-attention) targets such as Qwen3.5/3.6 need the config to lay out their cache
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _last_logits_kw(model) -> dict:
    """Only the last position's logits (a [B, T, vocab] tensor would dwarf the rest), where supported."""
    import inspect
    params = inspect.signature(model.forward).parameters
    return next(({k: 1} for k in ("logits_to_keep", "num_logits_to_keep") if k in params), {})


@torch.no_grad()
def greedy_complete(model, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int]) -> torch.Tensor:
    """prompt_ids [P] -> prompt + greedy completion [P + C], C <= max_new_tokens, eos kept if produced."""
    kv = _new_kv(model)
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


@torch.no_grad()
def greedy_complete_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int],
                          pad_id: int = 0) -> list[list[int]]:
    """Greedy completions of several prompts at once, one KV cache: prompts are LEFT-padded, pads masked
    out and positions counted from each prompt's first real token, so every row computes what an unbatched
    `greedy_complete` computes. A row stops at its eos (kept); the batch stops when all rows have."""
    dev = next(model.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    kv, keep = _new_kv(model), _last_logits_kw(model)
    logits = model(ids, mask, pos, kv, use_cache=True, **keep).logits[:, -1]
    out = [list(p) for p in prompts]
    live = list(range(B))
    nxt_pos = pos[:, -1:] + 1
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1)  # [B]
        toks = nxt.tolist()  # one host sync a step for the whole batch
        for i in list(live):
            out[i].append(toks[i])
            if toks[i] in eos_ids:
                live.remove(i)
        if not live or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
        logits = model(nxt[:, None], mask, nxt_pos, kv, use_cache=True, **keep).logits[:, -1]
        nxt_pos = nxt_pos + 1
    return out


@torch.no_grad()
def tapped_features_batch(model, seqs: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]:
    """Several sequences in one causal prefill, RIGHT-padded (a causal position never sees the pads after
    it, so no mask is needed) -> per sequence [T_i, len(layer_ids), H], as `tapped_features` gives."""
    dev = next(model.parameters()).device
    T = max(len(x) for x in seqs)
    ids = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)] = x
    hs = model(ids.to(dev), output_hidden_states=True, use_cache=False, **_last_logits_kw(model)).hidden_states
    n = model.config.get_text_config().num_hidden_layers
    if len(hs) != n + 1:
        raise RuntimeError(f"expected {n + 1} hidden states (embeddings + {n} blocks), got {len(hs)}")
    tapped = torch.stack([hs[l + 1] for l in layer_ids], dim=2)  # [B, T, n_layers, H]
    return [tapped[i, :len(x)] for i, x in enumerate(seqs)]


def batches(lengths: list[int], max_batch: int, max_tokens: int) -> list[list[int]]:
    """Indices grouped for batching: longest first (little padding), at most max_batch prompts and about
    max_tokens padded tokens (the longest member times the count) per group; every group has >= 1."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and len(groups[-1]) < max_batch and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def extract(target: str | os.PathLike, prompts_file: str | os.PathLike, out: str | os.PathLike, *,
            max_new_tokens: int, layer_ids: list[int], device: str = "auto", dtype: str = "auto",
            num_prompts: int | None = None, batch_size: int = 32, batch_tokens: int = 32768, log=print) -> Cache:
    """Run the target over the prompts and write a reval cache at `out` (atomically; resumable: an interrupted
    run's finished prompts are kept in `.OUT.partial` and the same command continues from there).

    Prompts go in batches (longest first, <= batch_size prompts and ~batch_tokens padded tokens each): one
    batched greedy generation with a KV cache, then one batched prefill of prompt + completion for the
    hidden states. The cache equals a batch-1 run's (tests/test_extract.py)."""
    target = Path(target)
    if num_prompts is not None and num_prompts < 1:
        raise PayloadError(f"--num-prompts {num_prompts}: need at least 1 (or leave it out for all)")
    if max_new_tokens < 1:
        raise PayloadError(f"--max-new-tokens {max_new_tokens}: need at least 1")
    if batch_size < 1 or batch_tokens < 1:
        raise PayloadError(f"--batch-size {batch_size} / --batch-tokens {batch_tokens}: need at least 1")
    prompts = read_prompts(prompts_file, num_prompts)
    config = check_target(target, layer_ids)
    H = config.get("hidden_size") or config.get("text_config", {}).get("hidden_size")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    encoded = [tok.encode(text).ids for _, text in prompts]
    empty = [name for (name, _), ids in zip(prompts, encoded) if not ids]
    if empty:
        raise PayloadError(f"prompt {empty[0]!r} tokenizes to nothing; remove it from {prompts_file}")
    dev, dt = resolve_device_dtype(device, dtype)
    config_sha = hashlib.sha256((target / "config.json").read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps({"target": config_sha, "layers": layer_ids, "max_new_tokens": max_new_tokens,
                                     "dtype": str(dt), "prompts": prompts}).encode()).hexdigest()
    writer = CacheWriter(out, layer_ids=layer_ids, hidden_size=int(H), target_path=str(target.resolve()),
                         target_config_sha256=config_sha, tokenizer_path=str((target / "tokenizer.json").resolve()),
                         resume_key=key)  # checks --out (and an interrupted run's state) before loading
    todo = [i for i in range(len(prompts)) if i not in writer.done]
    if writer.done:
        log(f"resuming {writer.partial}: {len(writer.done)} of {len(prompts)} prompts already extracted")
    log(f"loading target {target} on {dev} ({str(dt).removeprefix('torch.')})")
    model = load_target(target, dev, dt)
    eos = eos_ids_of(target)
    with writer as w:
        lengths = [len(encoded[i]) + max_new_tokens for i in todo]
        for group in batches(lengths, batch_size, batch_tokens):
            idx = sorted(todo[j] for j in group)
            seqs = greedy_complete_batch(model, [encoded[i] for i in idx], max_new_tokens, eos)
            feats = tapped_features_batch(model, [torch.tensor(x) for x in seqs], layer_ids)  # [T, n, H] each
            for i, ids, f in zip(idx, seqs, feats):
                w.add(prompts[i][0], len(encoded[i]), torch.tensor(ids), f, index=i)
                log(f"[{len(w.done)}/{len(prompts)}] {prompts[i][0]}: {len(ids)} tokens ({len(encoded[i])} "
                    f"prompt + {len(ids) - len(encoded[i])} completion)")
    return open_cache(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF model directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--prompts", required=True, help=".jsonl of {name, prompt} or .txt with one prompt a line")
    p.add_argument("--out", required=True, help="cache directory to create (must not exist)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="greedy completion length cap (default 512)")
    p.add_argument("--layers", help="tapped decoder layers, e.g. 1,16,31,46,61 (default: --for-drafter's)")
    p.add_argument("--for-drafter", metavar="PATH",
                   help="take --layers from this drafter's target_layer_ids (its config.json, or the .pt's config)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="auto = bf16 on GPU, fp32 on CPU")
    p.add_argument("--num-prompts", type=int, default=None, help="only the first N prompts")
    p.add_argument("--batch-size", type=int, default=32, help="prompts generated together (default 32)")
    p.add_argument("--batch-tokens", type=int, default=32768,
                   help="padded tokens per batch, prompt + max new tokens per prompt (default 32768)")


def layers_arg(layers: str | None, for_drafter: str | None) -> list[int]:
    """--layers, else the target_layer_ids of --for-drafter's config; neither is bad input."""
    if layers:
        return parse_layer_ids(layers)
    if not for_drafter:
        raise PayloadError("extract needs the tapped layers: --layers 1,16,31,46,61, or --for-drafter PATH to take "
                           "the drafter's target_layer_ids")
    from remote_payload.eval.checkpoint import load_drafter, peek_config
    cfg = peek_config(for_drafter) or load_drafter(for_drafter)[0].cfg  # .pt: its config is inside the file
    return list(cfg.target_layer_ids)


def main(args: argparse.Namespace) -> int:
    try:
        c = extract(args.target, args.prompts, args.out, max_new_tokens=args.max_new_tokens,
                    layer_ids=layers_arg(args.layers, args.for_drafter), device=args.device, dtype=args.dtype,
                    num_prompts=args.num_prompts, batch_size=args.batch_size, batch_tokens=args.batch_tokens)
    except PayloadError as e:
        print(f"error: {e}")
        return e.exit_code
    print(f"wrote {len(c)} prompts, layers {c.layer_ids}, H={c.hidden_size} -> {c.path}")
    return 0
