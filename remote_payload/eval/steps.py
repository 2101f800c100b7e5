"""The eval's five steps (run.py's module doc), each said on stdout and in events.jsonl (`Reporter`).

Steps 1-2 open the tokenizer and the cache (`open_inputs`); step 3, every prompt's features validated
(`feature_pass`), runs beside step 4's weight load and kernel warm-up (`load_beside_features`: `read_weights` on
a thread, `load_model` its checks and log); step 5 drafts at every anchor and walks (`eval_prompts`).
`cache_exactness` reads the argmax agreement `extract` recorded.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from remote_payload.contract import protocol
from remote_payload.contract import results as R
from remote_payload.contract.drafterconfig import check_features
from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular
from remote_payload.eval import anchors, metrics, rtc, samples
from remote_payload.eval.anchors import drafted_prompts, warm_up
from remote_payload.eval.cache import open_cache
from remote_payload.eval.checkpoint import load_drafter, load_target_head, peek_config
from remote_payload.eval.evalopts import EvalOptions
from remote_payload.eval.summary import decode, fmt

STEPS = 5


class Reporter:
    """Human lines on stdout (the seeds' style) + the same progress as events.jsonl."""

    def __init__(self, events_path: Path | None):
        self.events_path = events_path

    def step(self, k: int, stage: str, title: str) -> None:
        print(f"\n[{k}/{STEPS}] {title}", flush=True)
        self.event(stage=stage, step=k, steps=STEPS, message=title)

    def line(self, text: str, **event) -> None:
        print(text, flush=True)
        if event:
            self.event(message=text.strip(), **event)

    def event(self, **event) -> None:
        if self.events_path is not None:
            protocol.append_event(self.events_path, event)


def load_weights(drafter_path: str, target: str, device: torch.device, dtype: torch.dtype, allow_unknown=()):
    """(drafter, DrafterInfo, TargetHead, HeadInfo). When the drafter's config can be read first (z-lab
    layout), the drafter and the target's embed/lm_head are read by threads side by side (page-cached reads
    are CPU-bound per thread), on CUDA on a stream of their own."""
    peek = peek_config(drafter_path, allow_unknown)
    if peek is None:
        drafter, info = load_drafter(drafter_path, device=device, dtype=dtype, allow_unknown=allow_unknown)
        head, hinfo = load_target_head(target, vocab_size=drafter.cfg.vocab_size,
                                       hidden_size=drafter.cfg.hidden_size, device=device, dtype=dtype)
        return drafter, info, head, hinfo
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def on_side(fn, *args, **kw):
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            return fn(*args, **kw)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="reval-load") as ex:
        head_f = ex.submit(on_side, load_target_head, target, vocab_size=peek.vocab_size,
                           hidden_size=peek.hidden_size, device=device, dtype=dtype)
        drafter_f = ex.submit(on_side, load_drafter, drafter_path, device=device, dtype=dtype,
                              allow_unknown=allow_unknown)
        drafter, info = drafter_f.result()
        head, hinfo = head_f.result()
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)  # the weights are ready for this stream's kernels
    return drafter, info, head, hinfo


def _stats(x: torch.Tensor) -> tuple[float, float]:
    x = x.float()
    return x.mean().item(), x.std().item()


@dataclass
class Inputs:
    """Steps 1-3: the tokenizer, the cache, the prompts evaluated and their feature statistics."""
    tok: object
    cache: object
    prompts: list
    feature_stats: dict


@dataclass
class Loaded:
    """Step 4: the drafter and the target head it borrows."""
    drafter: object
    info: object
    head: object
    hinfo: object
    target_matches: bool | None     # the target's config is the one the cache was extracted with
    embed_stats: dict
    load_s: float  # the weights alone (the warm-up after them is in the log line)


@dataclass
class Drafted:
    """Step 5: per-prompt records of the walks and the drafts/targets the health guard reads."""
    per_prompt: list
    drafts: np.ndarray
    targets: np.ndarray
    prompt_set: str
    num_anchors: int
    eval_s: float
    batch_size: int


def open_inputs(opts: EvalOptions, rep: Reporter, tok) -> tuple:
    """Steps 1-2: (tokenizer, cache, the prompts evaluated). `tok`: `load_tokenizer(opts.target)`, whose helper
    process reads the file beside the weight load (its vocabulary is logged at step 4)."""
    rep.step(1, "tokenizer", "Loading tokenizer...")
    rep.line(f"  {tok.path}: read by a helper process beside the weights" if tok is not None
             else "  vocab_size=n/a (no tokenizer.json: tokens shown as ids)")

    rep.step(2, "completions", f"Loading cached completions from {opts.cache}...")
    cache = open_cache(opts.cache, seeds_layer_ids=opts.cache_layers)
    regime = check_regime(opts, cache)
    prompts = cache.prompts[: _entries_of(cache, opts.num_prompts)] if opts.num_prompts else cache.prompts
    rep.line(f"  Loaded {len(cache.prompts)} cached completions")
    if regime is not None:
        rep.line(f"  sampled cache: {regime.label()}; --draft {opts.draft}", stage="regime",
                 regime={**regime.to_json(), "draft": opts.draft})
    if opts.num_prompts and opts.num_prompts > len(cache.prompts):
        rep.line(f"  warning: --num-prompts {opts.num_prompts} is more than the cache holds: using all "
                 f"{len(cache.prompts)}")
    rep.line(f"  Got {len(prompts)} valid completions (layers {cache.layer_ids}, hidden {cache.hidden_size})")

    return tok, cache, prompts


def check_regime(opts: EvalOptions, cache):
    """The cache's regime (None: greedy), refused where the options cannot take it (one line, exit 3)."""
    regime = cache.regime
    if regime is None and opts.draft == "sampled":
        raise PayloadError(f"--draft sampled needs a sampled cache (extract --temperature T --seed S); "
                           f"{cache.path} is greedy: use --draft greedy")
    if regime is None and opts.online_seeds is not None:
        raise PayloadError(f"--online-seeds needs a sampled cache (extract --temperature T --seed S); {cache.path} "
                           "is greedy, whose online decode is deterministic: drop --online-seeds")
    return regime


def _entries_of(cache, num_prompts: int) -> int:
    """Cache entries of the first num_prompts prompts (a sampled cache: every sample of each)."""
    if cache.regime is None:
        return num_prompts
    seen: list[str] = []
    for i in range(len(cache.prompts)):
        name = cache.sample_of(i)[0]
        if name not in seen:
            if len(seen) == num_prompts:
                return i
            seen.append(name)
    return len(cache.prompts)


# While the weights load beside it, the feature pass's torch ops run on one CPU thread: torch's intra-op pool on
# every core fought the load's readers (and the content hash's threads; docs/benchmarks.md). Once the load is
# done the pass gets the pool back, and the eval stage has it as before.
FEATURE_THREADS_BESIDE_LOAD = 1


def feature_pass(opts: EvalOptions, cache, prompts: list, rep: Reporter,
                 loading: Callable[[], bool] = lambda: False) -> dict:
    """Step 3: every prompt's features validated and summarised ({name: {mean, std}}); runs beside the
    weight load (`evaluate`; `loading()` says whether it still runs)."""
    rep.step(3, "load_cache", f"Loading cached hidden states from {opts.cache}...")
    # Validated and summarised here, not kept: the eval re-reads each prompt with only the drafter's layers
    # (page-cache warm), so host memory holds one prompt's features at a time.
    feature_stats = {}
    threads = torch.get_num_threads()
    try:
        for i, p in enumerate(prompts):
            torch.set_num_threads(FEATURE_THREADS_BESIDE_LOAD if loading() else threads)
            _ids, feats_all = cache.load(i)  # validated: shapes, NaN/inf (prompts is a prefix of the cache)
            mean, std = _stats(feats_all)
            if not std > 0:
                raise PayloadError(f"cache {opts.cache}: prompt {p.name!r} features are constant (std {std}); "
                                   f"re-extract it")
            feature_stats[p.name] = {"mean": mean, "std": std}
            del feats_all
            rep.line(f"  [{i + 1}/{len(prompts)}] {p.name}: {p.seq_len} tokens aux_mean={mean:.4f} "
                     f"aux_std={std:.4f}", stage="load_cache", step=3, steps=STEPS, i=i + 1, n=len(prompts))
    finally:
        torch.set_num_threads(threads)
    return feature_stats


def batch_size(opts: EvalOptions, device: torch.device) -> int:
    """Anchors per drafter forward: --batch-size, else 128 on a GPU and 32 on the CPU."""
    return opts.batch_size or (128 if device.type == "cuda" else 32)


def read_weights(opts: EvalOptions, first, device: torch.device, dtype: torch.dtype) -> tuple:
    """The weight load of step 4 and the warm-up on `first` prompt's shapes (anchors.warmup_mode), printing
    nothing (it runs beside step 3): (drafter, info, head, hinfo, warm-up [(seconds, parts)], load seconds)."""
    if device.type == "cuda" and device.index is not None:  # a thread's current device is its own
        with torch.cuda.device(device.index):
            return _read_weights(opts, first, device, dtype)
    return _read_weights(opts, first, device, dtype)


def _read_weights(opts: EvalOptions, first, device: torch.device, dtype: torch.dtype) -> tuple:
    t_load = time.perf_counter()
    batch = batch_size(opts, device)
    rtc.precompile(device)  # the CUDA C kernels read (or, on a new host, compiled) beside everything else
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reval-prime") as ex:
        primed = _start_prime(ex, opts, device, dtype, batch)
        drafter, info, head, hinfo = load_weights(opts.drafter, opts.target, device, dtype, opts.allow_unknown_config)
        t = time.perf_counter()
        load_s = t - t_load
        prime = _prime_outcome(primed)  # the warm-up's seconds count any wait for it
    n = (first.seq_len - 1 - first.prompt_len if opts.all_anchors
         else metrics.num_anchors(first.prompt_len, first.seq_len, opts.max_blocks, drafter.cfg.block_size))
    parts = warm_up(drafter, head, device, dtype, seq_len=first.seq_len, prompt_len=first.prompt_len, n=n,
                    batch_size=batch, budgets=opts.ddtree_budgets, widths=opts.tree_widths)
    note = {"CUDA C kernels": rtc.how(device)} if device.type == "cuda" else {}
    warmed = [] if parts is None else [(time.perf_counter() - t, {**parts, **prime, **note})]
    return drafter, info, head, hinfo, warmed, load_s


def _start_prime(ex: ThreadPoolExecutor, opts: EvalOptions, device: torch.device, dtype: torch.dtype, batch: int):
    """anchors.prime on its own thread beside the load, where the drafter's config can be read first (a config
    that fails here fails the load, which says why); None where it does not run."""
    if device.type != "cuda" or anchors.warmup_mode() == "off":
        return None
    try:
        cfg = peek_config(opts.drafter, opts.allow_unknown_config)
    except Exception:  # noqa: BLE001 - the load reads the same config and reports it
        return None
    if cfg is None:
        return None

    def run():
        with torch.cuda.device(device):
            return anchors.prime(cfg, device, dtype, batch_size=batch, budgets=opts.ddtree_budgets,
                                 widths=opts.tree_widths)
    return ex.submit(run)


def _prime_outcome(primed) -> dict:
    """The warm-up log's word on the prime: its seconds (it ran beside the load; the load waited for it only
    past its own end), or that it failed and why (the warm-up after the load does its work then)."""
    if primed is None:
        return {}
    try:
        s = primed.result()
    except Exception as e:  # noqa: BLE001 - said in the log line; the warm-up on the real weights follows
        return {"prime failed": " ".join(f"{type(e).__name__}: {e}".split())[:200]}  # one line
    return {} if s is None else {"primed beside the load": s}


def load_model(opts: EvalOptions, inp: Inputs, device: torch.device, dtype: torch.dtype, rep: Reporter,
               weights) -> Loaded:
    """Step 4: the checks and the log of the weights `read_weights` is loading (`weights`: its Future)."""
    rep.step(4, "load_drafter", f"Loading drafter {opts.drafter}...")
    drafter, info, head, hinfo, warmed, load_s = weights.result()
    cache = inp.cache
    cfg = drafter.cfg
    check_features(cfg, cache.layer_ids, cache.hidden_size)  # names dims and layer ids on a mismatch
    rep.line(f"  layout={info.layout} params={info.num_parameters:,} fc layers {cfg.fc_layer_ids} "
             f"block_size={cfg.block_size} layers={cfg.num_hidden_layers}")
    rep.line(f"  attention (type/window/causal inside the block): {R.attention_signature(layer_attention(cfg))}")
    for rule in info.renamed:
        rep.line(f"  weight names: {rule} (vLLM's names for the same tensors)")
    if info.mask_embedding:
        rep.line(f"  mask embedding: {info.mask_embedding} replaces embed_tokens[{cfg.mask_token_id}] in the block")
    for c in cfg.conflicts:  # the documented precedence decided; said, as results.json's notes say it
        rep.line(f"  warning: drafter config: {c}", stage="warning")
    if cfg.allowed_unknown:
        rep.line(f"  warning: config keys allowed without interpretation (--allow-unknown-config): "
                 f"{', '.join(cfg.allowed_unknown)}", stage="warning")
    for key, st in info.weight_stats.items():
        rep.line(f"  {key}: mean={st['mean']:.4f} std={st['std']:.4f}")
    rep.line(f"  target head: embed {hinfo.embed_key!r}, lm_head "
             f"{'tied to embed' if hinfo.tied else repr(hinfo.lm_head_key)} from {Path(hinfo.source).name}")
    cached_sha = ((cache.meta or {}).get("target") or {}).get("config_sha256")
    cfg_file = Path(opts.target) / "config.json"
    try:
        target_matches = (None if not (cached_sha and cfg_file.exists())
                          else hashlib.sha256(read_regular(cfg_file)).hexdigest() == cached_sha)
    except OSError as e:  # a folder, a FIFO, a device: never read
        raise PayloadError(f"{cfg_file} cannot be read ({e.strerror}): replace it with the target's config.json")
    if target_matches is False:  # a warning, not an error: a re-saved config of the same model differs too
        rep.line(f"  warning: {cfg_file} is not the config the cache was extracted with "
                 f"({(cache.meta.get('target') or {}).get('path')}); check --target", stage="warning")
    e_mean, e_std = _stats(head.embed)
    rep.line(f"  embed_tokens: mean={e_mean:.4f} std={e_std:.4f}")
    if inp.tok is not None:  # read by its helper process while the weights loaded
        rep.line(f"  tokenizer: vocab_size={inp.tok.get_vocab_size()}")
    parts = " ".join(f"{k} {v:.2f}s" if isinstance(v, float) else f"{k} ({v})" for k, v in warmed[0][1].items()) \
        if warmed else ""
    rep.line(f"  loaded in {load_s:.2f}s" + (f" (kernels warmed up after it in {warmed[0][0]:.2f}s: {parts})"
                                             if warmed else ""), stage="load_drafter", step=4, steps=STEPS)
    return Loaded(drafter, info, head, hinfo, target_matches, {"mean": e_mean, "std": e_std}, load_s)


def eval_prompts(opts: EvalOptions, inp: Inputs, mod: Loaded, device: torch.device, dtype: torch.dtype,
                 rep: Reporter) -> Drafted:
    prompts, tok, cfg = inp.prompts, inp.tok, mod.drafter.cfg
    rep.step(5, "eval", f"Evaluating {len(prompts)} prompts x {opts.max_blocks} blocks...")
    bs, batch = cfg.block_size, batch_size(opts, device)
    budgets, widths = opts.ddtree_budgets, opts.tree_widths
    regime = inp.cache.regime
    transform = regime.transform if regime is not None and opts.draft == "sampled" else None
    per_prompt, all_drafts, all_targets = [], [], []
    prompt_hash = hashlib.sha256()
    t_eval = time.perf_counter()
    n_anchors_total = 0

    def anchors_of(i: int) -> int:  # the anchors the walk can reach; --all-anchors: every completion anchor
        p = prompts[i]
        return (max(0, p.seq_len - 1 - p.prompt_len) if opts.all_anchors
                else metrics.num_anchors(p.prompt_len, p.seq_len, opts.max_blocks, bs))

    # the device runs a prompt ahead of this loop: its walks and metrics overlap the next prompt's drafting
    for i, ids, out in drafted_prompts(mod.drafter, mod.head, inp.cache, len(prompts), anchors_of, device=device,
                                       dtype=dtype, batch_size=batch, budgets=budgets, widths=widths,
                                       transform=transform):
        p, n = prompts[i], anchors_of(i)
        rep.line(f"  [{i + 1}/{len(prompts)}] {p.name}: {p.seq_len} tokens", stage="eval", step=5, steps=STEPS,
                 i=i + 1, n=len(prompts))
        g = ids.numpy()
        prompt_hash.update(g.astype(np.int64).tobytes() + p.prompt_len.to_bytes(8, "little"))
        n_anchors_total += n
        rec = metrics.prompt_metrics(out.drafts, out.target_rank, out.topk_logprobs, g, p.prompt_len,
                                     opts.max_blocks, bs, budgets=budgets, widths=widths, tree_acc=out.tree_acc)
        all_drafts.append(out.drafts)
        all_targets.append(metrics.target_tokens(g, p.prompt_len, n, bs - 1))
        first = {"draft": decode(tok, out.drafts[0]) if n else "",
                 "target": decode(tok, all_targets[-1][0]) if n else ""}
        per_prompt.append({"name": p.name, "num_anchors": n, **rec, "first_block": first})
        if transform is not None:
            per_prompt[-1]["expected"] = samples.expected(out.target_q, inp.cache.load_logp(i), p.prompt_len,
                                                          p.seq_len, opts.max_blocks, bs)
            rec = {**rec, "tau": per_prompt[-1]["expected"]["tau"]}
        tau_p, pos1 = rec["tau"], rec["position_accuracy"][0]
        if i == 0 and n:
            rep.line(f"      first block, drafted: {first['draft']!r}")
            rep.line(f"      first block, target : {first['target']!r}")
        rep.line(f"      {len(rec['acceptance_lengths'])} rounds · {'E[tau | y]' if transform else 'tau'} {fmt(tau_p)} "
                 "· position-1 accuracy "
                 f"{fmt(pos1)}", stage="eval_prompt", i=i + 1, n=len(prompts),
                 metrics={"tau": tau_p, "position_1_accuracy": pos1})
    if device.type == "cuda":
        torch.cuda.synchronize()
    if regime is not None:  # one record per prompt, its samples inside (samples.by_prompt)
        per_prompt = samples.by_prompt(per_prompt, [inp.cache.sample_of(i) for i in range(len(prompts))])
    return Drafted(per_prompt, np.concatenate(all_drafts), np.concatenate(all_targets),
                   "sha256:" + prompt_hash.hexdigest(), n_anchors_total, time.perf_counter() - t_eval, batch)


def layer_attention(cfg) -> list:
    """Each drafter layer's resolved attention (drafterconfig.py's rules), as results.json records it."""
    return [R.LayerAttention(layer=i, type=cfg.layer_type(i), window=cfg.layer_window(i),
                             causal_in_block=cfg.layer_is_causal(i)) for i in range(cfg.num_hidden_layers)]


def load_beside_features(opts: EvalOptions, tok, cache, prompts: list, device: torch.device, dtype: torch.dtype,
                         rep: Reporter) -> tuple[Inputs, Loaded]:
    """Steps 3-4: the weights load (and the kernels warm up) on a thread while this one validates the features."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reval-weights") as ex:
        weights = ex.submit(read_weights, opts, prompts[0], device, dtype)
        try:
            inp = Inputs(tok, cache, prompts, feature_pass(opts, cache, prompts, rep,
                                                           loading=lambda: not weights.done()))
        except BaseException:
            weights.cancel()
            raise
        return inp, load_model(opts, inp, device, dtype, rep, weights)


MIN_ARGMAX_AGREEMENT = 0.99


def cache_exactness(cache, health: dict, rep: Reporter, suite: str | None = None) -> None:
    """The cache's exactness as `extract` recorded it (the target's argmax over its own prefill vs the cached next
    tokens): a log line; below MIN_ARGMAX_AGREEMENT a health reason (the run is marked suspect)."""
    what = f"cache {suite}" if suite else "cache"
    a, gen = getattr(cache, "agreement", cache.argmax_agreement), (cache.meta or {}).get("generation") or {}
    sampled = getattr(cache, "regime", None) is not None
    word = "sampled agreement" if sampled else "argmax agreement"
    if a is None:
        rep.line(f"  {what}: {word} not recorded (extracted before `extract` recorded it)")
        return
    how = f" (completions by {gen['generator']}, {gen.get('dtype')})" if gen.get("generator") else ""
    said = ("the cached token has probability > 0 under the transform" if sampled
            else "the target's argmax is the cached next token")
    rep.line(f"  {what}: {word} {a:.4f}: {said} at that fraction of the completion positions{how}",
             stage="cache_exactness", **{word.replace(" ", "_"): a})
    if a < MIN_ARGMAX_AGREEMENT:
        reason = (f"{what} {word} {a:.4f} < {MIN_ARGMAX_AGREEMENT}: its tokens are not what its hidden "
                  "states predict")
        health["suspect"] = True
        health["reasons"].append(reason)
        health["hints"].append("re-extract the cache with this target (`python -m remote_payload extract`; its "
                               "cache.json generation says how this one was made)")
        rep.line(f"\nwarning: SUSPECT RESULT — {reason}.\n         {health['hints'][-1]}. results.json marked "
                 "suspect.", stage="suspect")
