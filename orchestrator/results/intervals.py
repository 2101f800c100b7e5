"""The headline numbers of a result as per-prompt samples (stats.Sample), their bootstrap intervals, and
paired comparisons between two results. Computed from results.json's per_prompt, so runs written before
intervals existed get them too. Keys are those of `metric_values`."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from remote_payload.contract import results as results_json
from remote_payload.contract.results import PromptResult

from . import stats


def _macro(per_prompt: list[PromptResult], value) -> stats.Sample | None:
    rows = [(p.name, v) for p in per_prompt if (v := value(p)) is not None]
    if not rows:
        return None
    return stats.Sample([n for n, _ in rows], np.array([v for _, v in rows], dtype=np.float64), np.ones(len(rows)))


def _pooled(per_prompt: list[PromptResult], parts) -> stats.Sample | None:
    rows = [(p.name, *nd) for p in per_prompt if (nd := parts(p)) is not None and nd[1] > 0]
    if not rows:
        return None
    return stats.Sample([r[0] for r in rows], np.array([r[1] for r in rows], dtype=np.float64),
                        np.array([r[2] for r in rows], dtype=np.float64))


def _tree_tau(p: PromptResult, field: str, key: str) -> float | None:
    lengths = getattr(p, field) or {}
    if key in lengths:
        return float(np.mean(lengths[key])) if lengths[key] else None
    taus = getattr(p, field.replace("_acceptance_lengths", "_tau")) or {}
    return taus.get(key)


def distinct_prompts(result: results_json.Result) -> list[PromptResult]:
    """per_prompt with each prompt once: a suite whose cache and prompts repeat an earlier suite's (its
    records equal but for the `<suite>/` prefix: the same cache given as two suites, which files written
    before the spec refused it hold) adds nothing, so that no interval or paired test counts a prompt
    twice."""
    if not result.suites:
        return result.per_prompt
    def body(s):
        a, b = s.prompt_range
        return s.comparability.key(), [dataclasses.replace(p, name=p.name.removeprefix(f"{s.name}/"))
                                       for p in result.per_prompt[a:b]]
    seen, dropped = [], set()
    for s in result.suites:
        mine = body(s)
        if mine in seen:
            dropped.update(range(*s.prompt_range))
        else:
            seen.append(mine)
    return [p for i, p in enumerate(result.per_prompt) if i not in dropped] if dropped else result.per_prompt


def samples(result: results_json.Result) -> dict[str, stats.Sample]:
    """Every headline number of `result` that its per_prompt records can rebuild, each prompt counted once
    (distinct_prompts)."""
    pp = distinct_prompts(result)
    out = {"tau": _macro(pp, lambda p: p.tau),
           "tau_pooled": _pooled(pp, lambda p: (sum(p.acceptance_lengths), len(p.acceptance_lengths))),
           "streak": _macro(pp, lambda p: None if p.tau is None else p.tau - 1)}
    m = result.metrics
    for b in m.ddtree_tau:
        out[f"ddtree_{b}"] = _macro(pp, lambda p, b=b: _tree_tau(p, "ddtree_acceptance_lengths", b))
    if m.ddtree_best is not None:
        out["ddtree_best"] = out.get(f"ddtree_{m.ddtree_best.budget}")
    for w in m.tree_width_tau:
        out[f"width_{w}"] = _macro(pp, lambda p, w=w: _tree_tau(p, "tree_width_acceptance_lengths", w))
    out["pos1_acc"] = _pooled(pp, lambda p: (p.position_hits[0], p.position_totals[0])
                              if p.position_hits and p.position_totals else None)
    return {k: s for k, s in out.items() if s is not None}


def metric_values(result: results_json.Result) -> dict[str, float | None]:
    """The ranked numbers of one result as results.json states them, flat: tau, tau_pooled, streak, ddtree_best,
    ddtree_<B>, width_<k>, pos1_acc (the keys of `samples`)."""
    m = result.metrics
    out: dict[str, float | None] = {"tau": m.tau, "tau_pooled": m.tau_pooled, "streak": m.streak,
                                    "ddtree_best": m.ddtree_best.tau if m.ddtree_best else None}
    for b, v in m.ddtree_tau.items():
        out[f"ddtree_{b}"] = v
    for w, v in m.tree_width_tau.items():
        out[f"width_{w}"] = v
    out["pos1_acc"] = m.position_1_accuracy
    return out



def trusted_samples(result: results_json.Result) -> dict[str, stats.Sample]:
    """`samples` that rebuild the number results.json states (a damaged or hand-edited file's others would
    give an interval around another number) and are finite."""
    vals = metric_values(result)
    return {k: s for k, s in samples(result).items()
            if math.isfinite(s.value) and (vals.get(k) is None or math.isclose(s.value, vals[k], rel_tol=1e-3,
                                                                              abs_tol=1e-6))}


def estimates(result: results_json.Result, *, seed: int | None = None, keys=None
              ) -> dict[str, stats.Estimate]:
    """Bootstrap 95% intervals (SD, n) of every headline number (or those in `keys`) that its per-prompt data
    rebuilds; none where the interval is not finite."""
    wanted = {k: s for k, s in trusted_samples(result).items() if keys is None or k in keys}
    return {k: e for k, e in stats.bootstrap_many(wanted, seed=seed).items()
            if math.isfinite(e.lo) and math.isfinite(e.hi)}


def compare_paired(result: results_json.Result, reference: results_json.Result, *, seed: int | None = None,
                   keys=None) -> dict[str, stats.Paired]:
    """`result` against `reference`, paired by prompt, for every headline number (or those in `keys`) both
    rebuild."""
    a, b = trusted_samples(result), trusted_samples(reference)
    return stats.paired_many({k: (a[k], b[k]) for k in a
                              if k in b and (keys is None or k in keys) and stats.align(a[k], b[k])[0].n}, seed=seed)
