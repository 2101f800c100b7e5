"""results.json's online section for a sampled cache (`eval --online N` at the cache's T; online_sampled.py decodes,
online_stats.py sums up), and its log lines. targetchecks.online_section hands a sampled cache's prompts here."""
from __future__ import annotations

from pathlib import Path

import torch

from remote_payload.contract import results as R
from remote_payload.contract.errors import PayloadError
from remote_payload.eval.summary import dtype_name, fmt

DEFAULT_SEEDS = 4  # --online-seeds on a sampled cache when not given
WARN_MIN_PROMPTS = 8  # fewer: a percentile bootstrap over the prompts is too narrow to warn on (it still is shown)


def available_prompts(cache, entries: int) -> list[tuple[str, int]]:
    """The prompts among a sampled cache's first `entries` entries -> (prompt name, its first entry), in order."""
    seen: dict[str, int] = {}
    for j in range(entries):
        seen.setdefault(cache.sample_of(j)[0], j)
    return list(seen.items())


def _max_new_tokens(cache) -> int:
    """What extract generated at most after each prompt (cache.json's generation record, else its recipe)."""
    meta = cache.meta if isinstance(cache.meta, dict) else {}
    for rec in (meta.get("generation"), (meta.get("recipe") or {}).get("options")):
        n = rec.get("max_new_tokens") if isinstance(rec, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
            return n
    raise PayloadError(f"--online on a sampled cache needs its max_new_tokens (cache.json \"generation\"), which "
                       f"{cache.path} lacks: re-extract it")


def _ci(x) -> str:
    return "n/a" if not x else f"[{x[0]:.2f}, {x[1]:.2f}]"


def online_section_at_t(opts, results: dict, mod, inp, model, device: torch.device, dtype: torch.dtype, rep,
                        lat, n: int) -> None:
    """results["online"] for the first n prompts of a sampled cache (module docstring)."""
    from remote_payload.eval import online_sampled, online_stats
    from remote_payload.target.load import eos_ids_of
    regime, seeds = inp.cache.regime, opts.online_seeds or DEFAULT_SEEDS
    firsts = available_prompts(inp.cache, len(inp.prompts))[:n]
    prompts = []
    for name, j in firsts:
        ids, _feats = inp.cache.load(j, layer_ids=inp.cache.layer_ids[:1])
        prompts.append((name, [int(x) for x in ids[:inp.prompts[j].prompt_len]]))
    rep.line(f"  online at T: {n} prompts x {seeds} seeds, {regime.label()}, draft {opts.draft}", stage="online")
    try:
        got = online_sampled.online_at_t(
            model, mod.drafter, mod.head, list(inp.cache.layer_ids), prompts, opts.max_blocks,
            transform=regime.transform, seed=regime.seed, draft=opts.draft, seeds=seeds,
            max_new_tokens=_max_new_tokens(inp.cache), eos=eos_ids_of(Path(opts.target)), repeats=opts.online_repeats,
            progress=lambda i, k, name: rep.line(f"  online [{i}/{k}] {name}", stage="online", i=i, n=k))
    except ValueError as e:
        raise PayloadError(f"--online: {e}") from None
    records = results["per_prompt"][:n]
    s = online_stats.summarize_at_t(got, records)
    totals = [(sum(r.target_only_runs[i] for r in got), sum(r.spec_runs[i] for r in got))
              for i in range(min(len(r.spec_runs) for r in got))]
    runs = [p / q for p, q in totals if q > 0]
    spec, plain = sum(r.spec_s for r in got), sum(r.target_only_s for r in got)
    tau_same, projected = s["tau_pooled_offline"], None
    if lat is not None and tau_same is not None:
        projected = round(lat.speedup(tau_same, block_size=mod.drafter.cfg.block_size,
                                      batch=1 if 1 in lat.batches else None), 4)
    r4 = (lambda x: None if x is None else round(x, 4))
    results["online"] = R.Online(
        method="block", regime=R.OnlineRegime(**regime.to_json(), seeds=seeds, draft=opts.draft), device=str(device),
        dtype=dtype_name(dtype), prompts=s["prompts"], prompts_agreeing=None, rounds=s["rounds"], rounds_agreeing=None,
        tau_pooled_online=s["tau_pooled_online"], tau_pooled_offline=tau_same, tau_online=s["tau_online"],
        tau_online_ci=s["tau_online_ci"], tau_online_seed_ci=s["tau_online_seed_ci"], tau_offline=s["tau_offline"],
        tau_offline_ci=s["tau_offline_ci"], tau_difference=s["tau_difference"],
        tau_difference_ci=s["tau_difference_ci"], ci_note=s["ci_note"], tokens=s["tokens"], spec_s=round(spec, 4),
        target_only_s=round(plain, 4), measured_speedup=r4(plain / spec) if spec > 0 else None,
        prompts_with_cache_mismatch=None, projected_speedup=projected, projected_tau=r4(tau_same),
        repeats=opts.online_repeats, measured_speedup_runs=[round(x, 4) for x in runs],
        per_prompt=[R.OnlinePrompt(
            name=rec["name"], acceptance_lengths=[x for d in r.decodes for x in d.lengths], agree=None,
            spec_s=round(r.spec_s, 4), target_only_s=round(r.target_only_s, 4), seed_taus=r.seed_taus,
            seed_rounds=[len(d.lengths) for d in r.decodes],
            tau_online=online_stats.mean_of(r.seed_taus), tau_offline=rec["tau"]) for r, rec in zip(got, records)],
    ).to_dict()
    o = results["online"]
    rep.line(f"  online at T ({n} prompts x {seeds} seeds, draft {opts.draft}): tau {fmt(o['tau_online'], 2)} "
             f"{_ci(o['tau_online_ci'])} online vs {fmt(o['tau_offline'], 2)} {_ci(o['tau_offline_ci'])} offline "
             f"(95% bootstrap over prompts); difference {fmt(o['tau_difference'], 2)} {_ci(o['tau_difference_ci'])} "
             f"paired; measured speedup {fmt(o['measured_speedup'], 2)}x (eager)", stage="online")
    diff = o["tau_difference_ci"]
    if diff and not diff[0] <= 0 <= diff[1] and s["prompts_compared"] >= WARN_MIN_PROMPTS:
        rep.line(f"  warning: the online tau differs from the offline tau at T beyond the paired 95% interval "
                 f"{_ci(diff)} ({o['prompts']} prompts x {seeds} seeds; {dtype_name(dtype)}): more seeds, samples or "
                 f"prompts tell chance from a real difference", stage="warning")
