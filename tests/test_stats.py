"""orchestrator/results/stats.py against obviously-correct references on recorded per-prompt data: a plain Python
resampling loop (same draws), scipy.stats.bootstrap, a brute-force sign-flip enumeration; seeds and
stability; the paired cases that must come out exact."""
from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from orchestrator.results import intervals, stats
from remote_payload.contract.results import Result

OLD = Path(__file__).resolve().parent / "data" / "results-v1.json"   # a real eval's results.json (4 prompts)
# per-prompt tau of the seeds' 10-prompt z-lab run (SD 2.3 over prompts, the issue's numbers)
SEEDS_TAU = [8.9, 5.1, 9.8, 11.2, 6.3, 7.7, 10.4, 4.6, 9.1, 10.6]


def _sample(values, den=None) -> stats.Sample:
    den = np.ones(len(values)) if den is None else np.asarray(den, dtype=float)
    return stats.Sample([f"p{i}" for i in range(len(values))], np.asarray(values, dtype=float), den)


def _plain_bootstrap(num, den, draws):
    """The reference: for each resample, sum the drawn prompts' parts in a Python loop."""
    out = []
    for row in draws:
        out.append(sum(num[i] for i in row) / sum(den[i] for i in row))
    return out


def test_fast_bootstrap_equals_a_plain_resampling_loop():
    s = _sample(SEEDS_TAU)
    est = stats.bootstrap(s, resamples=4000, seed=7)
    draws = np.concatenate(list(stats.resample_indices(s.n, 4000, seed=7)))
    ref = sorted(_plain_bootstrap(list(s.num), list(s.den), draws.tolist()))
    lo, hi = np.quantile(ref, [0.025, 0.975])
    assert est.lo == pytest.approx(lo, abs=1e-12) and est.hi == pytest.approx(hi, abs=1e-12)
    assert est.value == pytest.approx(sum(SEEDS_TAU) / 10)
    assert est.sd == pytest.approx(float(np.std(SEEDS_TAU, ddof=1))) and est.n == 10
    assert 2.2 < est.sd < 2.4  # the "SD 2.3"


def test_many_prompts_are_resampled_chunk_by_chunk_with_the_same_draws(monkeypatch):
    rnd = random.Random(3)
    a = _sample([rnd.gauss(8, 2) for _ in range(50)])
    b = _sample([x + rnd.gauss(0.2, 0.5) for x in a.num])
    kept = stats.bootstrap(a, resamples=30_000, seed=2), stats.paired(a, b, resamples=30_000, seed=2)
    monkeypatch.setattr(stats, "CACHE_MAX_ELEMENTS", 0)  # as with thousands of prompts: never all counts at once
    chunked = stats.bootstrap(a, resamples=30_000, seed=2), stats.paired(a, b, resamples=30_000, seed=2)
    assert (kept[0].lo, kept[0].hi) == pytest.approx((chunked[0].lo, chunked[0].hi), abs=1e-12)
    assert (kept[1].delta_lo, kept[1].delta_hi) == pytest.approx((chunked[1].delta_lo, chunked[1].delta_hi),
                                                                 abs=1e-12)


def test_ratio_of_sums_bootstrap_equals_the_loop_on_recorded_data():
    res = Result.load(OLD)
    pooled = intervals.samples(res)["tau_pooled"]  # sum(lengths)/rounds per resample
    est = stats.bootstrap(pooled, resamples=2000, seed=3)
    draws = np.concatenate(list(stats.resample_indices(pooled.n, 2000, seed=3)))
    lengths = [p.acceptance_lengths for p in res.per_prompt]
    ref = []
    for row in draws.tolist():  # obviously correct: concatenate the drawn prompts' rounds, take the mean
        rounds = [x for i in row for x in lengths[i]]
        ref.append(sum(rounds) / len(rounds))
    assert (est.lo, est.hi) == pytest.approx(tuple(np.quantile(ref, [0.025, 0.975])), abs=1e-12)
    assert est.value == pytest.approx(res.metrics.tau_pooled)
    assert intervals.estimates(res)["tau"].value == pytest.approx(res.metrics.tau)
    assert intervals.estimates(res)["pos1_acc"].value == pytest.approx(res.metrics.position_1_accuracy)


def test_against_scipy_bootstrap_percentile():
    scipy_stats = pytest.importorskip("scipy.stats", reason="scipy is a dev dependency (pyproject [dev])")
    s = _sample(SEEDS_TAU)
    ours = stats.bootstrap(s, resamples=20000, seed=1)
    ref = scipy_stats.bootstrap((np.asarray(SEEDS_TAU),), np.mean, n_resamples=20000, method="percentile",
                                confidence_level=0.95, random_state=np.random.default_rng(2))
    # different draws: the two Monte Carlo estimates agree to their sampling error (~0.02 tau here)
    assert ours.lo == pytest.approx(ref.confidence_interval.low, abs=0.05)
    assert ours.hi == pytest.approx(ref.confidence_interval.high, abs=0.05)


def test_seeded_deterministic_and_stable_to_the_digits_shown():
    s = _sample(SEEDS_TAU)
    a, b = stats.bootstrap(s), stats.bootstrap(s)
    assert (a.lo, a.hi) == (b.lo, b.hi)  # the default seed: the same numbers every time
    others = [stats.bootstrap(s, seed=k) for k in range(11, 17)]
    for end in ("lo", "hi"):  # the Monte Carlo error of each end is below one unit of the last digit shown
        sd = float(np.std([getattr(o, end) for o in others], ddof=1))
        assert sd < 0.01, f"{stats.RESAMPLES} resamples leave the {end} end uncertain by {sd:.4f} tau"
        assert all(abs(getattr(o, end) - getattr(a, end)) <= 0.02 for o in others)


def test_fewer_resamples_for_more_prompts_keep_the_ends_as_stable():
    rnd = random.Random(8)
    s = _sample([rnd.gauss(8.4, 2.3) for _ in range(200)])  # the seeds' spread, 200 prompts
    assert stats.resamples_for(200) == 10_000 and stats.resamples_for(10) == stats.RESAMPLES
    ends = [stats.bootstrap(s, seed=k) for k in range(21, 27)]
    for end in ("lo", "hi"):
        assert float(np.std([getattr(e, end) for e in ends], ddof=1)) < 0.01


def test_sign_flip_p_equals_brute_force_enumeration():
    rnd = random.Random(5)
    a = [rnd.gauss(8, 2) for _ in range(9)]
    b = [x - 0.4 + rnd.gauss(0, 0.6) for x in a]
    sa, sb = _sample(a), _sample(b)
    observed = abs(sum(a) / 9 - sum(b) / 9)
    hits = 0
    for flips in itertools.product((0, 1), repeat=9):
        xa = [b[i] if f else a[i] for i, f in enumerate(flips)]
        xb = [a[i] if f else b[i] for i, f in enumerate(flips)]
        hits += abs(sum(xa) / 9 - sum(xb) / 9) >= observed - 1e-12
    assert stats.sign_flip_p(sa, sb) == pytest.approx(hits / 2 ** 9)
    big_a, big_b = _sample(a * 3), _sample(b * 3)  # 27 prompts: Monte Carlo, never 0
    p = stats.sign_flip_p(big_a, big_b)
    assert 0 < p < 0.01


def test_paired_bootstrap_is_the_loop_over_shared_draws():
    rnd = random.Random(9)
    a = [rnd.gauss(8, 2) for _ in range(12)]
    b = [x - 0.3 + rnd.gauss(0, 0.3) for x in a]
    p = stats.paired(_sample(a), _sample(b), resamples=2000, seed=4)
    draws = np.concatenate(list(stats.resample_indices(12, 2000, seed=4))).tolist()
    deltas = [sum(a[i] - b[i] for i in row) / 12 for row in draws]
    ratios = [sum(a[i] for i in row) / sum(b[i] for i in row) for row in draws]
    assert (p.delta_lo, p.delta_hi) == pytest.approx(tuple(np.quantile(deltas, [0.025, 0.975])), abs=1e-12)
    assert (p.ratio_lo, p.ratio_hi) == pytest.approx(tuple(np.quantile(ratios, [0.025, 0.975])), abs=1e-12)
    assert p.delta == pytest.approx(sum(a) / 12 - sum(b) / 12) and p.excludes_zero
    assert p.sd_diff == pytest.approx(float(np.std(np.subtract(a, b), ddof=1)))


def test_a_run_against_itself_is_exactly_zero():
    s = _sample(SEEDS_TAU)
    p = stats.paired(s, s)
    assert (p.delta, p.delta_lo, p.delta_hi) == (0.0, 0.0, 0.0) and p.ratio == 1.0
    assert p.p_value == 1.0 and not p.excludes_zero and stats.classify_change(p, 0.1) == "no clear change"


def test_pairing_is_by_prompt_name_not_position():
    a = stats.Sample(["x", "y", "z"], np.array([1.0, 5.0, 9.0]), np.ones(3))
    b = stats.Sample(["z", "x", "y"], np.array([9.0, 1.0, 5.0]), np.ones(3))
    p = stats.paired(a, b)
    assert (p.delta, p.delta_lo, p.delta_hi) == (0.0, 0.0, 0.0)


def test_verdicts_need_an_interval_excluding_zero_and_the_minimum_effect():
    noisy = stats.paired(_sample([8.3, 5.0, 9.9, 11.0, 6.4]), _sample([8.0, 5.3, 9.6, 11.4, 6.1]))
    assert not noisy.excludes_zero and stats.classify_change(noisy, 0.1) == "no clear change"
    clear = stats.paired(_sample([x + 0.5 for x in SEEDS_TAU]), _sample([x + 0.01 * i for i, x in
                                                                         enumerate(SEEDS_TAU)]))
    assert clear.excludes_zero and stats.classify_change(clear, 0.1) == "improved"
    assert stats.classify_change(clear, 1.0) == "no clear change"  # real but smaller than --threshold
    down = stats.paired(_sample(SEEDS_TAU), _sample([x + 0.5 for x in SEEDS_TAU]))
    assert stats.classify_change(down, 0.1) == "regressed"


def test_detectable_change_and_prompts_needed():
    sd, n = 0.73 * math.sqrt(10), 10   # the seeds: SEM 0.73 over 10 prompts
    mde = stats.detectable_change(sd, n)
    assert mde == pytest.approx(2.8016 * 0.73, rel=1e-3)
    need = stats.prompts_needed(sd, mde)
    assert need in (10, 11)  # the MDE of n prompts needs n prompts (rounding up)
    assert stats.prompts_needed(sd, 0.1) == math.ceil((2.801585 * sd / 0.1) ** 2)
    assert stats.detectable_change(None, 1) is None


def test_recorded_old_run_gets_intervals_for_every_headline_number():
    res = Result.load(OLD)
    est = intervals.estimates(res)
    assert {"tau", "tau_pooled", "streak", "ddtree_best", "pos1_acc"} <= set(est)
    assert {f"ddtree_{b}" for b in res.metrics.ddtree_tau} <= set(est)
    assert {f"width_{w}" for w in res.metrics.tree_width_tau} <= set(est)
    for k, e in est.items():
        assert e.lo <= e.value + 1e-9 and e.value <= e.hi + 1e-9 and e.n == 4, k
    data = json.loads(OLD.read_text())
    assert est["ddtree_16"].value == pytest.approx(data["metrics"]["ddtree_tau"]["16"])
