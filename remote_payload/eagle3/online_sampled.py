"""Online EAGLE-3 chain decoding at temperature T, round by round, with the real target: the reference the offline
figures on a sampled cache (sampled.py) are held to, as eval/online_sampled.py is for DFlash.

    prefill: the target runs the prompt; the first bonus ~ p(. | prompt) at the transform
    per round (a = index of the bonus token; y[0..a] committed):
      draft: the chain of online.draft_chain from the committed prefix with target features only;
             greedy drafts: each step's argmax; sampled drafts: each step's draft drawn from q_k (the transform on
             the draft vocabulary, mapped through d2t: sampled.full_logq) and fed back
      verify: the target over y[0..a] + d_1..d_{n-1}, n = min(K+1, end - a) -> p_1..p_n at the transform
      greedy drafts:  s_i ~ p_i; accept while d_i == s_i; the next bonus is s at the first mismatch (or s_n)
      sampled drafts: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) while accepted; at the first
                      rejection the next bonus ~ max(0, p_i - q_i) normalised; all accepted: the next ~ p_n
                      (eval/online_sampled._verify_sampled, the same code)
      commit y[a+1..a+acc+1]; their features come from this verify pass
    the sequence ends as extract's did: at a stop token (kept) or at `end`; at most max_rounds rounds.

Draws, from the decode's generator (CPU float64 uniforms, inverse CDF), in a fixed order a round: the first bonus
1; greedy drafts n (the posterior); sampled drafts K (the chain's draws, step by step), then n (n-1 accept tests,
1 next bonus). `coupled=y` (greedy drafts): the target's sample at each position is y's token and the end len(y);
the rounds are then the offline walk over y, round by round (tests/test_eagle3_sampled.py).
Written plainly, as online.py: the target recomputes the whole sequence every round, the head its prefix.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from remote_payload.eagle3.model import Eagle3Drafter
from remote_payload.eagle3.online import draft_chain
from remote_payload.eagle3.sampled import full_logq
from remote_payload.eval.online_sampled import DRAFT_RULES, Decode, _posterior, _uniforms, _verify_sampled
from remote_payload.eval.sampling import sample_with_uniforms, transform_logprobs


def _pass(target, seq: list[int], taps: list[int], dev) -> tuple[Tensor, Tensor]:
    """-> (logits [len, V] fp32, tapped features [len, 3Ht]) of one causal forward over seq."""
    out = target(torch.tensor([seq], device=dev), output_hidden_states=True)
    return out.logits[0].float(), torch.cat([out.hidden_states[k][0] for k in taps], -1)


def _sampled_chain(drafter: Eagle3Drafter, feats: Tensor, tokens: Tensor, K: int, transform: tuple, gen,
                   dev) -> tuple[list[int], Tensor]:
    """The chain with each draft drawn from q_k and fed back -> (drafts, log q [K, vocab_size] over target ids)."""
    u = _uniforms(gen, K, dev)
    qs: list[Tensor] = []

    def draw(logits: Tensor) -> Tensor:
        qs.append(full_logq(drafter, logits, transform))
        return sample_with_uniforms(transform_logprobs(logits, *transform), u[len(qs) - 1:len(qs)])
    drafts = draft_chain(drafter, feats, tokens, K, choose=draw)
    return drafts, torch.cat(qs)


@torch.no_grad()
def decode(target, drafter: Eagle3Drafter, prompt: Sequence[int], taps: list[int], K: int, *,
           transform: tuple[float, int, float], draft: str, max_rounds: int, end: int, eos=frozenset(),
           generator: torch.Generator | None = None, coupled: Sequence[int] | None = None) -> Decode:
    """One prompt's chain decode at the transform (module doc). taps: the HF hidden_states indices the head reads;
    end: the sequence's last position + 1 unless a stop token ends it earlier; coupled: y (prompt + completion),
    whose tokens are the target's samples (greedy drafts only; end = len(y), no stop tokens)."""
    if draft not in DRAFT_RULES:
        raise ValueError(f"draft rule {draft!r}: use {' or '.join(DRAFT_RULES)}")
    P = len(prompt)
    if coupled is not None:
        if draft != "greedy":
            raise ValueError("the coupled decode feeds y's tokens as the target's samples: greedy drafts only")
        if list(coupled[:P]) != list(prompt):
            raise ValueError("coupled: y does not start with the prompt")
        end, eos = len(coupled), frozenset()
    dev = next(target.parameters()).device
    logits, F = _pass(target, list(prompt), taps, dev)
    bonus = int(_posterior(transform_logprobs(logits[-1:], *transform), generator, coupled, P - 1, dev)[0])
    y = [*prompt, bonus]
    if bonus in eos:
        end = min(end, P + 1)
    lengths: list[int] = []
    a = P
    while a < end - 1 and len(lengths) < max_rounds:
        n = min(K + 1, end - a)
        tokens = torch.tensor(y[1:a + 1])
        if draft == "greedy":
            d = draft_chain(drafter, F[:a], tokens, K)
        else:
            d, q = _sampled_chain(drafter, F[:a], tokens, K, transform, generator, dev)
        logits, feats = _pass(target, y[:a + 1] + d[:n - 1], taps, dev)
        p = transform_logprobs(logits[a:a + n], *transform)  # positions a+1..a+n
        if draft == "greedy":
            s = _posterior(p, generator, coupled, a, dev).tolist()
            acc = next((i for i in range(n - 1) if d[i] != s[i]), n - 1)
            nxt = s[acc]
        else:
            acc, nxt_t = _verify_sampled(p, q, torch.tensor(d, device=dev), generator, dev)
            nxt = int(nxt_t[0])
        committed = [*d[:acc], nxt]  # positions a+1..a+acc+1
        stop = next((i for i, t in enumerate(committed) if t in eos), None)
        if stop is not None:  # the sequence ends at the stop token, as extract's did
            end = min(end, a + stop + 2)
            acc = min(acc, stop + 1)
        y = y[:a + 1] + committed[:acc + 1]
        F = torch.cat([F[:a], feats[a:a + acc + 1]])
        lengths.append(acc + 1)
        a += acc + 1
    return Decode(lengths=lengths, tokens=y[P:max(end, P)])
