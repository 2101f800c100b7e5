"""The target model: greedy completions + tapped hidden states -> a cache (`python -m remote_payload extract`).

Per prompt: greedy-complete (max_new_tokens, stop after eos), then ONE causal prefill of prompt + completion
with output_hidden_states=True and keep hs[l+1] for each tapped layer l (hs[0] is the embedding output, so
hs[l+1] is decoder block l's output; for the last block HF returns it after the final norm).
`extract` does both for batches of prompts (`greedy_complete_batch`, `tapped_features_batch`: left padding
for the generation, right padding for the prefill, each row equal to its batch-1 run) and is resumable.

Prompts: read by prompts/files.py (`read_prompts`), rendered by the target's chat template (prompts/chat.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular
from remote_payload.eval.cache import Cache, CacheWriter, open_cache, parse_layer_ids
from remote_payload.eval.devices import resolve_device_dtype
from remote_payload.prompts.chat import resolve_chat_template
from remote_payload.prompts.files import entry_names, read_prompts
from remote_payload.target.forward import last_logits_kw, new_kv
from remote_payload.target.load import check_target, eos_ids_of, load_target, weights_bytes


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
    kv, keep = new_kv(model), last_logits_kw(model)
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


class _Stop(Exception):  # not an error: raised by a hook to end a forward early
    """Raised by `prefill_batch`'s hook once everything it needs is computed: the rest of the forward is skipped."""


def _decoder_stack(model):
    """(the decoder: the module whose output is the final-normed last hidden state, its decoder blocks) of a HF
    causal LM, or None when not found (prefill_batch then asks for every hidden state)."""
    n = model.config.get_text_config().num_hidden_layers
    for get in (lambda m: m.get_decoder(), lambda m: m.model, lambda m: m.model.language_model):
        try:
            base = get(model)
        except (AttributeError, NotImplementedError, TypeError):
            continue
        layers = getattr(base, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
            return base, layers
    return None


def _block_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _decoder_output(out) -> torch.Tensor:
    h = getattr(out, "last_hidden_state", None)
    return h if h is not None else out[0]


@dataclass
class Prefill:
    """`prefill_batch`'s result: features [B, T, len(layer_ids), H] (right-padded to T = the longest sequence;
    row i's first lens[i] positions are its own) and, when asked for, agree [B, 2] = per row (positions where the
    target's argmax is the next token, completion positions)."""
    features: torch.Tensor
    lens: list[int]
    agree: torch.Tensor | None = None

    def rows(self) -> list[torch.Tensor]:
        return [self.features[i, :n] for i, n in enumerate(self.lens)]


@torch.no_grad()
def prefill_batch(model, seqs: list[torch.Tensor], layer_ids: list[int], prompt_lens: list[int] | None = None,
                  *, chunk_logits: int = 1 << 28) -> Prefill:
    """Several sequences in one causal prefill, RIGHT-padded (a causal position never sees the pads after it, so
    no mask is needed): the tapped hidden states hs[l+1] (`tapped_features`' numbers, bit for bit) and, given
    the prompt lengths, the argmax agreement at the completion positions.

    Forward hooks on the tapped decoder blocks keep their outputs and nothing else (output_hidden_states would
    keep every layer's). hs[n] of the last block l = n-1 is, as HF returns it, after the final norm: the
    decoder's own output, hooked there. The forward ends (`_Stop`) at the last module needed: the last tapped
    block when neither the last block nor the agreement is asked for, else the decoder, so no lm_head runs over
    the whole sequence. The agreement: the final hidden state at the positions that predict a completion token
    (prompt_len-1 .. T-2) through the lm_head in chunks of about `chunk_logits` logits, argmax, compared with
    the tokens. A model whose decoder blocks are not found runs with output_hidden_states (the same numbers)."""
    dev = next(model.parameters()).device
    lens = [len(x) for x in seqs]
    T = max(lens)
    ids = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)] = x
    ids = ids.to(dev)
    cfg = model.config.get_text_config()
    n = cfg.num_hidden_layers
    tie_last = getattr(cfg, "tie_last_hidden_states", None) is not False  # HF: hs[-1] = the normed output
    stack = _decoder_stack(model)
    if stack is None:
        hs = model(ids, output_hidden_states=True, use_cache=False, **last_logits_kw(model)).hidden_states
        if len(hs) != n + 1:
            raise RuntimeError(f"expected {n + 1} hidden states (embeddings + {n} blocks), got {len(hs)}")
        taps, final = {l: hs[l + 1] for l in layer_ids}, hs[n]
    else:
        base, layers = stack
        from_final = {l for l in layer_ids if l == n - 1 and tie_last}
        need_final = bool(from_final) or prompt_lens is not None
        last = None if need_final else max(layer_ids)
        got: dict = {}

        def keep(key, unpack):
            def hook(_module, _args, out):
                got[key] = unpack(out)
                if key == last or (key == "final" and need_final):
                    raise _Stop
            return hook
        hooks = [layers[l].register_forward_hook(keep(l, _block_output)) for l in sorted(set(layer_ids) - from_final)]
        if need_final:
            hooks.append(base.register_forward_hook(keep("final", _decoder_output)))
        try:
            model(ids, use_cache=False, **last_logits_kw(model))
        except _Stop:
            pass
        finally:
            for h in hooks:
                h.remove()
        final = got.get("final")
        taps = {l: final if l in from_final else got[l] for l in layer_ids}
    features = torch.stack([taps[l].to(dev) for l in layer_ids], dim=2)  # [B, T, n_layers, H]
    agree = None if prompt_lens is None else _argmax_agreement(model, final, ids, lens, prompt_lens, chunk_logits)
    return Prefill(features, lens, agree)


def _argmax_agreement(model, final: torch.Tensor, ids: torch.Tensor, lens: list[int], prompt_lens: list[int],
                      chunk_logits: int) -> torch.Tensor:
    """[B, 2] long on final's device: per row, how many completion tokens ids[p..T-1] are the lm_head's argmax
    of final[p-1..T-2], and how many there are."""
    head = model.get_output_embeddings()
    B, dev = final.shape[0], final.device
    rows = torch.cat([torch.full((t - p,), i, dtype=torch.long) for i, (p, t) in enumerate(zip(prompt_lens, lens))])
    cols = torch.cat([torch.arange(p - 1, t - 1) for p, t in zip(prompt_lens, lens)])
    rows, cols = rows.to(dev), cols.to(dev)
    want = ids.to(dev)[rows, cols + 1]
    h = final[rows, cols]  # [N, H]
    step = max(1, chunk_logits // max(1, head.weight.shape[0]))
    hit = torch.cat([head(h[s:s + step]).argmax(-1).to(dev) == want[s:s + step] for s in range(0, h.shape[0], step)])
    out = torch.zeros((B, 2), dtype=torch.long, device=dev)
    out[:, 0].index_add_(0, rows, hit.long())
    out[:, 1].index_add_(0, rows, torch.ones_like(rows))
    return out


def tapped_features_batch(model, seqs: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]:
    """Several sequences in one causal prefill -> per sequence [T_i, len(layer_ids), H], as `tapped_features`
    gives (`prefill_batch` without the agreement: the blocks after the last tapped one do not run)."""
    return prefill_batch(model, seqs, layer_ids).rows()


@dataclass
class Generator:
    """How `extract` generates the completions: `fastgen.greedy_static` (static KV cache; the decode step a CUDA
    graph on CUDA) where the target allows it, else `greedy_complete_batch` (the dynamic-cache reference: the
    same tokens, row for row); `why` says why not greedy_static. compile: the CUDA graph's step is traced
    through torch.compile first (kernel fusion; about a minute once per batch shape, see make bench-decode).
    The decode steps' attention is fastgen.grouped_decode_attention where transformers takes it (on CUDA in
    bf16/fp16 with Triton: its split-KV kernels over the filled slots; cache.json says which); on CUDA in bf16
    their RMSNorms, SiLU MLPs and RoPE are Triton passes (fastgen.FusedLayers; cache.json's decode_fused)."""
    name: str
    graphs: bool = False
    why: str | None = None
    compile: bool = False

    def __call__(self, model, prompts: list[list[int]], max_new_tokens: int, eos: set[int]) -> list[list[int]]:
        if self.name == "greedy_static":
            from remote_payload.eval.fastgen import greedy_static
            return greedy_static(model, prompts, max_new_tokens, eos, graphs=self.graphs, compile=self.compile)
        return greedy_complete_batch(model, prompts, max_new_tokens, eos)


def static_refusal(model) -> str | None:
    """Why `greedy_static` would not compute what `greedy_complete_batch` does on this model, or None. Its 4D
    mask is plain causal: no sliding windows, no linear-attention (recurrent) layers; one device."""
    cfg = model.config.get_text_config()
    types = list(getattr(cfg, "layer_types", None) or [])
    other = sorted(set(types) - {"full_attention"})
    if other:
        return f"layer types {other}"
    if not types and getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "a sliding window"
    if len({p.device for p in model.parameters()}) > 1:
        return "spread over several devices"
    return None


def choose_generator(model, compile: bool = False) -> Generator:
    """compile (extract --compile) applies to the CUDA graph's step: on the CPU there is no graph, the eager
    step runs (the generation record says so)."""
    why = static_refusal(model)
    if why:
        return Generator("greedy_complete_batch", why=why)
    cuda = next(model.parameters()).device.type == "cuda"
    return Generator("greedy_static", graphs=cuda, compile=compile and cuda)


def generation_record(model, gen: Generator, *, batch_size: int, batch_tokens: int, max_new_tokens: int,
                      sharded_over: int = 0) -> dict:
    """cache.json's "generation": what decides the cached numbers beside the target, prompts and layers (how
    many processes wrote the cache does not: a cache of several equals the cache of one)."""
    import transformers
    dev = next(model.parameters()).device
    from remote_payload.eval.fastgen import decode_attention_name, decode_fused_name
    static = gen.name == "greedy_static"
    rec = {"generator": gen.name, "cuda_graphs": gen.graphs, "compiled": gen.compile,
           "decode_attention": decode_attention_name(model) if static else None,
           "decode_fused": decode_fused_name(model, gen.compile) if static else None,
           "batch_size": batch_size, "batch_tokens": batch_tokens,
           "max_new_tokens": max_new_tokens, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
           "attn_implementation": getattr(model.config, "_attn_implementation", None),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type,
           "prefill": "hooked tapped blocks (prefill_batch)", "torch": torch.__version__,
           "transformers": transformers.__version__}
    if gen.why:
        rec["why_not_greedy_static"] = gen.why
    if sharded_over:
        rec["sharded_over_gpus"] = sharded_over
    return rec


@dataclass
class BatchResult:
    """One batch's completions and features, the features on the host (on CUDA still being copied: `wait`)."""
    seqs: list[list[int]]
    features: torch.Tensor  # [B, T, n_layers, H], right-padded
    agree: torch.Tensor     # [B, 2]: argmax matches, completion positions
    lens: list[int]
    ready: object = None    # the CUDA event the copies end at

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


def extract_batch(model, gen: Generator, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                  layer_ids: list[int]) -> BatchResult:
    """Greedy completions of `prompts`, then one prefill of prompt + completion: the tapped features and the
    argmax agreement. On CUDA the copies to the host are queued (pinned memory) and not waited for."""
    seqs = gen(model, prompts, max_new_tokens, eos)
    pre = prefill_batch(model, [torch.tensor(x) for x in seqs], layer_ids, [len(p) for p in prompts])
    if pre.features.device.type != "cuda":
        return BatchResult(seqs, pre.features, pre.agree, pre.lens)
    feats, agree = pre.features.to("cpu", non_blocking=True), pre.agree.to("cpu", non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(pre.features.device))
    return BatchResult(seqs, feats, agree, pre.lens, ready)


def batch_rows(res: BatchResult):
    """(row, ids [T], features [T, n_layers, H], info) per row of a finished batch, info = {"argmax_agree":
    [matches, positions]}."""
    res.wait()
    agree = res.agree.tolist()
    for r, seq in enumerate(res.seqs):
        yield r, torch.tensor(seq), res.features[r, :res.lens[r]], {"argmax_agree": agree[r]}


class Background:
    """Jobs run in order on one thread, at most `depth` waiting (`put` blocks when full): the cache's files are
    written while the next batch computes. The thread's first error is raised in the caller's thread (at the
    next `put`, or on leaving the `with`); after it, or after an error of the caller's, the jobs left are
    dropped (the prompts they held are extracted again on resume)."""

    def __init__(self, depth: int = 2, name: str = "reval-extract-writer"):
        import queue
        import threading
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            if self._error is None and not self._stop:
                try:
                    job()
                except BaseException as e:  # noqa: BLE001 — handed to the caller's thread
                    self._error = e

    def put(self, job) -> None:
        if self._error is not None:
            raise self._error
        self._q.put(job)

    def __enter__(self) -> Background:  # noqa: PYI034
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._stop = True
        self._q.put(None)
        self._thread.join()
        if exc_type is None and self._error is not None:
            raise self._error


class LocalRunner:
    """`extract` in this process: the model here; each batch's files are written by a background thread while the
    next batch computes (`Background`)."""

    def __init__(self, model, gen: Generator, *, layer_ids: list[int], max_new_tokens: int, eos: set[int],
                 writer: CacheWriter, report):
        self.model, self.gen, self.layer_ids, self.max_new_tokens, self.eos = model, gen, layer_ids, max_new_tokens, eos
        self.w, self.report = writer, report

    def __enter__(self) -> LocalRunner:  # noqa: PYI034
        self.bg = Background().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bg.__exit__(*exc)

    def run_round(self, groups: list[list[int]], prompts: dict[int, list[int]], names: list[str]) -> dict:
        """Every group (entry indices) as one batch; returns {entry: prompt + completion ids}."""
        seqs = {}
        for idx in groups:
            res = extract_batch(self.model, self.gen, [prompts[j] for j in idx], self.max_new_tokens, self.eos,
                                self.layer_ids)
            seqs.update(zip(idx, res.seqs))
            self.bg.put(lambda idx=idx, res=res: self._write(idx, res, prompts, names))
        return seqs

    def _write(self, idx: list[int], res: BatchResult, prompts: dict, names: list[str]) -> None:
        for r, ids, feats, info in batch_rows(res):
            j = idx[r]
            self.w.add(names[j], len(prompts[j]), ids, feats, index=j, info=info)
            self.report(j, len(prompts[j]), len(ids))


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
            chat_template: str = "auto", enable_thinking: bool = False, gpus: str | None = None,
            shard: bool = False, compile: bool = False, log=print) -> Cache:
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
    gpus: "0,1,..." or "all": one process a GPU (eval/extract_pool.py), the batches formed as one process forms
    them, so the cache equals a one-GPU run's; "cpu,cpu": CPU processes (tests). shard: one process, the target
    spread over those GPUs (device_map), for a target too big for one; chosen by itself when the weights take
    more than 80% of a GPU's memory. compile: the decode step through torch.compile (`Generator`; CUDA only)."""
    target = Path(target)
    devices = None
    if gpus is not None:
        from remote_payload.eval.extract_pool import parse_gpus
        if device != "auto":
            raise PayloadError(f"--gpus {gpus} and --device {device}: give one of them (--gpus 0 is --device cuda:0)")
        devices = parse_gpus(gpus)
    cuda_ids = sorted({torch.device(d).index for d in devices if d.startswith("cuda")}) if devices else []
    if shard and len(cuda_ids) < 2:
        raise PayloadError("--shard spreads the target over several GPUs: name them, e.g. --gpus 0,1 --shard")
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
    dev, dt = resolve_device_dtype(devices[0] if devices else device, dtype)
    config_sha = hashlib.sha256(read_regular(target / "config.json")).hexdigest()
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
    if len(cuda_ids) > 1 and not shard:
        need, have = weights_bytes(target), min(torch.cuda.get_device_properties(i).total_memory for i in cuda_ids)
        if need > 0.8 * have:
            shard = True
            log(f"the target's weights ({need / 2**30:.1f} GiB) take more than 80% of one GPU's memory "
                f"({have / 2**30:.0f} GiB): loading it across GPUs {cuda_ids} (--shard)")
    eos = eos_ids_of(target)

    def report(j: int, n_prompt: int, n_seq: int) -> None:
        log(f"[{len(writer.done)}/{len(entries)}] {names[j]}: {n_seq} tokens ({n_prompt} prompt + "
            f"{n_seq - n_prompt} completion)")
    opts = {"layer_ids": layer_ids, "max_new_tokens": max_new_tokens, "eos": eos, "writer": writer, "report": report}
    with writer as w:
        if devices and len(devices) > 1 and not shard:
            from remote_payload.eval.extract_pool import PoolRunner
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
            log(f"generation: {g['generator']}" + (" + CUDA graph" if g["cuda_graphs"] else "")
                + (" + torch.compile" if g.get("compiled") else "")
                + (f" + {g['decode_fused']}" if g.get("decode_fused") else "")
                + (" (--compile: CUDA graphs only, not used here)" if compile and not g.get("compiled") else "")
                + (f" (not greedy_static: {g['why_not_greedy_static']})" if g.get("why_not_greedy_static") else "")
                + f", attention {g['attn_implementation']}, batches of <= {batch_size} prompts / {batch_tokens} "
                  "tokens; prefill: the tapped layers only, + argmax agreement")
            for turn in range(max(last_turn) + 1):
                todo = [j for j, (_, k) in enumerate(entries) if k == turn and j not in w.done]
                for j in todo:
                    if j not in encoded:
                        encoded[j] = prompt_ids(j, completions)
                lengths = [len(encoded[j]) + max_new_tokens for j in todo]
                groups = [sorted(todo[g] for g in group) for group in batches(lengths, batch_size, batch_tokens)]
                for j, ids in runner.run_round(groups, {j: encoded[j] for j in todo}, names).items():
                    r, k = entries[j]
                    if k < last_turn[r]:
                        completions[(r, k)] = ids[len(encoded[j]):]
        total = agreement_total(w.done)
        if total:
            w.meta["argmax_agreement"] = total
            log(f"argmax agreement: the target's argmax is the cached next token at {total['matches']} of "
                f"{total['positions']} completion positions ({total['fraction']:.6f})")
    return open_cache(out)


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


def agreement_total(done: dict[int, dict]) -> dict | None:
    """cache.json's "argmax_agreement" from the prompts' [matches, positions]; None when a prompt lacks them."""
    pairs = [(e.get("info") or {}).get("argmax_agree") for e in done.values()]
    if not pairs or not all(isinstance(a, list) and len(a) == 2 and all(isinstance(x, int) for x in a)
                            for a in pairs):
        return None
    m, n = sum(a[0] for a in pairs), sum(a[1] for a in pairs)
    return {"fraction": m / n if n else 1.0, "matches": m, "positions": n}


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
    p.add_argument("--gpus", metavar="IDS",
                   help="several GPUs of this host: 0,1,... or all = one process a GPU, the prompts split between "
                        "them and merged into one cache equal to a one-GPU run's (with --shard: one process, the "
                        "target spread over them). cpu,cpu: CPU processes (tests)")
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
                    chat_template=args.chat_template, enable_thinking=args.enable_thinking, gpus=args.gpus,
                    shard=args.shard, compile=args.compile)
    except PayloadError as e:
        print(f"error: {e}")
        return e.exit_code
    print(f"wrote {len(c)} prompts, layers {c.layer_ids}, H={c.hidden_size} -> {c.path}")
    return 0
