"""`--speedup` and `--online N`: the whole target loaded once, after the offline eval, and their sections of
results.json (latency.py measures, online.py decodes).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from remote_payload.contract import results as R
from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular
from remote_payload.eval.evalopts import EvalOptions
from remote_payload.eval.steps import Inputs, Loaded, Reporter
from remote_payload.eval.summary import dtype_name, fmt


def check_online_target(opts: EvalOptions) -> None:
    """--online on a target whose cache cannot be rolled back by cropping: one line before anything runs."""
    if not opts.online:
        return
    from remote_payload.eval import online
    cfg_file = Path(opts.target) / "config.json"
    try:
        cfg = json.loads(read_regular(cfg_file))
    except (OSError, ValueError) as e:
        raise PayloadError(f"--online needs the whole target: cannot read {cfg_file} ({e})") from None
    why = online.refusal(cfg)
    if why:
        raise PayloadError(f"--online: {why}. Run without --online.")


def target_checks(opts: EvalOptions, results: dict, mod: Loaded, inp: Inputs, device: torch.device,
                  dtype: torch.dtype, rep: Reporter, plan: Plan | None = None, check=None, method: str = "block"
                  ) -> None:
    """--speedup and --online N, with the whole target loaded once (after the offline eval: its taus are what
    the projection uses and its walks what the online decoder is checked against). plan, check, method: another
    drafter family's (`speedup_section`, `online_section`; None: the DFlash block's)."""
    if not (opts.online or opts.speedup):
        return
    from remote_payload.target.load import load_target
    what = " and ".join(x for x in ("--speedup" if opts.speedup else "",
                                    f"--online {opts.online}" if opts.online else "") if x)
    rep.line(f"\nLoading the whole target {opts.target} for {what}...", stage="target")
    model = load_target(opts.target, device, dtype)
    lat = speedup_section(opts, results, mod, model, rep, plan) if opts.speedup else None
    if opts.online:
        online_section(opts, results, mod, inp, model, device, dtype, rep, lat, check, method)


def latency_table_path(opts: EvalOptions) -> Path:
    """The latency table (latencytable.table_path: --latency-table, $REVAL_LATENCY_TABLE that the run wrapper sets
    to <workdir>/latency.json, $REVAL_HOME/latency.json, ~/.cache/reval/latency.json); never beside --run-dir."""
    from remote_payload.eval.latencytable import table_path
    return table_path(opts.latency_table)


DFLASH_STEPS = "decode, verify of the block and of each DDTree budget's tree, one drafter block"


@dataclass
class Plan:
    """Another drafter family's --speedup (EAGLE-3: eagle3/targetside.py): the drafter the latency key hashes (its
    cfg.to_dict() and dtype), its steps (latency.Custom: the method, the verify's tree, the draft step), the
    per-method pooled taus of a list of results.json per_prompt records, and what is measured (the log)."""
    drafter: object
    custom: object
    methods: object
    what: str


def _latencies(opts: EvalOptions, mod: Loaded, model, ctx: int, rep: Reporter, plan: Plan | None = None):
    """(Latencies, reused, the table, the target's hash, why measured): the table's entry for this key unless
    --remeasure or it is missing or refused, else measured now (and kept)."""
    from remote_payload.eval import latency
    from remote_payload.eval.latencytable import LatencyTable, target_content_hash, target_signature
    bs = len(plan.custom.parents) if plan else mod.drafter.cfg.block_size
    budgets, drafter = ([], plan.drafter) if plan else (opts.ddtree_budgets, mod.drafter)
    table = LatencyTable(latency_table_path(opts))
    signature = target_signature(opts.target)  # unchanged files: their hash from the table, no re-read
    target_hash = table.known_hash(signature) or target_content_hash(opts.target)
    key = latency.latency_key(model, drafter, context_len=ctx, budgets=budgets, block_size=bs,
                              target_hash=target_hash, batches=opts.speedup_batches, repeats=opts.speedup_repeats,
                              method=plan.custom.method if plan else None)
    lat = None if opts.remeasure else table.get(key)
    if lat is not None:
        return lat, True, table, target_hash, None
    why = "--remeasure" if opts.remeasure else table.refused or "no entry for this GPU, target, dtype and shape"
    rep.line(f"  measuring the target's latencies at batch {','.join(map(str, opts.speedup_batches))}, context "
             f"{ctx}, at least {opts.speedup_repeats} runs each ({plan.what if plan else DFLASH_STEPS}; {why})...",
             stage="speedup")
    try:
        lat = latency.measure(model, drafter, mod.head, context_len=ctx, budgets=budgets, block_size=bs,
                              target_hash=target_hash, batches=opts.speedup_batches, repeats=opts.speedup_repeats,
                              custom=plan.custom if plan else None)
    except torch.cuda.OutOfMemoryError:
        raise PayloadError(f"--speedup: out of GPU memory measuring batches {opts.speedup_batches} with budgets "
                           f"{budgets}: give smaller --speedup-batches or --ddtree-budgets") from None
    if not table.put(lat, signature, target_hash):
        rep.line(f"  warning: {table.error}: the latencies are not kept for later runs", stage="warning")
    return lat, False, table, target_hash, why


def _step_rows(lat) -> list:
    rows = [("decode", 1, lat.decode), ("draft", lat.key.get("block_size", 0), lat.draft)]
    rows += [("verify", n, by) for n, by in sorted(lat.verify.items())]
    return [R.StepLatency(step=step, tokens=n, batch=b, **s.to_json()) for step, n, per in rows
            for b, s in sorted(per.items())]


def _methods(opts: EvalOptions, per_prompt: list[dict]) -> dict:
    from remote_payload.eval.projection import pooled_taus
    taus = pooled_taus(per_prompt)
    return {m: t for m, t in taus.items() if m == "block" or int(m.removeprefix("ddtree_")) in opts.ddtree_budgets}


def speedup_section(opts: EvalOptions, results: dict, mod: Loaded, model, rep: Reporter, plan: Plan | None = None):
    """results["speedup"] (the projection per method and batch from the pooled tau) -> the Latencies. plan:
    another drafter family's steps and methods (None: the DFlash block and its DDTree budgets)."""
    from remote_payload.eval import projection as P
    lens = [p["seq_len"] for p in results["per_prompt"]]
    ctx = max(64, round(sum(lens) / len(lens) / 64) * 64)  # buckets of 64: runs on one cache share it
    lat, reused, table, target_hash, why = _latencies(opts, mod, model, ctx, rep, plan)
    methods = plan.methods if plan else (lambda records: _methods(opts, records))
    rows = P.by_batch(lat, methods(results["per_prompt"]))
    first = rows[0]
    by_suite = None
    if results.get("suites"):
        by_suite = []
        for s in results["suites"]:
            lo, hi = s["prompt_range"]
            (row,) = P.by_batch(_first_batch(lat), methods(results["per_prompt"][lo:hi]))
            by_suite.append(R.SuiteSpeedup(name=s["name"], projected=row["projected"], best_method=row["best_method"],
                                           tied=row["tied"]))
    results["speedup"] = R.Speedup(
        regime=lat.regime, device=lat.device, gpu=lat.gpu, dtype=lat.dtype, context_len=lat.context_len,
        decode_s=lat.decode_s, draft_s=lat.draft_s, verify_s={str(n): v for n, v in lat.verify_s.items()},
        target_hash=target_hash, reused=reused, measure_s=0.0 if reused else lat.measure_s, note=lat.note or "",
        projected=first["projected"], best_method=first["best_method"], best_speedup=first["best_speedup"],
        tied=first["tied"], by_suite=by_suite, tau="pooled", batches=list(lat.batches),
        repeats=int(lat.key.get("repeats") or 0) or None, latencies=_step_rows(lat),
        by_batch=[R.BatchSpeedup(**r) for r in rows], stops_paying=P.stops_paying(rows),
        measured_at=lat.measured_at or None, table=str(table.path), table_note=why).to_dict()
    bs = lat.tokens()  # the verify's tokens of the drafter's own method (the block, an EAGLE-3 chain or tree)
    where = f"reused from {table.path}, measured {lat.measured_at}" if reused else f"kept in {table.path}"
    rep.line(f"  latencies ({lat.regime}, {where}; median [q1-q3] of n runs, ms):", stage="speedup")
    for b in lat.batches:
        n_best = _tokens(first["best_method"] or (first["tied"] or ["block"])[0], bs)
        cols = [("decode", lat.decode[b]), ("draft", lat.draft[b]), (f"verify {bs}", lat.verify[bs][b])]
        cols += [(f"verify {n_best}", lat.verify[n_best][b])] if n_best != bs else []
        rep.line(f"    batch {b:>4}: " + " · ".join(f"{k} {_ms(v)}" for k, v in cols), stage="speedup")
    rep.line("  projected speedup (pooled tau x decode / (draft + verify)):", stage="speedup")
    for r in rows:
        shown = " ".join(f"{k.replace('ddtree_', 'DDT-')} {v:.2f}x" for k, v in r["projected"].items() if v is not None)
        rep.line(f"    batch {r['batch']:>4}: {shown}; best: {P.verdict(r)}", stage="speedup")
    stops = P.stops_text(rows, P.stops_paying(rows))
    if stops:
        rep.line(f"  speculation stops paying (speedup < 1): {stops}", stage="speedup")
    return lat


def _first_batch(lat):
    import dataclasses
    return dataclasses.replace(lat, batches=lat.batches[:1])


def _tokens(method: str, bs: int) -> int:
    return int(method.removeprefix("ddtree_")) + 1 if method.startswith("ddtree_") else bs


def _ms(s) -> str:
    return f"{s.median * 1e3:.3g} [{s.q1 * 1e3:.3g}-{s.q3 * 1e3:.3g}] n{s.n}"


def online_section(opts: EvalOptions, results: dict, mod: Loaded, inp: Inputs, model, device: torch.device,
                   dtype: torch.dtype, rep: Reporter, lat=None, check=None, method: str = "block") -> None:
    """results["online"]: the first N prompts decoded online, timed --online-repeats times each way; beside it the
    method's projection at batch 1 over THE SAME prompts from their pooled offline tau (when --speedup ran).
    check(model, prompts, repeats, progress) -> [online.OnlinePrompt]: another drafter family's decode (EAGLE-3:
    eagle3/targetside.py; greedy caches only), `method` its name; None: the DFlash block (online.online_check)."""
    from remote_payload.eval import online
    from remote_payload.eval.online_section import available_prompts, online_section_at_t
    sampled = inp.cache.regime is not None
    if sampled and check is not None:
        raise PayloadError(f"--online on a sampled cache ({inp.cache.regime.label()}) is not implemented for "
                           f"{method}; run it on a greedy cache, or without --online")
    n = min(opts.online, len(available_prompts(inp.cache, len(inp.prompts)) if sampled else inp.prompts))
    if opts.online > n:  # said, not silently fewer
        where = f"suite {opts.suites[0][0]} (the first)" if opts.suites else "the eval"
        note = f"--online {opts.online}: {where} has {n} prompts, so {n} are decoded online"
        rep.line(f"  note: {note}", stage="note")
        results["notes"] = [*(results.get("notes") or []), note]
    if sampled:  # at the cache's T: sampled posterior, seeds, CIs (online_sampled.py)
        return online_section_at_t(opts, results, mod, inp, model, device, dtype, rep, lat, n)
    prompts = []
    for i in range(n):
        ids, _feats = inp.cache.load(i)
        rec = results["per_prompt"][i]
        prompts.append((rec["name"], [int(x) for x in ids], inp.prompts[i].prompt_len, rec["acceptance_lengths"]))
    def progress(i, n, name):
        rep.line(f"  online [{i}/{n}] {name}", stage="online", i=i, n=n)
    try:
        if check is None:
            got = online.online_check(model, mod.drafter, mod.head, list(inp.cache.layer_ids), prompts,
                                      opts.max_blocks, repeats=opts.online_repeats, progress=progress)
        else:
            got = check(model, prompts, opts.online_repeats, progress)
    except ValueError as e:
        raise PayloadError(f"--online: {e}") from None
    s = online.summarize(got)
    tau_same, projected = s["tau_pooled_offline"], None
    if lat is not None and tau_same is not None:
        projected = round(lat.speedup(tau_same, batch=1 if 1 in lat.batches else None), 4)
    runs = s["speedup_runs"]
    results["online"] = R.Online(
        method=method, device=str(device), dtype=dtype_name(dtype), prompts=s["prompts"],
        prompts_agreeing=s["prompts_agreeing"], rounds=s["rounds"], rounds_agreeing=s["rounds_agreeing"],
        tau_pooled_online=s["tau_pooled_online"], tau_pooled_offline=tau_same, tokens=s["tokens"],
        spec_s=round(s["spec_s"], 4), target_only_s=round(s["target_only_s"], 4),
        measured_speedup=None if s["speedup"] is None else round(s["speedup"], 4),
        prompts_with_cache_mismatch=s["prompts_with_cache_mismatch"], projected_speedup=projected,
        projected_tau=None if tau_same is None else round(tau_same, 4), repeats=opts.online_repeats,
        measured_speedup_runs=[round(x, 4) for x in runs],
        per_prompt=[R.OnlinePrompt(name=r.name, acceptance_lengths=list(r.acceptance_lengths), agree=r.agree,
                                   spec_s=round(r.spec_s, 4), target_only_s=round(r.target_only_s, 4))
                    for r in got]).to_dict()
    o = results["online"]
    spread = f" (runs {min(runs):.2f}-{max(runs):.2f}x, n {len(runs)})" if runs else ""
    beside = "" if projected is None else (f"; projected {projected:.2f}x at batch 1 from the pooled offline tau "
                                           f"{tau_same:.2f} of these {o['prompts']} prompts ({lat.regime})")
    rep.line(f"  online: {o['prompts']} prompts · rounds agreeing with the offline walk {o['rounds_agreeing']}/"
             f"{o['rounds']} · pooled tau {fmt(o['tau_pooled_online'], 2)} online vs {fmt(tau_same, 2)} offline · "
             f"measured speedup {fmt(o['measured_speedup'], 2)}x{spread} (median of the timed runs; eager)"
             f"{beside}", stage="online")
    if o["rounds_agreeing"] != o["rounds"]:
        rep.line(f"  warning: {o['rounds'] - o['rounds_agreeing']} online rounds differ from the offline walk "
                 f"(exact agreement is expected in fp32; {o['dtype']} near-ties can differ)", stage="warning")
