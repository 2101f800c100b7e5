"""Online greedy EAGLE-3 speculative decoding, round by round, with the real target (spec eagle3.md §3): the
reference the offline walk (walk.py) is held to.

    prefill: the target runs the prompt (n tokens); x_n = its argmax; features F[0..n-1] = the tapped states
    per round (p = index of the bonus token; y[0..p] committed):
      draft: the prefix pass over slots 0..p-1 (F[j], y[j+1], position j; causal), then K-1 steps, each feeding
             back the pre-norm hidden and the drafted token at position p+s-1, attending to the prefix and the
             chain's earlier steps (`draft_chain`)
      verify: the target over y[0..p] + d_1..d_K; A = longest run with d_i == its argmax; commit d_1..d_A and
              the target's token after them; the features of y[p..p+A] come from this verify pass
Written plainly: the target recomputes the whole sequence every round (no KV cache), and the drafter recomputes
its prefix every round (the same numbers as SafeAILab's `stable_kv`: a slot's K/V depend on its inputs only).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from remote_payload.eagle3.model import Eagle3Drafter, attend


@torch.no_grad()
def draft_chain(drafter: Eagle3Drafter, feats: Tensor, tokens: Tensor, K: int,
                choose: Callable[[Tensor], Tensor] | None = None) -> list[int]:
    """feats [p, 3Ht] (target features of slots 0..p-1), tokens [p] (y[1..p]) -> the K drafted target ids.
    choose: draft-vocabulary logits [1, Vd] -> the draft index [1] drafted (None: the argmax; online_sampled.py
    draws it)."""
    cfg = drafter.cfg
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    dev = drafter.fc.weight.device
    p = tokens.shape[0]
    u = drafter.project(feats.to(dev))
    pos = torch.arange(p, device=dev)
    q, k, v = drafter.qkv(drafter.slot_inputs(u, tokens.to(dev)), pos)
    causal = pos[None, :] <= pos[:, None]
    g = drafter.finish(u, attend(q, [(k, causal)], [v], group))  # every slot (as a prefill); the last drafts
    h = g[-1:]
    keys, values = [k], [v]
    out = []
    for s in range(1, K + 1):
        logits = drafter.logits(h)
        d = drafter.to_target(logits.argmax(-1) if choose is None else choose(logits))  # [1]
        out.append(int(d))
        if s == K:
            break
        qs, ks, vs = drafter.qkv(drafter.slot_inputs(h, d), torch.tensor([p + s - 1], device=dev))
        keys.append(ks)
        values.append(vs)
        kk, vv = torch.cat(keys), torch.cat(values)
        h = drafter.finish(h, attend(qs, [(kk, None)], [vv], group))
    return out


def _target_pass(target, seq: list[int], taps: list[int], dev) -> tuple[Tensor, Tensor]:
    """-> (argmax next tokens [len], tapped features [len, 3Ht]) of one causal forward over seq."""
    out = target(torch.tensor([seq], device=dev), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[k][0] for k in taps], -1)
    return out.logits[0].argmax(-1), feats


@torch.no_grad()
def decode(target, drafter: Eagle3Drafter, prompt: list[int], taps: list[int], K: int, seq_len: int,
           max_rounds: int) -> tuple[list[int], list[int]]:
    """-> (acceptance lengths incl. the bonus, one per round; the tokens y[:seq_len]). Decoding stops once y
    holds seq_len tokens or after max_rounds rounds; a round's acceptance is cut where y would pass seq_len, as
    the offline walk's is at the cache's end."""
    dev = next(target.parameters()).device
    n = len(prompt)
    preds, F = _target_pass(target, prompt, taps, dev)
    y = list(prompt) + [int(preds[-1])]
    F = F[:n]
    lengths: list[int] = []
    p = n
    while p < seq_len - 1 and len(lengths) < max_rounds:
        d = draft_chain(drafter, F[:p], torch.tensor(y[1:p + 1]), K)
        preds, feats = _target_pass(target, y[:p + 1] + d, taps, dev)
        want = preds[p:p + K + 1].tolist()  # the target's token after y[p], d_1, ..., d_K
        A = 0
        while A < K and d[A] == want[A]:
            A += 1
        A = min(A, seq_len - 1 - p)
        y = y[:p + 1] + d[:A] + [want[A]]
        F = torch.cat([F[:p], feats[p:p + A + 1]])
        lengths.append(A + 1)
        p += A + 1
    return lengths, y[:seq_len]
