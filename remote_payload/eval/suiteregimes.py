"""Several decoding regimes in one eval process (issue 29): `--cache gsm8k=greedy_cache --cache gsm8k_t1=sampled`.

Each suite is evaluated as a one-cache eval of its cache would be, in its own regime (its cache's sampling
transform; `--draft` for a sampled cache, `greedy` for a greedy one: at T = 0 the draft rule is irrelevant, the
drafter's sample being its argmax and the target's distribution one-hot, so rejection sampling accepts exactly
the greedy matches), and records it in suites[].regime and suites[].comparability. The run's top level:

- one regime over every suite: that regime, as a one-cache run of it records (what every run did before);
- several: `regime.mixed` (the transform's fields null, `draft` the --draft given), the comparability key
  `mixed:<suite>=<signature or greedy>;...` (so a mixed run ranks only against a run over the same suites in the
  same regimes), metrics pooled over every prompt by `pooled_metrics` (a realised walk counted as its own
  expectation), no `suite_mean` (a mean over T = 0 and T = 1 is no regime's figure), and a note saying so.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from remote_payload.contract import results as R
from remote_payload.contract.errors import PayloadError
from remote_payload.eval import metrics
from remote_payload.eval.samples import _expected_pooled

MIXED_NOTE = ("suites of different decoding regimes (suites[].regime): the top-level metrics, and the top-level "
              "speedup where measured, pool prompts of different regimes and rank only against a run over the same "
              "suites in the same regimes; suite_mean is left out (a mean over regimes is no regime's figure); "
              "compare them per suite: reval compare --by suite")

T0_NOTE = ("--draft {draft} applies to the sampled suites; this suite's cache is greedy (T = 0), where the draft rule "
           "is irrelevant (the drafter's sample is its argmax, the target's distribution one-hot: rejection sampling "
           "accepts exactly the greedy matches), so it is evaluated and recorded as draft greedy, comparable with "
           "every greedy run")


def suite_draft(draft: str, regime) -> str:
    """The draft rule a suite is evaluated with: --draft on a sampled cache; greedy on a greedy one (T = 0)."""
    return draft if regime is not None else "greedy"


def suite_regime(record: dict, draft: str) -> R.Regime:
    """A suite's results.json regime (record.regime_record's), saying why a greedy suite's rule is not --draft's."""
    reg = R.Regime.from_dict(record, "regime")
    if reg.draft != draft:
        reg.notes.append(T0_NOTE.format(draft=draft))
    return reg


def check_drafts(draft: str, regimes: Sequence[tuple[str, object]]) -> None:
    """--draft sampled over suites none of which is sampled is refused (one line), as on one greedy cache."""
    if draft == "sampled" and all(r is None for _, r in regimes):
        names = ", ".join(n for n, _ in regimes)
        raise PayloadError(f"--draft sampled needs a sampled cache (extract --temperature T --seed S); every suite "
                           f"({names}) is greedy: use --draft greedy")


def mixed_signature(suites: Sequence[R.Suite]) -> str | None:
    """The run's comparability regime: the suites' one signature, or `mixed:<suite>=<sig or greedy>;...`."""
    sigs = [s.comparability.regime for s in suites]
    if len(set(sigs)) <= 1:
        return sigs[0] if sigs else None
    return "mixed:" + ";".join(f"{s.name}={sig or 'greedy'}" for s, sig in zip(suites, sigs))


def mixed_regime(draft: str) -> R.Regime:
    return R.Regime(temperature=None, top_k=None, top_p=None, seed=None, samples=None, draft=draft,
                    notes=[MIXED_NOTE], mixed=True)


def _walk(lengths: Sequence[int], bs: int) -> dict:
    """A realised walk in expect.py's form: its own expectation."""
    acc = np.asarray(lengths, dtype=np.int64)
    return {"tokens": float(acc.sum()), "rounds": float(acc.size),
            "histogram": np.bincount(acc, minlength=bs + 1).astype(float).tolist(),
            "at_least": [float(((acc - 1) >= k).sum()) for k in range(bs)]}


def pooled_metrics(records: Sequence[dict], bs: int) -> dict:
    """results.json's top-level metrics over per_prompt records of several regimes: tau the mean over prompts of
    each prompt's tau (in its own regime), the pooled figures over every round (sampled drafts: expected counts),
    DDTree and width-k trees where every prompt has them (else left out), position accuracy pooled."""
    walks = []
    for r in records:
        samples = r.get("samples") or []
        if samples and samples[0].get("expected") is not None:
            walks += [s["expected"] for s in samples]
        else:
            walks.append(_walk(r["acceptance_lengths"], bs))
    out = _expected_pooled(walks, bs)
    taus = [r["tau"] for r in records if r.get("tau") is not None]
    tau = float(np.mean(taus)) if taus else None
    trees = {}
    for key in ("ddtree_tau", "tree_width_tau"):
        have = [r.get(key) for r in records]
        names = (have[0] if all(have) else None) or {}
        trees[key] = {b: _mean(h.get(b) for h in have) for b in names}
    scored = [(t, int(b)) for b, t in trees["ddtree_tau"].items() if t is not None]
    best = max(scored, key=lambda t: (t[0], -t[1]), default=None)
    out.update(trees, ddtree_best={"budget": best[1], "tau": best[0]} if best else None, tau=tau,
               streak=None if tau is None else tau - 1, num_prompts=len(records),
               num_samples=sum(len(r.get("samples") or [None]) for r in records))
    out.update(metrics.position_accuracy([(np.array(r["position_hits"]), np.array(r["position_totals"]))
                                          for r in records]))
    return out


def _mean(xs) -> float | None:
    vals = [x for x in xs if x is not None]
    return float(np.mean(vals)) if vals else None
