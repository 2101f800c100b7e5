"""Benchmark suites side by side (pure): `reval compare --by suite`, the papers' layout — one row per run, one
column per suite (tau with its 95% bootstrap interval over that suite's prompts) and the mean over suites.

A run evaluated with `--cache NAME=PATH` repeated carries `suites` in results.json: each suite's metrics,
comparability key and its slice of the top-level per_prompt. Its interval is computed from that slice exactly as
the main table computes a run's (intervals.estimates on a view of the result holding only the suite's prompts).
A suite is compared across runs only when its comparability key matches the first run's for that suite
(same cache, prompts, max blocks, metrics, attention): otherwise its cell is marked `≠`, never ranked.
"""
from __future__ import annotations

import dataclasses

from remote_payload.contract import results as results_json
from remote_payload.contract.results import Suite

from ..results import intervals
from ..results.compare import ComparedRuns, Result
from .tables import Cell, Column, Row, Table, mark_best

SUITE_NOTE = ("rows = runs, columns = benchmark suites: tau (tokens per round incl. the bonus, macro over that "
              "suite's prompts) [95% bootstrap CI over its prompts]; mean = the unweighted mean over suites of "
              "each suite's tau (the papers' per-dataset average); bold = best per column")
MISMATCH = "≠"


def suite_view(result: results_json.Result, suite: Suite) -> results_json.Result:
    """The result as if it held only `suite`'s prompts (what intervals and the tables read)."""
    a, b = suite.prompt_range
    return dataclasses.replace(result, per_prompt=result.per_prompt[a:b], metrics=suite.metrics, cache=suite.cache,
                               comparability=suite.comparability, suites=None, suite_mean=None)


def suite_names(runs: list[Result]) -> list[str]:
    """Every suite any run holds, in the order first seen."""
    names: list[str] = []
    for r in runs:
        for s in (r.result.suites or []) if r.result else []:
            if s.name not in names:
                names.append(s.name)
    return names


def _reference_keys(runs: list[Result]) -> dict[str, dict]:
    """Per suite: the comparability key of the first run that has it (the others are compared with it)."""
    ref: dict[str, dict] = {}
    for r in runs:
        for s in (r.result.suites or []) if r.result else []:
            ref.setdefault(s.name, s.comparability.key())
    return ref


def _speedup(res: results_json.Result, name: str):
    """The suite's projected speedups when the run measured them (--speedup): (projected dict, best method)."""
    if res.speedup is None or not res.speedup.by_suite:
        return None, None
    s = next((x for x in res.speedup.by_suite if x.name == name), None)
    return (s.projected, s.best_method) if s is not None else (None, None)


def _speedup_text(res: results_json.Result, name: str) -> str:
    projected, best = _speedup(res, name)
    if not projected or best is None or projected.get(best) is None:
        return ""
    return f" · {projected[best]:.2f}x {best.replace('ddtree_', '@').replace('block', 'blk')}"


def suite_table(cmp: ComparedRuns) -> Table:
    runs = cmp.runs
    names = suite_names(runs)
    ref = _reference_keys(runs)
    cols = [Column("run", "run", digits=None)]
    cols += [Column(f"suite:{n}", n, ranked=True) for n in names]
    cols.append(Column("suite_mean", "mean\nover suites", ranked=True))
    rows, mismatched, without = [], False, []
    for run in runs:
        res = run.result
        label = cmp.label(run)
        cells = {"run": Cell(label, label)}
        by_name = {s.name: s for s in (res.suites or [])} if res else {}
        if res is not None and not by_name:
            without.append(label)
        for n in names:
            s = by_name.get(n)
            if s is None or s.metrics.tau is None:
                cells[f"suite:{n}"] = Cell()
                continue
            cell = Cell(value=s.metrics.tau, text=f"{s.metrics.tau:.2f}" + _speedup_text(res, n))
            cell.est = intervals.estimates(suite_view(res, s)).get("tau")
            if s.comparability.key() != ref[n]:
                cell.text += f" {MISMATCH}"
                cell.value, mismatched = None, True  # shown, never ranked
            cells[f"suite:{n}"] = cell
        mean = res.suite_mean.tau if res is not None and res.suite_mean is not None else None
        cells["suite_mean"] = Cell() if mean is None else Cell(value=mean, text=f"{mean:.2f}")
        rows.append(Row(cells, [], cmp.rankable(run)))
    notes = [SUITE_NOTE]
    if any(r.result is not None and r.result.speedup is not None for r in runs):
        notes.append("· Nx @B = the best projected speedup for that suite and its method (@B: DDTree budget B; blk: "
                     "the plain block), from the run's measured latencies (--speedup)")
    if mismatched:
        notes.append(f"{MISMATCH} = this suite's cache, prompts, max blocks, metrics or drafter attention differ "
                     "from the first run's: not comparable, not ranked")
    if without:
        notes.append(f"no suites (one cache): {', '.join(without)}")
    return mark_best(Table("tau by suite", cols, rows, notes=notes))


def suite_json(cmp: ComparedRuns) -> dict:
    """Machine-readable: per run, per suite its tau with the interval (value, ci, sd, n) and comparability."""
    ref = _reference_keys(cmp.runs)
    out = {"suites": suite_names(cmp.runs), "runs": []}
    for run in cmp.runs:
        res = run.result
        entry = {"label": cmp.label(run), "path": str(run.path), "suites": {},
                 "suite_mean": res.suite_mean.to_dict() if res is not None and res.suite_mean else None}
        for s in (res.suites or []) if res else []:
            est = intervals.estimates(suite_view(res, s)).get("tau")
            projected, best = _speedup(res, s.name)
            entry["suites"][s.name] = {"tau": s.metrics.tau, "num_prompts": s.metrics.num_prompts,
                                       "interval": est.as_dict() if est else None,
                                       "comparable": s.comparability.key() == ref[s.name],
                                       "projected_speedup": projected, "best_method_by_speedup": best}
        out["runs"].append(entry)
    return out
