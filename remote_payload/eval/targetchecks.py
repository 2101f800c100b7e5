"""`--speedup` and `--online N`: the whole target loaded once, after the offline eval, and their sections of
results.json (latency.py measures, online.py decodes).
"""
from __future__ import annotations

import json
import time
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
                  dtype: torch.dtype, rep: Reporter) -> None:
    """--speedup and --online N, with the whole target loaded once (after the offline eval: its taus are what
    the projection uses and its walks what the online decoder is checked against)."""
    if not (opts.online or opts.speedup):
        return
    from remote_payload.target.load import load_target
    what = " and ".join(x for x in ("--speedup" if opts.speedup else "",
                                    f"--online {opts.online}" if opts.online else "") if x)
    rep.line(f"\nLoading the whole target {opts.target} for {what}...", stage="target")
    model = load_target(opts.target, device, dtype)
    if opts.speedup:
        speedup_section(opts, results, mod, model, rep)
    if opts.online:
        online_section(opts, results, mod, inp, model, device, dtype, rep)


def latency_table_path(opts: EvalOptions) -> Path:
    """The host's latency table: <workdir>/latency.json for a run in <workdir>/runs/<run> (shared by every run
    and sweep on that host)."""
    return Path(opts.run_dir).resolve().parent.parent / "latency.json"


def projections(lat, m: dict, bs: int) -> tuple[dict, str | None, float | None]:
    """{method: projected speedup} for the block and each DDTree budget measured, and the best of them."""
    out = {"block": None if m.get("tau") is None else round(lat.speedup(m["tau"], block_size=bs), 4)}
    for b, tau in (m.get("ddtree_tau") or {}).items():
        out[f"ddtree_{b}"] = None if tau is None or int(b) + 1 not in lat.verify_s else \
            round(lat.speedup(tau, budget=int(b)), 4)
    ranked = [(v, k) for k, v in out.items() if v is not None]
    best = max(ranked) if ranked else (None, None)
    return out, best[1], best[0]


def speedup_section(opts: EvalOptions, results: dict, mod: Loaded, model, rep: Reporter) -> None:
    from remote_payload.eval import latency
    bs = mod.drafter.cfg.block_size
    lens = [p["seq_len"] for p in results["per_prompt"]]
    ctx = max(64, round(sum(lens) / len(lens) / 64) * 64)  # buckets of 64: runs on one cache share it
    t = time.perf_counter()
    table = latency.LatencyTable(latency_table_path(opts))
    signature = latency.target_signature(opts.target)  # unchanged files: the hash measured under them, no re-read
    target_hash = table.known_hash(signature) or latency.target_content_hash(opts.target)
    key = latency.latency_key(model, mod.drafter, context_len=ctx, budgets=opts.ddtree_budgets, block_size=bs,
                              target_hash=target_hash) | {"target_stat": signature}
    lat = table.get(key)
    reused = lat is not None
    if lat is None:
        rep.line(f"  measuring the target's latencies at batch 1, context {ctx} (decode, verify of the block and "
                 f"of each DDTree budget's tree, one drafter block)...", stage="speedup")
        lat = latency.measure(model, mod.drafter, mod.head, context_len=ctx, budgets=opts.ddtree_budgets,
                              block_size=bs, target_hash=target_hash)
        lat.key["target_stat"] = signature
        if not table.put(lat):
            rep.line(f"  warning: {table.error}: the latencies are not kept for later runs", stage="warning")
    measure_s = 0.0 if reused else time.perf_counter() - t
    projected, best, best_x = projections(lat, results["metrics"], bs)
    by_suite = None
    if results.get("suites"):
        by_suite = []
        for s in results["suites"]:
            p, b, _ = projections(lat, s["metrics"], bs)
            by_suite.append(R.SuiteSpeedup(name=s["name"], projected=p, best_method=b))
    results["speedup"] = R.Speedup(
        regime=lat.regime, device=lat.device, gpu=lat.gpu, dtype=lat.dtype, context_len=lat.context_len,
        decode_s=lat.decode_s, draft_s=lat.draft_s, verify_s={str(n): v for n, v in sorted(lat.verify_s.items())},
        target_hash=target_hash, reused=reused, measure_s=round(measure_s, 3), note=lat.note or "",
        projected=projected, best_method=best, best_speedup=best_x, by_suite=by_suite).to_dict()
    shown = " · ".join(f"{k.replace('ddtree_', 'DDTree-')} {v:.2f}x" for k, v in projected.items() if v is not None)
    rep.line(f"  latencies ({lat.regime}{', reused from ' + str(table.path) if reused else ''}): decode "
             f"{lat.decode_s * 1e3:.2f} ms · draft {lat.draft_s * 1e3:.2f} ms · verify {bs} tokens "
             f"{lat.verify_s[bs] * 1e3:.2f} ms", stage="speedup")
    rep.line(f"  projected speedup: {shown}; best: {best} ({fmt(best_x, 2)}x)", stage="speedup")


def online_section(opts: EvalOptions, results: dict, mod: Loaded, inp: Inputs, model, device: torch.device,
                   dtype: torch.dtype, rep: Reporter) -> None:
    from remote_payload.eval import online
    n = min(opts.online, len(inp.prompts))
    if opts.online > n:  # said, not silently fewer
        where = f"suite {opts.suites[0][0]} (the first)" if opts.suites else "the eval"
        note = f"--online {opts.online}: {where} has {n} prompts, so {n} are decoded online"
        rep.line(f"  note: {note}", stage="note")
        results["notes"] = [*(results.get("notes") or []), note]
    prompts = []
    for i in range(n):
        ids, _feats = inp.cache.load(i)
        rec = results["per_prompt"][i]
        prompts.append((rec["name"], [int(x) for x in ids], inp.prompts[i].prompt_len, rec["acceptance_lengths"]))
    try:
        got = online.online_check(model, mod.drafter, mod.head, list(inp.cache.layer_ids), prompts, opts.max_blocks)
    except ValueError as e:
        raise PayloadError(f"--online: {e}") from None
    s = online.summarize(got)
    results["online"] = R.Online(
        method="block", device=str(device), dtype=dtype_name(dtype), prompts=s["prompts"],
        prompts_agreeing=s["prompts_agreeing"], rounds=s["rounds"], rounds_agreeing=s["rounds_agreeing"],
        tau_pooled_online=s["tau_pooled_online"], tau_pooled_offline=s["tau_pooled_offline"], tokens=s["tokens"],
        spec_s=round(s["spec_s"], 4), target_only_s=round(s["target_only_s"], 4),
        measured_speedup=None if s["speedup"] is None else round(s["speedup"], 4),
        prompts_with_cache_mismatch=s["prompts_with_cache_mismatch"],
        projected_speedup=((results.get("speedup") or {}).get("projected") or {}).get("block"),
        per_prompt=[R.OnlinePrompt(name=r.name, acceptance_lengths=list(r.acceptance_lengths), agree=r.agree,
                                   spec_s=round(r.spec_s, 4), target_only_s=round(r.target_only_s, 4))
                    for r in got]).to_dict()
    o = results["online"]
    rep.line(f"  online: {o['prompts']} prompts · rounds agreeing with the offline walk {o['rounds_agreeing']}/"
             f"{o['rounds']} · tau {fmt(o['tau_pooled_online'], 2)} online vs {fmt(o['tau_pooled_offline'], 2)} "
             f"offline · measured speedup {fmt(o['measured_speedup'], 2)}x ({o['spec_s']:.2f}s speculative vs "
             f"{o['target_only_s']:.2f}s target-only)", stage="online")
    if o["rounds_agreeing"] != o["rounds"]:
        rep.line(f"  warning: {o['rounds'] - o['rounds_agreeing']} online rounds differ from the offline walk "
                 f"(exact agreement is expected in fp32; {o['dtype']} near-ties can differ)", stage="warning")
