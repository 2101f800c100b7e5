"""`eval --speedup` and `--online N` for an EAGLE-3 head: what eval/targetchecks.py needs beside the DFlash block's
(the whole target loaded once, results.json's `speedup` and `online` sections written as for DFlash).

--speedup measures, at each --speedup-batches size (latency.py's timing: the median of timed runs with the spread,
CUDA graphs where capture works), and projects speedup = pooled tau x decode / (draft + verify) (projection.py):
  - decode: one target step, 1 token a sequence (as for DFlash);
  - verify: one target forward over its KV cache of the round's tokens: the chain's K+1 (a causal block), or the
    tree's total_token under the tree mask (a tree of that many nodes and depth+2 levels, root included, of the
    shape treeverify.ddtree_tree builds: the shape sets the mask and positions, the tokens the FLOPs);
  - draft: one round of the head at context_len (its prefix K/V there, as SafeAILab's stable_kv): the anchor's
    slot over the prefix, then the chain's K-1 steps (K sequential head forwards) or the tree's `depth` level
    steps (depth+1), each attending to the prefix and its own path's growing keys (tree._draft_chunk; the chain as
    the tree K+1,K-1,1, as EAGLE runs it), the top-k and the tree's selection included. The batch's sequences
    read one shared prefix K/V (the same FLOPs as b separate contexts; less memory read). The new slots of the
    tokens a round accepts (u, q, k, v of about tau positions) are not counted.
The method: "eagle3-chain-<K>" or "eagle3-tree-<total_token>,<depth>,<top_k>", also in the latency table's key (a
DFlash entry is never reused for EAGLE-3, nor a chain's for a tree's).

--online N: eagle3/onlinecheck.py's decode, timed by eval/online.timed_check.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from remote_payload.eagle3.model import Eagle3Drafter
from remote_payload.eagle3.onlinecheck import chain_shape, online_check
from remote_payload.eagle3.tree import TreeShape, _draft_chunk
from remote_payload.eval.latency import Custom
from remote_payload.eval.projection import pooled
from remote_payload.eval.targetchecks import Plan
from remote_payload.eval.treeverify import chain, ddtree_tree


def method_name(shape: TreeShape | None, K: int) -> str:
    return f"eagle3-tree-{','.join(map(str, shape.as_list()))}" if shape else f"eagle3-chain-{K}"


def verify_parents(shape: TreeShape | None, K: int) -> list[int]:
    """The tree a round's verify feeds, root first: the chain's K+1 tokens, or total_token nodes over depth+2
    levels (the root and depth+1 levels of drafts)."""
    return chain(K + 1) if shape is None else ddtree_tree(shape.total_token - 1, shape.depth + 2)


def draft_step(head: Eagle3Drafter, shape: TreeShape, context_len: int, batch: int, g: torch.Generator,
               dev: torch.device):
    """One round's draft for `batch` sequences at context_len (module doc) -> a callable returning the trees'
    tokens (no host sync: capturable). The prefix's u, q, k, v are computed here once, not timed."""
    cfg = head.cfg
    feats = torch.randn(context_len, cfg.fc_in_features, generator=g).to(dev, head.dtype)
    ids = torch.randint(0, min(cfg.vocab_size, head.embed.shape[0]), (context_len,), generator=g).to(dev)
    u = head.project(feats)
    prefix = (u, *head.qkv(head.slot_inputs(u, ids), torch.arange(context_len, device=dev)))
    anchors = torch.full((batch,), context_len, device=dev)

    def draft():
        return _draft_chunk(head, prefix, anchors, shape).tokens
    return draft


def family_args(opts, mod) -> dict:
    """targetchecks.target_checks's plan, check and method for this EAGLE-3 head (mod: evaluate.load_head's). The
    latency key hashes every field of the head's config (its to_dict refuses a post-norm-feedback layout)."""
    head, view = mod.drafter.head, mod.drafter.cfg
    shape, K = view.tree, view.block_size - 1
    method = method_name(shape, K)
    parents = verify_parents(shape, K)
    steps = shape or chain_shape(K)

    def draft(context_len, batch, g, dev):
        return draft_step(head, steps, context_len, batch, g, dev)
    how = (f"the tree's verify of {len(parents)} tokens under its mask, the head's {shape.depth + 1} sequential level "
           f"steps" if shape else f"the chain's verify of {K + 1} tokens, the head's {K} sequential steps")
    keyed = SimpleNamespace(cfg=SimpleNamespace(to_dict=lambda: dataclasses.asdict(head.cfg)), dtype=head.dtype)
    plan = Plan(drafter=keyed, custom=Custom(method, parents, draft),
                methods=lambda records: {method: pooled([r.get("acceptance_lengths") or [] for r in records])},
                what=f"decode, {how}")

    def check(model, prompts, repeats, progress):
        return online_check(model, head, list(view.fc_layer_ids), steps, prompts, opts.max_blocks, repeats=repeats,
                            progress=progress)
    return {"plan": plan, "check": check, "method": method}
