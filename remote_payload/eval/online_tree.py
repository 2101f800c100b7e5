"""Online DDTree decoding: the real target verifies the drafter's DDTree under a tree attention mask over its KV
cache, round by round (issue 29 item 5: the coupled equality round by round for DDTree; online.py and
online_sampled.py decode the plain block).

The offline eval's DDTree walk (metrics.ddtree_accept_lengths + metrics.walk) builds, at each anchor, the tree of
the B best prefixes (`metrics.ddtree_build`) over the drafter's per-position top-k log-probs (greedy drafts:
k = min(max(budgets), vocab), logits_topk's order) and accepts how deep the cached completion's rank path stays
inside it. Online, per round at anchor a (the bonus, the token at a, committed):

    drafts  = drafter(features of positions < a, bonus)    -> topk ids / log-probs [bs-1, k], one forward
    tree    = metrics.ddtree_build(topk log-probs, B), nodes past the end dropped (depth <= end - a - 1: the walk
              never accepts a position past the sequence's end)
    verify  = target([bonus, node tokens]) over its KV cache at positions a + depth, with the tree mask
              (treeverify.tree_mask: a node sees the context, its ancestors and itself): ONE forward
    accept  = from the root, while some child of the current node holds the target's own token after it
              (argmax at T = 0, or in coupled mode y's token at that position), step into that child
    commit  = crop the KV cache back to a and run [bonus, accepted tokens] as one causal forward (the simplest
              exact KV handling: the tree's rows are dropped; the chain's features feed the drafter's context);
              the next bonus is the target's token after the last accepted node; record acc + 1

The tokens of a node are distinct among siblings (one row's top-k ids), so the child holding the target's token is
the target's rank at that depth, and the accepted depth equals the offline walk's (a prefix of ranks in the tree).
On CPU in fp32 the per-round lengths equal the offline walk's round by round (tests/test_online_tree.py); in bf16
features from incremental forwards differ in the last bits, as online.py says for the block.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from remote_payload.eval.drafter import DFlashDrafter, TargetHead, logits_topk
from remote_payload.eval.metrics import ddtree_build
from remote_payload.eval.online import _crop, _forward, _GrowingContext, _new_rollback_kv, check_inputs
from remote_payload.eval.treeverify import ddtree_parents, tree_depths, tree_mask


@dataclass
class TreeDecode:
    """One online DDTree decode of one prompt."""
    lengths: list[int]  # per round, incl. the bonus token (what the offline walk records)
    tokens: list[int]  # the committed tokens after the prompt (the first bonus first), cut at the end
    tree_sizes: list[int]  # per round: the nodes verified (root included)

    @property
    def tau(self) -> float | None:
        return sum(self.lengths) / len(self.lengths) if self.lengths else None


def build_tree(topk_ids: Tensor, topk_logprobs: Tensor, budget: int, max_depth: int) -> tuple[list[int], list[int]]:
    """The drafter's top-k [bs-1, k] ids and log-probs (descending) -> (tokens, parents) of [root, *nodes]: the
    budget-B DDTree of metrics.ddtree_build, nodes deeper than max_depth dropped (their descendants with them).
    The root's token is left to the caller (tokens[0] = -1)."""
    nodes = [r for r in ddtree_build(topk_logprobs.double().cpu().numpy(), budget) if len(r) <= max_depth]
    ids = topk_ids.tolist()
    return [-1, *(ids[len(r) - 1][r[-1]] for r in nodes)], ddtree_parents(nodes)


def _tree_forward(model, tokens: Tensor, parents: list[int], start: int, kv) -> Tensor:
    """The tree's nodes (tokens [n], root first) through the target over kv (which holds 0..start-1), node i at
    position start + depth(i), attending to the context, its ancestors and itself -> logits [n, V]."""
    n = len(parents)
    dtype = next(model.parameters()).dtype
    visible = torch.cat([torch.ones(n, start, dtype=torch.bool), tree_mask(parents)], dim=1)  # [n, start + n]
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    pos = (start + torch.tensor(tree_depths(parents)))[None].to(tokens.device)  # [1, n]
    # positional arguments: the cache's keyword is `past_key_values` or `cache` by transformers version
    out = model(tokens[None], mask[None, None].to(tokens.device), pos, kv, use_cache=True)
    return out.logits[0]


def _target_tokens(logits: Tensor, depths: list[int], a: int, coupled: Sequence[int] | None) -> list[int]:
    """The target's token after each node (at position a + depth + 1): its argmax, or y's token (coupled; past
    y's end the argmax: the walk never reads it)."""
    out = logits.argmax(-1).tolist()
    if coupled is not None:
        out = [int(coupled[a + d + 1]) if a + d + 1 < len(coupled) else t for t, d in zip(out, depths)]
    return out


def _accept(tokens: list[int], parents: list[int], target: list[int]) -> tuple[list[int], int]:
    """Walk the tree from the root while a child holds the target's token -> (accepted node ids, next bonus)."""
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], {})[tokens[i]] = i
    path, cur = [], 0
    while target[cur] in children.get(cur, {}):
        cur = children[cur][target[cur]]
        path.append(cur)
    return path, target[cur]


@torch.no_grad()
def decode_tree(target, drafter: DFlashDrafter, head: TargetHead, prompt: Sequence[int], *, budget: int,
                max_blocks: int, end: int, topk: int | None = None, coupled: Sequence[int] | None = None,
                layer_ids_in_cache_order: list[int] | None = None) -> TreeDecode:
    """One prompt's online DDTree decode with greedy drafts (module docstring). The target's token after each node
    is its argmax (T = 0), or in coupled mode y's token (coupled: y = prompt + completion; then end = len(y)).
    end: the sequence's last position + 1 (the cached ids' length for a greedy cache); no stop tokens.
    topk: the drafter's top-k width the tree is built from (the offline eval's: min(max(budgets), vocab)); the
    budget-B tree is the same for any k >= B. Raises ValueError as online.online_check does, and on budget < 1."""
    fc, dev = check_inputs(target, drafter, head, layer_ids_in_cache_order, 1)
    if budget < 1:
        raise ValueError(f"DDTree budget {budget} must be >= 1")
    P = len(prompt)
    if coupled is not None:
        if list(coupled[:P]) != list(prompt):
            raise ValueError("coupled: y does not start with the prompt")
        end = len(coupled)
    k = min(topk or budget, drafter.cfg.vocab_size)
    kv = _new_rollback_kv(target)
    ctx = _GrowingContext(drafter, max(end, P + 1), dev)
    logits, feats = _forward(target, torch.tensor(list(prompt), dtype=torch.long, device=dev), 0, kv, fc,
                             last_only=True)  # [1, V], [P, n_fc*H]
    ctx.append(feats)
    bonus = _target_tokens(logits[-1:], [0], P - 1, coupled)[0]
    tokens, lengths, sizes = [bonus], [], []
    a = P
    while a < end - 1 and len(lengths) < max_blocks:
        hidden = drafter.draft_hidden(ctx.view(), torch.tensor([a], device=dev),
                                      torch.tensor([bonus], device=dev), head, bounds=(a, a))  # [1, bs, H]
        top = logits_topk(hidden, head, k)
        node_ids, parents = build_tree(top.topk_ids[0], top.topk_logprobs[0], budget, end - a - 1)
        node_ids[0] = bonus
        depths = tree_depths(parents)
        logits = _tree_forward(target, torch.tensor(node_ids, device=dev), parents, a, kv)  # [n, V]
        path, nxt = _accept(node_ids, parents, _target_tokens(logits, depths, a, coupled))
        accepted = [node_ids[i] for i in path]
        _crop(kv, a)  # drop the tree's rows; the accepted chain again, causally: exact KV and features
        _, feats = _forward(target, torch.tensor([bonus, *accepted], device=dev), a, kv, fc)
        ctx.append(feats)
        tokens += [*accepted, nxt]
        lengths.append(len(path) + 1)
        sizes.append(len(parents))
        a += len(path) + 1
        bonus = nxt
    return TreeDecode(lengths=lengths, tokens=tokens[:max(end - P, 0)], tree_sizes=sizes)
