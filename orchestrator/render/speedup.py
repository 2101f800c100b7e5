"""The projected speedup per batch size (pure): `reval compare --wide`'s table and the HTML report's
speedup-vs-batch plot, from results.json `speedup.by_batch` (the payload's projection, eval/projection.py: pooled
tau x t(decode) / (t(draft) + t(verify)) from the latency table measured at each batch, with the quartiles' worst
and best case as low and high). One row per run and method, one column per batch measured: it fits 100 columns for
the usual four batches, where a column per (method, batch) would not.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..results.compare import ComparedRuns, Result
from ..words import printable
from .tables import Cell, Column, Row, Table

BATCH_NOTE = ("projected speedup at each batch size (--speedup-batches): pooled tau x t(decode) / (t(draft) + "
              "t(verify)) from the medians of the latencies measured at that batch (low..high: the quartiles' worst "
              "and best case, in --format json and the HTML plot); best = the method whose low clears every other "
              "method's high at that batch (bold); ≈ = within noise of the highest (the spreads overlap): no method "
              "is named best there; stops paying = the smallest batch measured where the speedup is below 1")


@dataclass
class Series:
    """One (run, method) curve: batches and the projected speedup's median, low and high at each."""
    run: str
    method: str
    batches: list[int]
    median: list[float | None]
    low: list[float | None]
    high: list[float | None]


def method_name(method: str) -> str:
    return method.replace("ddtree_", "DDT-")


def _by_batch(run: Result):
    sp = run.result.speedup if run.result is not None else None
    return sp.by_batch if sp is not None and sp.by_batch else None


def series(cmp: ComparedRuns) -> list[Series]:
    """Every run's by_batch as curves, one per method (runs without by_batch: none)."""
    out = []
    for run in cmp.runs:
        rows = _by_batch(run)
        if rows is None:
            continue
        methods = list(dict.fromkeys(m for r in rows for m in r.projected))
        for m in methods:
            out.append(Series(cmp.label(run), printable(m), [r.batch for r in rows], [r.projected.get(m) for r in rows],
                              [r.low.get(m) for r in rows], [r.high.get(m) for r in rows]))
    return out


def batch_table(cmp: ComparedRuns) -> Table | None:
    """Rows = (run, method), columns = the batches any run measured, the cell its projected speedup marked best or
    ≈ (BATCH_NOTE); None when no run has the projection per batch."""
    measured = [r for r in cmp.runs if _by_batch(r) is not None]
    if not measured:
        return None
    batches = sorted({b.batch for r in measured for b in _by_batch(r)})
    cols = [Column("run", "run", digits=None), Column("method", "method", digits=None)]
    cols += [Column(f"b{b}", f"batch\n{b}", digits=None) for b in batches]
    cols.append(Column("stops", "stops\npaying", digits=None))
    rows, notes = [], [BATCH_NOTE]
    for run in measured:
        at = {b.batch: b for b in _by_batch(run)}
        stops = run.result.speedup.stops_paying or {}
        methods = list(dict.fromkeys(m for b in at.values() for m in b.projected))
        for i, m in enumerate(methods):
            label = cmp.label(run)
            cells = {"run": Cell(label, label if i == 0 else ""), "method": Cell(m, method_name(m))}
            for b in batches:
                cells[f"b{b}"] = _cell(at.get(b), m)
            where = stops.get(m)
            cells["stops"] = Cell(where, "-" if where is None else f"at {where}")
            rows.append(Row(cells, [], cmp.rankable(run)))
        if run.result.regime is not None and run.result.regime.mixed:
            notes.append(f"{cmp.label(run)}: its suites are of several decoding regimes; this projection pools "
                         "their rounds (see compare --by suite)")
    others = [cmp.label(r) for r in cmp.runs if r.result is not None and _by_batch(r) is None]
    if others:
        notes.append(f"not projected per batch (no --speedup, or a results.json from before batches): "
                     f"{', '.join(others)}")
    return Table("projected speedup by batch size", cols, rows, notes=notes)


def _cell(row, method: str) -> Cell:
    v = row.projected.get(method) if row is not None else None
    if v is None:
        return Cell()
    mark = " best" if row.best_method == method else " ≈" if method in (row.tied or []) else ""
    return Cell(v, f"{v:.2f}x{mark}", best=row.best_method == method)

