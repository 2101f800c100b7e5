"""The projected speedup per (method, batch) from measured latencies (latency.py) and acceptance lengths, with
the latencies' spread carried through, the best method per batch named only when its lead is clear, and the
batch where speculation stops paying.

    speedup(method, b) = tau * decode(b) / (draft(b) + verify[n](b))          (medians)
    low  = tau * decode.q1(b) / (draft.q3(b) + verify[n].q3(b))                 (the quartiles' worst case)
    high = tau * decode.q3(b) / (draft.q1(b) + verify[n].q1(b))

tau is the POOLED acceptance length (every round of every prompt counted once: tokens / rounds), the one the
time saved follows; a per-prompt mean weights a short prompt's few rounds like a long one's many. The best
method at a batch is the highest median; it is named only when its low is above every other method's high,
else the methods whose high reaches its low are `tied` ("within noise"). A method `stops paying` at the
smallest measured batch whose median is below 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Projected:
    median: float
    low: float
    high: float


def pooled(lengths: list[list[int]]) -> float | None:
    """Tokens per round over every round of every prompt (the pooled tau); None without rounds."""
    rounds = [x for per in lengths for x in per]
    return sum(rounds) / len(rounds) if rounds else None


def pooled_taus(per_prompt: list[dict]) -> dict[str, float | None]:
    """{'block': pooled tau, 'ddtree_<B>': pooled DDTree tau per budget} from results.json per_prompt records."""
    out = {"block": pooled([p.get("acceptance_lengths") or [] for p in per_prompt])}
    budgets = sorted({int(b) for p in per_prompt for b in (p.get("ddtree_acceptance_lengths") or {})})
    for b in budgets:
        out[f"ddtree_{b}"] = pooled([(p.get("ddtree_acceptance_lengths") or {}).get(str(b)) or []
                                     for p in per_prompt])
    return out


def project(lat, method: str, tau: float, batch: int) -> Projected | None:
    """One method at one batch; None when the latencies lack its verify size or the figure is not finite."""
    # ddtree_<B>: B + 1 tokens; `block` or another family's own method (eagle3-...): the key's verify size
    n = int(method.removeprefix("ddtree_")) + 1 if method.startswith("ddtree_") else lat.tokens()
    if n not in lat.verify or batch not in lat.verify[n] or tau is None:
        return None
    d, dr, v = lat.decode[batch], lat.draft[batch], lat.verify[n][batch]
    vals = (tau * d.median / (dr.median + v.median), tau * d.q1 / (dr.q3 + v.q3), tau * d.q3 / (dr.q1 + v.q1))
    if not all(math.isfinite(x) and x >= 0 for x in vals):
        return None
    return Projected(*vals)


def best_of(figures: dict[str, Projected | None]) -> tuple[str | None, float | None, list[str]]:
    """(the best method when its lead is clear else None, the highest median, the tied methods when not)."""
    ranked = sorted(((p.median, m) for m, p in figures.items() if p is not None), reverse=True)
    if not ranked:
        return None, None, []
    top = figures[ranked[0][1]]
    tied = [m for _, m in ranked[1:] if figures[m].high >= top.low]
    if tied:
        return None, ranked[0][0], [ranked[0][1], *tied]
    return ranked[0][1], ranked[0][0], []


def by_batch(lat, taus: dict[str, float | None]) -> list[dict]:
    """Per measured batch: {batch, projected, low, high (per method, 4 digits), best_method, best_speedup,
    tied}."""
    rows = []
    for b in lat.batches:
        figs = {m: project(lat, m, t, b) if t is not None else None for m, t in taus.items()}
        best, best_x, tied = best_of(figs)
        rows.append({"batch": b,
                     "projected": {m: None if p is None else round(p.median, 4) for m, p in figs.items()},
                     "low": {m: None if p is None else round(p.low, 4) for m, p in figs.items()},
                     "high": {m: None if p is None else round(p.high, 4) for m, p in figs.items()},
                     "best_method": best, "best_speedup": None if best_x is None else round(best_x, 4),
                     "tied": tied})
    return rows


def stops_paying(rows: list[dict]) -> dict[str, int | None]:
    """Per method: the smallest measured batch whose projected speedup is below 1 (None: it pays at every one)."""
    methods = list(rows[0]["projected"]) if rows else []
    return {m: next((r["batch"] for r in rows if r["projected"].get(m) is not None and r["projected"][m] < 1), None)
            for m in methods}


def stops_text(rows: list[dict], stops: dict[str, int | None]) -> str:
    """'block at batch 64 (0.83x); ddtree_16 at batch 16 (0.94x, within noise)': each method's first batch below
    1x, 'within noise' when its high still reaches 1x; '' when every method pays at every batch."""
    by = {r["batch"]: r for r in rows}
    parts = []
    for m, b in stops.items():
        if b is not None:
            r = by[b]
            noisy = ", within noise" if (r["high"].get(m) or 0) >= 1 else ""
            parts.append(f"{m} at batch {b} ({r['projected'][m]:.2f}x{noisy})")
    return "; ".join(parts)


def verdict(row: dict) -> str:
    """'ddtree_32 (2.10x)' or 'within noise: block, ddtree_16 (~1.95x)' or 'none'."""
    if row["best_method"]:
        return f"{row['best_method']} ({row['best_speedup']:.2f}x)"
    if row["tied"]:
        return f"within noise: {', '.join(row['tied'])} (~{row['best_speedup']:.2f}x)"
    return "none"


def summary_rows(sp: dict) -> list[tuple[str, str]]:
    """results.json's speedup -> the summary's rows: the projection per batch (pooled tau) with the best method
    or the tied ones, where speculation stops paying, and the first batch's decode / draft / block verify
    times with their spread."""
    rows = sp.get("by_batch") or [{"batch": 1, "projected": sp["projected"], "best_method": sp["best_method"],
                                   "best_speedup": sp["best_speedup"], "tied": sp.get("tied") or []}]
    out = []
    for r in rows:
        shown = " ".join(f"{k.replace('ddtree_', 'DDT-')} {v:.2f}x" for k, v in r["projected"].items()
                         if v is not None)
        best = verdict(r) if r["best_speedup"] is not None else "none"
        out.append((f"speedup at batch {r['batch']}", f"{shown}; best: {best}"))
    if sp.get("by_batch"):
        out.append(("stops paying (< 1x)", stops_text(rows, sp.get("stops_paying") or {})
                    or f"never up to batch {rows[-1]['batch']}"))
    lat = {(x["step"], x["tokens"], x["batch"]): x for x in sp.get("latencies") or []}
    b0, bs = rows[0]["batch"], next((x["tokens"] for x in sp.get("latencies") or [] if x["step"] == "draft"), None)

    def ms(k):
        x = lat.get(k)
        return "?" if x is None else f"{x['median'] * 1e3:.3g} ms [{x['q1'] * 1e3:.3g}-{x['q3'] * 1e3:.3g}] n{x['n']}"
    if lat:
        text = (f"decode {ms(('decode', 1, b0))} · draft {ms(('draft', bs, b0))} · verify {bs} "
                f"{ms(('verify', bs, b0))} ({sp['regime']}, {'reused' if sp['reused'] else 'measured'})")
        out.append((f"latency at batch {b0}", text))
    return out
