"""The online check at T in numbers (online_sampled.py's decodes beside the offline figures of the same prompts).

Per prompt: the online tau is the mean over its seeds of each decode's tau (tokens / rounds, the walk's per-prompt
tau), the offline tau the eval's per_prompt tau (the mean over the cache's samples of the walk's tau, or of
E[tau | y] for sampled drafts); the headline figures are their means over the prompts (macro, as results.json's
tau). Intervals: 95% percentile bootstraps (RESAMPLES draws, seeded):
  - `tau_online_ci`, `tau_offline_ci`: over prompts, each prompt with all its seeds (samples): the cluster
    bootstrap, seeds (samples) nested in prompts, as the eval's other intervals;
  - `tau_difference_ci`: online - offline, paired over prompts (the same prompts drawn for both): the prompts'
    own spread cancels, what is left is the decodes' and the samples' randomness;
  - `tau_online_seed_ci`: over the seed indices, prompts fixed (the online decode's randomness alone).
With few prompts (or one seed) an interval is narrow by construction: the note in results.json says how many.
"""
from __future__ import annotations

import numpy as np

RESAMPLES = 10_000
SEED = 20261203
CONFIDENCE = 0.95
CI_NOTE = ("95% percentile bootstraps ({n} draws): tau_online_ci and tau_offline_ci over prompts (seeds, samples "
           "nested: the cluster bootstrap); tau_difference_ci paired over prompts; tau_online_seed_ci over the {k} "
           "seed indices with the {p} prompts fixed; over fewer than 8 prompts a percentile bootstrap is narrower "
           "than its 95%, and the log does not warn when the paired interval excludes 0")


def mean_of(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def _percentile_ci(rows: np.ndarray, stat) -> list[float] | None:
    """rows: the units resampled (axis 0); stat(rows[idx]) per draw -> [lo, hi], or None without units."""
    n = rows.shape[0]
    if n == 0:
        return None
    rng = np.random.default_rng(SEED)
    idx = rng.integers(0, n, size=(RESAMPLES, n))
    vals = stat(rows[idx])
    vals = vals[np.isfinite(vals)]
    if not vals.size:
        return None
    a = (1 - CONFIDENCE) / 2
    lo, hi = np.quantile(vals, [a, 1 - a])
    return [float(lo), float(hi)]


def _offline_pooled(records: list[dict]) -> float | None:
    tokens = rounds = 0.0
    for rec in records:
        for s in rec.get("samples") or []:
            if s.get("expected"):
                tokens, rounds = tokens + s["expected"]["tokens"], rounds + s["expected"]["rounds"]
            else:
                tokens, rounds = tokens + sum(s["acceptance_lengths"]), rounds + len(s["acceptance_lengths"])
    return tokens / rounds if rounds else None


def summarize_at_t(runs: list, offline: list[dict]) -> dict:
    """runs: online_sampled.SeededPrompt per prompt; offline: the eval's per_prompt records of the same prompts
    (a sampled cache's: each with its "samples"), in the same order -> the online section's figures."""
    if len(runs) != len(offline):
        raise ValueError(f"{len(runs)} prompts decoded online but {len(offline)} offline records")
    seeds = min((len(r.decodes) for r in runs), default=0)
    taus = np.array([[np.nan if t is None else t for t in r.seed_taus[:seeds]] for r in runs], dtype=float)
    taus = taus.reshape(len(runs), seeds)
    on = np.array([np.nanmean(t) if np.isfinite(t).any() else np.nan for t in taus])
    off = np.array([np.nan if o["tau"] is None else o["tau"] for o in offline], dtype=float)
    keep = np.isfinite(on) & np.isfinite(off)  # prompts with a round both ways
    lengths = [x for r in runs for d in r.decodes for x in d.lengths]
    with np.errstate(all="ignore"):
        out = {
            "tau_online": mean_of(on[keep]) if keep.any() else None,
            "tau_offline": mean_of(off[keep]) if keep.any() else None,
            "tau_online_ci": _percentile_ci(on[keep], lambda x: x.mean(axis=1)),
            "tau_offline_ci": _percentile_ci(off[keep], lambda x: x.mean(axis=1)),
            "tau_difference_ci": _percentile_ci(on[keep] - off[keep], lambda x: x.mean(axis=1)),
            "tau_online_seed_ci": _percentile_ci(taus[keep].T, lambda x: np.nanmean(np.nanmean(x, axis=1), axis=1)),
        }
    out["tau_difference"] = (None if out["tau_online"] is None
                             else out["tau_online"] - out["tau_offline"])
    out.update(tau_pooled_online=sum(lengths) / len(lengths) if lengths else None,
               tau_pooled_offline=_offline_pooled(offline), rounds=len(lengths), tokens=sum(lengths),
               seeds=seeds, prompts=len(runs), prompts_compared=int(keep.sum()),
               ci_note=CI_NOTE.format(n=RESAMPLES, k=seeds, p=int(keep.sum())))
    return out
