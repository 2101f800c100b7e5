"""EAGLE's dynamic draft tree (SafeAILab/EAGLE `cnets.py` `topK_genrate`; spec eagle3.md §3), at many anchors at once.

Per round (anchor a: the bonus token g[a], committed g[0..a]) the head drafts from slot a-1 (target features only):
- level 1: the top_k tokens of the slot's draft distribution, scores = their log-probs;
- `depth` times: the frontier (top_k nodes of the newest level) runs one pass, every node fed its parent's
  pre-norm hidden (level 1: the slot's) and its own token at ONE position per level (a + i), attending to the prefix
  slots <= a-1, its ancestors' keys and its own; each node's top_k children score parent + log-prob; of those
  top_k^2 candidates the best top_k are the next frontier;
- the tree: the best `total_token - 1` nodes of all scored candidates (level 1 and every frontier's children),
  by cumulative log-prob, plus the root (the bonus token).
The target accepts the longest root-to-node path whose tokens are its greedy continuation: here g[a+1], g[a+2], ...
(siblings hold distinct tokens, so the path is unique). `total_token=K+1, depth=K-1, top_k=1` is the chain of K
(every candidate is kept, each level one node: exactly walk.py's chain; tests/test_eagle3_tree.py checks it).

A node's key/value depends on its own inputs only (one layer), so the prefix's K/V are computed once per prompt and
a node attends to them (masked at its anchor) plus the stacked keys of its path: EAGLE's tree mask, row by row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from remote_payload.contract import spec
from remote_payload.contract.errors import PayloadError
from remote_payload.contract.spec import TreeShape
from remote_payload.eagle3.model import Eagle3Drafter, attend

DEFAULT_TREE = spec.DEFAULT_EAGLE_TREE  # SafeAILab EaModel.from_pretrained(total_token=60, depth=7, top_k=10)
NO_NODE = -2  # a path row past the tree's end (-1 is metrics' 'past the sequence end': never equal)
CHUNK = 64  # anchors per batch (a frontier pass is CHUNK * top_k queries)


def parse_tree(text: str) -> TreeShape:
    """`--eagle-tree TOTAL,DEPTH,TOPK` (or `default`) -> TreeShape: the contract's one parse (contract/spec.py, which
    the laptop's spec uses too), its refusal a PayloadError (exit 3) naming what is wrong."""
    try:
        return spec.parse_tree(text)
    except spec.SpecError as e:
        raise PayloadError(str(e)) from None


@dataclass
class Trees:
    """n trees of M = total_token - 1 nodes each (the root, the bonus token, is implicit: index 0 of `parent`)."""
    tokens: Tensor  # [n, M] target ids, nodes in EAGLE's order (by level, then candidate index)
    parent: Tensor  # [n, M] 0 = the root, j + 1 = node j
    level: Tensor  # [n, M] 1 = a child of the root
    scores: Tensor  # [n, M] cumulative log-probs (fp32)


def _level_of(flat: Tensor, k: int) -> Tensor:
    """Index into the concatenated candidate scores -> level (k level-1 candidates, then k^2 per pass)."""
    return torch.where(flat < k, 1, 2 + (flat - k).div(k * k, rounding_mode="floor"))


@torch.no_grad()
def draft_trees(drafter: Eagle3Drafter, feats: Tensor, ids: Tensor, anchors: Tensor, shape: TreeShape,
                chunk: int = CHUNK) -> Trees:
    """feats [T, 3Ht], ids [T] (the committed tokens), anchors [n] (1 <= a <= T-1; slot a-1 pairs features a-1
    with token ids[a]) -> the tree each round starting at those anchors would draft (module doc)."""
    if anchors.numel() == 0:
        e = torch.empty((0, shape.total_token - 1), dtype=torch.long)
        return Trees(e, e.clone(), e.clone(), e.float())
    dev = drafter.fc.weight.device
    T1 = int(anchors.max())
    ids = ids.to(dev)
    u = drafter.project(feats[:T1].to(dev))  # the prefix's slots, once: a slot's K/V depend on its inputs only
    prefix = (u, *drafter.qkv(drafter.slot_inputs(u, ids[1:T1 + 1]), torch.arange(T1, device=dev)))
    parts = [_draft_chunk(drafter, prefix, anchors[i:i + chunk], shape) for i in range(0, anchors.numel(), chunk)]
    return Trees(*(torch.cat([getattr(p, f).cpu() for p in parts]) for f in ("tokens", "parent", "level", "scores")))


def _draft_chunk(drafter: Eagle3Drafter, prefix: tuple[Tensor, ...], anchors: Tensor, shape: TreeShape) -> Trees:
    """prefix (u, q, k, v) of the slots 0..T1-1, anchors [n] (slot a-1 < T1) -> the n trees, on the drafter's
    device (no host sync: eagle3/speedup.py captures it in a CUDA graph; online.py grows the prefix per round)."""
    cfg, k = drafter.cfg, shape.top_k
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    u, q0, k0, v0 = prefix
    dev, n = u.device, anchors.numel()
    t = anchors.to(dev) - 1  # the anchor's slot
    pos0 = torch.arange(u.shape[0], device=dev)
    vis = pos0[None, :] <= t[:, None]  # [n, T1]
    last = drafter.finish(u[t], attend(q0[t], [(k0, vis)], [v0], group))  # [n, H]
    lp = drafter.logits(last).log_softmax(-1)
    scores, top = lp.topk(k, dim=-1)  # [n, k]
    tok = drafter.to_target(top)
    score_list, token_list = [scores], [tok]
    parent_list = [torch.zeros((n, 1), dtype=torch.long, device=dev)]  # level 1's group: the root
    hidden = last[:, None].expand(n, k, last.shape[-1])
    vis_q = vis.repeat_interleave(k, 0)  # [n*k, T1]
    path_k = path_v = None  # [n, k, i, nkv, d]: the keys of each frontier node's ancestors
    chosen = torch.arange(k, device=dev).expand(n, k)  # frontier = flat candidate indices (level 1: all k)
    for i in range(shape.depth):
        base = 1 + (0 if i == 0 else k + k * k * (i - 1))  # EAGLE's `bias`: where this frontier sits, + the root
        parent_list.append(chosen + base)
        q, kk, vv = drafter.qkv(drafter.slot_inputs(hidden, tok), (t + i + 1)[:, None].expand(n, k))
        path_k = kk[:, :, None] if path_k is None else torch.cat([path_k, kk[:, :, None]], 2)
        path_v = vv[:, :, None] if path_v is None else torch.cat([path_v, vv[:, :, None]], 2)
        attn = attend(q.flatten(0, 1), [(k0, vis_q), (path_k.flatten(0, 1), None)], [v0, path_v.flatten(0, 1)],
                      group)
        out = drafter.finish(hidden, attn.unflatten(0, (n, k)))  # [n, k, H]
        lp = drafter.logits(out).log_softmax(-1)
        child_p, child = lp.topk(k, dim=-1)  # [n, k, k]
        cu = (child_p + scores[:, :, None]).flatten(1)  # [n, k*k]
        scores, chosen = cu.topk(k, dim=-1)
        owner = chosen.div(k, rounding_mode="floor")  # which frontier node each new frontier node hangs from
        child_tok = drafter.to_target(child).flatten(1)
        tok = child_tok.gather(1, chosen)
        hidden = out.gather(1, owner[:, :, None].expand(-1, -1, out.shape[-1]))
        idx = owner[:, :, None, None, None].expand(-1, -1, *path_k.shape[2:])
        path_k, path_v = path_k.gather(1, idx), path_v.gather(1, idx)
        score_list.append(cu)
        token_list.append(child_tok)
    all_scores, all_tokens = torch.cat(score_list, 1), torch.cat(token_list, 1)
    groups = torch.cat(parent_list, 1)  # [n, 1 + depth*k]: the parent (flat + 1, 0 = root) of each k-group
    M = shape.total_token - 1
    keep = all_scores.topk(M, dim=-1).indices.sort(dim=-1).values  # [n, M] flat candidate indices, EAGLE's order
    par_flat = groups.gather(1, keep.div(k, rounding_mode="floor"))  # flat + 1 of each node's parent (0 = root)
    # the parent's index among the kept nodes (+1; 0 = root): a parent always scores above its child, so is kept
    parent = torch.searchsorted(keep, (par_flat - 1).clamp(min=0)) + 1
    parent = torch.where(par_flat == 0, 0, parent)
    return Trees(all_tokens.gather(1, keep), parent, _level_of(keep, k), all_scores.gather(1, keep).float())


def accept_lengths(trees: Trees, g: Tensor, anchors: Tensor, width: int | None = None) -> tuple[Tensor, Tensor]:
    """-> (acc [n]: drafts accepted at each anchor, the deepest node whose path is g[a+1], g[a+2], ...;
    path [n, width or the deepest level] target ids: that path, then the best-scoring descendants past it,
    NO_NODE where the tree ends): the walk reads acc, the position metrics read path as a row of drafts.
    Tensor ops over all anchors and nodes at once: D sweeps settle `ok` (parents precede children), then one step
    per level moves every anchor's cursor to its matching child, else its best-scoring child (the first on a tie)."""
    n, M = trees.tokens.shape
    D = int(trees.level.max()) if M else 0
    g = g.cpu().long()
    want_pos = anchors.cpu()[:, None] + trees.level  # [n, M] the index in g each node must equal
    want = torch.where(want_pos < g.numel(), g[want_pos.clamp(max=g.numel() - 1)], -1)
    hit = trees.tokens == want
    ok = torch.zeros((n, M + 1), dtype=torch.bool)
    ok[:, 0] = True
    for _ in range(D):  # parents precede children: D sweeps settle every level
        ok[:, 1:] = hit & ok.gather(1, trees.parent)
    acc = torch.where(ok[:, 1:], trees.level, 0).amax(1) if M else torch.zeros(n, dtype=torch.long)
    path = torch.full((n, max(D, width or 0)), NO_NODE, dtype=torch.long)
    cur = torch.zeros(n, dtype=torch.long)  # each anchor's node on its path (0 = the root; -1: the tree ended)
    for lvl in range(D):
        kid = trees.parent == cur[:, None]  # [n, M] the cursor's children (none once it is -1)
        has = kid.any(1)
        match = kid & ok[:, 1:]  # at most one: siblings hold distinct tokens
        masked = torch.where(kid, trees.scores, -torch.inf)
        best = kid & (masked >= masked.amax(1, keepdim=True))  # the best-scoring children (-inf scores too)
        nxt = torch.where(match.any(1), match.byte().argmax(1), best.byte().argmax(1))  # argmax: the first True
        path[:, lvl] = torch.where(has, trees.tokens.gather(1, nxt[:, None])[:, 0], NO_NODE)
        cur = torch.where(has, nxt + 1, -1)
    return acc, path
