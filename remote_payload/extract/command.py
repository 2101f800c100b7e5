"""`python -m remote_payload extract`: the target over prompts -> a hidden-state cache.

Per prompt: greedy-complete (max_new_tokens, stop after eos), then ONE causal prefill of prompt + completion
keeping hs[l+1] for each tapped layer l (hs[0] is the embedding output, so hs[l+1] is decoder block l's output;
for the last block HF returns it after the final norm). `extract` does both for batches of prompts (decode.py:
the generation, left padding; prefill.py: the prefill, right padding; each row equal to its batch-1 run), runs
the batches in this process (batching.py) or in one process per GPU (pool.py), and is resumable.

Prompts: read by prompts/files.py (`read_prompts`), rendered by the target's chat template (prompts/chat.py).
"""
from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch

from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular
from remote_payload.eval.cache import Cache, open_cache
from remote_payload.eval.devices import resolve_device_dtype
from remote_payload.eval.regime import Regime, check_resume, entry_name
from remote_payload.extract.batching import LocalRunner, batches
from remote_payload.extract.decode import choose_generator, generation_record
from remote_payload.extract.options import data_kwargs, run_kwargs
from remote_payload.extract.pool import PoolRunner, parse_gpus
from remote_payload.extract.recipe import Recipe, recipe_of
from remote_payload.extract.writer import CacheWriter
from remote_payload.prompts.chat import resolve_chat_template
from remote_payload.prompts.files import entry_names, read_prompts
from remote_payload.target.load import check_target, eos_ids_of, load_target, weights_bytes


def extract(target: str | os.PathLike, prompts_file: str | os.PathLike, out: str | os.PathLike, *,
            max_new_tokens: int, layer_ids: list[int], device: str = "auto", dtype: str = "auto",
            num_prompts: int | None = None, batch_size: int = 32, batch_tokens: int = 32768,
            chat_template: str = "auto", enable_thinking: bool = False, gpus: str | None = None,
            shard: bool = False, compile: bool = False, hash_memo: str | os.PathLike | None = None,
            labels: dict | None = None, progress=None, regime: Regime | None = None,
            log=print) -> Cache:
    """Run the target over the prompts and write a reval cache at `out` (atomically; resumable: an interrupted
    run's finished prompts are kept in `.OUT.partial` and the same command continues from there).

    Prompts go in batches (longest first, <= batch_size prompts and ~batch_tokens padded tokens each): one
    batched greedy generation with a KV cache (`choose_generator`: fastgen.greedy_static, its decode step a
    CUDA graph on CUDA; greedy_complete_batch where the target needs it), then one batched prefill of prompt +
    completion for the tapped hidden states and the argmax agreement (`prefill_batch`); a background thread
    writes a batch's files while the next one computes. Multi-turn records go turn by turn: round k batches
    every conversation's turn k, whose prompt holds the completions of round < k. The cache equals a batch-1
    run's (tests/test_extract*.py). cache.json records "generation" (how) and "argmax_agreement" (exactness).
    `chat_template` auto|on|off and `enable_thinking`: see the module docstring; num_prompts counts records.
    gpus: "0,1,..." or "all": one process a GPU (pool.py), the batches formed as one process forms
    them, so the cache equals a one-GPU run's; "cpu,cpu": CPU processes (tests). shard: one process, the target
    spread over those GPUs (device_map), for a target too big for one; chosen by itself when the weights take
    more than 80% of a GPU's memory. compile: the decode step through torch.compile (`Generator`; CUDA only).
    The resume key and cache.json's "recipe" are the extract's recipe (recipe.py; hash_memo: where the
    target's content hash is kept between runs, e.g. a cache store's). labels: more cache.json fields that
    name the cache without changing it (a store's {"store": {"suite": ...}}); progress(done, total, name):
    called as each prompt is finished.

    regime (eval/regime.py; None: greedy): the completions are sampled with its transform, `samples` per prompt,
    each its own entry `<prompt>~s<i>` drawing from its own generator (seed, prompt, sample), so the cache is
    the same whatever the batches or processes; cache.json records it under "sampling", each entry's file its
    tokens' log-probs, and "sampled_agreement" replaces the argmax agreement."""
    target = Path(target)
    devices, cuda_ids = _devices(gpus, device, shard)
    _check_sizes(num_prompts, max_new_tokens, batch_size, batch_tokens)
    shape, records = read_prompts(prompts_file, num_prompts)
    config = check_target(target, layer_ids)
    H = config.get("hidden_size") or config.get("text_config", {}).get("hidden_size")
    template = resolve_chat_template(target, chat_template, enable_thinking, records, prompts_file)
    from tokenizers import Tokenizer
    entries = _Entries(records, template, Tokenizer.from_file(str(target / "tokenizer.json")), regime)
    encoded = {j: entries.prompt_ids(j, {}) for j, at in enumerate(entries.at) if at[1] == 0}
    empty = [entries.names[j] for j, ids in encoded.items() if not ids]
    if empty:
        raise PayloadError(f"prompt {empty[0]!r} tokenizes to nothing; remove it from {prompts_file}")
    prompt_format = {"source": Path(prompts_file).name, "shape": shape, "chat_template": template is not None,
                     "chat_template_sha256": template.sha256 if template else None,
                     "enable_thinking": enable_thinking if template else None}
    dev, dt = resolve_device_dtype(devices[0] if devices else device, dtype)
    recipe = recipe_of(target, prompts_file, layer_ids=layer_ids, max_new_tokens=max_new_tokens,
                       dtype=str(dt), chat_template=chat_template, enable_thinking=enable_thinking,
                       num_prompts=num_prompts, memo=hash_memo, regime=regime)
    writer = _writer(out, target, recipe, int(H), {"prompt_format": prompt_format,
                     "hf_hidden_states": [l + 1 for l in layer_ids], **_sampling_meta(regime),
                     **(labels or {})})
    if writer.done:
        check_resume(writer.resumed_metadata.get("sampling"), regime, str(writer.partial))
    completions = _resumed(writer, entries)
    if writer.done:
        log(f"resuming {writer.partial}: {len(writer.done)} of {len(entries.at)} prompts already extracted")
    n_turns = sum(len(turns) for _, turns in records)
    turns_note = f", {n_turns} turns" if n_turns != len(records) else ""
    if regime is not None:
        turns_note += f"; sampled {regime.label()}: {len(entries.at)} completions"
    log(f"prompts: {len(records)} from {Path(prompts_file).name} ({shape}{turns_note}); chat template "
        + (f"on (sha256 {template.sha256[:12]}, enable_thinking={enable_thinking})" if template else "off (raw text)"))
    shard = shard or _too_big_for_one(target, cuda_ids, log)
    eos = eos_ids_of(target)

    def report(j: int, n_prompt: int, n_seq: int) -> None:
        log(f"[{len(writer.done)}/{len(entries.at)}] {entries.names[j]}: {n_seq} tokens ({n_prompt} prompt + "
            f"{n_seq - n_prompt} completion)")
        if progress is not None:
            progress(len(writer.done), len(entries.at), entries.names[j])
    opts = {"layer_ids": layer_ids, "max_new_tokens": max_new_tokens, "eos": eos, "writer": writer, "report": report,
            "regime": regime}
    with writer as w:
        if devices and len(devices) > 1 and not shard:
            log(f"loading target {target} in {len(devices)} processes ({', '.join(devices)}; "
                f"{str(dt).removeprefix('torch.')})")
            runner = PoolRunner(devices, target=target, dtype=dt, batch_size=batch_size, batch_tokens=batch_tokens,
                                compile=compile, **opts)
        else:
            where = f"GPUs {cuda_ids} (sharded)" if shard else str(dev)
            log(f"loading target {target} on {where} ({str(dt).removeprefix('torch.')})")
            model = load_target(target, dev, dt, shard_over=cuda_ids if shard else None)
            gen = choose_generator(model, compile)
            runner = LocalRunner(model, gen, **opts)
            runner.generation = generation_record(model, gen, batch_size=batch_size, batch_tokens=batch_tokens,
                                                  max_new_tokens=max_new_tokens,
                                                  sharded_over=len(cuda_ids) if shard else 0)
        with runner:
            g = runner.generation
            w.meta["generation"] = _with_history(g, w.resumed_metadata.get("generation"))
            log(_generation_line(g, compile, batch_size, batch_tokens))
            _rounds(runner, w, entries, encoded, completions, max_new_tokens, batch_size, batch_tokens)
        _record_agreement(w, regime, log)
    return open_cache(out)


def _record_agreement(w: CacheWriter, regime: Regime | None, log) -> None:
    """cache.json's exactness figure over every finished prompt: the argmax agreement (greedy) or the sampled
    agreement (a regime), said in the log."""
    total = agreement_total(w.done, "argmax_agree" if regime is None else "sampled_agree")
    if total and regime is None:
        w.meta["argmax_agreement"] = total
        log(f"argmax agreement: the target's argmax is the cached next token at {total['matches']} of "
            f"{total['positions']} completion positions ({total['fraction']:.6f})")
    elif total:
        w.meta["sampled_agreement"] = total
        log(f"sampled agreement: the cached token has probability > 0 under the transform ({regime.label()}) "
            f"at {total['matches']} of {total['positions']} completion positions ({total['fraction']:.6f})")


def _writer(out, target: Path, recipe: Recipe, hidden_size: int, metadata: dict) -> CacheWriter:
    """The cache's writer (it checks --out before anything loads), resuming on the recipe's key; cache.json
    records the recipe and its key besides `metadata`."""
    config_sha = hashlib.sha256(read_regular(target / "config.json")).hexdigest()
    return CacheWriter(out, layer_ids=recipe.options["layers"], hidden_size=hidden_size,
                       target_path=str(target.resolve()), target_config_sha256=config_sha,
                       tokenizer_path=str((target / "tokenizer.json").resolve()), resume_key=recipe.key,
                       recipe=recipe.as_dict(),
                       metadata={**metadata, "recipe": {**recipe.as_dict(), "key": recipe.key}})


def _sampling_meta(regime: Regime | None) -> dict:
    """cache.json's "sampling" (absent for greedy: a greedy cache is today's, byte for byte)."""
    return {} if regime is None else {"sampling": regime.to_json()}


def _devices(gpus: str | None, device: str, shard: bool) -> tuple[list[str] | None, list[int]]:
    """--gpus (or None) -> (the devices of the processes, or None: one process on --device; their CUDA
    indices), checked against --device and --shard."""
    devices = None
    if gpus is not None:
        if device != "auto":
            raise PayloadError(f"--gpus {gpus} and --device {device}: give one of them (--gpus 0 is --device cuda:0)")
        devices = parse_gpus(gpus)
    cuda_ids = sorted({torch.device(d).index for d in devices if d.startswith("cuda")}) if devices else []
    if shard and len(cuda_ids) < 2:
        raise PayloadError("--shard spreads the target over several GPUs: name them, e.g. --gpus 0,1 --shard")
    return devices, cuda_ids


def _check_sizes(num_prompts: int | None, max_new_tokens: int, batch_size: int, batch_tokens: int) -> None:
    if num_prompts is not None and num_prompts < 1:
        raise PayloadError(f"--num-prompts {num_prompts}: need at least 1 (or leave it out for all)")
    if max_new_tokens < 1:
        raise PayloadError(f"--max-new-tokens {max_new_tokens}: need at least 1")
    if batch_size < 1 or batch_tokens < 1:
        raise PayloadError(f"--batch-size {batch_size} / --batch-tokens {batch_tokens}: need at least 1")


class _Entries:
    """The cache's entries: entry j is turn k of record r (`at[j] = (r, k)`), named `names[j]`. Sampled (a
    regime): sample s of it is an entry of its own (`at[j] = (r, k, s)`, named `<turn name>~s<s>`, whose later
    turns follow sample s's replies), `draw[j]` = (turn name, s) its generator's identity, `info[j]` the
    prompt's name and the sample index for cache.json."""

    def __init__(self, records: list[tuple[str, list[str]]], template, tok, regime: Regime | None = None):
        self.records, self.template, self.tok = records, template, tok
        base = [n for ns in entry_names(records) for n in ns]
        turns_at = [(r, k) for r, (_, turns) in enumerate(records) for k in range(len(turns))]
        n = 1 if regime is None else regime.samples
        self.at = [(r, k) if regime is None else (r, k, s) for r, k in turns_at for s in range(n)]
        self.names = [b if regime is None else entry_name(b, s) for b in base for s in range(n)]
        self.draw = [None if regime is None else (b, s) for b in base for s in range(n)]
        self.info = [{} if regime is None else {"prompt": b, "sample": s} for b in base for s in range(n)]
        self.last_turn = [len(turns) - 1 for _, turns in records]

    def key(self, j: int, turn: int) -> tuple:
        """(record, turn[, sample]) of entry j's conversation at `turn`: the key of `completions`."""
        return (self.at[j][0], turn, *self.at[j][2:])

    def prompt_ids(self, j: int, completions: dict[tuple, list[int]]) -> list[int]:
        """Entry j's prompt: its turn rendered by the chat template after the earlier turns and the target's
        replies to them (`completions`: `key` -> reply ids); without a template, the raw text."""
        r, k = self.at[j][:2]
        turns, tok = self.records[r][1], self.tok
        if self.template is None:  # raw text, as before chat templates (single-turn only)
            return tok.encode(turns[0]).ids
        messages = []
        for i in range(k):
            reply = tok.decode(completions[self.key(j, i)], skip_special_tokens=True)
            messages += [{"role": "user", "content": turns[i]}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": turns[k]})
        return tok.encode(self.template.render(messages, self.names[j]), add_special_tokens=False).ids


def _resumed(writer: CacheWriter, entries: _Entries) -> dict[tuple, list[int]]:
    """The target's replies that later turns need (`entries.key` -> reply ids), from the entries an interrupted
    run finished; an entry whose earlier turn is to be done again is dropped from `writer.done`."""
    completions: dict[tuple, list[int]] = {}
    step = _samples(entries)
    for j in sorted(writer.done):
        r, k = entries.at[j][:2]
        if k and j - step not in writer.done:  # an earlier turn is to be done again: so is every later one
            del writer.done[j]
        elif k < entries.last_turn[r]:
            completions[entries.key(j, k)] = writer.done_ids(j)[writer.done[j]["prompt_len"]:].tolist()
    return completions


def _samples(entries: _Entries) -> int:
    """Entries a turn has (its samples; 1 when greedy): turn k-1 of entry j is entry j - this."""
    return 1 if len(entries.at[0]) == 2 else 1 + max(a[2] for a in entries.at)


def _too_big_for_one(target: Path, cuda_ids: list[int], log) -> bool:
    """Several GPUs and no --shard: whether the weights take more than 80% of one GPU's memory (then they are
    spread over the GPUs, said in the log)."""
    if len(cuda_ids) <= 1:
        return False
    need = weights_bytes(target)
    have = min(torch.cuda.get_device_properties(i).total_memory for i in cuda_ids)
    if need > 0.8 * have:
        log(f"the target's weights ({need / 2**30:.1f} GiB) take more than 80% of one GPU's memory "
            f"({have / 2**30:.0f} GiB): loading it across GPUs {cuda_ids} (--shard)")
        return True
    return False


def _generation_line(g: dict, compile: bool, batch_size: int, batch_tokens: int) -> str:
    why_not = g.get("why_not_greedy_static")
    return (f"generation: {g['generator']}" + (" + CUDA graph" if g["cuda_graphs"] else "")
            + (" + torch.compile" if g.get("compiled") else "")
            + (f" + {g['decode_fused']}" if g.get("decode_fused") else "")
            + (" (--compile: CUDA graphs only, not used here)" if compile and not g.get("compiled") else "")
            + (f" (not greedy_static: {why_not})" if why_not else "")
            + f", attention {g['attn_implementation']}, batches of <= {batch_size} prompts / {batch_tokens} "
              "tokens; prefill: the tapped layers only, + argmax agreement")


def _rounds(runner, w: CacheWriter, entries: _Entries, encoded: dict[int, list[int]],
            completions: dict[tuple[int, int], list[int]], max_new_tokens: int, batch_size: int,
            batch_tokens: int) -> None:
    """Turn by turn: round k batches every conversation's turn k (whose prompt holds the replies of the
    rounds before)."""
    for turn in range(max(entries.last_turn) + 1):
        todo = [j for j, at in enumerate(entries.at) if at[1] == turn and j not in w.done]
        for j in todo:
            if j not in encoded:
                encoded[j] = entries.prompt_ids(j, completions)
        lengths = [len(encoded[j]) + max_new_tokens for j in todo]
        groups = [sorted(todo[g] for g in group) for group in batches(lengths, batch_size, batch_tokens)]
        for j, ids in runner.run_round(groups, {j: encoded[j] for j in todo}, entries).items():
            r, k = entries.at[j][:2]
            if k < entries.last_turn[r]:
                completions[entries.key(j, k)] = ids[len(encoded[j]):]


def _with_history(current: dict, previous) -> dict:
    """The generation record; when the interrupted run this one resumes generated with other settings, theirs
    under "earlier" (prompts of the cache were made by either)."""
    if not isinstance(previous, dict):
        return dict(current)
    earlier = [e for e in previous.get("earlier", []) if isinstance(e, dict)]
    prev = {k: v for k, v in previous.items() if k != "earlier"}
    if prev != current and prev not in earlier:
        earlier.append(prev)
    return {**current, "earlier": earlier} if earlier else dict(current)


def agreement_total(done: dict[int, dict], field: str = "argmax_agree") -> dict | None:
    """cache.json's "argmax_agreement" ("sampled_agreement") from the prompts' [matches, positions] (`field`);
    None when a prompt lacks them."""
    pairs = [(e.get("info") or {}).get(field) for e in done.values()]
    if not pairs or not all(isinstance(a, list) and len(a) == 2 and all(isinstance(x, int) for x in a)
                            for a in pairs):
        return None
    m, n = sum(a[0] for a in pairs), sum(a[1] for a in pairs)
    return {"fraction": m / n if n else 1.0, "matches": m, "positions": n}


def main(args: argparse.Namespace) -> int:
    """`extract --out DIR` (`extract --store DIR` is storecmd.main's)."""
    try:
        if len(args.prompts) != 1 or not args.out:
            raise PayloadError("extract --out DIR takes one --prompts FILE; several prompt files (--prompts "
                               "NAME=FILE ...) go into a cache store: --store DIR")
        c = extract(args.target, args.prompts[0], args.out, **data_kwargs(args), **run_kwargs(args))
    except PayloadError as e:
        print(f"error: {e}")
        return e.exit_code
    print(f"wrote {len(c)} prompts, layers {c.layer_ids}, H={c.hidden_size} -> {c.path}")
    return 0
