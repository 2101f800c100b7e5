"""Uncertainty over prompts: bootstrap confidence intervals, paired comparisons, sign-flip permutation tests,
and the smallest change a number of prompts can detect. Pure numpy (no torch, no scipy), seeded, deterministic.

Every headline number of a run is a ratio of sums over its prompts, `sum(num) / sum(den)`:
  - macro numbers (tau, streak, DDTree tau per budget, width-k tau): num = the prompt's value, den = 1;
  - pooled numbers (tau pooled, position-1 accuracy): num/den = the prompt's counts (lengths/rounds,
    hits/anchors).
So one vectorised resampler serves all of them: draw prompts with replacement (the same draws for both runs
of a paired comparison, and for every number of a run), recompute the statistic, take the 2.5th and 97.5th
percentiles. Memory is bounded whatever the number of prompts: the draws are made and used in chunks of at
most CHUNK_ELEMENTS; they come from one generator stream and each resample's sum is its own (never a sum
across a chunk), so the chunking never changes a result.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

RESAMPLES = 100_000       # at 10 prompts the ends of a tau interval move by < 0.01 (the digit shown) between seeds
MIN_RESAMPLES = 10_000
SEED = 20261201
CONFIDENCE = 0.95
ALPHA = 0.05              # the sign-flip test's level, two-sided: the decision rule needs p < ALPHA
EXACT_PERMUTATION_MAX_N = 16   # up to 2**16 sign patterns: enumerate them all (an exact p-value)
PERMUTATIONS = 20_000
Z_ALPHA = 1.959964        # two-sided 5%
Z_POWER = 0.841621        # 80% power
_CHUNK = 10_000           # resamples drawn per step, at most ...
CHUNK_ELEMENTS = 1_000_000  # ... and at most this many prompt draws (~24 MB of working arrays, whatever n):
                            # 20,000 prompts x 10,000 resamples at once was 1.5 GB
CACHE_MAX_ELEMENTS = 4_000_000  # draws kept for reuse up to this size (32 MB of int64 each)


@dataclass
class Sample:
    """One number's per-prompt parts (the prompts' names, numerators, denominators)."""
    names: list[str]
    num: np.ndarray
    den: np.ndarray

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def value(self) -> float:
        return float(self.num.sum() / self.den.sum())

    @property
    def per_prompt(self) -> np.ndarray:
        return self.num / self.den


@dataclass
class Estimate:
    """A headline number with its 95% bootstrap interval over prompts, the SD across prompts and n."""
    value: float
    lo: float
    hi: float
    sd: float | None     # SD of the per-prompt values (ddof 1); None with one prompt
    n: int

    def as_dict(self) -> dict:
        return {"value": self.value, "ci": [self.lo, self.hi], "sd": self.sd, "n": self.n,
                "resamples": resamples_for(self.n)}


@dataclass
class Paired:
    """A run against a reference, paired by prompt: the difference and the ratio with their paired-bootstrap
    95% intervals, the sign-flip permutation p-value, the SD of the per-prompt differences and n."""
    delta: float
    delta_lo: float
    delta_hi: float
    ratio: float | None
    ratio_lo: float | None
    ratio_hi: float | None
    p_value: float
    sd_diff: float | None
    n: int

    @property
    def excludes_zero(self) -> bool:
        """The 95% interval of the difference lies on one side of 0."""
        return self.delta_lo > 0 or self.delta_hi < 0

    @property
    def significant(self) -> bool:
        """The one decision rule (the star, the verdicts, the HTML's better/worse): a difference the data
        supports when the paired 95% interval excludes 0 AND the sign-flip p < ALPHA. Both, because the
        percentile bootstrap is too narrow at few prompts (its ends can exclude 0 where the exact test says
        p 0.06), and the interval gives the direction and size that p alone does not. With 5 prompts or fewer
        nothing is significant: the smallest two-sided p of n prompts is 2 / 2**n."""
        return self.excludes_zero and self.p_value < ALPHA

    @property
    def disagree(self) -> bool:
        """The interval and the test say different things (one excludes 'no difference', the other does not)."""
        return self.excludes_zero != (self.p_value < ALPHA)

    def as_dict(self) -> dict:
        return {"delta": self.delta, "delta_ci": [self.delta_lo, self.delta_hi], "ratio": self.ratio,
                "ratio_ci": [self.ratio_lo, self.ratio_hi], "p_value": self.p_value, "sd_diff": self.sd_diff,
                "n": self.n, "ci_excludes_0": self.excludes_zero, "significant": self.significant}


def resamples_for(n: int) -> int:
    """Resamples for n prompts: RESAMPLES at 10 prompts or fewer, then fewer in proportion (the interval
    narrows as 1/sqrt(n), so does the Monte Carlo error of its ends: the same error in tau), >= MIN_RESAMPLES."""
    return max(MIN_RESAMPLES, min(RESAMPLES, RESAMPLES * 10 // max(n, 1)))


def resample_indices(n: int, resamples: int = RESAMPLES, seed: int | None = None):
    """The draws: chunks of [k, n] prompt indices, with replacement (the sampling scheme, seeded)."""
    rng = np.random.default_rng(SEED if seed is None else seed)
    step = _rows(n)
    for s in range(0, resamples, step):
        yield rng.integers(0, n, size=(min(step, resamples - s), n))


def _rows(n: int) -> int:
    """Resamples (or sign patterns) per chunk for n prompts: bounded by memory (CHUNK_ELEMENTS), not by count."""
    return max(1, min(_CHUNK, CHUNK_ELEMENTS // max(n, 1)))


@functools.lru_cache(maxsize=4)
def _indices(n: int, resamples: int, seed: int | None) -> np.ndarray:
    """[resamples, n] draws, kept for reuse while small (CACHE_MAX_ELEMENTS)."""
    out = np.concatenate(list(resample_indices(n, resamples, seed)))
    out.setflags(write=False)
    return out


def resampled(samples: tuple[Sample, ...], resamples: int, seed: int | None) -> list[np.ndarray]:
    """Per sample (all of the same n), sum(num)/sum(den) over every resample, from the same draws: each
    resample's drawn values summed on their own (a row of a chunk), so a chunk's size never changes a result.
    Many prompts: the draws are made chunk by chunk (at most CHUNK_ELEMENTS), never all at once."""
    n = samples[0].n
    assert all(s.n == n for s in samples)
    if n * resamples <= CACHE_MAX_ELEMENTS:
        chunks = [_indices(n, resamples, seed)]
    else:
        chunks = resample_indices(n, resamples, seed)
    ones = [bool(np.all(s.den == 1)) for s in samples]  # macro numbers: every resample's den is exactly n
    parts: list[list[np.ndarray]] = [[] for _ in samples]
    for idx in chunks:
        for out, s, one in zip(parts, samples, ones):
            out.append(s.num[idx].sum(axis=1) / (float(n) if one else s.den[idx].sum(axis=1)))
    return [np.concatenate(p) for p in parts]


def _percentiles(stats: np.ndarray, confidence: float) -> tuple[float, float]:
    a = (1 - confidence) / 2
    lo, hi = np.quantile(stats, [a, 1 - a])
    return float(lo), float(hi)


def _sd(x: np.ndarray) -> float | None:
    return float(np.std(x, ddof=1)) if len(x) > 1 else None


def bootstrap(sample: Sample, *, resamples: int | None = None, seed: int | None = None,
              confidence: float = CONFIDENCE) -> Estimate:
    """Percentile bootstrap over prompts of sum(num)/sum(den)."""
    return bootstrap_many({"": sample}, resamples=resamples, seed=seed, confidence=confidence)[""]


def bootstrap_many(samples: dict, *, resamples: int | None = None, seed: int | None = None,
                   confidence: float = CONFIDENCE) -> dict:
    """bootstrap() of each sample (the same numbers), the samples of one n sharing one pass over the draws
    (every number of a run: 20,000 prompts once instead of once per number)."""
    by_n: dict[int, list] = {}
    for k, s in samples.items():
        by_n.setdefault(s.n, []).append(k)
    out = {}
    for n, keys in by_n.items():
        values = resampled(tuple(samples[k] for k in keys), resamples or resamples_for(n), seed)
        for k, v in zip(keys, values):
            lo, hi = _percentiles(v, confidence)
            out[k] = Estimate(samples[k].value, lo, hi, _sd(samples[k].per_prompt), n)
    return {k: out[k] for k in samples}


def align(a: Sample, b: Sample) -> tuple[Sample, Sample]:
    """The prompts both samples have, in a's order (comparable runs have the same prompts)."""
    pos = {name: i for i, name in enumerate(b.names)}
    keep = [i for i, name in enumerate(a.names) if name in pos]
    j = [pos[a.names[i]] for i in keep]
    names = [a.names[i] for i in keep]
    return Sample(names, a.num[keep], a.den[keep]), Sample(names, b.num[j], b.den[j])


def paired(a: Sample, b: Sample, *, resamples: int | None = None, seed: int | None = None,
           confidence: float = CONFIDENCE) -> Paired:
    """a against b, paired by prompt name: Δ = stat(a) - stat(b) and stat(a)/stat(b), both from the same
    resampled prompts; p-value: sign flips (a and b swapped per prompt) under 'no difference'."""
    return paired_many({"": (a, b)}, resamples=resamples, seed=seed, confidence=confidence)[""]


def paired_many(pairs: dict, *, resamples: int | None = None, seed: int | None = None,
                confidence: float = CONFIDENCE) -> dict:
    """paired() of each (a, b) (the same numbers), the pairs of one n sharing one pass over the draws and one
    over the sign patterns (every number of two runs: 20,000 prompts once instead of once per number)."""
    aligned = {k: align(a, b) for k, (a, b) in pairs.items()}
    by_n: dict[int, list] = {}
    for k, (a, _) in aligned.items():
        if a.n == 0:
            raise ValueError("no prompt in common: a paired comparison needs the same prompts")
        by_n.setdefault(a.n, []).append(k)
    out = {}
    for n, keys in by_n.items():
        values = resampled(tuple(s for k in keys for s in aligned[k]), resamples or resamples_for(n), seed)
        p_values = _sign_flips([aligned[k] for k in keys], PERMUTATIONS, seed)
        for i, k in enumerate(keys):
            out[k] = _paired(*aligned[k], values[2 * i], values[2 * i + 1], p_values[i], confidence)
    return {k: out[k] for k in pairs}


def _paired(a: Sample, b: Sample, sa: np.ndarray, sb: np.ndarray, p_value: float, confidence: float) -> Paired:
    d_lo, d_hi = _percentiles(sa - sb, confidence)
    delta = a.value - b.value
    if b.value != 0:
        with np.errstate(divide="ignore", invalid="ignore"):
            r = sa / sb
        r_lo, r_hi = _percentiles(r[np.isfinite(r)], confidence) if np.isfinite(r).any() else (None, None)
        ratio = a.value / b.value
    else:
        ratio = r_lo = r_hi = None
    if delta == 0 and np.array_equal(a.per_prompt, b.per_prompt):
        d_lo = d_hi = 0.0   # identical per prompt: every resample agrees exactly
    return Paired(delta, d_lo, d_hi, ratio, r_lo, r_hi, p_value, _sd(a.per_prompt - b.per_prompt), a.n)


def sign_flip_p(a: Sample, b: Sample, *, permutations: int = PERMUTATIONS, seed: int | None = None) -> float:
    """Two-sided permutation p-value of |stat(a) - stat(b)|, swapping a and b within prompts (aligned samples).
    Exact (every one of the 2**n swap patterns) up to EXACT_PERMUTATION_MAX_N prompts, else Monte Carlo with
    the +1 correction (never 0)."""
    return _sign_flips([(a, b)], permutations, seed)[0]


def _sign_flips(pairs: list, permutations: int, seed: int | None) -> list[float]:
    """sign_flip_p of each aligned pair (all of one n), every pair judged on the same swap patterns, drawn
    in chunks of bounded memory (one stream: the chunking never changes them)."""
    n = pairs[0][0].n
    observed = [abs(a.value - b.value) for a, b in pairs]
    if n <= EXACT_PERMUTATION_MAX_N:
        flips = _all_flips(n)
        return [float(_extreme(a, b, flips, o).sum() / len(flips)) for (a, b), o in zip(pairs, observed)]
    rng = np.random.default_rng(SEED if seed is None else seed)
    counts = [0] * len(pairs)
    step = _rows(n)
    for s in range(0, permutations, step):
        flips = rng.random((min(step, permutations - s), n)) < 0.5
        for i, ((a, b), o) in enumerate(zip(pairs, observed)):
            counts[i] += int(_extreme(a, b, flips, o).sum())
    return [(c + 1) / (permutations + 1) for c in counts]


@functools.lru_cache(maxsize=EXACT_PERMUTATION_MAX_N + 1)
def _all_flips(n: int) -> np.ndarray:
    """Every swap pattern of n prompts, [2**n, n] bool, in itertools.product order (built once per n)."""
    flips = (np.arange(2 ** n)[:, None] >> np.arange(n - 1, -1, -1)) & 1 == 1
    flips.flags.writeable = False
    return flips


def _extreme(a: Sample, b: Sample, flips: np.ndarray, observed: float) -> np.ndarray:
    if np.all(a.den == 1) and np.all(b.den == 1):  # macro numbers: every pattern's den is exactly n
        an = np.where(flips, b.num, a.num).sum(1) / float(a.n)
        bn = np.where(flips, a.num, b.num).sum(1) / float(a.n)
    else:
        an = np.where(flips, b.num, a.num).sum(1) / np.where(flips, b.den, a.den).sum(1)
        bn = np.where(flips, a.num, b.num).sum(1) / np.where(flips, a.den, b.den).sum(1)
    # relative tolerance: the observed pattern itself (no flip) must count as at least as extreme
    return np.abs(an - bn) >= observed - 1e-12 * max(1.0, observed)


def detectable_change(sd_diff: float | None, n: int) -> float | None:
    """The smallest true difference that n paired prompts detect (two-sided 5%, 80% power), from the SD of
    the per-prompt differences: (z_0.975 + z_0.8) * sd / sqrt(n) (normal approximation)."""
    if sd_diff is None or n < 2:
        return None
    return (Z_ALPHA + Z_POWER) * sd_diff / math.sqrt(n)


def prompts_needed(sd_diff: float | None, change: float) -> int | None:
    """Paired prompts needed to detect `change` (two-sided 5%, 80% power) at this SD of differences; None
    without spread (SD 0: every prompt differs by the same amount, so any change would show)."""
    if sd_diff is None or change <= 0 or sd_diff == 0:
        return None
    return max(2, math.ceil(((Z_ALPHA + Z_POWER) * sd_diff / change) ** 2))


def classify_change(p: Paired | None, threshold: float) -> str:
    """improved / regressed: significant (the paired 95% interval excludes 0 and the sign-flip p < 0.05:
    Paired.significant) AND the change is at least `threshold`; otherwise 'no clear change' (the interval says
    how large a change it cannot rule out)."""
    if p is None:
        return "no clear change"
    if p.significant and abs(p.delta) >= threshold:
        return "improved" if p.delta > 0 else "regressed"
    return "no clear change"
