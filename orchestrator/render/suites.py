"""Benchmark suites side by side (pure): `reval compare --by suite`, the papers' layout — one row per run, one
column per suite (tau with its 95% bootstrap interval over that suite's prompts) and the mean over suites;
with a baseline, a second table of each suite's Δ tau against it, paired by prompt, with its 95% interval.

How suites are matched across runs (by name, never by the order of `--cache`; a one-cache run by its cache's
content), when a suite is comparable (else `≠`: shown, never ranked) and when the mean over suites is ranked:
results/suites.py. A run's marks (base, SUSPECT, a run without results) follow its name in every format; the
run-level INCOMPARABLE mark is not this table's (the pooled key differs whenever the suites or their order
do).
"""
from __future__ import annotations

from remote_payload.contract import results as results_json

from ..results.compare import ComparedRuns, Result, run_marks
from ..results.suites import MISMATCH, SuiteComparison, match
from .tables import PAIRED_NOTE, Cell, Column, Row, Table, disagreement, fmt_delta, fmt_p, mark_best

SUITE_NOTE = ("rows = runs, columns = benchmark suites (matched by name; a one-cache run by its cache's "
              "content): tau (tokens per round incl. the bonus, macro over that suite's prompts) [95% "
              "bootstrap CI over its prompts]; mean = the unweighted mean over suites of each suite's tau "
              "(the papers' per-dataset average), its CI resampling every prompt weighted 1/n of its suite; "
              "empty: the run has no such suite; bold = best per column among ranked runs (not SUSPECT, "
              "not ≠)")
SUITE_PAIRED_NOTE = ("Δ tau per suite = run - baseline over that suite's prompts, paired by prompt (n = the "
                     "suite's prompts both evaluated); Δ mean: the mean over suites, paired the same way")


def suite_names(runs: list[Result]) -> list[str]:
    """Every suite any run holds, in the order first seen."""
    names: list[str] = []
    for r in runs:
        for s in (r.result.suites or []) if r.result else []:
            if s.name not in names:
                names.append(s.name)
    return names


def suite_marks(cmp: ComparedRuns, run: Result) -> list[str]:
    """base, SUSPECT, a state without results (the run-level INCOMPARABLE is the pooled key's, not the
    suites')."""
    return [m for m in run_marks(cmp, run) if m != "INCOMPARABLE"]


def _run_cell(cmp: ComparedRuns, run: Result) -> Cell:
    label = cmp.label(run)
    return Cell(label, label + "".join(f" ({m})" for m in suite_marks(cmp, run)))


def _speedup(res: results_json.Result, name: str):
    """The suite's projected speedups when the run measured them (--speedup): (projected dict, best method);
    a one-cache run's are its own."""
    if res.speedup is not None and not res.suites:
        return res.speedup.projected, res.speedup.best_method
    if res.speedup is None or not res.speedup.by_suite:
        return None, None
    s = next((x for x in res.speedup.by_suite if x.name == name), None)
    return (s.projected, s.best_method) if s is not None else (None, None)


def _speedup_text(res: results_json.Result, name: str) -> str:
    projected, best = _speedup(res, name)
    if not projected or best is None or projected.get(best) is None:
        return ""
    return f" · {projected[best]:.2f}x {best.replace('ddtree_', '@').replace('block', 'blk')}"


def _suite_cell(sc: SuiteComparison, run: Result, column: str) -> Cell:
    c = sc.cell(run, column)
    if c is None or c.tau is None:
        return Cell()
    cell = Cell(value=c.tau, text=f"{c.tau:.2f}" + _speedup_text(run.result, c.name),
                est=sc.estimate(run, column))
    cell.pair = sc.paired(run, column)
    if cell.pair is not None:
        cell.delta, cell.ratio = cell.pair.delta, cell.pair.ratio
    if not c.comparable:
        cell.text, cell.ranked = f"{cell.text} {MISMATCH}", False  # shown, never ranked
    return cell


def _mean_cell(sc: SuiteComparison, run: Result) -> Cell:
    mean = run.result.suite_mean.tau if run.result is not None and run.result.suite_mean is not None else None
    if mean is None:
        return Cell()
    cell = Cell(value=mean, text=f"{mean:.2f}", est=sc.mean_estimate(run), pair=sc.mean_paired(run))
    if cell.pair is not None:
        cell.delta, cell.ratio = cell.pair.delta, cell.pair.ratio
    if not sc.mean_comparable(run):
        cell.text, cell.ranked = f"{cell.text} {MISMATCH}", False
    return cell


def suite_table(cmp: ComparedRuns) -> Table:
    sc = match(cmp)
    cols = [Column("run", "run", digits=None)]
    cols += [Column(f"suite:{n}", sc.heads[n], ranked=True) for n in sc.columns]
    cols.append(Column("suite_mean", "mean\nover suites", ranked=True))
    rows = []
    for run in cmp.runs:
        cells = {"run": _run_cell(cmp, run), **{f"suite:{n}": _suite_cell(sc, run, n) for n in sc.columns},
                 "suite_mean": _mean_cell(sc, run)}
        rows.append(Row(cells, suite_marks(cmp, run), run.result is not None and not run.suspect))
    title = "tau by suite" + (f" vs {cmp.label(cmp.baseline)}" if cmp.baseline else "")
    return mark_best(Table(title, cols, rows, notes=_notes(sc, rows)))


def _notes(sc: SuiteComparison, rows: list[Row]) -> list[str]:
    cmp, notes = sc.cmp, [SUITE_NOTE]
    if any(r.result is not None and r.result.speedup is not None for r in cmp.runs):
        notes.append("· Nx @B = the best projected speedup for that suite and its method (@B: DDTree budget B; blk: "
                     "the plain block), from the run's measured latencies (--speedup)")
    if any(sig is not None for sig in sc.regimes.values()):
        notes.append("T=t under a suite = the decoding regime of that column (T=0: greedy; T>0: a sampled cache, "
                     "top-k/top-p when set, draft=sampled: rejection-sampled drafts, else greedy drafts): each "
                     "column is one regime, columns of different regimes are set side by side, never ranked "
                     "against each other")
    if any(not c.comparable for c in sc.cells.values()):
        refs = ", ".join(f"{n}: {cmp.label(sc.reference[n])}" for n in sc.columns)
        notes.append(f"{MISMATCH} = this suite's cache, prompts, max blocks, metrics or drafter attention differ "
                     f"from the reference run's ({refs}): not comparable, not ranked")
    if any(not r.cells["suite_mean"].ranked for r in rows):
        ref = ", ".join(sc.mean_columns())
        notes.append(f"mean {MISMATCH} = over other suites than the reference's ({ref}), or over a suite "
                     f"marked {MISMATCH}: not ranked")
    mixed = [cmp.label(r) for r in cmp.runs if r.result is not None and r.result.regime is not None
             and r.result.regime.mixed]
    if mixed:
        notes.append(f"{', '.join(mixed)}: suites of several decoding regimes: no mean over suites (a mean over "
                     "regimes is no regime's figure)")
    for run, column in sc.landed:
        notes.append(f"{cmp.label(run)}: one cache, the same content as suite {column}'s: in that column")
    alone = [cmp.label(r) for r in cmp.runs if r.result is not None and not r.result.suites
             and all(r is not x for x, _ in sc.landed)]
    if alone:
        notes.append(f"one cache, named by its folder: {', '.join(alone)}")
    return notes


def suite_paired_table(cmp: ComparedRuns) -> Table | None:
    """Against the baseline: per run and suite, Δ tau [95% paired CI] (* the data supports it) and p; the mean
    over suites the same. None without a baseline or another run with results."""
    others = [r for r in cmp.runs if r is not cmp.baseline and r.result is not None]
    if cmp.baseline is None or not others:
        return None
    sc = match(cmp)
    cols = [Column("run", "run", digits=None)]
    for n in sc.columns:
        cols += [Column(f"suite:{n}_delta", f"Δ {n}\n[95% CI]"), Column(f"suite:{n}_p", f"p\n({n})", digits=3,
                                                                          headline=False)]
    cols += [Column("suite_mean_delta", "Δ mean\n[95% CI]"), Column("suite_mean_p", "p\n(mean)", digits=3,
                                                                     headline=False)]
    rows, notes = [], [SUITE_PAIRED_NOTE, PAIRED_NOTE]
    for run in others:
        label = cmp.label(run)
        pairs = {f"suite:{n}": sc.paired(run, n) for n in sc.columns} | {"suite_mean": sc.mean_paired(run)}
        cells = {"run": _run_cell(cmp, run)}
        for key, p in pairs.items():
            cells[f"{key}_delta"] = Cell(p.delta, fmt_delta(p, 2), pair=p) if p else Cell()
            cells[f"{key}_p"] = Cell(p.p_value, fmt_p(p.p_value)) if p else Cell()
            if p is not None and (why := disagreement(p)):
                notes.append(f"{label}: Δ {key.removeprefix('suite:')} {fmt_delta(p, 2)}: {why}")
        missing = [n for n in sc.columns if pairs[f"suite:{n}"] is None and sc.cell(run, n) is not None]
        if missing:
            notes.append(f"{label}: not paired for {', '.join(missing)} (the baseline lacks it, or its "
                         "cache, prompts or max blocks differ)")
        rows.append(Row(cells, suite_marks(cmp, run), not run.suspect))
    return Table(f"Δ tau by suite vs {cmp.label(cmp.baseline)}, paired by prompt", cols, rows, notes=notes)


def _pair_json(p) -> dict | None:
    return None if p is None else {"delta": p.delta, "ratio": p.ratio, "paired": p.as_dict()}


def suite_json(cmp: ComparedRuns) -> dict:
    """Machine-readable: per run its marks and, per suite, its tau with the interval (value, ci, sd, n),
    whether it is comparable (and what differs), and against the baseline the paired comparison; the mean
    likewise."""
    sc = match(cmp)
    out = {"by": "suite", "baseline": cmp.label(cmp.baseline) if cmp.baseline else None, "suites": sc.columns,
           "regimes": dict(sc.regimes),
           "reference": {n: cmp.label(sc.reference[n]) for n in sc.columns}, "mean_over": sc.mean_columns(),
           "comparable": not sc.differences,
           "differences": [{"run": d.run, "suite": d.suite, "field": d.field, "value": d.value,
                            "expected": d.expected, "reference": d.reference} for d in sc.differences],
           "note": SUITE_NOTE, "runs": []}
    for run in cmp.runs:
        res = run.result
        mean = res.suite_mean.to_dict() if res is not None and res.suite_mean else None
        if mean is not None:
            est = sc.mean_estimate(run)
            mean |= {"interval": est.as_dict() if est else None, "comparable": sc.mean_comparable(run),
                     "ranked": sc.mean_ranked(run), "vs_baseline": _pair_json(sc.mean_paired(run))}
        entry = {"label": cmp.label(run), "path": str(run.path), "state": run.state,
                 "marks": suite_marks(cmp, run), "rankable": res is not None and not run.suspect,
                 "suspect_reasons": res.health.reasons if run.suspect else [], "suites": {},
                 "suite_mean": mean}
        for c in sc.run_cells(run):
            est = sc.estimate(run, c.column)
            projected, best = _speedup(res, c.name)
            entry["suites"][c.column] = {
                "suite": c.name, "regime": sc.regimes[c.column], "tau": c.tau,
                "num_prompts": c.view.metrics.num_prompts,
                "interval": est.as_dict() if est else None, "comparable": c.comparable,
                "differences": [{"field": f, "value": v, "expected": w} for f, v, w in c.differences],
                "projected_speedup": projected, "best_method_by_speedup": best,
                "vs_baseline": _pair_json(sc.paired(run, c.column))}
        out["runs"].append(entry)
    return out
