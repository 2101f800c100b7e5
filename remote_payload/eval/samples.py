"""τ at T (issue 29): the eval over a sampled cache (eval/regime.py), its samples grouped into prompts.

The walks run per cache entry (one sampled completion each), as on a greedy cache; then each prompt's samples
become ONE per_prompt record (`by_prompt`): its tau the mean over its samples, each sample's own numbers kept
under "samples". So a bootstrap over per_prompt resamples prompts with all their samples: the cluster
bootstrap, samples nested in prompts. Two draft rules (`--draft`):

- greedy: the drafter's argmax drafts, verified against the sampled y (z-lab's dflash_generate, vLLM's default):
  the walk of metrics.py over every sample, DDTree and width-k trees included;
- sampled: drafts drawn from q (the drafter's block output after the same transform), verified by rejection
  sampling: E[tau | y] exactly (expect.py's dynamic program, `expected`); the per-sample records hold the
  expectations (tokens, rounds, histogram, rounds with acc >= k), the pooled figures their sums. DDTree and
  the width-k trees are left out (they verify top tokens deterministically: no rejection-sampling law here).

`aggregate` turns per_prompt records of either kind (a greedy cache's too) into results.json's metrics.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from remote_payload.eval import metrics
from remote_payload.eval.expect import expected_walk

NOTE_CLUSTER = ("per_prompt holds one record per prompt: its samples averaged (tau, ddtree_tau, tree_width_tau: "
                "the mean over its samples; position hits and acceptance lengths pooled), each sample's own "
                "numbers under samples; an interval from a bootstrap over per_prompt is therefore the cluster "
                "bootstrap (samples nested in prompts)")
NOTE_GREEDY = ("draft greedy: the drafter's argmax drafts verified against the sampled completions (the walk over "
               "every sample: exact in law for greedy drafts and a sampled target, the online decode's rounds); "
               "tau: per prompt the mean over its samples, then the mean over prompts; tau_pooled: all rounds of "
               "all samples")
NOTE_SAMPLED = ("draft sampled: drafts drawn from the drafter's distribution after the same transform, verified by "
                "rejection sampling; every figure is the exact expectation given the cached completions "
                "(remote_payload/eval/expect.py): tau per sample E[tau | y], tau_pooled = sum E[tokens] / "
                "sum E[rounds], acceptance_histogram and num_rounds expected counts, per-position acceptance "
                "ratios of expected counts; per_prompt acceptance_lengths are empty (no realised rounds), so "
                "tau_pooled has no per-prompt interval")
NOTE_NO_TREES = ("ddtree_tau, ddtree_best and tree_width_tau are left out for sampled drafts: DDTree and the width-k "
                 "trees verify the drafter's top tokens deterministically, which has no rejection-sampling law "
                 "here; evaluate them with --draft greedy")


def expected(target_q: np.ndarray, logp: torch.Tensor, prompt_len: int, seq_len: int, max_blocks: int,
             bs: int) -> dict:
    """One sampled completion under sampled drafts: target_q [n, bs-1] = log q(g[a+k]) (anchors.target_q),
    logp [N] = log p(y) from the cache -> its expected walk (JSON-ready)."""
    w = expected_walk(torch.from_numpy(np.asarray(target_q, dtype=np.float64)), logp, prompt_len, seq_len,
                      max_blocks, bs)
    return {"tau": w.tau, "tokens": w.tokens, "rounds": w.rounds, "histogram": w.histogram,
            "at_least": w.at_least}


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def by_prompt(records: Sequence[dict], keys: Sequence[tuple[str, int]]) -> list[dict]:
    """Entry records (steps.eval_prompts, one per sample; `keys[i]` = (prompt, sample) of record i) -> one
    record per prompt, in the order prompts first appear (module docstring)."""
    groups: dict[str, list[tuple[int, dict]]] = {}
    for (prompt, sample), rec in zip(keys, records):
        groups.setdefault(prompt, []).append((sample, rec))
    return [_one_prompt(name, group) for name, group in groups.items()]


def _one_prompt(name: str, group: list[tuple[int, dict]]) -> dict:
    recs = [r for _, r in group]
    sampled = "expected" in recs[0]
    hits = np.sum([r["position_hits"] for r in recs], axis=0)
    totals = np.sum([r["position_totals"] for r in recs], axis=0)
    out = {"name": name, "prompt_len": recs[0]["prompt_len"], "seq_len": recs[0]["seq_len"],
           "num_anchors": sum(r["num_anchors"] for r in recs),
           "acceptance_lengths": [] if sampled else [x for r in recs for x in r["acceptance_lengths"]],
           "tau": _mean(r["expected"]["tau"] if sampled else r["tau"] for r in recs),
           "position_hits": hits.tolist(), "position_totals": totals.tolist(),
           "position_accuracy": [float(h) / t if t else None for h, t in zip(hits, totals)],
           "first_block": recs[0].get("first_block")}
    if not sampled:
        for key in ("ddtree_tau", "tree_width_tau"):
            out[key] = {b: _mean(r[key][b] for r in recs) for b in recs[0][key]}
    out["samples"] = [{"name": r["name"], "sample": s, "prompt_len": r["prompt_len"], "seq_len": r["seq_len"],
                       "tau": r["expected"]["tau"] if sampled else r["tau"],
                       "acceptance_lengths": None if sampled else r["acceptance_lengths"],
                       "expected": r["expected"] if sampled else None,
                       "ddtree_tau": None if sampled else r["ddtree_tau"]} for s, r in group]
    return out


def aggregate(records: Sequence[dict], bs: int) -> dict:
    """per_prompt records -> results.json's metrics: metrics.aggregate for a greedy cache's; for a sampled
    cache's (`by_prompt`) the macro figures over prompts of their sample means and the pooled figures over
    every sample (expected counts for sampled drafts)."""
    if not records or "samples" not in records[0]:
        return metrics.aggregate(records, bs)
    samples = [s for r in records for s in r["samples"]]
    tau = _mean(r["tau"] for r in records)
    if samples[0]["expected"] is None:
        out = metrics.summarize([r["acceptance_lengths"] for r in records], bs)  # the pooled figures
        trees = {key: {b: _mean(r[key][b] for r in records) for b in records[0][key]}
                 for key in ("ddtree_tau", "tree_width_tau")}
        scored = [(t, int(b)) for b, t in trees["ddtree_tau"].items() if t is not None]
        best = max(scored, key=lambda t: (t[0], -t[1]), default=None)
        out.update(trees, ddtree_best={"budget": best[1], "tau": best[0]} if best else None)
    else:
        out = _expected_pooled([s["expected"] for s in samples], bs)
        out.update(ddtree_tau={}, tree_width_tau={}, ddtree_best=None)
    out.update(tau=tau, streak=None if tau is None else tau - 1, num_prompts=len(records),
               num_samples=len(samples))
    out.update(metrics.position_accuracy([(np.array(r["position_hits"]), np.array(r["position_totals"]))
                                          for r in records]))
    return out


def _expected_pooled(walks: list[dict], bs: int) -> dict:
    """The pooled expectations over every sample (expect.summarize_expected's formulas on the JSON records)."""
    tokens, rounds = sum(w["tokens"] for w in walks), sum(w["rounds"] for w in walks)
    at_least = [sum(w["at_least"][k] for w in walks) for k in range(bs)]
    pooled = tokens / rounds if rounds else None
    return {"tau_pooled": pooled, "streak_pooled": None if pooled is None else pooled - 1, "num_rounds": rounds,
            "acceptance_histogram": [sum(w["histogram"][k] for w in walks) for k in range(bs + 1)],
            "per_position_acceptance_unconditional": [at_least[k] / at_least[0] if at_least[0] else None
                                                      for k in range(1, bs)],
            "per_position_acceptance_conditional": [at_least[k] / at_least[k - 1] if at_least[k - 1] else None
                                                    for k in range(1, bs)]}


def notes(draft: str) -> list[str]:
    """results.json regime.notes for a sampled cache evaluated with `draft`."""
    return [NOTE_CLUSTER, NOTE_GREEDY] if draft == "greedy" else [NOTE_CLUSTER, NOTE_SAMPLED, NOTE_NO_TREES]
