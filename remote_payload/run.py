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
import hashlib
import os
import platform
import socket
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import __version__, metrics, protocol
from .cache import open_cache, parse_layer_ids
from .checkpoint import check_features, load_drafter, load_target_head, peek_config
from .devices import resolve_device_dtype
from .errors import PayloadError

STEPS = 5
DEFAULT_BUDGETS = (16, 32, 64, 128, 256, 512)
DEFAULT_WIDTHS = (4, 8)
# Health guards (the seeds' harness printed "Loaded" and then drafted gibberish at 0.000 accuracy).
SUSPECT_POS1_ACCURACY = 0.05
SUSPECT_DRAFT_SHARE = 0.5


@dataclass
class EvalOptions:
    drafter: str
    target: str
    cache: str
    run_dir: str
    name: str
    num_prompts: int | None = None
    max_blocks: int = 30
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int = 0  # anchors per drafter forward; 0 = auto
    ddtree_budgets: list[int] = field(default_factory=lambda: list(DEFAULT_BUDGETS))
    tree_widths: list[int] = field(default_factory=lambda: list(DEFAULT_WIDTHS))
    cache_layers: list[int] | None = None
    strict: bool = False
    all_anchors: bool = False


# ---------------------------------------------------------------------------------------------- CLI
def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="z-lab folder (config.json + safetensors) or team .pt file")
    p.add_argument("--target", required=True,
                   help="target model folder: its embed_tokens/lm_head (via model.safetensors.index.json) "
                        "and tokenizer.json are borrowed")
    p.add_argument("--cache", required=True, help="hidden-state cache (from `extract`, or the seeds' layout)")
    p.add_argument("--cache-layers", type=parse_layer_ids, default=None,
                   help="layer ids of a seeds-layout cache, e.g. 1,16,31,46,61 (aux_hidden..., last_hidden)")
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/<name>)")
    p.add_argument("--name", default=None,
                   help="run name (default: the --run-dir folder name, else <drafter>-<UTC timestamp>)")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts of the cache (default: all)")
    p.add_argument("--max-blocks", type=int, default=30, help="draft rounds per prompt (default 30)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--batch-size", type=int, default=0, help="anchors per drafter forward (0: auto)")
    p.add_argument("--ddtree-budgets", type=_int_list, default=list(DEFAULT_BUDGETS),
                   help="DDTree node budgets (default 16,32,64,128,256,512)")
    p.add_argument("--tree-widths", type=_int_list, default=list(DEFAULT_WIDTHS),
                   help="width-k trees, the seeds' DDTree-4/DDTree-8 (default 4,8)")
    p.add_argument("--strict", action="store_true", help="a suspect result fails the run (exit 1)")
    p.add_argument("--all-anchors", action="store_true",
                   help="teacher-forced position accuracy at every completion anchor (default: the anchors "
                        "the walk can reach within --max-blocks; the walks are the same either way)")


def options_from_args(args: argparse.Namespace) -> EvalOptions:
    # A run directory names its run (the controller passes --run-dir <workdir>/runs/<name>).
    name = args.name or (Path(args.run_dir).name if args.run_dir else protocol.default_run_name(args.drafter))
    protocol.validate_run_name(name)
    if args.max_blocks < 1:
        raise PayloadError(f"--max-blocks must be >= 1, got {args.max_blocks}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise PayloadError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    return EvalOptions(drafter=args.drafter, target=args.target, cache=args.cache,
                       run_dir=args.run_dir or str(Path("runs") / name), name=name, num_prompts=args.num_prompts,
                       max_blocks=args.max_blocks, device=args.device, dtype=args.dtype,
                       batch_size=args.batch_size, ddtree_budgets=sorted(set(args.ddtree_budgets)),
                       tree_widths=sorted(set(args.tree_widths)), cache_layers=args.cache_layers,
                       strict=args.strict, all_anchors=args.all_anchors)


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
    except Exception as e:  # noqa: BLE001 — unexpected: keep the traceback, exit 1
        traceback.print_exc()
        protocol.append_event(run_dir / protocol.EVENTS_JSONL, {"stage": "error", "message": repr(e)})
        rc = protocol.EXIT_FAILED
    if own_status:
        _write_status(run_dir, protocol.SUCCEEDED if rc == 0 else protocol.FAILED, started, rc)
    return rc


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
def load_tokenizer(target: str):
    """tokenizers.Tokenizer from the target folder, or None (decoding is then shown as ids)."""
    path = Path(target) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))


def decode(tok, ids) -> str:
    ids = [int(i) for i in ids if int(i) >= 0]
    if tok is None:
        return " ".join(map(str, ids))
    return tok.decode(ids, skip_special_tokens=False)


@dataclass
class AnchorOutputs:
    """Per-anchor results of one prompt, anchors a = prompt_len + j (metrics.py conventions)."""

    drafts: np.ndarray  # [n, bs-1] int
    target_rank: np.ndarray  # [n, bs-1] int, -1 past the end
    topk_logprobs: torch.Tensor | None  # [n, bs-1, K] fp32 sorted descending, on the device (DDTree)


@torch.inference_mode()
def draft_all_anchors(drafter, head, feats: torch.Tensor, ids: torch.Tensor, prompt_len: int, n: int,
                      *, batch_size: int, budgets: list[int], widths: list[int] = ()) -> AnchorOutputs:
    """feats [T, n_fc*H] (on the drafter's device), ids [T] -> outputs at anchors prompt_len..prompt_len+n-1."""
    from .drafter import logits_topk
    bs = drafter.cfg.block_size
    dev = feats.device
    ctx = drafter.precompute_context(feats, anchors_per_prompt=batch_size)  # context K/V once per prompt
    g = ids.cpu().numpy()
    targets = metrics.target_tokens(g, prompt_len, n, bs - 1)  # [n, bs-1], -1 past the end
    # top-k per row: DDTree needs the top-B values, width-k trees ranks below k (ranks are capped at k)
    k = min(max([*budgets, *widths, 1]), drafter.cfg.vocab_size)
    drafts, ranks, topk = [], [], []
    ids_dev = ids.to(dev)
    for s in range(0, n, batch_size):
        anchors = torch.arange(prompt_len + s, prompt_len + min(n, s + batch_size), device=dev)  # [m]
        hidden = drafter.draft_hidden(ctx, anchors, ids_dev[anchors], head)  # [m, bs, H]
        tgt = torch.as_tensor(targets[s:s + len(anchors)], device=dev)  # [m, bs-1]
        out = logits_topk(hidden, head, k, target_ids=tgt.clamp(min=0))
        if not torch.isfinite(out.topk_logprobs[..., 0]).all():
            raise PayloadError("drafter produced NaN/inf logits: check the weights' dtype and the cache features")
        drafts.append(out.argmax_ids)
        ranks.append(out.target_ranks.masked_fill(tgt < 0, -1))
        if budgets:
            topk.append(out.topk_logprobs)
    width = bs - 1
    if not drafts:
        empty = np.zeros((0, width), dtype=np.int64)
        return AnchorOutputs(empty, empty, torch.zeros(0, width, k) if budgets else None)
    return AnchorOutputs(drafts=torch.cat(drafts).cpu().numpy(), target_rank=torch.cat(ranks).cpu().numpy(),
                         topk_logprobs=torch.cat(topk) if budgets else None)


def load_weights(drafter_path: str, target: str, device: torch.device, dtype: torch.dtype):
    """(drafter, DrafterInfo, TargetHead, HeadInfo). When the drafter's config can be read first (z-lab
    layout), the target's embed/lm_head are read by a second thread beside the drafter's weights: reading
    page-cached bytes is CPU-bound per thread, so two readers finish sooner than one after the other."""
    peek = peek_config(drafter_path)
    if peek is None:
        drafter, info = load_drafter(drafter_path, device=device, dtype=dtype)
        head, hinfo = load_target_head(target, vocab_size=drafter.cfg.vocab_size,
                                       hidden_size=drafter.cfg.hidden_size, device=device, dtype=dtype)
        return drafter, info, head, hinfo
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reval-head") as ex:
        head_f = ex.submit(load_target_head, target, vocab_size=peek.vocab_size, hidden_size=peek.hidden_size,
                           device=device, dtype=dtype)
        drafter, info = load_drafter(drafter_path, device=device, dtype=dtype)
        head, hinfo = head_f.result()
    return drafter, info, head, hinfo


def _stats(x: torch.Tensor) -> tuple[float, float]:
    x = x.float()
    return x.mean().item(), x.std().item()


def evaluate(opts: EvalOptions, rep: Reporter) -> dict:
    t0 = time.perf_counter()
    device, dtype = resolve_device_dtype(opts.device, opts.dtype)
    rep.line(f"DFlash drafter eval · {opts.name} · device {device} ({dtype_name(dtype)})")

    rep.step(1, "tokenizer", "Loading tokenizer...")
    tok = load_tokenizer(opts.target)
    rep.line(f"  vocab_size={tok.get_vocab_size() if tok else 'n/a (no tokenizer.json: tokens shown as ids)'}")

    rep.step(2, "completions", f"Loading cached completions from {opts.cache}...")
    cache = open_cache(opts.cache, seeds_layer_ids=opts.cache_layers)
    prompts = cache.prompts[: opts.num_prompts] if opts.num_prompts else cache.prompts
    rep.line(f"  Loaded {len(cache.prompts)} cached completions")
    rep.line(f"  Got {len(prompts)} valid completions (layers {cache.layer_ids}, hidden {cache.hidden_size})")

    rep.step(3, "load_cache", f"Loading cached hidden states from {opts.cache}...")
    # Validated and summarised here, not kept: the eval re-reads each prompt with only the drafter's layers
    # (page-cache warm), so host memory holds one prompt's features at a time.
    feature_stats = {}
    for i, p in enumerate(prompts):
        ids, feats_all = cache.load(i)  # validated: shapes, NaN/inf (prompts is a prefix of the cache)
        mean, std = _stats(feats_all)
        if not std > 0:
            raise PayloadError(f"cache {opts.cache}: prompt {p.name!r} features are constant (std {std}); "
                               f"re-extract it")
        feature_stats[p.name] = {"mean": mean, "std": std}
        del feats_all
        rep.line(f"  [{i + 1}/{len(prompts)}] {p.name}: {p.seq_len} tokens aux_mean={mean:.4f} aux_std={std:.4f}",
                 stage="load_cache", step=3, steps=STEPS, i=i + 1, n=len(prompts))

    rep.step(4, "load_drafter", f"Loading drafter {opts.drafter}...")
    t_load = time.perf_counter()
    drafter, info, head, hinfo = load_weights(opts.drafter, opts.target, device, dtype)
    cfg = drafter.cfg
    check_features(cfg, cache.layer_ids, cache.hidden_size)  # names dims and layer ids on a mismatch
    rep.line(f"  layout={info.layout} params={info.num_parameters:,} fc layers {cfg.fc_layer_ids} "
             f"block_size={cfg.block_size} layers={cfg.num_hidden_layers} ({', '.join(cfg.layer_types)})")
    for key, st in info.weight_stats.items():
        rep.line(f"  {key}: mean={st['mean']:.4f} std={st['std']:.4f}")
    rep.line(f"  target head: embed {hinfo.embed_key!r}, lm_head "
             f"{'tied to embed' if hinfo.tied else repr(hinfo.lm_head_key)} from {Path(hinfo.source).name}")
    cached_sha = ((cache.meta or {}).get("target") or {}).get("config_sha256")
    cfg_file = Path(opts.target) / "config.json"
    target_matches = (None if not (cached_sha and cfg_file.exists())
                      else hashlib.sha256(cfg_file.read_bytes()).hexdigest() == cached_sha)
    if target_matches is False:  # a warning, not an error: a re-saved config of the same model differs too
        rep.line(f"  warning: {cfg_file} is not the config the cache was extracted with "
                 f"({(cache.meta.get('target') or {}).get('path')}); check --target", stage="warning")
    e_mean, e_std = _stats(head.embed)
    rep.line(f"  embed_tokens: mean={e_mean:.4f} std={e_std:.4f}")
    load_s = time.perf_counter() - t_load
    rep.line(f"  loaded in {load_s:.2f}s", stage="load_drafter", step=4, steps=STEPS)

    rep.step(5, "eval", f"Evaluating {len(prompts)} prompts x {opts.max_blocks} blocks...")
    bs = cfg.block_size
    batch = opts.batch_size or (128 if device.type == "cuda" else 32)
    budgets, widths = opts.ddtree_budgets, opts.tree_widths
    per_prompt, all_drafts, all_targets = [], [], []
    prompt_hash = hashlib.sha256()
    t_eval = time.perf_counter()
    n_anchors_total = 0
    for i, p in enumerate(prompts):
        ids, feats = cache.load(i, layer_ids=cfg.fc_layer_ids, device=device, dtype=dtype)  # [T], [T, n_fc*H]
        if int(ids.max()) >= cfg.vocab_size or int(ids.min()) < 0:
            raise PayloadError(f"cache {opts.cache}: prompt {p.name!r} holds token id {int(ids.max())} outside the "
                               f"drafter's vocabulary ({cfg.vocab_size}): the cache comes from another tokenizer")
        rep.line(f"  [{i + 1}/{len(prompts)}] {p.name}: {p.seq_len} tokens", stage="eval", step=5, steps=STEPS,
                 i=i + 1, n=len(prompts))
        g = ids.cpu().numpy()
        prompt_hash.update(g.astype(np.int64).tobytes() + p.prompt_len.to_bytes(8, "little"))
        # anchors the walk can reach; --all-anchors: every completion anchor (position accuracy over all)
        n = (max(0, p.seq_len - 1 - p.prompt_len) if opts.all_anchors
             else metrics.num_anchors(p.prompt_len, p.seq_len, opts.max_blocks, bs))
        out = draft_all_anchors(drafter, head, feats, ids, p.prompt_len, n, batch_size=batch, budgets=budgets,
                                widths=widths)
        n_anchors_total += n
        rec = metrics.prompt_metrics(out.drafts, out.target_rank, out.topk_logprobs, g, p.prompt_len,
                                     opts.max_blocks, bs, budgets=budgets, widths=widths)
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
    eval_s = time.perf_counter() - t_eval

    m = metrics.aggregate(per_prompt, bs)
    health = assess_health(m, np.concatenate(all_drafts), np.concatenate(all_targets), tok, rep)
    health.update(feature_stats=feature_stats, weight_stats=info.weight_stats,
                  embed_stats={"mean": e_mean, "std": e_std})

    fingerprint = cache.fingerprint
    results = {
        "schema": protocol.RESULTS_SCHEMA,
        "run": opts.name,
        "created_at": protocol.now_iso(),
        "drafter": {"path": str(opts.drafter), "name": info.name, "layout": info.layout, "step": info.step,
                    "content_hash": info.content_hash, "target_layer_ids": list(cfg.target_layer_ids),
                    "fc_layer_ids": list(cfg.fc_layer_ids), "num_parameters": info.num_parameters},
        "target": {"path": str(opts.target), "embed_key": hinfo.embed_key,
                   "lm_head_key": None if hinfo.tied else hinfo.lm_head_key, "tied": hinfo.tied,
                   "config_matches_cache": target_matches},
        "cache": {"path": str(opts.cache), "fingerprint": fingerprint, "layer_ids": list(cache.layer_ids),
                  "num_prompts_total": len(cache.prompts)},
        "options": {"num_prompts": len(prompts), "max_blocks": opts.max_blocks, "block_size": bs,
                    "ddtree_budgets": budgets, "tree_widths": widths, "device": str(device),
                    "dtype": dtype_name(dtype), "batch_size": batch, "strict": opts.strict,
                    "position_accuracy_anchors": "all" if opts.all_anchors else "walk_reach"},
        "comparability": {"cache_fingerprint": fingerprint, "prompt_set": "sha256:" + prompt_hash.hexdigest(),
                          "num_prompts": len(prompts), "max_blocks": opts.max_blocks, "block_size": bs,
                          "metrics_version": protocol.METRICS_VERSION + ("+all-anchors" if opts.all_anchors else "")},
        "definitions": metrics.DEFINITIONS,
        "metrics": m,
        "per_prompt": per_prompt,
        "health": health,
        "timing": {"load_s": round(load_s, 3), "eval_s": round(eval_s, 3),
                   "anchors_per_s": round(n_anchors_total / eval_s, 1) if eval_s > 0 else None,
                   "total_s": round(time.perf_counter() - t0, 3)},
        "environment": {"torch": torch.__version__, "cuda": torch.version.cuda,
                        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                        "hostname": socket.gethostname(), "python": platform.python_version(),
                        "payload_version": __version__},
    }
    print_summary(results)
    rep.event(stage="done", step=STEPS, steps=STEPS, metrics=headline(results))
    return results


def assess_health(m: dict, drafts: np.ndarray, targets: np.ndarray, tok, rep: Reporter) -> dict:
    """Flag results that look like a broken load rather than a weak drafter (loud warning + reasons)."""
    reasons, hints = [], []
    pos1 = m.get("position_1_accuracy")
    if pos1 is not None and pos1 < SUSPECT_POS1_ACCURACY:
        reasons.append(f"position-1 accuracy {pos1:.3f} over {m['num_anchors']} anchors")
    degenerate, token, share = metrics.degenerate_drafts(drafts, SUSPECT_DRAFT_SHARE)
    valid = targets[targets >= 0]
    target_share = float((valid == token).mean()) if valid.size and token is not None else 0.0
    if degenerate and share > 2 * target_share:  # the target itself does not repeat that token
        reasons.append(f"drafts repeat one token ({decode(tok, [token])!r}, {share:.0%} of drafts vs "
                       f"{target_share:.0%} of target tokens)")
    if reasons:
        hints.append("weights loaded but the drafts look like gibberish: check weight key paths, the target "
                     "(embed_tokens/lm_head) and dtypes")
        rep.line(f"\nwarning: SUSPECT RESULT — {'; '.join(reasons)}.\n         {hints[0]}. "
                 "results.json marked suspect.", stage="suspect")
    return {"suspect": bool(reasons), "reasons": reasons, "hints": hints,
            "top_draft_token": {"id": token, "share": share, "target_share": target_share}}


def _fmt(x, nd=3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def headline(results: dict) -> dict:
    m = results["metrics"]
    return {"tau": m["tau"], "streak": m["streak"], "ddtree_best": m.get("ddtree_best"),
            "tree_width_tau": m.get("tree_width_tau"), "position_1_accuracy": m["position_1_accuracy"],
            "num_rounds": m["num_rounds"], "num_prompts": m["num_prompts"],
            "suspect": results["health"]["suspect"]}


def print_summary(results: dict) -> None:
    m, o = results["metrics"], results["options"]
    rows = [("tau (incl. bonus, macro)", _fmt(m["tau"], 2)), ("tau pooled", _fmt(m["tau_pooled"], 2)),
            ("streak (excl. bonus)", _fmt(m["streak"], 2))]
    rows += [(f"DDTree-{b} tau", _fmt(v, 2)) for b, v in m["ddtree_tau"].items()]
    rows += [(f"width-{w} tree tau", _fmt(v, 2)) for w, v in m["tree_width_tau"].items()]
    rows += [("position-1 accuracy", _fmt(m["position_1_accuracy"])),
             ("position accuracy k=1..15", " ".join(_fmt(x, 2) for x in m["position_accuracy"])),
             ("acceptance histogram 1..16", " ".join(str(x) for x in m["acceptance_histogram"][1:])),
             ("rounds / prompts / anchors", f"{m['num_rounds']} / {m['num_prompts']} / {m['num_anchors']}"),
             ("max blocks", str(o["max_blocks"])),
             ("load / eval", f"{results['timing']['load_s']:.2f}s / {results['timing']['eval_s']:.2f}s"),
             ("suspect", "YES: " + "; ".join(results["health"]["reasons"]) if results["health"]["suspect"] else "no")]
    w = max(len(k) for k, _ in rows)
    print("\n" + "=" * 70)
    print(f"Summary: {results['run']}")
    print("=" * 70)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    print("=" * 70, flush=True)


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(main(p.parse_args()))
