"""Online greedy EAGLE-3 decoding with EAGLE's dynamic tree and the real target (spec eagle3.md §3): the reference
the offline tree walk (tree.py over the cache) is held to, round by round.

    prefill: the target runs the prompt; x_n = its argmax; features F[0..n-1] = the tapped states
    per round (p = index of the bonus token; y[0..p] committed):
      draft: the tree from the committed prefix with the target's features only (tree.draft_trees at anchor p,
             fed F[0..p-1] as this decoder collected them: from prefill and the verify passes)
      verify: one target forward over y[0..p] + the tree's nodes with a tree attention mask (a node sees the
              prefix, its ancestors and itself; every node of a level at position p + level), as EAGLE's
              tree_decoding does; from the root, follow the child whose token is the target's argmax at its parent,
              as far as it goes (EAGLE's evaluate_posterior: the longest path matching the argmaxes)
      commit: the accepted nodes and the target's token after the last; their features from this verify pass
Written plainly: the target recomputes the whole sequence each round (no KV cache).
"""
from __future__ import annotations

import torch
from torch import Tensor

from remote_payload.eagle3.model import Eagle3Drafter
from remote_payload.eagle3.tree import Trees, TreeShape, draft_trees


def tree_mask(parent: list[int], prefix: int, dtype: torch.dtype) -> Tensor:
    """[1, 1, prefix+M, prefix+M] additive mask: causal over the prefix, each node (parent 0 = the prefix's last
    token, j+1 = node j) sees the prefix, its ancestors and itself."""
    M = len(parent)
    see = torch.tril(torch.ones(prefix + M, prefix + M, dtype=torch.bool))
    see[prefix:, prefix:] = False
    for j, par in enumerate(parent):
        row = prefix + j
        if par:
            see[row, prefix:] = see[prefix + par - 1, prefix:]
        see[row, row] = True
    mask = torch.zeros(see.shape, dtype=dtype).masked_fill(~see, torch.finfo(dtype).min)
    return mask[None, None]


def _verify(target, seq: list[int], trees: Trees, taps: list[int], p: int) -> tuple[Tensor, Tensor]:
    """-> (argmax [p+1+M], tapped features [p+1+M, 3Ht]) of one target forward over y[0..p] + the nodes."""
    dev = next(target.parameters()).device
    nodes, parent, level = trees.tokens[0].tolist(), trees.parent[0].tolist(), trees.level[0]
    ids = torch.tensor([seq + nodes], device=dev)
    pos = torch.cat([torch.arange(p + 1), p + level]).to(dev)[None]
    dtype = next(target.parameters()).dtype
    out = target(ids, attention_mask=tree_mask(parent, p + 1, dtype).to(dev), position_ids=pos,
                 output_hidden_states=True)
    return out.logits[0].argmax(-1), torch.cat([out.hidden_states[k][0] for k in taps], -1)


@torch.no_grad()
def decode_tree(target, drafter: Eagle3Drafter, prompt: list[int], taps: list[int], shape: TreeShape, seq_len: int,
                max_rounds: int) -> tuple[list[int], list[int]]:
    """-> (acceptance lengths incl. the bonus, one per round; the tokens y[:seq_len]); a round's acceptance is cut
    where y would pass seq_len, as the offline walk's is at the cache's end."""
    dev = next(target.parameters()).device
    n = len(prompt)
    out = target(torch.tensor([prompt], device=dev), output_hidden_states=True)
    y = list(prompt) + [int(out.logits[0, -1].argmax())]
    F = torch.cat([out.hidden_states[k][0] for k in taps], -1)
    lengths: list[int] = []
    p = n
    while p < seq_len - 1 and len(lengths) < max_rounds:
        trees = draft_trees(drafter, F[:p], torch.tensor(y[:p + 1]), torch.tensor([p]), shape)
        preds, feats = _verify(target, y[:p + 1], trees, taps, p)
        parent, tokens = trees.parent[0].tolist(), trees.tokens[0].tolist()
        path, node, want = [], 0, int(preds[p])  # node 0 = the root; want = the target's token after it
        while True:
            kids = [j for j, par in enumerate(parent) if par == node and tokens[j] == want]
            if not kids:
                break
            path.append(kids[0])
            node = kids[0] + 1
            want = int(preds[p + node])
        A = min(len(path), seq_len - 1 - p)
        path = path[:A]
        nxt = int(preds[p + path[-1] + 1]) if path else int(preds[p])
        y = y[:p + 1] + [tokens[j] for j in path] + [nxt]
        rows = [p] + [p + 1 + j for j in path]
        F = torch.cat([F[:p], feats[rows]])
        lengths.append(A + 1)
        p += A + 1
    return lengths, y[:seq_len]
