"""The target model: greedy completions + tapped hidden states -> a cache (`python -m remote_payload extract`).

Per prompt: greedy-complete (max_new_tokens, stop after eos), then ONE causal prefill of prompt + completion
with output_hidden_states=True and keep hs[l+1] for each tapped layer l (hs[0] is the embedding output, so
hs[l+1] is decoder block l's output; for the last block HF returns it after the final norm).
`extract` does both for batches of prompts (`greedy_complete_batch`, `tapped_features_batch`: left padding
for the generation, right padding for the prefill, each row equal to its batch-1 run) and is resumable.

Prompts (`read_prompts`): z-lab's `{"turns": [...]}` jsonl (multi-turn, e.g. MT-Bench), `{"prompt": ...}` jsonl,
or a .txt with one prompt a line. With a chat template (`--chat-template auto|on|off`; auto = when the target
has one) each prompt is rendered by transformers' `apply_chat_template(messages, tokenize=False,
add_generation_prompt=True, enable_thinking=...)` as the DFlash/DDTree benchmark scripts do, then tokenized with
the target's tokenizer.json without adding special tokens again. Turn k of a conversation is one cache entry
`<name>/t<k>`: the user turns 1..k with the target's own greedy replies to the earlier turns (decoded, special
tokens skipped) as the assistant messages, generated turn by turn. cache.json records it in "prompt_format".
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


_NAME_KEYS = ("name", "question_id", "id")
PROMPT_SHAPES = ('{"turns": ["...", ...]} (z-lab, multi-turn; optional "question_id"/"id"/"name"), '
                 '{"prompt": "..."} (optional "name"); or a .txt with one prompt a line')


class _BadLine(ValueError):
    """What is wrong with a prompt file's line (read_prompts adds the file and line)."""


def _parse_prompt_line(line: str) -> tuple[str | None, list[str], str]:
    """One jsonl line -> (name or None, turns, shape); _BadLine saying what is wrong."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise _BadLine(f"not JSON ({e})") from None
    if not isinstance(d, dict):
        raise _BadLine(f"a JSON {type(d).__name__}, not an object")
    if "turns" in d and "prompt" in d:
        raise _BadLine('both "turns" and "prompt"')
    if "turns" in d:
        turns = d["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise _BadLine('"turns" is not a non-empty list of non-empty strings')
        shape = "turns"
    elif "prompt" in d:
        if not isinstance(d["prompt"], str) or not d["prompt"].strip():
            raise _BadLine('"prompt" is not a non-empty string')
        turns, shape = [d["prompt"]], "prompt"
    else:
        keys = sorted(" ".join(str(k).split())[:40] for k in d)  # one line, whatever the keys hold
        raise _BadLine(f'no "turns" or "prompt" (keys: {", ".join(keys[:6])}{", ..." if len(keys) > 6 else ""})')
    name = next((d[k] for k in _NAME_KEYS if d.get(k) is not None), None)
    return (None if name is None else str(name)), list(turns), shape


def entry_names(records: list[tuple[str, list[str]]]) -> list[list[str]]:
    """Cache entry names per record: a single-turn prompt keeps its name, turn k of a longer one is <name>/t<k>."""
    return [[name] if len(turns) == 1 else [f"{name}/t{k}" for k in range(1, len(turns) + 1)]
            for name, turns in records]


def read_prompts(path: str | os.PathLike, num_prompts: int | None = None) -> tuple[str, list[tuple[str, list[str]]]]:
    """A prompt file -> (shape, [(name, turns)]) for its first num_prompts records (conversations).

    shape "turns": z-lab's {"turns": [...]} jsonl (name: "name", "question_id" or "id"); "prompt": {"prompt": ...}
    jsonl (also today's {name, prompt}); "txt": any other file, one prompt a line. A record without a name is
    prompt-NNN (its place in the file). One shape per file; a bad line is one line naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise PayloadError(f"--prompts {path}: no such file; pass a .jsonl of {PROMPT_SHAPES}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise PayloadError(f"--prompts {path}: not UTF-8 text ({e}); pass a .jsonl or .txt of prompts") from None
    records: list[tuple[str, list[str]]] = []
    if path.suffix == ".jsonl":
        shape = None
        for n, ln in enumerate(lines, 1):
            if not ln.strip():
                continue
            try:
                name, turns, line_shape = _parse_prompt_line(ln)
            except _BadLine as e:
                raise PayloadError(f"--prompts {path} line {n}: {e}; expected one of {PROMPT_SHAPES}") from None
            if shape is not None and line_shape != shape:
                raise PayloadError(f"--prompts {path} line {n}: a {line_shape!r} line after {shape!r} lines; "
                                   "use one shape per file")
            shape = line_shape
            records.append((name if name is not None else f"prompt-{len(records):03d}", turns))
    else:
        shape = "txt"
        records = [(f"prompt-{i:03d}", [ln]) for i, ln in enumerate(ln for ln in lines if ln.strip())]
    if not records:
        raise PayloadError(f"--prompts {path} holds no prompts; add one prompt per line")
    names = [n for ns in entry_names(records) for n in ns]
    seen: set[str] = set()
    dup = sorted({n for n in names if n in seen or seen.add(n)})
    if dup:
        raise PayloadError(f"--prompts {path}: duplicate names {dup[:5]}; give every prompt its own name")
    return shape, (records[:num_prompts] if num_prompts else records)


def chat_template_source(target: Path) -> str | None:
    """Where the target's chat template is: "tokenizer_config.json" (its chat_template), "chat_template.jinja",
    or None when it has none."""
    cfg = target / "tokenizer_config.json"
    if cfg.is_file():
        try:
            d = json.loads(cfg.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PayloadError(f"--target {target}: tokenizer_config.json is not valid JSON ({e}); fix it, or pass "
                               "--chat-template off for raw text") from None
        if isinstance(d, dict) and d.get("chat_template"):
            return "tokenizer_config.json"
    return "chat_template.jinja" if (target / "chat_template.jinja").is_file() else None


class ChatTemplate:
    """The target's chat template, rendered by transformers' tokenizer (local files only)."""

    def __init__(self, target: Path, enable_thinking: bool):
        try:
            from transformers import AutoTokenizer
            self.hf = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
        except Exception as e:  # whatever a broken tokenizer_config makes transformers raise
            raise PayloadError(f"--target {target}: transformers cannot load its tokenizer to render the chat "
                               f"template ({type(e).__name__}: {_first_line(e)}); fix its tokenizer files or pass "
                               "--chat-template off for raw text") from e
        t = getattr(self.hf, "chat_template", None)
        if not t:
            raise PayloadError(f"--target {target}: transformers' tokenizer has no chat template; pass "
                               "--chat-template off for raw text")
        text = t if isinstance(t, str) else json.dumps(t, sort_keys=True)
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        self.enable_thinking = enable_thinking

    def render(self, messages: list[dict], name: str) -> str:
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               enable_thinking=self.enable_thinking)
        except Exception as e:  # jinja errors, the template's raise_exception
            raise PayloadError(f"prompt {name!r}: the target's chat template fails on it ({type(e).__name__}: "
                               f"{_first_line(e)}); try --chat-template off") from e


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def resolve_chat_template(target: Path, mode: str, enable_thinking: bool,
                          records: list[tuple[str, list[str]]], prompts_file) -> ChatTemplate | None:
    """--chat-template auto|on|off and --enable-thinking -> the template to apply, or None (raw text); checks
    that a multi-turn file or --enable-thinking has a template to go with."""
    if mode not in ("auto", "on", "off"):
        raise PayloadError(f"--chat-template {mode}: expected auto, on or off")
    source = None if mode == "off" else chat_template_source(target)
    if mode == "on" and source is None:
        raise PayloadError(f"--chat-template on: --target {target} has no chat template (no chat_template in "
                           "tokenizer_config.json, no chat_template.jinja); add one, or pass --chat-template off")
    multi = next(((n, len(t)) for n, t in records if len(t) > 1), None)
    if source is None and multi:
        why = "--chat-template off" if mode == "off" else f"--target {target} has no chat template"
        raise PayloadError(f"--prompts {prompts_file}: {multi[0]!r} has {multi[1]} turns, and multi-turn prompts "
                           f"need a chat template ({why}); use a target with a chat template, or --chat-template on")
    if source is None and enable_thinking:
        why = "--chat-template off" if mode == "off" else f"--target {target} has no chat template"
        raise PayloadError(f"--enable-thinking: no chat template is applied ({why}) and only a chat template reads "
                           "enable_thinking; leave --enable-thinking out or use a target with a chat template")
    return ChatTemplate(target, enable_thinking) if source else None


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
            num_prompts: int | None = None, batch_size: int = 32, batch_tokens: int = 32768,
            chat_template: str = "auto", enable_thinking: bool = False, log=print) -> Cache:
    """Run the target over the prompts and write a reval cache at `out` (atomically; resumable: an interrupted
    run's finished prompts are kept in `.OUT.partial` and the same command continues from there).

    Prompts go in batches (longest first, <= batch_size prompts and ~batch_tokens padded tokens each): one
    batched greedy generation with a KV cache, then one batched prefill of prompt + completion for the
    hidden states. Multi-turn records go turn by turn: round k batches every conversation's turn k, whose
    prompt holds the completions of round < k. The cache equals a batch-1 run's (tests/test_extract*.py).
    `chat_template` auto|on|off and `enable_thinking`: see the module docstring; num_prompts counts records."""
    target = Path(target)
    if num_prompts is not None and num_prompts < 1:
        raise PayloadError(f"--num-prompts {num_prompts}: need at least 1 (or leave it out for all)")
    if max_new_tokens < 1:
        raise PayloadError(f"--max-new-tokens {max_new_tokens}: need at least 1")
    if batch_size < 1 or batch_tokens < 1:
        raise PayloadError(f"--batch-size {batch_size} / --batch-tokens {batch_tokens}: need at least 1")
    shape, records = read_prompts(prompts_file, num_prompts)
    config = check_target(target, layer_ids)
    H = config.get("hidden_size") or config.get("text_config", {}).get("hidden_size")
    template = resolve_chat_template(target, chat_template, enable_thinking, records, prompts_file)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    names = [n for ns in entry_names(records) for n in ns]
    entries = [(r, k) for r, (_, turns) in enumerate(records) for k in range(len(turns))]  # entry j -> (record, turn)
    last_turn = [len(turns) - 1 for _, turns in records]

    def prompt_ids(j: int, completions: dict[tuple[int, int], list[int]]) -> list[int]:
        r, k = entries[j]
        turns = records[r][1]
        if template is None:  # raw text, as before chat templates (single-turn only)
            return tok.encode(turns[0]).ids
        messages = []
        for i in range(k):
            messages += [{"role": "user", "content": turns[i]},
                         {"role": "assistant", "content": tok.decode(completions[(r, i)], skip_special_tokens=True)}]
        messages.append({"role": "user", "content": turns[k]})
        return tok.encode(template.render(messages, names[j]), add_special_tokens=False).ids

    encoded = {j: prompt_ids(j, {}) for j, (_, k) in enumerate(entries) if k == 0}
    empty = [names[j] for j, ids in encoded.items() if not ids]
    if empty:
        raise PayloadError(f"prompt {empty[0]!r} tokenizes to nothing; remove it from {prompts_file}")
    prompt_format = {"source": Path(prompts_file).name, "shape": shape, "chat_template": template is not None,
                     "chat_template_sha256": template.sha256 if template else None,
                     "enable_thinking": enable_thinking if template else None}
    dev, dt = resolve_device_dtype(device, dtype)
    config_sha = hashlib.sha256((target / "config.json").read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps({"target": config_sha, "layers": layer_ids, "max_new_tokens": max_new_tokens,
                                     "dtype": str(dt), "prompts": records,
                                     "prompt_format": prompt_format}).encode()).hexdigest()
    writer = CacheWriter(out, layer_ids=layer_ids, hidden_size=int(H), target_path=str(target.resolve()),
                         target_config_sha256=config_sha, tokenizer_path=str((target / "tokenizer.json").resolve()),
                         resume_key=key, metadata={"prompt_format": prompt_format})  # checks --out before loading
    completions: dict[tuple[int, int], list[int]] = {}  # (record, turn) -> the target's reply, for later turns
    for j in sorted(writer.done):
        r, k = entries[j]
        if k and j - 1 not in writer.done:  # an earlier turn is to be done again: so is every later one
            del writer.done[j]
        elif k < last_turn[r]:
            completions[(r, k)] = writer.done_ids(j)[writer.done[j]["prompt_len"]:].tolist()
    if writer.done:
        log(f"resuming {writer.partial}: {len(writer.done)} of {len(entries)} prompts already extracted")
    turns_note = f", {len(entries)} turns" if len(entries) != len(records) else ""
    log(f"prompts: {len(records)} from {Path(prompts_file).name} ({shape}{turns_note}); chat template "
        + (f"on (sha256 {template.sha256[:12]}, enable_thinking={enable_thinking})" if template else "off (raw text)"))
    log(f"loading target {target} on {dev} ({str(dt).removeprefix('torch.')})")
    model = load_target(target, dev, dt)
    eos = eos_ids_of(target)
    with writer as w:
        for turn in range(max(last_turn) + 1):
            todo = [j for j, (_, k) in enumerate(entries) if k == turn and j not in w.done]
            for j in todo:
                if j not in encoded:
                    encoded[j] = prompt_ids(j, completions)
            lengths = [len(encoded[j]) + max_new_tokens for j in todo]
            for group in batches(lengths, batch_size, batch_tokens):
                idx = sorted(todo[g] for g in group)
                seqs = greedy_complete_batch(model, [encoded[j] for j in idx], max_new_tokens, eos)
                feats = tapped_features_batch(model, [torch.tensor(x) for x in seqs], layer_ids)  # [T, n, H] each
                for j, ids, f in zip(idx, seqs, feats):
                    n_prompt = len(encoded[j])
                    w.add(names[j], n_prompt, torch.tensor(ids), f, index=j)
                    r, k = entries[j]
                    if k < last_turn[r]:
                        completions[(r, k)] = ids[n_prompt:]
                    log(f"[{len(w.done)}/{len(entries)}] {names[j]}: {len(ids)} tokens ({n_prompt} "
                        f"prompt + {len(ids) - n_prompt} completion)")
    return open_cache(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF model directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--prompts", required=True,
                   help='.jsonl of {"turns": [...]} (z-lab, multi-turn) or {"prompt": ...} (optional "name"), '
                        "or .txt with one prompt a line")
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"],
                   help="render prompts with the target's chat template: auto = when it has one (tokenizer_config."
                        "json chat_template or chat_template.jinja), on = refuse without one, off = raw text")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=False,
                   help="enable_thinking passed to the chat template (Qwen3 reads it; default off, as the papers)")
    p.add_argument("--out", required=True, help="cache directory to create (must not exist)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="greedy completion length cap (default 512)")
    p.add_argument("--layers", help="tapped decoder layers, e.g. 1,16,31,46,61 (default: --for-drafter's)")
    p.add_argument("--for-drafter", metavar="PATH",
                   help="take --layers from this drafter's target_layer_ids (its config.json, or the .pt's config)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="auto = bf16 on GPU, fp32 on CPU")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="only the first N prompts (conversations, for a multi-turn file)")
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
                    num_prompts=args.num_prompts, batch_size=args.batch_size, batch_tokens=args.batch_tokens,
                    chat_template=args.chat_template, enable_thinking=args.enable_thinking)
    except PayloadError as e:
        print(f"error: {e}")
        return e.exit_code
    print(f"wrote {len(c)} prompts, layers {c.layer_ids}, H={c.hidden_size} -> {c.path}")
    return 0
