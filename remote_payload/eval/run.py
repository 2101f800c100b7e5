"""`python -m remote_payload eval`: evaluate one drafter on a cache of target hidden states.

    [1/5] tokenizer  [2/5] cached completions  [3/5] cached hidden states  [4/5] drafter + target head
    [5/5] drafting at every anchor, then the walks and metrics (metrics.py) -> results.json

The drafter's output at anchor a depends only on the cached features (< a) and the bonus token g[a], so
the drafter runs ONCE at every anchor the walk could reach (teacher-forced), in large batches over a
prompt's anchors with the prompt's context K/V computed once; every walk (vanilla, DDTree per budget,
width-k) then hops over those per-anchor results. This reproduces online greedy speculative decoding
exactly, and gives position-k accuracy at every anchor for free.

Run directory (protocol.py): events.jsonl as we go, results.json once at the end (atomically), and
status.json only when no wrapper owns it (a standalone run). A PayloadError (bad input) exits 3 with one
line; anything else keeps its traceback and exits 1; nothing half-written either way.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import socket
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from remote_payload import __version__
from remote_payload.contract import protocol
from remote_payload.contract import results as R
from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular
from remote_payload.eval import anchors, metrics, rtc
from remote_payload.eval.anchors import AnchorOutputs, draft_all_anchors, drafted_prompts, warm_up  # noqa: F401 (re-exported)
from remote_payload.eval.cache import open_cache
from remote_payload.eval.checkpoint import check_features, load_drafter, load_target_head, peek_config
from remote_payload.eval.devices import resolve_device_dtype
from remote_payload.eval.evalopts import (
    DEFAULT_BUDGETS,
    DEFAULT_WIDTHS,
    EvalOptions,
    add_arguments,
    options_from_args,
)
from remote_payload.eval.summary import (
    _fmt,
    assess_health,
    decode,
    dtype_name,
    headline,
    load_tokenizer,
    print_summary,
)

__all__ = ["DEFAULT_BUDGETS", "DEFAULT_WIDTHS", "EvalOptions", "add_arguments", "evaluate", "main",
           "options_from_args"]
STEPS = 5


# ---------------------------------------------------------------------------------------------- CLI
def main(args: argparse.Namespace) -> int:
    try:
        opts = options_from_args(args)
    except (PayloadError, protocol.ProtocolError) as e:
        print(f"error: {e}", file=sys.stderr)
        return protocol.EXIT_BAD_INPUT
    run_dir = Path(opts.run_dir)
    if (run_dir / protocol.RESULTS_JSON).exists():
        print(f"error: {run_dir} already holds results.json: pick another --name/--run-dir", file=sys.stderr)
        return protocol.EXIT_BAD_INPUT
    run_dir.mkdir(parents=True, exist_ok=True)
    # under `wrap` (REVAL_WRAPPED) the wrapper owns status.json; standalone, the payload writes its own
    own_status = not os.environ.get("REVAL_WRAPPED") and not (run_dir / protocol.STATUS_JSON).exists()
    started = protocol.now_iso()
    if not (run_dir / protocol.RUN_JSON).exists():
        protocol.atomic_write_json(run_dir / protocol.RUN_JSON, {
            "run": opts.name, "argv": sys.argv, "options": asdict(opts), "host": socket.gethostname(),
            "created_at": started, "payload_version": __version__})
    if own_status:
        _write_status(run_dir, protocol.RUNNING, started)
    rc = protocol.EXIT_FAILED
    sys.stdout = _ClosedReaderTolerant(sys.stdout)  # `eval ... | head`: the eval goes on, its log in events.jsonl
    try:
        results = evaluate(opts, Reporter(run_dir / protocol.EVENTS_JSONL))
        protocol.atomic_write_json(run_dir / protocol.RESULTS_JSON, results)
        print(f"results: {run_dir / protocol.RESULTS_JSON}")
        rc = protocol.EXIT_FAILED if (opts.strict and results["health"]["suspect"]) else protocol.EXIT_OK
        if rc:
            print("error: --strict: the result is SUSPECT (see the warning above); exit 1", file=sys.stderr)
    except PayloadError as e:
        print(f"error: {e}", file=sys.stderr)
        protocol.append_event(run_dir / protocol.EVENTS_JSONL, {"stage": "error", "message": str(e)})
        rc = e.exit_code
    except KeyboardInterrupt:  # Ctrl-C on a standalone eval: one line, no results.json, status cancelled
        print("interrupted: nothing evaluated to the end, no results.json written", file=sys.stderr)
        protocol.append_event(run_dir / protocol.EVENTS_JSONL, {"stage": "error", "message": "interrupted"})
        rc = protocol.EXIT_CANCELLED
    except Exception as e:  # noqa: BLE001 — unexpected: keep the traceback, exit 1
        traceback.print_exc()
        protocol.append_event(run_dir / protocol.EVENTS_JSONL,
                              {"stage": "error", "message": f"{type(e).__name__}: {e}"})
        rc = protocol.EXIT_FAILED
    if own_status:
        state = {protocol.EXIT_OK: protocol.SUCCEEDED, protocol.EXIT_CANCELLED: protocol.CANCELLED}
        _write_status(run_dir, state.get(rc, protocol.FAILED), started, rc)
    return rc


class _ClosedReaderTolerant:
    """stdout that goes quiet instead of raising once its reader has gone (a closed pipe)."""

    def __init__(self, stream):
        self._stream, self._closed = stream, False

    def write(self, text: str) -> int:
        if not self._closed:
            try:
                self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self._closed:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self._closed = True
        try:  # no second EPIPE when the interpreter flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _write_status(run_dir: Path, state: str, started: str, exit_code: int | None = None) -> None:
    st = {"state": state, "pid": os.getpid(), "pgid": os.getpgid(0), "started_at": started,
          "host": socket.gethostname(), "boot_id": protocol.boot_id(), "owner": "payload"}
    if state != protocol.RUNNING:
        st.update(finished_at=protocol.now_iso(), exit_code=exit_code)
    protocol.atomic_write_json(run_dir / protocol.STATUS_JSON, st)


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


# ---------------------------------------------------------------------------------------------- eval
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
    prompts = cache.prompts[: opts.num_prompts] if opts.num_prompts else cache.prompts
    rep.line(f"  Loaded {len(cache.prompts)} cached completions")
    if opts.num_prompts and opts.num_prompts > len(cache.prompts):
        rep.line(f"  warning: --num-prompts {opts.num_prompts} is more than the cache holds: using all "
                 f"{len(cache.prompts)}")
    rep.line(f"  Got {len(prompts)} valid completions (layers {cache.layer_ids}, hidden {cache.hidden_size})")

    return tok, cache, prompts


# While the weights load beside it, the feature pass's torch ops run on one CPU thread: torch's intra-op pool on
# every core fought the load's readers (and the content hash's threads). H200 host, the seeds' run at 27B sizes,
# 5 interleaved pairs of eval processes: the load 2.12 -> 1.80 s (medians). Once the load is done the pass gets
# the pool back, and the eval stage has it as before.
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
                                       dtype=dtype, batch_size=batch, budgets=budgets, widths=widths):
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
        tau_p, pos1 = rec["tau"], rec["position_accuracy"][0]
        if i == 0 and n:
            rep.line(f"      first block, drafted: {first['draft']!r}")
            rep.line(f"      first block, target : {first['target']!r}")
        rep.line(f"      {len(rec['acceptance_lengths'])} rounds · tau {_fmt(tau_p)} · position-1 accuracy "
                 f"{_fmt(pos1)}", stage="eval_prompt", i=i + 1, n=len(prompts),
                 metrics={"tau": tau_p, "position_1_accuracy": pos1})
    if device.type == "cuda":
        torch.cuda.synchronize()
    return Drafted(per_prompt, np.concatenate(all_drafts), np.concatenate(all_targets),
                   "sha256:" + prompt_hash.hexdigest(), n_anchors_total, time.perf_counter() - t_eval, batch)


def layer_attention(cfg) -> list:
    """Each drafter layer's resolved attention (drafterconfig.py's rules), as results.json records it."""
    return [R.LayerAttention(layer=i, type=cfg.layer_type(i), window=cfg.layer_window(i),
                             causal_in_block=cfg.layer_is_causal(i)) for i in range(cfg.num_hidden_layers)]


def _allowed(cfg) -> dict:
    """{key: value as JSON text} of the config keys the user allowed uninterpreted (--allow-unknown-config)."""
    out = {}
    for k in cfg.allowed_unknown:
        src, name = (cfg.extra.get("dflash_config") or {}, k.split(".", 1)[1]) if k.startswith("dflash_config.") \
            else (cfg.extra, k)
        out[k] = json.dumps(src.get(name), sort_keys=True)
    return out


def build_results(opts: EvalOptions, inp: Inputs, mod: Loaded, ev: Drafted, m: dict, health: dict,
                  device: torch.device, dtype: torch.dtype, total_s: float) -> dict:
    """results.json (schema: docs/results.md)."""
    cfg, info, hinfo, cache = mod.drafter.cfg, mod.info, mod.hinfo, inp.cache
    bs, prompts, budgets, widths = cfg.block_size, inp.prompts, opts.ddtree_budgets, opts.tree_widths
    eval_s = ev.eval_s
    fingerprint = cache.fingerprint
    attention = layer_attention(cfg)
    result = R.Result(
        schema=R.SCHEMA, run=opts.name, created_at=protocol.now_iso(),
        drafter=R.Drafter(path=str(opts.drafter), name=info.name, layout=info.layout, step=info.step,
                          content_hash=info.content_hash, target_layer_ids=list(cfg.target_layer_ids),
                          fc_layer_ids=list(cfg.fc_layer_ids), num_parameters=info.num_parameters,
                          attention=attention, mask_embedding=info.mask_embedding,
                          renamed_weights=list(info.renamed) or None,
                          allowed_unknown_config=_allowed(cfg) or None),
        target=R.Target(path=str(opts.target), embed_key=hinfo.embed_key,
                        lm_head_key=None if hinfo.tied else hinfo.lm_head_key, tied=hinfo.tied,
                        config_matches_cache=mod.target_matches),
        cache=R.CacheInfo(path=str(opts.cache), fingerprint=fingerprint, layer_ids=list(cache.layer_ids),
                          num_prompts_total=len(cache.prompts),
                          argmax_agreement=getattr(cache, "argmax_agreement", None)),
        options=R.Options(num_prompts=len(prompts), max_blocks=opts.max_blocks, block_size=bs,
                          ddtree_budgets=budgets, tree_widths=widths, device=str(device), dtype=dtype_name(dtype),
                          batch_size=ev.batch_size, strict=opts.strict,
                          position_accuracy_anchors="all" if opts.all_anchors else "walk_reach"),
        comparability=R.Comparability(
            cache_fingerprint=fingerprint, prompt_set=ev.prompt_set,
            num_prompts=len(prompts), max_blocks=opts.max_blocks, block_size=bs,
            metrics_version=protocol.METRICS_VERSION + ("+all-anchors" if opts.all_anchors else ""),
            attention=R.attention_signature(attention)),
        definitions=metrics.DEFINITIONS,
        metrics=R.Metrics.from_dict(m, "metrics"),
        per_prompt=[R.PromptResult.from_dict(p, f"per_prompt[{i}]") for i, p in enumerate(ev.per_prompt)],
        health=R.Health.from_dict(health, "health"),
        timing=R.Timing(load_s=round(mod.load_s, 3), eval_s=round(eval_s, 3),
                        anchors_per_s=round(ev.num_anchors / eval_s, 1) if eval_s > 0 else None,
                        total_s=round(total_s, 3)),
        environment=R.Environment(torch=torch.__version__, cuda=torch.version.cuda,
                                  gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                                  hostname=socket.gethostname(), python=platform.python_version(),
                                  payload_version=__version__))
    return result.to_dict()


def evaluate(opts: EvalOptions, rep: Reporter) -> dict:
    """The five steps (module doc), then the walks' aggregate, the health guard and results.json's dict.
    With suites (`--cache NAME=PATH` repeated) steps 2, 3 and 5 run per suite on the weights loaded once."""
    t0 = time.perf_counter()
    device, dtype = resolve_device_dtype(opts.device, opts.dtype)
    rep.line(f"DFlash drafter eval · {opts.name} · device {device} ({dtype_name(dtype)})")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # `--device cuda:1`: the pipeline's events and streams on that device
    check_online_target(opts)
    tok = load_tokenizer(opts.target)
    try:
        if opts.suites:
            return evaluate_suites(opts, rep, device, dtype, t0, tok)
        return _evaluate(opts, rep, device, dtype, t0, tok)
    finally:
        if tok is not None:
            tok.close()


def _evaluate(opts: EvalOptions, rep: Reporter, device: torch.device, dtype: torch.dtype, t0: float, tok) -> dict:
    tok, cache, prompts = open_inputs(opts, rep, tok)
    inp, mod = load_beside_features(opts, tok, cache, prompts, device, dtype, rep)
    ev = eval_prompts(opts, inp, mod, device, dtype, rep)
    m = metrics.aggregate(ev.per_prompt, mod.drafter.cfg.block_size)
    health = assess_health(m, ev.drafts, ev.targets, inp.tok, rep)
    cache_exactness(inp.cache, health, rep)
    health.update(feature_stats=inp.feature_stats, weight_stats=mod.info.weight_stats, embed_stats=mod.embed_stats)
    results = build_results(opts, inp, mod, ev, m, health, device, dtype, time.perf_counter() - t0)
    target_checks(opts, results, mod, inp, device, dtype, rep)
    print_summary(results)
    rep.event(stage="done", step=STEPS, steps=STEPS, metrics=headline(results))
    return results


MIN_ARGMAX_AGREEMENT = 0.99


def cache_exactness(cache, health: dict, rep: Reporter, suite: str | None = None) -> None:
    """The cache's exactness as `extract` recorded it (the target's argmax over its own prefill vs the cached next
    tokens): a log line; below MIN_ARGMAX_AGREEMENT a health reason (the run is marked suspect)."""
    what = f"cache {suite}" if suite else "cache"
    a, gen = cache.argmax_agreement, (cache.meta or {}).get("generation") or {}
    if a is None:
        rep.line(f"  {what}: argmax agreement not recorded (extracted before `extract` recorded it)")
        return
    how = f" (completions by {gen['generator']}, {gen.get('dtype')})" if gen.get("generator") else ""
    rep.line(f"  {what}: argmax agreement {a:.4f}: the target's argmax is the cached next token at that fraction of "
             f"the completion positions{how}", stage="cache_exactness", argmax_agreement=a)
    if a < MIN_ARGMAX_AGREEMENT:
        reason = (f"{what} argmax agreement {a:.4f} < {MIN_ARGMAX_AGREEMENT}: its tokens are not what its hidden "
                  "states predict")
        health["suspect"] = True
        health["reasons"].append(reason)
        health["hints"].append("re-extract the cache with this target (`python -m remote_payload extract`; its "
                               "cache.json generation says how this one was made)")
        rep.line(f"\nwarning: SUSPECT RESULT — {reason}.\n         {health['hints'][-1]}. results.json marked "
                 "suspect.", stage="suspect")


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


def check_online_target(opts: EvalOptions) -> None:
    """--online on a target whose cache cannot be rolled back by cropping: one line before anything runs."""
    if not opts.online:
        return
    from remote_payload.eval import online
    cfg_file = Path(opts.target) / "config.json"
    try:
        cfg = json.loads(read_regular(cfg_file))
    except (OSError, ValueError) as e:
        raise PayloadError(f"--online needs the whole target: cannot read {cfg_file} ({e})") from None
    why = online.refusal(cfg)
    if why:
        raise PayloadError(f"--online: {why}. Run without --online.")


def target_checks(opts: EvalOptions, results: dict, mod: Loaded, inp: Inputs, device: torch.device,
                  dtype: torch.dtype, rep: Reporter) -> None:
    """--speedup and --online N, with the whole target loaded once (after the offline eval: its taus are what
    the projection uses and its walks what the online decoder is checked against)."""
    if not (opts.online or opts.speedup):
        return
    from remote_payload.target.load import load_target
    what = " and ".join(x for x in ("--speedup" if opts.speedup else "",
                                    f"--online {opts.online}" if opts.online else "") if x)
    rep.line(f"\nLoading the whole target {opts.target} for {what}...", stage="target")
    model = load_target(opts.target, device, dtype)
    if opts.speedup:
        speedup_section(opts, results, mod, model, rep)
    if opts.online:
        online_section(opts, results, mod, inp, model, device, dtype, rep)


def latency_table_path(opts: EvalOptions) -> Path:
    """The host's latency table: <workdir>/latency.json for a run in <workdir>/runs/<run> (shared by every run
    and sweep on that host)."""
    return Path(opts.run_dir).resolve().parent.parent / "latency.json"


def projections(lat, m: dict, bs: int) -> tuple[dict, str | None, float | None]:
    """{method: projected speedup} for the block and each DDTree budget measured, and the best of them."""
    out = {"block": None if m.get("tau") is None else round(lat.speedup(m["tau"], block_size=bs), 4)}
    for b, tau in (m.get("ddtree_tau") or {}).items():
        out[f"ddtree_{b}"] = None if tau is None or int(b) + 1 not in lat.verify_s else \
            round(lat.speedup(tau, budget=int(b)), 4)
    ranked = [(v, k) for k, v in out.items() if v is not None]
    best = max(ranked) if ranked else (None, None)
    return out, best[1], best[0]


def speedup_section(opts: EvalOptions, results: dict, mod: Loaded, model, rep: Reporter) -> None:
    from remote_payload.eval import latency
    bs = mod.drafter.cfg.block_size
    lens = [p["seq_len"] for p in results["per_prompt"]]
    ctx = max(64, round(sum(lens) / len(lens) / 64) * 64)  # buckets of 64: runs on one cache share it
    t = time.perf_counter()
    table = latency.LatencyTable(latency_table_path(opts))
    signature = latency.target_signature(opts.target)  # unchanged files: the hash measured under them, no re-read
    target_hash = table.known_hash(signature) or latency.target_content_hash(opts.target)
    key = latency.latency_key(model, mod.drafter, context_len=ctx, budgets=opts.ddtree_budgets, block_size=bs,
                              target_hash=target_hash) | {"target_stat": signature}
    lat = table.get(key)
    reused = lat is not None
    if lat is None:
        rep.line(f"  measuring the target's latencies at batch 1, context {ctx} (decode, verify of the block and "
                 f"of each DDTree budget's tree, one drafter block)...", stage="speedup")
        lat = latency.measure(model, mod.drafter, mod.head, context_len=ctx, budgets=opts.ddtree_budgets,
                              block_size=bs, target_hash=target_hash)
        lat.key["target_stat"] = signature
        if not table.put(lat):
            rep.line(f"  warning: {table.error}: the latencies are not kept for later runs", stage="warning")
    measure_s = 0.0 if reused else time.perf_counter() - t
    projected, best, best_x = projections(lat, results["metrics"], bs)
    by_suite = None
    if results.get("suites"):
        by_suite = []
        for s in results["suites"]:
            p, b, _ = projections(lat, s["metrics"], bs)
            by_suite.append(R.SuiteSpeedup(name=s["name"], projected=p, best_method=b))
    results["speedup"] = R.Speedup(
        regime=lat.regime, device=lat.device, gpu=lat.gpu, dtype=lat.dtype, context_len=lat.context_len,
        decode_s=lat.decode_s, draft_s=lat.draft_s, verify_s={str(n): v for n, v in sorted(lat.verify_s.items())},
        target_hash=target_hash, reused=reused, measure_s=round(measure_s, 3), note=lat.note or "",
        projected=projected, best_method=best, best_speedup=best_x, by_suite=by_suite).to_dict()
    shown = " · ".join(f"{k.replace('ddtree_', 'DDTree-')} {v:.2f}x" for k, v in projected.items() if v is not None)
    rep.line(f"  latencies ({lat.regime}{', reused from ' + str(table.path) if reused else ''}): decode "
             f"{lat.decode_s * 1e3:.2f} ms · draft {lat.draft_s * 1e3:.2f} ms · verify {bs} tokens "
             f"{lat.verify_s[bs] * 1e3:.2f} ms", stage="speedup")
    rep.line(f"  projected speedup: {shown}; best: {best} ({_fmt(best_x, 2)}x)", stage="speedup")


def online_section(opts: EvalOptions, results: dict, mod: Loaded, inp: Inputs, model, device: torch.device,
                   dtype: torch.dtype, rep: Reporter) -> None:
    from remote_payload.eval import online
    n = min(opts.online, len(inp.prompts))
    prompts = []
    for i in range(n):
        ids, _feats = inp.cache.load(i)
        rec = results["per_prompt"][i]
        prompts.append((rec["name"], [int(x) for x in ids], inp.prompts[i].prompt_len, rec["acceptance_lengths"]))
    try:
        got = online.online_check(model, mod.drafter, mod.head, list(inp.cache.layer_ids), prompts, opts.max_blocks)
    except ValueError as e:
        raise PayloadError(f"--online: {e}") from None
    s = online.summarize(got)
    results["online"] = R.Online(
        method="block", device=str(device), dtype=dtype_name(dtype), prompts=s["prompts"],
        prompts_agreeing=s["prompts_agreeing"], rounds=s["rounds"], rounds_agreeing=s["rounds_agreeing"],
        tau_pooled_online=s["tau_pooled_online"], tau_pooled_offline=s["tau_pooled_offline"], tokens=s["tokens"],
        spec_s=round(s["spec_s"], 4), target_only_s=round(s["target_only_s"], 4),
        measured_speedup=None if s["speedup"] is None else round(s["speedup"], 4),
        prompts_with_cache_mismatch=s["prompts_with_cache_mismatch"],
        projected_speedup=((results.get("speedup") or {}).get("projected") or {}).get("block"),
        per_prompt=[R.OnlinePrompt(name=r.name, acceptance_lengths=list(r.acceptance_lengths), agree=r.agree,
                                   spec_s=round(r.spec_s, 4), target_only_s=round(r.target_only_s, 4))
                    for r in got]).to_dict()
    o = results["online"]
    rep.line(f"  online: {o['prompts']} prompts · rounds agreeing with the offline walk {o['rounds_agreeing']}/"
             f"{o['rounds']} · tau {_fmt(o['tau_pooled_online'], 2)} online vs {_fmt(o['tau_pooled_offline'], 2)} "
             f"offline · measured speedup {_fmt(o['measured_speedup'], 2)}x ({o['spec_s']:.2f}s speculative vs "
             f"{o['target_only_s']:.2f}s target-only)", stage="online")
    if o["rounds_agreeing"] != o["rounds"]:
        rep.line(f"  warning: {o['rounds'] - o['rounds_agreeing']} online rounds differ from the offline walk "
                 f"(exact agreement is expected in fp32; {o['dtype']} near-ties can differ)", stage="warning")


def evaluate_suites(opts: EvalOptions, rep: Reporter, device: torch.device, dtype: torch.dtype, t0: float,
                    tok) -> dict:
    """One drafter over several caches: each suite evaluated as a one-cache eval would be (the same functions,
    its own cache), the weights loaded once; results.json = every prompt pooled at the top level (names
    `<suite>/<prompt>`), per-suite metrics and comparability in `suites`, their unweighted mean in `suite_mean`."""
    names = [n for n, _ in opts.suites]
    rep.line(f"  suites: {', '.join(names)}")
    done: list[tuple[str, EvalOptions, Inputs, Drafted]] = []
    mod = None
    for k, (name, path) in enumerate(opts.suites):
        so = dataclasses.replace(opts, cache=path, suites=None)
        rep.line(f"\n== suite {name} ({k + 1}/{len(names)}): {path}", stage="suite", suite=name, i=k + 1,
                 n=len(names))
        tok, cache, prompts = open_inputs(so, rep, tok)
        if mod is None:
            inp, mod = load_beside_features(so, tok, cache, prompts, device, dtype, rep)
        else:
            check_features(mod.drafter.cfg, cache.layer_ids, cache.hidden_size)
            inp = Inputs(tok, cache, prompts, feature_pass(so, cache, prompts, rep))
        done.append((name, so, inp, eval_prompts(so, inp, mod, device, dtype, rep)))
    bs = mod.drafter.cfg.block_size
    suites, per_prompt, feature_stats = [], [], {}
    for name, so, inp, ev in done:
        m = metrics.aggregate(ev.per_prompt, bs)
        one = build_results(so, inp, mod, ev, m, {"suspect": False, "reasons": [], "hints": []}, device, dtype, 0.0)
        suites.append(R.Suite(name=name, cache=R.CacheInfo.from_dict(one["cache"], "cache"),
                              comparability=R.Comparability.from_dict(one["comparability"], "comparability"),
                              metrics=R.Metrics.from_dict(one["metrics"], "metrics"),
                              prompt_range=[len(per_prompt), len(per_prompt) + len(ev.per_prompt)]))
        per_prompt += [{**p, "name": f"{name}/{p['name']}"} for p in ev.per_prompt]
        feature_stats.update({f"{name}/{k}": v for k, v in inp.feature_stats.items()})
    first = done[0][2]
    both = hashlib.sha256("".join(f"{s.name}\0{s.comparability.prompt_set}\n" for s in suites).encode())
    ev_all = Drafted(per_prompt, np.concatenate([d[3].drafts for d in done]),
                     np.concatenate([d[3].targets for d in done]), "sha256:" + both.hexdigest(),
                     sum(d[3].num_anchors for d in done), sum(d[3].eval_s for d in done), done[0][3].batch_size)
    m = metrics.aggregate(per_prompt, bs)
    health = assess_health(m, ev_all.drafts, ev_all.targets, first.tok, rep)
    for name, _so, inp_s, _ev in done:
        cache_exactness(inp_s.cache, health, rep, suite=name)
    health.update(feature_stats=feature_stats, weight_stats=mod.info.weight_stats, embed_stats=mod.embed_stats)
    fp = hashlib.sha256("".join(f"{s.name}\0{s.cache.fingerprint}\n" for s in suites).encode()).hexdigest()
    joined = _JoinedCache(fingerprint="sha256:" + fp, layer_ids=list(first.cache.layer_ids),
                          prompts=[p for d in done for p in d[2].cache.prompts], meta=None)
    inp_all = Inputs(first.tok, joined, [p for d in done for p in d[2].prompts], feature_stats)
    results = build_results(opts, inp_all, mod, ev_all, m, health, device, dtype, time.perf_counter() - t0)
    results["suites"] = [s.to_dict() for s in suites]
    results["suite_mean"] = suite_mean(suites).to_dict()
    target_checks(opts, results, mod, done[0][2], device, dtype, rep)
    print_summary(results)
    rep.event(stage="done", step=STEPS, steps=STEPS, metrics=headline(results))
    return results


@dataclass
class _JoinedCache:
    """What build_results reads of a cache, for the suites together (their fingerprints hashed by name)."""
    fingerprint: str
    layer_ids: list
    prompts: list
    meta: dict | None


def suite_mean(suites: list) -> R.SuiteMean:
    """Unweighted mean over suites of each suite's value (a suite without the value is left out of that mean)."""
    def mean(values):
        vals = [v for v in values if v is not None]
        return sum(vals) / len(vals) if vals else None
    tau = mean(s.metrics.tau for s in suites)
    budgets = sorted({b for s in suites for b in s.metrics.ddtree_tau}, key=int)
    return R.SuiteMean(num_suites=len(suites), tau=tau, streak=None if tau is None else tau - 1,
                       position_1_accuracy=mean(s.metrics.position_1_accuracy for s in suites),
                       ddtree_tau={b: mean(s.metrics.ddtree_tau.get(b) for s in suites) for b in budgets})


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(main(p.parse_args()))
