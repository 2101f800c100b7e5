"""The EAGLE-3 chain at every anchor of a prompt at once: K batched test-time-training passes (spec §4).

Anchor a (the round's bonus token g[a], committed g[0..a]) drafts from slot t = a-1 (features t, token g[a]):
- step 0: the prefix pass, slot j = (features j, token g[j+1]) at position j for every j <= t, causal; its output
  at t predicts d_1;
- step s = 1..K-1 at index t: the hidden fed back is step s-1's pre-norm output at t, the token g[t+1+s] (= d_s
  wherever the round is still accepting), position t+s; it attends to the step-0 keys <= t and to its own
  chain's keys of steps 1..s; it predicts d_{s+1}.
Teacher forcing with the cached tokens changes nothing the walk reads: a round's acceptance stops at the first
d_s != g[a+s], and every step before it was fed exactly the drafted tokens. So drafts[j] (anchor prompt_len + j)
equal the online chain's drafts up to the first miss, and the acceptance walk over them equals online greedy
decoding round by round (tests/test_eagle3.py checks it against online.py's per-round decoder).

The step-0 keys and values of every slot are computed once (one layer: a slot's K/V depend on its own inputs);
queries go in chunks so that the prefix scores stay [chunk, heads, T].
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from remote_payload.eagle3.model import Eagle3Drafter, attend

CHUNK = 256  # anchors per attention call (prefix scores: CHUNK x heads x T fp32)


def ttt_steps(drafter: Eagle3Drafter, feats: Tensor, ids: Tensor, slots: Tensor, steps: int,
              chunk: int = CHUNK) -> Iterator[tuple[slice, int, Tensor]]:
    """feats [T, 3Ht], ids [T] (the cached tokens), slots [n] (t = anchor - 1, 0 <= t <= T-2) -> yields
    (rows of `slots`, step s, draft-vocabulary logits [rows, Vd] fp32) for s = 0..steps-1, chunk by chunk.
    Differentiable (training uses it); the eval wraps it in no_grad."""
    T = ids.shape[0]
    if slots.numel() == 0:
        return
    if int(slots.min()) < 0 or int(slots.max()) > T - 2:
        raise ValueError(f"slots must lie in 0..{T - 2} (a slot's token is the next one); got "
                         f"{int(slots.min())}..{int(slots.max())}")
    cfg = drafter.cfg
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    T1 = int(slots.max()) + 1
    dev = drafter.fc.weight.device
    ids = ids.to(dev)
    u = drafter.project(feats[:T1].to(dev))  # [T1, H]
    pos0 = torch.arange(T1, device=dev)
    q0, k0, v0 = drafter.qkv(drafter.slot_inputs(u, ids[1:T1 + 1]), pos0)
    for start in range(0, slots.numel(), chunk):
        rows = slice(start, min(start + chunk, slots.numel()))
        t = slots[rows].to(dev)
        vis = pos0[None, :] <= t[:, None]  # [n, T1]: the prefix up to and including the anchor's slot
        h = drafter.finish(u[t], attend(q0[t], [(k0, vis)], [v0], group))
        yield rows, 0, drafter.logits(h)
        ck, cv = [], []
        for s in range(1, steps):
            tok = ids[(t + 1 + s).clamp(max=T - 1)]  # past the end: any token (its drafts are never accepted)
            q, k, v = drafter.qkv(drafter.slot_inputs(h, tok), t + s)
            ck.append(k[:, None])
            cv.append(v[:, None])
            kc, vc = torch.cat(ck, 1), torch.cat(cv, 1)
            h = drafter.finish(h, attend(q, [(k0, vis), (kc, None)], [v0, vc], group))
            yield rows, s, drafter.logits(h)


@torch.no_grad()
def chain_drafts(drafter: Eagle3Drafter, feats: Tensor, ids: Tensor, anchors: Tensor, K: int,
                 chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """-> (drafts [n, K] target ids, logprobs [n, K] fp32 of those drafts) at anchors [n] (bonus positions a,
    1 <= a <= T-2): the greedy chain of K drafts each round would propose there (module doc)."""
    n = anchors.numel()
    drafts = torch.empty((n, K), dtype=torch.long)
    logprobs = torch.empty((n, K), dtype=torch.float32)
    for rows, s, logits in ttt_steps(drafter, feats, ids, anchors - 1, K, chunk):
        lp = logits.log_softmax(-1)
        best = lp.argmax(-1)
        drafts[rows, s] = drafter.to_target(best).cpu()
        logprobs[rows, s] = lp.gather(-1, best[:, None])[:, 0].cpu()
    return drafts, logprobs
