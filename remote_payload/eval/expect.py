"""The exact expectation of the acceptance walk for SAMPLED drafts verified by rejection sampling, given y.

Why it is exact (issue 29): rejection sampling is lossless, so a completion y sampled from the target at the
serving transform is an ancestral sample of the speculative decode too. Given y, a round at anchor a accepts
its draft for position a+i with probability

    r[a, i] = P(accept | committed token y_{a+i}) = min(q(y), p(y)) / p(y) = min(1, q(y) / p(y))

(draft x ~ q, kept with probability min(1, p(x)/q(x)); when it is rejected the residual max(0, p - q) puts
p(y) - min(p(y), q(y)) on y), and the positions of a round are accepted independently given y (each step's
joint law with its committed token factorises; the committed token's marginal is p(y) whatever came before).
q: the drafter's distribution at block position i for anchor a (a block drafter's parallel output; an
autoregressive drafter's output teacher-forced on y), p: the target's; both after the same transform.
With q one-hot (greedy drafts) r is 1 where the draft equals y and 0 elsewhere: the walk of metrics.py.

The walk's rules (metrics.walk), in completion coordinates j = a - prompt_len, N = seq_len - prompt_len:
    j = 0; rounds = 0; while j < N - 1 and rounds < max_blocks: acc ~ law(j); j += acc + 1; rounds += 1
    acc counts the leading accepted drafts of the round's bs - 1; a draft past the end is never accepted, so
    acc <= min(bs - 1, N - 1 - j) and j never passes N; a round's length acc + 1 includes the bonus token.
    The walk's per-prompt tau = (tokens committed) / rounds = j_end / rounds_end.
`exact_walk` runs that loop as a dynamic program over rounds on the distribution of j: the state after each
round is (rounds done, position reached); states with j >= N - 1 or rounds = max_blocks are terminal. The
terminal distribution gives E[tau | y] = sum P(r, j) j / r (the expectation of the walk's ratio, not a ratio
of expectations), and the expected counts (rounds, histogram of lengths, rounds with acc >= k) are summed over
the rounds' start distributions. Everything is float64, on the device of the inputs.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def acceptance_probs(logq: Tensor, logp: Tensor) -> Tensor:
    """logq [n, bs-1]: log q_a(y_{a+i}), the drafter's log-prob of y's token for anchor a = prompt_len + j
    (row j), block position i = 1..bs-1 (column i-1); logp [N]: log p(y) at completion position k (the token
    at prompt_len + k; entry 0, the first bonus, is never drafted). Both under the serving transform.
    -> r [n, bs-1] float64: min(1, q/p), 0 where a + i is past the end (j + i >= N).
    Limits: q = 0 -> 0 (the draft is never y); p = 0 < q (y outside the target's support, possible only when
    the cache's agreement is < 1) -> 1."""
    lq = torch.as_tensor(logq).to(torch.float64)
    lp = torch.as_tensor(logp).to(device=lq.device, dtype=torch.float64)
    if lq.dim() != 2 or lp.dim() != 1:
        raise ValueError(f"logq must be [anchors, bs-1] and logp [completion tokens]; got shapes "
                         f"{tuple(lq.shape)} and {tuple(lp.shape)}")
    n, width = lq.shape
    pos = torch.arange(n, device=lq.device)[:, None] + torch.arange(1, width + 1, device=lq.device)[None, :]
    inside = pos < lp.shape[0]
    if bool(torch.isnan(lq[inside]).any()) or bool(torch.isnan(lp).any()):
        raise ValueError("log-probs must not be NaN (check the logits given to the transform)")
    lp_at = torch.cat([lp, lp.new_zeros(n + width + 1)])[pos]  # 0 past the end (masked below)
    r = torch.exp((lq - lp_at).clamp(max=0.0))
    r = torch.where(torch.isneginf(lq), 0.0, torch.where(torch.isneginf(lp_at), 1.0, r))
    return torch.where(inside, r, 0.0)


def accept_length_law(r: Tensor) -> tuple[Tensor, Tensor]:
    """r [n, bs-1] -> (pmf [n, bs]: P(acc = k), tail [n, bs]: P(acc >= k)), k = 0..bs-1, drafts accepted
    excl. the bonus: P(acc >= k) = r_1 ... r_k, P(acc = k) = P(acc >= k) (1 - r_{k+1})."""
    r = torch.as_tensor(r).to(torch.float64)
    ones = torch.ones(r.shape[0], 1, dtype=r.dtype, device=r.device)
    tail = torch.cat([ones, torch.cumprod(r, dim=1)], dim=1)  # [n, bs]
    pmf = tail * torch.cat([1.0 - r, ones], dim=1)
    return pmf, tail


@dataclass
class ExactWalk:
    """The walk's law for one completion (all float64 expectations over the drafts' randomness given y)."""

    tau: float | None  # E[tokens / rounds] = E[tau | y] (the walk's per-prompt tau); None: no round possible
    tokens: float  # E[tokens committed] (= E[sum of acceptance lengths]; the position reached)
    rounds: float  # E[rounds]
    histogram: list[float]  # [bs + 1]: E[#rounds of length L] (index 0 always 0)
    at_least: list[float]  # [bs]: E[#rounds with acc >= k], k = 0..bs-1 (k = 0: E[rounds])
    rounds_law: list[float]  # [R + 1]: P(the walk ends after r rounds)
    terminal: Tensor | None = None  # [R + 1, N + 1]: P(it ends after r rounds at completion position j)

    @property
    def streak(self) -> float | None:
        """E[streak | y] = E[tau | y] - 1 (drafts accepted per round excl. the bonus)."""
        return None if self.tau is None else self.tau - 1

    @property
    def conditional(self) -> list[float | None]:
        """k = 1..bs-1: E[#acc >= k] / E[#acc >= k-1] (ratio of expected counts; None where 0/0)."""
        a = self.at_least
        return [a[k] / a[k - 1] if a[k - 1] else None for k in range(1, len(a))]


def _starts(prompt_len: int, seq_len: int, max_blocks: int, bs: int) -> int:
    """Anchors a round can start at: j < N - 1 (and j < max_blocks * bs); metrics.num_anchors' count."""
    n_total = seq_len - prompt_len
    return max(0, min(n_total - 2, max_blocks * bs - 1) + 1)


def exact_walk(r: Tensor, prompt_len: int, seq_len: int, max_blocks: int, bs: int,
               keep_terminal: bool = True) -> ExactWalk:
    """r [n, bs-1] (`acceptance_probs`; n >= metrics.num_anchors(...), row j = anchor prompt_len + j)
    -> the exact law of metrics.walk over y when each draft i of the round at anchor j is accepted with
    probability r[j, i-1] independently given y (module docstring), its terminal law kept."""
    return exact_walks(torch.as_tensor(r)[None], [prompt_len], [seq_len], max_blocks, bs, keep_terminal)[0]


def exact_walks(r: Tensor, prompt_lens: Sequence[int], seq_lens: Sequence[int], max_blocks: int, bs: int,
                keep_terminal: bool = False) -> list[ExactWalk]:
    """Batched `exact_walk`: r [B, n, bs-1] (completion b's rows first, the rest ignored), one program for B
    completions of different lengths (one round per step for all). keep_terminal: also return each one's
    terminal law [R + 1, N + 1] (memory B * R * N floats: leave off for big batches)."""
    r = torch.as_tensor(r).to(torch.float64)
    big_b = len(seq_lens)
    if r.dim() != 3 or r.shape[0] != big_b or r.shape[2] != bs - 1 or len(prompt_lens) != big_b:
        raise ValueError(f"exact_walks needs r [B, anchors, {bs - 1}] and B prompt_lens and seq_lens; got "
                         f"r {tuple(r.shape)}, {len(prompt_lens)} prompt_lens, {len(seq_lens)} seq_lens")
    needs = [_starts(p, s, max_blocks, bs) for p, s in zip(prompt_lens, seq_lens)]
    for b, need in enumerate(needs):
        if r.shape[1] < need:
            raise ValueError(f"completion {b}: the walk needs acceptance probabilities at {need} anchors "
                             f"(prompt_len {prompt_lens[b]}, seq_len {seq_lens[b]}, max_blocks {max_blocks}, "
                             f"block_size {bs}); got {r.shape[1]}")
    dev, f64 = r.device, torch.float64
    n_max = max([0, *(s - p for p, s in zip(prompt_lens, seq_lens))])
    rows = max([0, *needs])
    size = max(n_max + 1, rows + bs)  # positions 0..N (and room for j + L, whose mass past N is 0)
    rounds_cap = min(max_blocks, rows)  # a round starts at j < N - 1 and advances >= 1
    starts = torch.arange(rows, device=dev)[None, :] < torch.tensor(needs, device=dev)[:, None]  # [B, rows]
    r = r[:, :rows].masked_fill(~starts[:, :, None], 0.0)  # rows no round starts at are never read
    if bool(((r < 0) | (r > 1) | torch.isnan(r)).any()):
        raise ValueError("acceptance probabilities must lie in [0, 1]")
    pmf, tail = accept_length_law(r.reshape(-1, bs - 1))
    pmf, tail = pmf.view(big_b, rows, bs), tail.view(big_b, rows, bs)
    reach = (torch.arange(rows, device=dev)[:, None] + torch.arange(1, bs + 1, device=dev)[None, :]).flatten()
    j_idx = torch.arange(size, dtype=f64, device=dev)
    dist = torch.zeros(big_b, size, dtype=f64, device=dev)
    dist[:, 0] = 1.0
    hist = torch.zeros(big_b, bs, dtype=f64, device=dev)
    at_least = torch.zeros(big_b, bs, dtype=f64, device=dev)
    tau = torch.zeros(big_b, dtype=f64, device=dev)
    law = torch.zeros(big_b, rounds_cap + 1, dtype=f64, device=dev)
    terminal = torch.zeros(big_b, rounds_cap + 1, size, dtype=f64, device=dev) if keep_terminal else None
    rnd = 0
    while True:
        live = dist[:, :rows] * starts  # the mass that starts a round (j < N - 1); none after max_blocks
        if rnd == rounds_cap:
            live = torch.zeros_like(live)
        ended = dist.clone()
        ended[:, :rows] -= live
        law[:, rnd] = ended.sum(dim=1)
        if rnd:
            tau += (ended * j_idx).sum(dim=1) / rnd
        if terminal is not None:
            terminal[:, rnd] = ended
        if rnd == rounds_cap or not bool(live.any()):
            break
        hist += torch.einsum("bj,bjk->bk", live, pmf)
        at_least += torch.einsum("bj,bjk->bk", live, tail)
        dist = torch.zeros_like(dist)
        dist.index_add_(1, reach, (live[:, :, None] * pmf).reshape(big_b, -1))
        rnd += 1
    tau, hist, at_least, law = (t.cpu() for t in (tau, hist, at_least, law))  # one copy, not one per number
    return [_result(b, tau, hist, at_least, law, rnd, terminal, seq_lens[b] - prompt_lens[b])
            for b in range(big_b)]


def _result(b, tau, hist, at_least, law, rnd, terminal, n_total) -> ExactWalk:
    law_b = law[b, :rnd + 1]
    r_idx = torch.arange(rnd + 1, dtype=law.dtype, device=law.device)
    lengths = torch.arange(1, hist.shape[1] + 1, dtype=hist.dtype, device=hist.device)
    return ExactWalk(tau=float(tau[b]) if float(law_b[1:].sum()) > 0 else None,
                     tokens=float((hist[b] * lengths).sum()), rounds=float((law_b * r_idx).sum()),
                     histogram=[0.0, *hist[b].tolist()], at_least=at_least[b].tolist(),
                     rounds_law=law_b.tolist(),
                     terminal=None if terminal is None else terminal[b, :rnd + 1, :max(n_total, 0) + 1])


def expected_walk(logq: Tensor, logp: Tensor, prompt_len: int, seq_len: int, max_blocks: int,
                  bs: int) -> ExactWalk:
    """`exact_walk` of `acceptance_probs(logq, logp)`: the whole program for one sampled completion."""
    return exact_walk(acceptance_probs(logq, logp), prompt_len, seq_len, max_blocks, bs)


def summarize_expected(walks: Sequence[ExactWalk], bs: int) -> dict:
    """Exact walks of many completions -> the names of metrics.summarize, as expectations given the ys:
    tau (mean of E[tau | y] over completions with a round), tau_pooled (sum E[tokens] / sum E[rounds]),
    streak(_pooled), num_prompts, num_rounds (expected), acceptance_histogram (expected counts),
    per_position_acceptance_{unconditional,conditional} (ratios of expected counts). Samples nested in
    prompts: average each prompt's samples first when prompts have different sample counts."""
    taus = [w.tau for w in walks if w.tau is not None]
    tokens = sum(w.tokens for w in walks)
    rounds = sum(w.rounds for w in walks)
    at_least = [sum(w.at_least[k] for w in walks) for k in range(bs)]
    tau = sum(taus) / len(taus) if taus else None
    tau_pooled = tokens / rounds if rounds else None
    return {
        "tau": tau,
        "tau_pooled": tau_pooled,
        "streak": None if tau is None else tau - 1,
        "streak_pooled": None if tau_pooled is None else tau_pooled - 1,
        "num_prompts": len(walks),
        "num_rounds": rounds,
        "acceptance_histogram": [sum(w.histogram[k] for w in walks) for k in range(bs + 1)],
        "per_position_acceptance_unconditional": [at_least[k] / at_least[0] if at_least[0] else None
                                                  for k in range(1, bs)],
        "per_position_acceptance_conditional": [at_least[k] / at_least[k - 1] if at_least[k - 1] else None
                                                for k in range(1, bs)],
    }
