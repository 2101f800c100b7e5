"""`eval --online N` for an EAGLE-3 head: real greedy speculative decoding with the whole target over its KV cache,
the chain of K or EAGLE's dynamic tree, round by round beside the offline walk (eval/online.py times it and
eval/targetchecks.py writes results.json's `online` section, as for DFlash).

    prefill: the target over the prompt y[0..n-1] (KV cache); the features of positions 0..n-1 (HF hidden_states[k]
             of the head's taps = hs[l+1] of the cache's layers l = k-1); the bonus y[n] = the target's argmax
    per round (p = the bonus token's index; y[0..p] committed):
      draft:  the head's prefix slots grow by the positions committed since the last round (slot j = features j,
              token y[j+1], position j; u, q, k, v computed once: one layer, a slot's K/V depend on its own inputs:
              SafeAILab's stable_kv); then the tree from slot p-1 (tree._draft_chunk: step 0 over the prefix, then
              `depth` level steps, each node fed its parent's hidden, every node of a level at position p + level;
              the chain of K is the tree K+1,K-1,1, as EAGLE runs it)
      verify: ONE target forward over its cache: y[p] + the nodes at positions p + level, under the tree mask (a
              node sees the context, its ancestors and itself; the chain: a causal block, no mask)
      accept: from the root, the child whose token is the target's argmax at its parent, as far as it goes (cut
              where y would pass the cached ids, as the offline walk is at the cache's end)
      commit: the accepted nodes' K/V rows moved behind the root in the target's cache, the rest cropped; their
              features (this verify pass) appended; the next bonus = the target's argmax after the last one
"""
from __future__ import annotations

import torch
from torch import Tensor

from remote_payload.eagle3.model import Eagle3Drafter
from remote_payload.eagle3.tree import TreeShape, _draft_chunk
from remote_payload.eval import online
from remote_payload.eval.treeverify import tree_mask


def chain_shape(K: int) -> TreeShape:
    """The chain of K drafts as EAGLE's tree: total_token K+1, depth K-1, top_k 1."""
    return TreeShape(K + 1, K - 1, 1)


class _Prefix:
    """The head's prefix slots (u, q, k, v of slots 0..n-1), appended as positions are committed."""

    def __init__(self, head: Eagle3Drafter):
        self.head, self.n, self.parts = head, 0, None

    def grow(self, feats: Tensor, tokens: Tensor) -> None:
        """feats [m, 3Ht] (positions n..n+m-1), tokens [m] (y[n+1..n+m]): slots n..n+m-1."""
        if feats.shape[0] == 0:
            return
        h = self.head
        u = h.project(feats)
        q, k, v = h.qkv(h.slot_inputs(u, tokens), torch.arange(self.n, self.n + feats.shape[0], device=u.device))
        new = (u, q, k, v)
        self.parts = new if self.parts is None else tuple(torch.cat([a, b]) for a, b in zip(self.parts, new))
        self.n += feats.shape[0]


def _forward(model, ids: list[int], start: int, level: Tensor | None, parents: list[int] | None, kv, cache_ids):
    """ids at positions start + level (level None: start, start+1, ...) over kv (positions < start), under the
    tree mask of `parents` (None: causal) -> (argmax [n], features [n, 3Ht])."""
    dev = next(model.parameters()).device
    n = len(ids)
    pos = (start + (torch.arange(n) if level is None else level))[None].to(dev)
    mask = None
    if parents is not None:
        dtype = next(model.parameters()).dtype
        see = torch.cat([torch.ones(n, start, dtype=torch.bool), tree_mask(parents)], 1)
        mask = torch.zeros(see.shape, dtype=dtype).masked_fill(~see, torch.finfo(dtype).min)[None, None].to(dev)
    out = model(torch.tensor([ids], device=dev), mask, pos, kv, use_cache=True, output_hidden_states=True)
    hs = out.hidden_states
    return out.logits[0].argmax(-1), torch.cat([hs[l + 1][0] for l in cache_ids], -1)


def _keep_rows(kv, start: int, rows: list[int]) -> None:
    """Keep the cache rows start + rows[i] (ascending, rows[0] = 0: the root) as start + i; crop the rest."""
    if rows != list(range(len(rows))):
        idx = torch.tensor(rows) + start
        layers = getattr(kv, "layers", None)
        pairs = ([(x.keys, x.values) for x in layers] if layers is not None
                 else list(zip(kv.key_cache, kv.value_cache)))
        for k, v in pairs:
            i = idx.to(k.device)
            k[..., start:start + len(rows), :] = k[..., i, :]
            v[..., start:start + len(rows), :] = v[..., i, :]
    online._crop(kv, start + len(rows))


@torch.no_grad()
def speculative(target, head: Eagle3Drafter, cache_ids: list[int], shape: TreeShape, g: list[int], P: int,
                max_rounds: int) -> tuple[list[int], list[int]]:
    """One prompt's greedy EAGLE-3 decode (module doc) -> (acceptance lengths incl. the bonus, the target's tokens
    P, P+1, ...); g: the cached ids (prompt + completion), P the prompt's length."""
    dev = head.fc.weight.device
    chain = shape.top_k == 1
    T = len(g)
    kv = online._new_rollback_kv(target)
    pre, feats = _forward(target, g[:P], 0, None, None, kv, cache_ids)
    F, y, prefix = feats.to(dev), list(g[:P]) + [int(pre[-1])], _Prefix(head)
    lengths: list[int] = []
    p = P
    while p < T - 1 and len(lengths) < max_rounds:
        prefix.grow(F[prefix.n:p], torch.tensor(y[prefix.n + 1:p + 1], device=dev))
        trees = _draft_chunk(head, prefix.parts, torch.tensor([p], device=dev), shape)
        parent, tokens = trees.parent[0].tolist(), trees.tokens[0].tolist()
        parents = [-1, *parent]  # block index: 0 = the root (y[p]), j + 1 = node j
        level = torch.cat([torch.zeros(1, dtype=torch.long), trees.level[0].cpu()])
        greedy, feats = _forward(target, [y[p], *tokens], p, None if chain else level,
                                 None if chain else parents, kv, cache_ids)
        greedy = greedy.tolist()
        path, node = [], 0
        while len(path) < T - 1 - p:  # the deepest child of `node` whose token is the target's next
            node = next((j + 1 for j, par in enumerate(parent) if par == node and tokens[j] == greedy[node]), None)
            if node is None:
                break
            path.append(node)
        rows = [0, *path]
        _keep_rows(kv, p, rows)
        F = torch.cat([F[:p], feats[rows].to(dev)])
        y = y[:p + 1] + [tokens[j - 1] for j in path] + [greedy[rows[-1]]]
        lengths.append(len(path) + 1)
        p += len(path) + 1
    return lengths, y[P:]


def online_check(target, head: Eagle3Drafter, cache_ids: list[int], shape: TreeShape,
                 prompts: list[tuple[str, list[int], int, list[int]]], max_blocks: int, *, repeats: int = 1,
                 progress=None) -> list[online.OnlinePrompt]:
    """eval/online.online_check's contract for an EAGLE-3 head (`speculative` per prompt); ValueError (one line) on
    a target whose cache cannot be rolled back, or one the taps do not fit."""
    why = online.refusal(target)
    if why is not None:
        raise ValueError(why)
    n_layers = target.config.get_text_config().num_hidden_layers
    if max(cache_ids) >= n_layers:
        raise ValueError(f"the head taps cache layers {cache_ids} but the target has {n_layers} layers")
    return online.timed_check(target, prompts,
                              lambda g, P: speculative(target, head, cache_ids, shape, g, P, max_blocks),
                              repeats=repeats, progress=progress)
