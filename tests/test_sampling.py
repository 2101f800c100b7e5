"""remote_payload/eval/sampling.py and expect.py: the serving transform, seeded sampling, and the exact
expectation of the acceptance walk for sampled drafts verified by rejection sampling (issue 29), CPU, fp32 and
float64.

- the program's E[tau | y] (and E[rounds], the expected histogram) against a Monte Carlo of the real rejection
  sampler (drafts drawn from q, kept with probability min(1, p/q), the residual drawn otherwise), conditioned
  on y step by step, with full distributions: within 4 standard errors;
- q one-hot (greedy drafts) gives the numbers of metrics.walk / metrics.summarize exactly, on random data and
  on the trained fixtures; a transform at T -> 0 is greedy;
- the sampler's law is softmax(logits / T) after top-k and top-p (chi-square, p > 1e-3), tokens outside never
  drawn; generator_for makes draws independent of the batch.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from remote_payload.eval import metrics
from remote_payload.eval.expect import (
    acceptance_probs,
    exact_walk,
    exact_walks,
    expected_walk,
    summarize_expected,
)
from remote_payload.eval.sampling import (
    agreement,
    generator_for,
    sample,
    sample_rows,
    token_logprobs,
    transform_logprobs,
)

NEG_INF = float("-inf")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls, one thread


# ---------------------------------------------------------------- the Monte Carlo of the rejection sampler

def _draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """probs [..., V] (rows summing to 1) -> one index per row by inverse CDF (float64)."""
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[:-1], generator=gen, dtype=torch.float64) * cdf[..., -1]
    return torch.searchsorted(cdf, u[..., None], right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def _conditioned_step(q: torch.Tensor, p: torch.Tensor, y: int, gen: torch.Generator) -> torch.Tensor:
    """One verification step of z-lab's rejection sampler for rows of draft distributions q [m, V] against the
    target's p [V], conditioned on the committed token being y: each row's step is run again until it commits
    y (`tries` independent runs at once, about 2 / p(y); the first that commits y counts) -> accepted [m]."""
    tries = int(min(64, max(2, math.ceil(2 / float(p[y])))))
    out = torch.zeros(q.shape[0], dtype=torch.bool)
    pending = torch.arange(q.shape[0])
    residual = (p[None, :] - q).clamp_min(0)  # where the sampler draws from when it rejects
    total = residual.sum(1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-300), p[None, :])
    for _ in range(1000):
        if not pending.numel():
            return out
        qq = q[pending][:, None, :].expand(-1, tries, -1)
        x = _draw(qq, gen)  # [m, tries]: the draft
        u = torch.rand(x.shape, generator=gen, dtype=torch.float64)
        accept = u * qq.gather(2, x[..., None]).squeeze(2) < p[x]  # z-lab: rand * q < p
        z = _draw(residual[pending][:, None, :].expand(-1, tries, -1), gen)
        ok = torch.where(accept, x, z) == y
        first = ok.int().argmax(1)
        found = ok.any(1)
        out[pending[found]] = accept[found, first[found]]
        pending = pending[~found]
    raise AssertionError(f"the conditioned step did not commit y in {1000 * tries} tries")


def _monte_carlo(q_full, p_full, y, max_blocks: int, bs: int, draws: int, seed: int):
    """Speculative decoding with sampled drafts, conditioned on the completion y (completion coordinates:
    anchor j, block draft i from q_full[j, i-1], target p_full[k] at position k) -> (tau [draws] per walk,
    rounds [draws], hist [draws, bs + 1]: each walk's rounds per length). Every step commits one token of y;
    a round ends at a rejection (length i) or after bs - 1 acceptances with the target's bonus (length bs);
    drafts past the end are never accepted; at most max_blocks rounds. The walk's rules, driven by the
    sampler itself."""
    gen = torch.Generator().manual_seed(seed)
    n_total = len(y)
    anchor = torch.zeros(draws, dtype=torch.long)
    rounds = torch.zeros(draws, dtype=torch.long)
    hist = torch.zeros(draws, bs + 1, dtype=torch.long)
    done = torch.full((draws,), n_total - 1 <= 0 or max_blocks == 0)

    def end_round(rows, s):
        hist[rows, s - anchor[rows]] += 1
        rounds[rows] += 1
        anchor[rows] = s

    for s in range(1, n_total):
        act = ~done
        i = s - anchor
        end_round(torch.nonzero(act & (i == bs)).squeeze(1), s)
        idx = torch.nonzero(act & (i < bs)).squeeze(1)
        if idx.numel():
            accepted = _conditioned_step(q_full[anchor[idx], i[idx] - 1], p_full[s], int(y[s]), gen)
            end_round(idx[~accepted], s)
        done |= (rounds >= max_blocks) | (anchor >= n_total - 1)
    end_round(torch.nonzero(~done).squeeze(1), n_total)  # all drafts up to the end accepted
    tau = anchor.double() / rounds.clamp(min=1).double()
    return tau, rounds, hist


def _sampled_case(seed: int, n_total: int, bs: int, vocab: int, transform: tuple):
    """Random drafter and target distributions after the transform, y sampled from the target; the drafter
    leans toward y so that runs of acceptances happen
    -> (q_full [n, bs-1, V], p_full [N, V], y, logq, logp)."""
    gen = torch.Generator().manual_seed(seed)
    p_lp = transform_logprobs(torch.randn(n_total, vocab, generator=gen) * 1.5, *transform)
    y = sample(p_lp, 1.0, generator=gen)  # T = 1 on log-probs: draws from the transformed target itself
    n = max(n_total - 1, 1)
    logits = torch.randn(n, bs - 1, vocab, generator=gen) * 1.5
    pos = (torch.arange(n)[:, None] + torch.arange(1, bs)[None, :]).clamp(max=n_total - 1)
    lean = (torch.rand(n, bs - 1, generator=gen) < 0.75).float() * 2.5
    logits.scatter_add_(2, y[pos][..., None], lean[..., None])
    q_lp = transform_logprobs(logits, *transform)
    logq = q_lp.gather(2, y[pos][..., None]).squeeze(2)
    logp = p_lp.gather(1, y[:, None]).squeeze(1)
    return q_lp.double().exp(), p_lp.double().exp(), y, logq, logp


@pytest.mark.parametrize("max_blocks,transform", [(64, (0.8, 4, 0.9)), (4, (1.0, 0, 1.0))],
                         ids=["walk-ends-at-the-completion-end", "max-blocks-binds"])
def test_exact_expectation_matches_a_monte_carlo_of_the_rejection_sampler(max_blocks, transform):
    bs, n_total, prompt_len, draws = 5, 26, 3, 20_000
    q_full, p_full, y, logq, logp = _sampled_case(7, n_total, bs, 6, transform)
    w = expected_walk(logq, logp, prompt_len, prompt_len + n_total, max_blocks, bs)
    tau, rounds, hist = _monte_carlo(q_full, p_full, y, max_blocks, bs, draws, seed=11)
    assert math.isclose(float(w.terminal.sum()), 1.0, rel_tol=1e-12) and sum(w.rounds_law) == pytest.approx(1)
    checks = [("E[tau | y]", w.tau, tau), ("E[rounds]", w.rounds, rounds.double())]
    checks += [(f"E[#rounds of length {k}]", w.histogram[k], hist[:, k].double()) for k in range(1, bs + 1)]
    for name, exact, xs in checks:
        mean, se = float(xs.mean()), float(xs.std()) / math.sqrt(draws)
        lo, hi = mean - 4 * se, mean + 4 * se
        assert lo <= exact <= hi, (f"{name}: exact {exact:.5f} outside the Monte Carlo's 4-SE interval "
                                   f"[{lo:.5f}, {hi:.5f}] (mean {mean:.5f}, {draws} draws)")
    assert 1.5 < w.tau < bs  # the case is not degenerate: runs of acceptances and rejections both happen
    assert w.streak == pytest.approx(w.tau - 1)
    assert w.tokens == pytest.approx(sum(k * h for k, h in enumerate(w.histogram)))


def test_acceptance_probabilities_are_min_one_q_over_p_and_zero_past_the_end():
    logq = torch.log(torch.tensor([[0.5, 0.2, 1.0], [0.0, 0.075, 0.9]], dtype=torch.float64))
    logp = torch.log(torch.tensor([0.7, 0.25, 0.4, 0.1], dtype=torch.float64))  # N = 4
    r = acceptance_probs(logq, logp)
    expect = torch.tensor([[1.0, 0.5, 1.0], [0.0, 0.75, 0.0]], dtype=torch.float64)
    assert torch.allclose(r, expect, rtol=1e-12, atol=0), r
    # y outside the target's support (agreement < 1) with q > 0: limit 1; q = 0 and p = 0: 0
    r = acceptance_probs(torch.tensor([[0.0, NEG_INF]]), torch.tensor([0.0, NEG_INF, NEG_INF]))
    assert r.tolist() == [[1.0, 0.0]]
    with pytest.raises(ValueError, match="NaN"):
        acceptance_probs(torch.tensor([[float("nan")]]), torch.tensor([0.0, 0.0]))


# ---------------------------------------------------------------- greedy drafts: the walk, exactly

def _greedy_case(rng: np.random.Generator):
    bs = int(rng.choice([2, 4, 16]))
    prompt_len, n_total = int(rng.integers(0, 6)), int(rng.integers(0, 70))
    max_blocks = int(rng.choice([1, 2, 3, 7, 1000]))
    g = rng.integers(0, 5, prompt_len + n_total)
    n = metrics.num_anchors(prompt_len, len(g), max_blocks, bs)
    tgt = metrics.target_tokens(g, prompt_len, n, bs - 1)
    drafts = np.where(rng.random((n, bs - 1)) < rng.uniform(0.5, 0.97), tgt, rng.integers(0, 5, (n, bs - 1)))
    drafts = np.where(tgt < 0, rng.integers(0, 5, (n, bs - 1)), drafts)
    logq = torch.from_numpy(np.where(drafts == tgt, 0.0, NEG_INF))  # one-hot q: log q(y) is 0 or -inf
    logp = torch.from_numpy(rng.uniform(-3, 0, n_total))  # any target: r = min(1, 1/p) = 1 where drafted
    return bs, prompt_len, max_blocks, g, drafts, logq, logp


def test_one_hot_drafts_reproduce_the_walk_exactly_on_random_data():
    rng = np.random.default_rng(3)
    cases = [_greedy_case(rng) for _ in range(150)]
    per_bs: dict = {}
    for bs, prompt_len, max_blocks, g, drafts, logq, logp in cases:
        lengths = metrics.walk(metrics.accept_lengths_vanilla(drafts, g, prompt_len), prompt_len, len(g),
                               max_blocks, bs)
        w = expected_walk(logq, logp, prompt_len, len(g), max_blocks, bs)
        s = metrics.summarize([lengths], bs)
        assert w.tau == s["tau"] and w.rounds == len(lengths) and w.tokens == sum(lengths), (lengths, w)
        assert w.histogram == [float(c) for c in s["acceptance_histogram"]]
        assert w.conditional == s["per_position_acceptance_conditional"]
        assert w.rounds_law[len(lengths)] == 1.0 and float(w.terminal.max()) == 1.0
        per_bs.setdefault((bs, max_blocks), []).append((lengths, w, logq, logp, prompt_len, len(g)))
    for (bs, max_blocks), group in per_bs.items():  # a batch of completions of different lengths, one program
        width = max(x[2].shape[0] for x in group)
        r = torch.zeros(len(group), max(width, 1), bs - 1, dtype=torch.float64)
        for b, (_, _, logq, logp, _, _) in enumerate(group):
            r[b, :logq.shape[0]] = acceptance_probs(logq, logp)
        batched = exact_walks(r, [x[4] for x in group], [x[5] for x in group], max_blocks, bs)
        for (_, w, *_), v in zip(group, batched):
            assert (v.tau, v.rounds, v.histogram, v.at_least) == (w.tau, w.rounds, w.histogram, w.at_least)
        s = metrics.summarize([x[0] for x in group], bs)
        e = summarize_expected([x[1] for x in group], bs)
        assert e["tau_pooled"] == s["tau_pooled"] and e["acceptance_histogram"] == s["acceptance_histogram"]
        assert e["per_position_acceptance_conditional"] == s["per_position_acceptance_conditional"]
        assert e["per_position_acceptance_unconditional"] == s["per_position_acceptance_unconditional"]
        assert (e["tau"] is None) == (s["tau"] is None) and e["tau"] == pytest.approx(s["tau"], rel=1e-14)


def test_a_walk_with_no_round_and_short_inputs():
    w = exact_walk(torch.zeros(0, 3), 4, 5, 8, 4)  # one completion token: the walk does no round
    assert w.tau is None and w.rounds == 0 and w.rounds_law == [1.0]
    with pytest.raises(ValueError, match="at 3 anchors"):
        exact_walk(torch.zeros(1, 3), 0, 4, 8, 4)


def test_the_transform_at_t_to_zero_is_greedy_and_gives_the_walk():
    gen = torch.Generator().manual_seed(5)
    bs, prompt_len, n_total, vocab = 6, 2, 40, 30
    n = n_total - 1
    y = torch.randint(0, vocab, (prompt_len + n_total,), generator=gen)
    tgt = torch.from_numpy(metrics.target_tokens(y.numpy(), prompt_len, n, bs - 1))
    # distinct logits 0.1 apart: at T = 1e-4 every non-argmax probability underflows to exactly 0
    d_logits = torch.stack([torch.randperm(vocab, generator=gen) * 0.1 for _ in range(n * (bs - 1))])
    d_logits = d_logits.view(n, bs - 1, vocab)
    hit = (torch.rand(tgt.shape, generator=gen) < 0.8) & (tgt >= 0)  # the draft is y's token: raise it on top
    d_logits[hit, tgt[hit]] = vocab * 0.1
    drafts = d_logits.argmax(-1)
    lengths = metrics.walk(metrics.accept_lengths_vanilla(drafts.numpy(), y.numpy(), prompt_len), prompt_len,
                           len(y), 100, bs)
    logp = torch.zeros(n_total)  # the completion is the target's greedy output
    for temp in (0.0, 1e-4):
        lp = transform_logprobs(d_logits, temp)
        assert torch.equal(lp.exp() == 1, torch.nn.functional.one_hot(drafts, vocab).bool())
        assert torch.equal(sample(d_logits, temp, generator=gen), drafts)
        logq = lp.gather(2, tgt.clamp(min=0)[..., None]).squeeze(2)
        w = expected_walk(logq, logp, prompt_len, len(y), 100, bs)
        assert w.tau == float(np.mean(lengths)) and w.rounds == len(lengths), (temp, w.tau, lengths)
    warm = expected_walk(transform_logprobs(d_logits, 0.05).gather(2, tgt.clamp(min=0)[..., None]).squeeze(2),
                         logp, prompt_len, len(y), 100, bs)
    assert warm.tau < float(np.mean(lengths))  # at T > 0 drafts are sometimes off the argmax: fewer accepted
    assert 1 < len(set(lengths)) and max(lengths) > 2  # the walk itself is not trivial


# ---------------------------------------------------------------- the sampler's law

def _reference_law(logits: np.ndarray, temp: float, top_k: int, top_p: float) -> np.ndarray:
    """The transform written out in float64 numpy: softmax(logits / T), keep the top_k largest, renormalise,
    keep tokens whose sorted mass before them is < top_p, renormalise (no ties in the inputs used)."""
    order = np.argsort(-logits, kind="stable")
    z = logits[order] / temp
    keep = np.arange(len(z)) < (top_k if 0 < top_k < len(z) else len(z))
    pr = np.where(keep, np.exp(z - z.max()), 0.0)
    pr /= pr.sum()
    keep &= (np.cumsum(pr) - pr) < top_p
    pr = np.where(keep, pr, 0.0)
    out = np.zeros_like(pr)
    out[order] = pr / pr.sum()
    return out


@pytest.mark.parametrize("temp,top_k,top_p,binds", [(0.7, 10, 0.9, "top_p"), (1.3, 5, 0.97, "top_k")])
def test_the_sampled_law_is_softmax_over_temperature_after_top_k_and_top_p(temp, top_k, top_p, binds):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(16, generator=gen)
    m = 200_000
    law = _reference_law(logits.double().numpy(), temp, top_k, top_p)
    lp = transform_logprobs(logits, temp, top_k, top_p)
    kept = int((law > 0).sum())
    assert np.array_equal(lp.numpy() > NEG_INF, law > 0) and (2 <= kept < top_k if binds == "top_p" else
                                                               kept == top_k), (binds, kept)
    assert np.allclose(lp.double().exp().numpy(), law, rtol=1e-5, atol=0)
    per_row = [generator_for(0, "p", i) for i in range(20_000)]
    one = sample(logits.expand(m, 16), temp, top_k, top_p, generator=gen)
    rowwise = sample_rows(logits.expand(20_000, 16), temp, top_k, top_p, per_row)
    for name, draws in (("one generator", one), ("a generator per row", rowwise)):
        counts = np.bincount(draws.numpy(), minlength=16)
        assert counts[law == 0].sum() == 0, f"{name}: tokens outside top-k/top-p were drawn: {counts}"
        kept = law > 0
        stat = chisquare(counts[kept], law[kept] * counts.sum())
        assert stat.pvalue > 1e-3, f"{name}: chi-square p = {stat.pvalue:.2e} <= 1e-3 (counts {counts[kept]})"


def test_transform_conventions_ties_and_edges():
    x = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])
    assert (transform_logprobs(x, 1.0, top_k=2) > NEG_INF).tolist() == [False, True, True, False, False]
    assert transform_logprobs(x, 0.0).tolist() == [NEG_INF, 0.0, NEG_INF, NEG_INF, NEG_INF]  # ties: lower id
    assert (transform_logprobs(x, 1.0, top_p=1e-6) > NEG_INF).tolist() == [False, True, False, False, False]
    assert torch.allclose(transform_logprobs(x, 2.0, top_k=0, top_p=1.0), torch.log_softmax(x / 2, -1))
    assert torch.equal(transform_logprobs(x, 1.0, top_k=5), transform_logprobs(x, 1.0))  # k >= V: off
    y = torch.tensor([1, 0, 4])
    lp = token_logprobs(x.expand(3, 5), y, 1.0, top_k=2)
    assert agreement(lp) == pytest.approx(1 / 3)
    assert agreement(token_logprobs(x, torch.tensor(1), 0.0)[None]) == 1 and agreement(torch.zeros(0)) is None
    for bad in ({"temperature": -1}, {"temperature": 1, "top_k": -2}, {"temperature": 1, "top_p": 0.0}):
        with pytest.raises(ValueError, match="temperature|top_k|top_p"):
            transform_logprobs(x, **{"top_k": 0, "top_p": 1.0, **bad})


# ---------------------------------------------------------------- reproducibility of seeded draws

def _decode(batch: list[tuple[str, int]], steps: int, seed: int) -> dict:
    """Sample `steps` tokens for each (prompt, sample) of the batch, the rows together at each step; the
    logits depend only on the prompt and the step (as a target's would on the prefix)."""
    gens = [generator_for(seed, p, s) for p, s in batch]
    out: dict = {key: [] for key in batch}
    for t in range(steps):
        logits = torch.stack([torch.sin(torch.arange(12.0) * (1 + len(p)) + t) * 3 for p, _ in batch])
        for key, tok in zip(batch, sample_rows(logits, 0.9, 0, 0.95, gens).tolist()):
            out[key].append(tok)
    return out


def test_generator_for_makes_draws_independent_of_batch_order_and_size():
    keys = [(p, s) for p in ("alpha", "beta", "gamma7", "d") for s in range(3)]
    whole = _decode(keys, 24, seed=42)
    reordered = _decode(keys[::-1], 24, seed=42)
    chunked = {k: v for i in range(0, len(keys), 5) for k, v in _decode(keys[i:i + 5], 24, seed=42).items()}
    alone = {k: _decode([k], 24, seed=42)[k] for k in keys}
    assert whole == reordered == chunked == alone
    assert len({tuple(v) for v in whole.values()}) == len(keys)  # different samples and prompts differ
    assert _decode(keys[:1], 24, seed=43)[keys[0]] != whole[keys[0]]  # and the seed matters
    a = torch.rand(4, generator=generator_for(1, "7", 0))
    assert not torch.equal(a, torch.rand(4, generator=generator_for(1, 7, 0)))  # "7" and 7 are two identities
    assert torch.equal(a, torch.rand(4, generator=generator_for(1, "7", 0)))


# ---------------------------------------------------------------- the trained fixtures

@pytest.fixture(scope="module")
def fixture_prompts(trained_fixtures):
    """Two cache prompts of the trained fixtures: the good drafter's full logits at every anchor and the
    target's logits over prompt + cached (greedy) completion, fp32 CPU."""
    import json

    from remote_payload.eval.anchors import draft_all_anchors
    from remote_payload.eval.cache import open_cache
    from remote_payload.eval.checkpoint import load_drafter, load_target_head
    from remote_payload.target.load import load_target
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    p = {k: trained_fixtures / v for k, v in meta["paths"].items() if isinstance(v, str)}
    drafter, _ = load_drafter(p["drafter_good"])
    cfg = drafter.cfg
    head, _ = load_target_head(p["target"], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size)
    target = load_target(p["target"], torch.device("cpu"), torch.float32)
    cache = open_cache(p["cache"])
    out = []
    with torch.inference_mode():
        for i in range(2):
            ids, feats = cache.load(i, layer_ids=cfg.fc_layer_ids)
            prompt_len, n = cache.prompts[i].prompt_len, len(ids) - cache.prompts[i].prompt_len - 1
            anchors = torch.arange(prompt_len, prompt_len + n)
            hidden = drafter.draft_hidden(drafter.precompute_context(feats), anchors, ids[anchors], head)
            d_logits = torch.nn.functional.linear(hidden[:, 1:], head.lm_head)  # [n, bs-1, V]
            t_logits = target(ids[None]).logits[0, prompt_len - 1:-1]  # predicts completion position k
            greedy = draft_all_anchors(drafter, head, feats, ids, prompt_len, n, batch_size=64,
                                       budgets=[]).drafts
            out.append((ids, prompt_len, d_logits, t_logits, greedy, cfg.block_size))
    return out


def test_on_the_trained_fixtures_t0_is_the_walk_and_t1_matches_the_sampler(fixture_prompts):
    max_blocks = 12  # the good drafter's walks on the first two prompts reach full blocks by round 12
    for ids, prompt_len, d_logits, t_logits, greedy, bs in fixture_prompts:
        y = ids[prompt_len:]
        n = d_logits.shape[0]
        tgt = torch.from_numpy(metrics.target_tokens(ids.numpy(), prompt_len, n, bs - 1)).clamp(min=0)
        assert torch.equal(d_logits.argmax(-1), torch.from_numpy(greedy))  # the eval's own drafts
        lengths = metrics.walk(metrics.accept_lengths_vanilla(greedy, ids.numpy(), prompt_len), prompt_len,
                               len(ids), max_blocks, bs)
        logq = transform_logprobs(d_logits, 0.0).gather(2, tgt[..., None]).squeeze(2)
        logp = token_logprobs(t_logits, y, 0.0)
        assert agreement(logp) == 1.0  # the cache is the target's greedy output
        w = expected_walk(logq, logp, prompt_len, len(ids), max_blocks, bs)
        assert (w.tau, w.rounds, w.tokens) == (float(np.mean(lengths)), len(lengths), sum(lengths))
        assert max(lengths) == bs  # the trained drafter does accept whole blocks
        # T = 1: the program against the rejection sampler on the real distributions, conditioned on y
        q_lp, p_lp = transform_logprobs(d_logits, 1.0), transform_logprobs(t_logits, 1.0)
        w1 = expected_walk(q_lp.gather(2, tgt[..., None]).squeeze(2), p_lp.gather(1, y[:, None]).squeeze(1),
                           prompt_len, len(ids), max_blocks, bs)
        tau, _, _ = _monte_carlo(q_lp.double().exp(), p_lp.double().exp(), y, max_blocks, bs, 4000, seed=2)
        se = float(tau.std()) / math.sqrt(len(tau))
        lo, hi = float(tau.mean()) - 4 * se, float(tau.mean()) + 4 * se
        assert lo <= w1.tau <= hi, (f"E[tau | y] at T=1 {w1.tau:.4f} outside the Monte Carlo's 4-SE interval "
                                    f"[{lo:.4f}, {hi:.4f}] (4000 draws)")
