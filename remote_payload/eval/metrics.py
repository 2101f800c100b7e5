"""Acceptance metrics over teacher-forced drafts: walks, per-position numbers, DDTree, width-k trees.

The drafter's output at anchor `a` depends only on the cached target features (< a) and the bonus
token g[a], never on the walk, so the eval runs the drafter once at every anchor
a = prompt_len + j, j = 0..n-1, and every walk below is index-hopping over these per-anchor arrays:

    drafts          int   [n, bs-1]     argmax draft for positions a+1 .. a+bs-1
    target_rank     int   [n, bs-1]     position of g[a+k] in the row's top-k order (K if absent); -1 past the end
    topk_logprobs   float [n, bs-1, K]  the K largest logprobs per row, sorted descending (DDTree)

Conventions: `acc` = drafts accepted in one round, excluding the bonus token (0..bs-1); an
acceptance length `L` = acc + 1 includes it; `tau` = mean L; `streak` = tau - 1.
Everything here is numpy except `ddtree_accept_lengths`, which imports torch lazily so that it can
run on the GPU; the rest stays importable without torch.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

DEFINITIONS: dict[str, str] = {
    "acceptance_lengths": "per round of the greedy acceptance walk: drafts accepted + 1 (the bonus token); "
    "walk: a = prompt_len; while a < seq_len-1 and rounds < max_blocks: a += LCP(draft(a), g[a+1:a+bs]) + 1",
    "tau": "mean acceptance length incl. the bonus token (max block_size), macro-averaged over prompts "
    "(prompts without a round are left out)",
    "tau_pooled": "mean acceptance length incl. the bonus token over all rounds of all prompts",
    "streak": "tau - 1: mean drafts accepted per round excl. the bonus token, macro over prompts",
    "streak_pooled": "tau_pooled - 1",
    "num_prompts": "prompts evaluated",
    "num_rounds": "rounds of the vanilla walk over all prompts",
    "num_anchors": "teacher-forced anchor positions evaluated over all prompts",
    "acceptance_histogram": "index L (0..block_size) = vanilla rounds whose acceptance length incl. bonus was L "
    "(index 0 is always 0), pooled over prompts",
    "per_position_acceptance_unconditional": "k=1..block_size-1: #(rounds with acc >= k) / #rounds, "
    "acc = drafts accepted excl. bonus, pooled over the vanilla rounds of all prompts",
    "per_position_acceptance_conditional": "k=1..block_size-1: #(acc >= k) / #(acc >= k-1), pooled over the "
    "vanilla rounds of all prompts; null where no round reached k-1",
    "position_accuracy": "k=1..block_size-1, teacher-forced at every anchor (not only those the walk visits): "
    "#(anchors with draft k == g[a+k]) / #(anchors with a+k < seq_len), pooled over all anchors of all prompts; "
    "anchors: prompt_len <= a <= min(seq_len-2, prompt_len + max_blocks*block_size - 1), the positions the walk "
    "can reach (options.position_accuracy_anchors 'walk_reach'), or every completion anchor ('all')",
    "position_accuracy_macro": "as position_accuracy, but the per-prompt fractions averaged over prompts",
    "position_1_accuracy": "position_accuracy at k=1 (pooled)",
    "ddtree_tau": "per node budget B: tau (macro) of the acceptance walk with a DDTree draft tree of the B most "
    "probable prefixes under the product of the per-position draft distributions (bonus root not counted; "
    "equal scores: the lexicographically smaller rank tuple first; the rank-r child is the r-th token of the "
    "drafter's top-k order: logit descending, equal logits by the lower token id); a round accepts while the "
    "target's token is a child",
    "ddtree_best": "the budget with the largest ddtree_tau (equal tau: the smaller budget), and that tau",
    "tree_width_tau": "per width k: tau (macro) of the acceptance walk with a tree that keeps the top-k draft "
    "tokens at every depth; a round accepts while g at that depth is among them (rank < k)",
    "position_hits": "per prompt, k=1..block_size-1: anchors whose draft k equals g[a+k] (teacher-forced)",
    "position_totals": "per prompt, k=1..block_size-1: anchors with a+k < seq_len",
    "ddtree_acceptance_lengths": "per prompt and budget: the acceptance lengths (incl. bonus) of the DDTree walk",
    "tree_width_acceptance_lengths": "per prompt and width: the acceptance lengths (incl. bonus) of the width-k walk",
    "degenerate_drafts": "the most common draft token and its share of all draft tokens; suspect above 0.5",
    "num_samples": "a sampled cache (extract --temperature T): completions evaluated, every sample of each prompt; "
    "tau is then the mean over prompts of each prompt's mean over its samples, the pooled figures pool every "
    "sample's rounds (with --draft sampled: exact expected counts, eval/samples.py); null on a greedy cache",
}


# ---------------------------------------------------------------- per-anchor acceptance (acc, excl. bonus)

def num_anchors(prompt_len: int, seq_len: int, max_blocks: int, bs: int) -> int:
    """Anchors the eval must draft at: a in [prompt_len, min(seq_len-2, prompt_len + max_blocks*bs - 1)]."""
    return max(0, min(seq_len - 2, prompt_len + max_blocks * bs - 1) - prompt_len + 1)


def _leading_true(mask: np.ndarray) -> np.ndarray:
    """mask [n, m] bool -> [n] int: length of the all-True prefix of each row."""
    return np.cumprod(mask, axis=1).sum(axis=1).astype(np.int64)


def target_tokens(g: Sequence[int], prompt_len: int, n: int, width: int) -> np.ndarray:
    """-> [n, width] int: g[a+k] for anchor a = prompt_len + j, k = 1..width; -1 past the sequence end
    (the rows to score the drafts against; set target_rank to -1 where this is -1)."""
    g = np.asarray(g, dtype=np.int64)
    pos = prompt_len + np.arange(n)[:, None] + np.arange(1, width + 1)[None, :]
    return np.where(pos < len(g), g[np.minimum(pos, len(g) - 1)], -1)


def accept_lengths_vanilla(drafts: np.ndarray, g: Sequence[int], prompt_len: int) -> np.ndarray:
    """drafts [n, bs-1] int, g [seq_len] int -> acc [n]: LCP(drafts[j], g[a+1 : a+bs]), cut at the end."""
    drafts = np.asarray(drafts)
    n, width = drafts.shape
    return _leading_true(drafts == target_tokens(np.asarray(g), prompt_len, n, width))


def accept_lengths_width(target_rank: np.ndarray, k: int) -> np.ndarray:
    """target_rank [n, bs-1] int -> acc [n]: leading rows where g is among the top-k (0 <= rank < k).

    k = 1 equals the vanilla walk when drafts are the argmax (ranks are positions in the same top-k order).
    """
    r = np.asarray(target_rank)
    return _leading_true((r >= 0) & (r < k))


# ---------------------------------------------------------------- DDTree, reference (heap, O(B log B))

def ddtree_build(sorted_logprobs: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """sorted_logprobs [D, K] (each row descending) -> the tree's nodes as rank tuples, in pop order.

    Best-first over prefixes scored by the sum of their per-depth logprobs (summed in depth order in
    float64, like the vectorised version). Popping a node pushes its first child (rank 0 one depth
    down) and its next sibling (last rank + 1); each prefix has exactly one such generator, ranked
    before it, so the pops are all prefixes in order of (-score, rank tuple): equal scores go to the
    lexicographically smaller rank tuple. The root (bonus token) is implicit and not counted.
    """
    lp = np.asarray(sorted_logprobs, dtype=np.float64)
    depth_limit, k = lp.shape
    if budget <= 0 or depth_limit == 0 or k == 0:
        return []
    # heap entries: (-score, ranks, score of the parent prefix)
    heap = [(-float(lp[0, 0]), (0,), 0.0)]
    nodes: list[tuple[int, ...]] = []
    while heap and len(nodes) < budget:
        neg, ranks, parent_score = heapq.heappop(heap)
        nodes.append(ranks)
        depth, rank = len(ranks), ranks[-1]
        if rank + 1 < k:
            s = parent_score + float(lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-s, ranks[:-1] + (rank + 1,), parent_score))
        if depth < depth_limit:
            s = -neg + float(lp[depth, 0])
            heapq.heappush(heap, (-s, ranks + (0,), -neg))
    return nodes


def ddtree_accept_heap(sorted_logprobs: np.ndarray, target_rank: np.ndarray, budget: int) -> int:
    """sorted_logprobs [D, K], target_rank [D] -> drafts accepted: how deep the target's rank path
    stays inside the budget-B tree (a negative rank, past the sequence end, stops it)."""
    tree = set(ddtree_build(sorted_logprobs, budget))
    ranks = [int(r) for r in np.asarray(target_rank)]
    acc = 0
    while acc < len(ranks) and ranks[acc] >= 0 and tuple(ranks[: acc + 1]) in tree:
        acc += 1
    return acc


# ---------------------------------------------------------------- DDTree, vectorised (torch, CPU or CUDA)

def ddtree_accept_lengths(topk_logprobs, target_rank, budgets: Sequence[int],
                          max_elements: int = 1 << 24) -> dict[int, np.ndarray]:
    """topk_logprobs [n, D, K] sorted descending (numpy or torch, any device), target_rank [n, D]
    -> {B: acc [n] int} for every budget B. Exact, equal to `ddtree_accept_heap`.

    Per-depth beam: the B best prefixes of depth d extend the B best of depth d-1, so the beam keeps
    the exact top-B scores of every depth; theta_B = the B-th largest score over all depths. The
    target's prefix of depth d (scores summed in depth order in float64, like the beam and the heap;
    its logprob is read from topk_logprobs at its rank, i.e. its position in the drafter's top-k order)
    is in the tree if its score >= theta_B. Anchors where a target prefix scores exactly theta_B and
    another prefix does too depend on the tie rule: they go to the heap reference. Candidate
    (beam i, rank r) is skipped when (i+1)(r+1) > B: that many candidates already score as high.
    Memory: about max_elements float64 values per depth step (anchors are chunked).
    Two halves: `ddtree_accept_device` (no host sync: it can be queued behind the drafting) and
    `ddtree_resolve` (host: the tied anchors through the heap).
    """
    budgets = sorted({int(b) for b in budgets})
    acc, tied = ddtree_accept_device(topk_logprobs, target_rank, budgets, max_elements)
    return ddtree_resolve(acc.cpu().numpy(), tied.cpu().numpy(), topk_logprobs, target_rank, budgets)


_PAIRS: dict = {}


def _beam_pairs(w: int, width: int, dev):
    """(beam index i, rank r) candidates with (i+1)(r+1) <= w, as device index tensors (built once a device)."""
    import torch
    key = (w, width, str(dev))
    if key not in _PAIRS:
        i_idx, r_idx = zip(*[(i, r) for r in range(width) for i in range(w // (r + 1))])
        _PAIRS[key] = (torch.tensor(i_idx).to(dev), torch.tensor(r_idx).to(dev))
    return _PAIRS[key]


def ddtree_accept_device(topk_logprobs, target_rank, budgets: Sequence[int], max_elements: int = 1 << 24):
    """The device half of `ddtree_accept_lengths` -> (acc [len(budgets), n] long, tied [len(budgets), n] bool),
    budgets sorted ascending; acc is exact where tied is False."""
    import torch

    lp = torch.as_tensor(topk_logprobs).to(torch.float64)
    n, depth, k = lp.shape
    dev = lp.device
    rank = torch.as_tensor(target_rank).to(dev).long()
    budgets = sorted({int(b) for b in budgets})
    if not budgets or budgets[0] < 1:
        raise ValueError(f"DDTree budgets must be positive node counts; got {budgets}")
    b_max = budgets[-1]
    if n == 0 or depth == 0:
        return (torch.zeros(len(budgets), n, dtype=torch.long, device=dev),
                torch.zeros(len(budgets), n, dtype=torch.bool, device=dev))

    # Target path: its prefix scores c[:, d], summed sequentially in depth order.
    on_path = torch.cumprod(((rank >= 0) & (rank < k)).long(), dim=1).bool()  # [n, D]
    lp_t = lp.gather(2, rank.clamp(0, k - 1)[:, :, None])[:, :, 0]  # [n, D]
    c = torch.empty_like(lp_t)
    run = torch.zeros(n, dtype=torch.float64, device=dev)
    for d in range(depth):
        run = run + lp_t[:, d]
        c[:, d] = run

    # Top-w scores per depth, w = b_max + 1 (one past the largest tree, to see ties at its edge),
    # descending: scores [n, D, w]; -inf pads when fewer prefixes exist.
    w = b_max + 1
    width = min(k, w)
    i_idx, r_idx = _beam_pairs(w, width, dev)
    scores = torch.empty((n, depth, w), dtype=torch.float64, device=dev)
    chunk = max(1, max_elements // len(i_idx))
    for s in range(0, n, chunk):
        part = lp[s:s + chunk]  # [c, D, K]
        beam = torch.full((part.shape[0], w), float("-inf"), dtype=torch.float64, device=dev)
        beam[:, :width] = part[:, 0, :width]
        scores[s:s + chunk, 0] = beam
        for d in range(1, depth):
            cand = beam[:, i_idx] + part[:, d, r_idx]  # [c, M], M ~ w * ln(w) >= w
            beam = cand.topk(w, dim=1).values
            scores[s:s + chunk, d] = beam

    accs, ties = [], []
    for b in budgets:
        # the top-b of each depth is the first b of its top-w; theta = the b-th largest over depths
        theta = scores[:, :, :b].reshape(n, depth * b).topk(b, dim=1).values[:, -1:]  # [n, 1]
        accs.append(torch.cumprod((on_path & (c >= theta)).long(), dim=1).sum(dim=1))
        # c == theta is exact when the target prefix is the only prefix scoring theta (it is then the
        # B-th node). Any other prefix at theta shows up in the top-(b+1) of some depth.
        shared = (scores[:, :, :b + 1] == theta[:, :, None]).sum(dim=(1, 2)) > 1
        ties.append((on_path & (c == theta)).any(dim=1) & shared)
    return torch.stack(accs), torch.stack(ties)


def ddtree_resolve(acc: np.ndarray, tied: np.ndarray, topk_logprobs, target_rank,
                   budgets: Sequence[int]) -> dict[int, np.ndarray]:
    """Host half: acc/tied [len(budgets), n] (budgets ascending) -> {B: acc [n]}, tied anchors by the heap."""
    out = {}
    for row, b in enumerate(sorted({int(b) for b in budgets})):
        a = np.array(acc[row], dtype=np.int64)
        for j in np.flatnonzero(tied[row]).tolist():
            lp_j = topk_logprobs[j].cpu().numpy() if hasattr(topk_logprobs, "cpu") else np.asarray(topk_logprobs[j])
            r_j = target_rank[j].cpu().numpy() if hasattr(target_rank, "cpu") else np.asarray(target_rank[j])
            a[j] = ddtree_accept_heap(lp_j.astype(np.float64), r_j, b)
        out[b] = a
    return out


# ---------------------------------------------------------------- the walk and the aggregates

def walk(acc: np.ndarray, prompt_len: int, seq_len: int, max_blocks: int, bs: int) -> list[int]:
    """acc [n] per anchor (excl. bonus) -> acceptance lengths incl. bonus, in round order."""
    need = num_anchors(prompt_len, seq_len, max_blocks, bs)
    if len(acc) < need:
        raise ValueError(f"walk needs acc at {need} anchors (prompt_len {prompt_len}, seq_len {seq_len}, "
                         f"max_blocks {max_blocks}, block_size {bs}); got {len(acc)}")
    lengths: list[int] = []
    a = prompt_len
    while a < seq_len - 1 and len(lengths) < max_blocks:
        length = int(acc[a - prompt_len]) + 1
        lengths.append(length)
        a += length
    return lengths


def _ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den else None


def summarize(per_prompt_lengths: Sequence[Sequence[int]], bs: int) -> dict:
    """Acceptance lengths (incl. bonus) of each prompt's walk -> the walk metrics of results.json:
    tau, tau_pooled, streak, streak_pooled, num_prompts, num_rounds, acceptance_histogram [bs+1],
    per_position_acceptance_{unconditional,conditional} [bs-1]. Undefined numbers are None."""
    walks = [np.asarray(w, dtype=np.int64) for w in per_prompt_lengths]
    pooled = np.concatenate(walks) if walks else np.zeros(0, dtype=np.int64)
    if pooled.size and (pooled.min() < 1 or pooled.max() > bs):
        raise ValueError(f"acceptance lengths must lie in 1..{bs} (block_size); got {pooled.min()}..{pooled.max()}")
    means = [float(w.mean()) for w in walks if w.size]
    tau = float(np.mean(means)) if means else None
    tau_pooled = float(pooled.mean()) if pooled.size else None
    acc = pooled - 1
    at_least = [int((acc >= k).sum()) for k in range(bs)]  # at_least[0] = #rounds
    return {
        "tau": tau,
        "tau_pooled": tau_pooled,
        "streak": None if tau is None else tau - 1,
        "streak_pooled": None if tau_pooled is None else tau_pooled - 1,
        "num_prompts": len(walks),
        "num_rounds": int(pooled.size),
        "acceptance_histogram": np.bincount(pooled, minlength=bs + 1).tolist(),
        "per_position_acceptance_unconditional": [_ratio(at_least[k], at_least[0]) for k in range(1, bs)],
        "per_position_acceptance_conditional": [_ratio(at_least[k], at_least[k - 1]) for k in range(1, bs)],
    }


def position_hits(drafts: np.ndarray, g: Sequence[int], prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """drafts [n, bs-1], g [seq_len] -> (hits [bs-1], totals [bs-1]) int, teacher-forced at every anchor:
    hits[k-1] = #(draft k == g[a+k]), totals[k-1] = #(anchors with a+k < seq_len)."""
    drafts = np.asarray(drafts)
    n, width = drafts.shape
    t = target_tokens(np.asarray(g), prompt_len, n, width)
    return (drafts == t).sum(axis=0).astype(np.int64), (t >= 0).sum(axis=0).astype(np.int64)


def position_accuracy(per_prompt_hits: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict:
    """[(hits [bs-1], totals [bs-1]) per prompt] -> position_accuracy (pooled over anchors, the
    headline), position_accuracy_macro (mean of per-prompt fractions), position_1_accuracy,
    num_anchors. Undefined entries (no anchor reaches k) are None."""
    hits = np.array([h for h, _ in per_prompt_hits], dtype=np.int64).reshape(len(per_prompt_hits), -1)
    totals = np.array([t for _, t in per_prompt_hits], dtype=np.int64).reshape(hits.shape)
    pooled = [_ratio(h, t) for h, t in zip(hits.sum(0), totals.sum(0))]
    macro = []
    for k in range(hits.shape[1]):
        fracs = [h / t for h, t in zip(hits[:, k], totals[:, k]) if t]
        macro.append(float(np.mean(fracs)) if fracs else None)
    return {
        "position_accuracy": pooled,
        "position_accuracy_macro": macro,
        "position_1_accuracy": pooled[0] if pooled else None,
        "num_anchors": int(totals[:, 0].sum()) if totals.size else 0,
    }


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def prompt_metrics(drafts: np.ndarray, target_rank, topk_logprobs, g: Sequence[int], prompt_len: int,
                   max_blocks: int, bs: int, budgets: Sequence[int] = (), widths: Sequence[int] = (),
                   tree_acc: dict | None = None) -> dict:
    """One prompt's per-anchor arrays (module docstring; target_rank -1 past the end, topk_logprobs
    numpy or torch on any device, None when budgets is empty) -> its JSON-ready per_prompt record:
    prompt_len, seq_len, acceptance_lengths, tau, position_hits, position_totals, position_accuracy,
    ddtree_acceptance_lengths, ddtree_tau, tree_width_acceptance_lengths, tree_width_tau
    (budget/width keys are strings, as JSON keeps them). tree_acc: the DDTree acc per budget, when computed
    already (topk_logprobs is then not read)."""
    seq_len = len(g)
    lengths = walk(accept_lengths_vanilla(drafts, g, prompt_len), prompt_len, seq_len, max_blocks, bs)
    hits, totals = position_hits(drafts, g, prompt_len)
    if tree_acc is None:  # precomputed: {B: acc [n]} from ddtree_accept_lengths (e.g. queued on the GPU)
        tree_acc = ddtree_accept_lengths(topk_logprobs, target_rank, budgets) if budgets else {}
    dd = {str(b): walk(a, prompt_len, seq_len, max_blocks, bs) for b, a in tree_acc.items()}
    ranks = np.asarray(target_rank.cpu() if hasattr(target_rank, "cpu") else target_rank)
    wide = {str(k): walk(accept_lengths_width(ranks, k), prompt_len, seq_len, max_blocks, bs) for k in widths}
    return {
        "prompt_len": prompt_len,
        "seq_len": seq_len,
        "acceptance_lengths": lengths,
        "tau": _mean(lengths),
        "position_hits": hits.tolist(),
        "position_totals": totals.tolist(),
        "position_accuracy": [_ratio(h, t) for h, t in zip(hits, totals)],
        "ddtree_acceptance_lengths": dd,
        "ddtree_tau": {b: _mean(w) for b, w in dd.items()},
        "tree_width_acceptance_lengths": wide,
        "tree_width_tau": {k: _mean(w) for k, w in wide.items()},
    }


def aggregate(records: Sequence[dict], bs: int) -> dict:
    """per_prompt records from `prompt_metrics` -> results.json `metrics`: the vanilla walk's numbers
    (`summarize`), position accuracy (`position_accuracy`), ddtree_tau, ddtree_best, tree_width_tau
    (each tau macro over prompts, like the headline tau)."""
    out = summarize([r["acceptance_lengths"] for r in records], bs)
    out.update(position_accuracy([(np.array(r["position_hits"]), np.array(r["position_totals"]))
                                  for r in records]))
    for key, per in (("ddtree_tau", "ddtree_acceptance_lengths"), ("tree_width_tau", "tree_width_acceptance_lengths")):
        names = records[0][per] if records else {}
        out[key] = {name: summarize([r[per][name] for r in records], bs)["tau"] for name in names}
    scored = [(tau, int(b)) for b, tau in out["ddtree_tau"].items() if tau is not None]
    best = max(scored, key=lambda t: (t[0], -t[1]), default=None)  # equal tau: the smaller budget
    out["ddtree_best"] = {"budget": best[1], "tau": best[0]} if best else None
    return out


def degenerate_drafts(drafts: np.ndarray, max_share: float = 0.5) -> tuple[bool, int | None, float]:
    """drafts [..] int -> (suspect, most common token id, its share of all draft tokens).
    The seeds' broken loader drafted one token over and over; a share above max_share flags that."""
    flat = np.asarray(drafts).ravel()
    if flat.size == 0:
        return False, None, 0.0
    ids, counts = np.unique(flat, return_counts=True)
    top = int(counts.argmax())
    share = float(counts[top]) / flat.size
    return share > max_share, int(ids[top]), share
