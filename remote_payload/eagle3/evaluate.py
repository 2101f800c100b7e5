"""`python -m remote_payload eval --drafter EAGLE3_HEAD ...`: the eval of an EAGLE-3 head (the family switch is
family.py). The DFlash eval's five steps and results.json, with the chain in place of the block:

    [1/5] tokenizer  [2/5] cached completions  [3/5] cached hidden states (steps.py, unchanged)
    [4/5] the head (loader.py) + the target's embedding; its three taps resolved against the target's layer
          count and found in the cache (HF hidden_states[k] = cache layer k-1)
    [5/5] the chain of K drafts at every anchor (walk.py: K batched passes per prompt), then the acceptance walk
          and metrics (eval/metrics.py with block_size = K+1: one bonus token + K drafts per round); with
          --eagle-tree, EAGLE's dynamic tree at every anchor instead (tree.py: block_size = depth+2)

results.json: the DFlash schema, with drafter.family / comparability.family "eagle3", drafter.eagle3 (the taps,
the chain length or the tree, the draft vocabulary, where the embedding came from), options.block_size = K+1, no
DDTree or width-k trees (their drafts come from one block pass; EAGLE's own tree is --eagle-tree).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from remote_payload.contract.eagle3config import FAMILY, Eagle3Config, check_taps, target_layers
from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular
from remote_payload.eagle3.loader import load_eagle3, peek_eagle3_config
from remote_payload.eagle3.sampled import chain_logq, refuse_tree
from remote_payload.eagle3.targetside import family_args
from remote_payload.eagle3.tree import TreeShape, accept_lengths, draft_trees, parse_tree
from remote_payload.eagle3.walk import chain_drafts
from remote_payload.eval import metrics, samples
from remote_payload.eval.checkpoint import load_target_head
from remote_payload.eval.devices import resolve_device_dtype
from remote_payload.eval.evalopts import EvalOptions
from remote_payload.eval.record import build_results
from remote_payload.eval.steps import (
    STEPS,
    Drafted,
    Inputs,
    Loaded,
    Reporter,
    cache_exactness,
    feature_pass,
    open_inputs,
)
from remote_payload.eval.summary import (
    assess_health,
    decode,
    dtype_name,
    fmt,
    headline,
    load_tokenizer,
    print_summary,
)
from remote_payload.eval.targetchecks import check_online_target, target_checks

DEFAULT_CHAIN = 5
CONVENTION = "vllm"  # explicit eagle_aux_hidden_state_layer_ids read as HF hidden_states indices (config.py)
DEFINITIONS = {
    "eagle3_chain": "EAGLE-3 greedy chain: per round K drafts from the committed prefix with target features only "
    "(SafeAILab eagenerate with top_k=1, depth=K-1, total_token=K+1); block_size = K+1 (bonus + K drafts); the "
    "walk, tau and histograms as for DFlash",
    "eagle3_tree": "EAGLE-3 dynamic tree (--eagle-tree total_token,depth,top_k): per round the tree SafeAILab's "
    "topK_genrate drafts from the committed prefix with target features only (the best total_token-1 nodes by "
    "cumulative log-prob; the nodes of a level at one position); the longest root-to-node path matching the "
    "target's greedy tokens is accepted; block_size = depth+2 (bonus + the deepest level)",
    "position_accuracy": "k=1..K, at every anchor: #(draft k == g[a+k]) / #(anchors with a+k < seq_len), draft k "
    "made with the cached tokens g[a+1..a+k-1] fed back (teacher-forced chain, the TTT form); pooled over anchors. "
    "With --eagle-tree: k=1..depth+1, at every anchor, #(the tree holds g[a+1..a+k] as a path) / #(anchors with "
    "a+k < seq_len)",
}


@dataclass
class HeadView:
    """What the shared results.json assembly (eval/record.py) reads of a drafter's config, for an EAGLE-3 head:
    one full causal layer, blocks of K+1, the cache layers its fc reads."""
    block_size: int
    target_layer_ids: list[int]
    fc_layer_ids: list[int]
    allowed_unknown: list[str]
    extra: dict = field(default_factory=dict)
    num_hidden_layers: int = 1
    tree: TreeShape | None = None  # --eagle-tree; None: the chain of block_size-1
    family: str = FAMILY  # results.json's drafter.family and comparability.family (eval/record.py)

    def layer_type(self, i: int) -> str:
        return "full_attention"

    def layer_window(self, i: int) -> None:
        return None

    def layer_is_causal(self, i: int) -> bool:
        return True


def _refuse_unsupported(opts: EvalOptions) -> None:
    if opts.chain is not None and opts.eagle_tree is not None:
        raise PayloadError(f"--chain {opts.chain} and --eagle-tree {opts.eagle_tree}: one decoding per run (the chain "
                           "of K is the tree K+1,K-1,1); give one")
    if opts.eagle_tree is not None:
        parse_tree(opts.eagle_tree)  # a malformed tree: exit 3 before anything is loaded
    check_online_target(opts)


def resolve_taps(cfg: Eagle3Config, target: str, cache) -> tuple[list[int], list[int]]:
    """(HF hidden_states indices, cache layer ids) of the head's taps on this target (contract/eagle3config.py)."""
    cfg_file = Path(target) / "config.json"
    try:
        target_cfg = json.loads(read_regular(cfg_file))
    except (OSError, ValueError) as e:
        raise PayloadError(f"{cfg_file}: cannot read the target's layer count ({e}); the EAGLE-3 taps depend on it")
    return check_taps(cfg, target_layers(target_cfg), cache.layer_ids, cache.hidden_size, CONVENTION)


def _target_matches(target: str, cache) -> bool | None:
    cached = ((cache.meta or {}).get("target") or {}).get("config_sha256")
    f = Path(target) / "config.json"
    if not (cached and f.is_file()):
        return None
    return hashlib.sha256(read_regular(f)).hexdigest() == cached


def load_head(opts: EvalOptions, inp: Inputs, device, dtype, rep: Reporter) -> tuple[Loaded, dict]:
    """Step 4: the head and its taps -> (Loaded as eval/record.py reads it, drafter.eagle3 of results.json)."""
    rep.step(4, "load_drafter", f"Loading EAGLE-3 head {opts.drafter}...")
    t = time.perf_counter()
    cfg = peek_eagle3_config(opts.drafter, opts.allow_unknown_config)
    taps, cache_ids = resolve_taps(cfg, opts.target, inp.cache)
    head, hinfo = load_target_head(opts.target, vocab_size=cfg.vocab_size, hidden_size=cfg.target_hidden_size,
                                   device=device, dtype=dtype)
    drafter, info = load_eagle3(opts.drafter, device=device, dtype=dtype, allow_unknown=opts.allow_unknown_config,
                                embed=head.embed)
    load_s = time.perf_counter() - t
    shape = parse_tree(opts.eagle_tree) if opts.eagle_tree is not None else None
    K = shape.max_accept if shape else opts.chain or DEFAULT_CHAIN
    how = (f"tree total_token={shape.total_token} depth={shape.depth} top_k={shape.top_k}" if shape
           else f"chain K={K}")
    rep.line(f"  layout={info.layout} params={info.num_parameters:,} taps HF hidden_states {taps} = cache layers "
             f"{cache_ids}; draft vocabulary {cfg.draft_vocab_size} of {cfg.vocab_size}; {how}")
    rep.line(f"  embedding: {'the checkpoint' if info.embed_source == 'checkpoint' else 'the target'}'s "
             f"({hinfo.embed_key if info.embed_source == 'target' else 'embed_tokens.weight'})")
    for rule in info.renamed:
        rep.line(f"  weight names: {rule} (vLLM's names for the same tensors)")
    if cfg.allowed_unknown:
        rep.line(f"  warning: config keys allowed without interpretation (--allow-unknown-config): "
                 f"{', '.join(cfg.allowed_unknown)}", stage="warning")
    matches = _target_matches(opts.target, inp.cache)
    if matches is False:
        rep.line(f"  warning: {Path(opts.target) / 'config.json'} is not the config the cache was extracted with; "
                 "check --target", stage="warning")
    e_std, e_mean = torch.std_mean(drafter.embed.float())
    rep.line(f"  loaded in {load_s:.2f}s", stage="load_drafter", step=4, steps=STEPS)
    view = HeadView(block_size=K + 1, target_layer_ids=cache_ids, fc_layer_ids=cache_ids,
                    allowed_unknown=list(cfg.allowed_unknown), extra=cfg.extra, tree=shape)
    mod = Loaded(drafter=SimpleNamespace(cfg=view, head=drafter), info=info, head=head, hinfo=hinfo,
                 target_matches=matches, embed_stats={"mean": float(e_mean), "std": float(e_std)}, load_s=load_s)
    record = {"decoding": "tree" if shape else "chain", "chain_length": None if shape else K,
              "tree": dict(zip(("total_token", "depth", "top_k"), shape.as_list())) if shape else None,
              "taps_hf_hidden_states": taps, "layer_id_convention": CONVENTION,
              "explicit_layer_ids": cfg.aux_layer_ids, "draft_vocab_size": cfg.draft_vocab_size,
              "vocab_size": cfg.vocab_size, "embed_source": info.embed_source, "config_source": info.config_source}
    return mod, record


def draft_prompts(opts: EvalOptions, inp: Inputs, mod: Loaded, device, dtype, rep: Reporter) -> Drafted:
    """Step 5: the chain at every anchor of every prompt, the walk and the per-prompt metrics."""
    head, K, cache_ids = mod.drafter.head, mod.drafter.cfg.block_size - 1, mod.drafter.cfg.fc_layer_ids
    bs, shape = K + 1, mod.drafter.cfg.tree
    how = f"EAGLE-3 tree {','.join(map(str, shape.as_list()))}" if shape else f"EAGLE-3 chain, K={K}"
    rep.step(5, "eval", f"Evaluating {len(inp.prompts)} prompts x {opts.max_blocks} rounds ({how})...")
    per_prompt, all_drafts, all_targets, h, n_total = [], [], [], hashlib.sha256(), 0
    regime = inp.cache.regime  # a sampled cache: each entry one sample, grouped into prompts at the end
    transform = regime.transform if regime is not None and opts.draft == "sampled" else None
    t0 = time.perf_counter()
    for i, p in enumerate(inp.prompts):
        ids, feats = inp.cache.load(i, layer_ids=cache_ids, device=device, dtype=dtype)
        n = (max(0, p.seq_len - 1 - p.prompt_len) if opts.all_anchors
             else metrics.num_anchors(p.prompt_len, p.seq_len, opts.max_blocks, bs))
        anchors = torch.arange(p.prompt_len, p.prompt_len + n, device=device)
        if transform is not None:  # sampled drafts: q along y too (sampled.py)
            drafts, logq = chain_logq(head, feats, ids, anchors, K, transform, chunk=opts.batch_size or 256)
        elif shape is None:
            drafts, _ = chain_drafts(head, feats, ids, anchors, K, chunk=opts.batch_size or 256)
        else:  # the path each tree offers the walk: its acceptance is the tree's (tree.accept_lengths)
            trees = draft_trees(head, feats, ids, anchors, shape, chunk=opts.batch_size or 64)
            _, drafts = accept_lengths(trees, ids, anchors, width=K)
        g = ids.cpu().numpy()
        h.update(g.astype(np.int64).tobytes() + p.prompt_len.to_bytes(8, "little"))
        d = drafts.numpy()
        rec = metrics.prompt_metrics(d, np.full_like(d, -1), None, g, p.prompt_len, opts.max_blocks, bs)
        targets = metrics.target_tokens(g, p.prompt_len, n, K)
        first = {"draft": decode(inp.tok, d[0]) if n else "", "target": decode(inp.tok, targets[0]) if n else ""}
        per_prompt.append({"name": p.name, "num_anchors": n, **rec, "first_block": first})
        if transform is not None:  # E[tau | y] (eval/expect.py), as the DFlash eval's steps.eval_prompts
            per_prompt[-1]["expected"] = samples.expected(logq.numpy(), inp.cache.load_logp(i), p.prompt_len,
                                                          p.seq_len, opts.max_blocks, bs)
            rec = {**rec, "tau": per_prompt[-1]["expected"]["tau"]}
        all_drafts.append(d)
        all_targets.append(targets)
        n_total += n
        rep.line(f"  [{i + 1}/{len(inp.prompts)}] {p.name}: {p.seq_len} tokens · {len(rec['acceptance_lengths'])} "
                 f"rounds · {'E[tau | y]' if transform else 'tau'} {fmt(rec['tau'])} · position-1 accuracy "
                 f"{fmt(rec['position_accuracy'][0])}",
                 stage="eval_prompt", i=i + 1, n=len(inp.prompts),
                 metrics={"tau": rec["tau"], "position_1_accuracy": rec["position_accuracy"][0]})
    if regime is not None:  # one record per prompt, its samples inside (the cluster bootstrap: samples.by_prompt)
        per_prompt = samples.by_prompt(per_prompt, [inp.cache.sample_of(i) for i in range(len(inp.prompts))])
    return Drafted(per_prompt, np.concatenate(all_drafts), np.concatenate(all_targets), "sha256:" + h.hexdigest(),
                   n_total, time.perf_counter() - t0, opts.batch_size or 256)


def finish_results(results: dict, record: dict) -> None:
    """results.json's EAGLE-3 fields: drafter.eagle3 (load_head's record) and the definitions."""
    results["drafter"].update(family=FAMILY, eagle3=record)
    results["definitions"] = {**results["definitions"], **DEFINITIONS}


def prepare(opts: EvalOptions, rep: Reporter) -> tuple[float, torch.device, torch.dtype]:
    """The options' refusals (exit 3, before anything is loaded), the device: (start time, device, dtype). Shared
    with the several-suite eval (suites.py)."""
    t0 = time.perf_counter()
    _refuse_unsupported(opts)
    refuse_tree(opts.eagle_tree, opts.draft)
    if opts.chain is not None and opts.chain < 1:
        raise PayloadError(f"--chain {opts.chain}: need at least 1 draft per round")
    device, dtype = resolve_device_dtype(opts.device, opts.dtype)
    rep.line(f"EAGLE-3 drafter eval · {opts.name} · device {device} ({dtype_name(dtype)})")
    return t0, device, dtype


def evaluate(opts: EvalOptions, rep: Reporter) -> dict:
    """The eval of an EAGLE-3 head over one cache (module doc) -> results.json's dict (several: suites.py)."""
    t0, device, dtype = prepare(opts, rep)
    tok = load_tokenizer(opts.target)
    try:
        tok, cache, prompts = open_inputs(opts, rep, tok)
        inp = Inputs(tok, cache, prompts, feature_pass(opts, cache, prompts, rep))
        mod, record = load_head(opts, inp, device, dtype, rep)
        with torch.no_grad():
            ev = draft_prompts(opts, inp, mod, device, dtype, rep)
        bs = mod.drafter.cfg.block_size
        m = samples.aggregate(ev.per_prompt, bs)
        health = assess_health(m, ev.drafts, ev.targets, tok, rep)
        cache_exactness(cache, health, rep)
        health.update(feature_stats=inp.feature_stats, weight_stats=mod.info.weight_stats,
                      embed_stats=mod.embed_stats)
        plain = dataclasses.replace(opts, ddtree_budgets=[], tree_widths=[])
        results = build_results(plain, inp, mod, ev, m, health, device, dtype, time.perf_counter() - t0)
    finally:
        if tok is not None:
            tok.close()
    finish_results(results, record)
    target_checks(opts, results, mod, inp, device, dtype, rep, **family_args(opts, mod))  # --speedup, --online N
    print_summary(results)
    rep.event(stage="done", step=STEPS, steps=STEPS, metrics=headline(results))
    return results
