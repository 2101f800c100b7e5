"""Load pulled runs and compare them: name resolution, comparability, and the pure table builders.

Nothing here prints or writes; `report.py` renders the `Table`s built here (rich, markdown, csv, json)
and `plots.py` draws the curves. A pulled run lives in `runs/<host>/<run>/` (remote_payload/protocol.py).
"""
from __future__ import annotations

import calendar
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remote_payload import protocol
from remote_payload.contenthash import STEP_PATTERN as _STEP  # one checkpoint-step rule
from remote_payload.results import Result, ResultsError

from .errors import ConfigError, RunNotFound

# comparability_key field -> the words used when telling the user what differs
FIELD_WORDS = {"cache_fingerprint": "cache", "prompt_set": "prompt set", "num_prompts": "num_prompts",
               "max_blocks": "max_blocks", "block_size": "block_size", "metrics_version": "metric definitions",
               "attention": "drafter attention (window / causal inside the block)"}


@dataclass
class RunRecord:
    """One pulled run directory, as read from disk (result is None when the eval did not finish).
    `result` is the typed results.json (remote_payload/results.py); `results` the same file as a plain dict."""
    name: str
    host: str
    path: Path
    result: Result | None = None
    status: dict | None = None
    run_info: dict | None = None

    @property
    def results(self) -> dict | None:
        return None if self.result is None else self.result.to_dict()

    @property
    def state(self) -> str:
        if self.result is not None:
            return protocol.SUCCEEDED
        return (self.status or {}).get("state", "unknown")

    @property
    def suspect(self) -> bool:
        return self.result is not None and self.result.suspect

    @property
    def spec(self) -> str:
        return f"{self.host}/{self.name}"


def _read_optional(path: Path) -> dict | None:
    try:
        return protocol.read_json(path)
    except FileNotFoundError:
        return None
    except ValueError as e:  # json.JSONDecodeError
        raise ConfigError(f"{path}: not valid JSON ({e})", hint="re-pull the run: reval pull <run>") from e


def load_run(path: str | Path) -> RunRecord:
    """Read a run directory (results.json, status.json, run.json; any may be missing but not all)."""
    path = Path(path)
    results = _read_optional(path / protocol.RESULTS_JSON)
    result = None
    if results is not None:
        try:
            result = Result.from_dict(results, source=path / protocol.RESULTS_JSON)
        except ResultsError as e:
            raise ConfigError(str(e), hint="re-pull the run (reval pull RUN), or re-run the eval with this "
                                           "version of reval") from None
    status = _read_optional(path / protocol.STATUS_JSON)
    run_info = _read_optional(path / protocol.RUN_JSON)
    if results is None and status is None and run_info is None:
        raise RunNotFound(f"{path}: not a run directory (no results.json, status.json or run.json)",
                          hint="pull it first: reval pull <run>, or pass the run's folder")
    host = (run_info or {}).get("host") or path.parent.name
    return RunRecord(name=path.name, host=str(host), path=path, result=result, status=status, run_info=run_info)


def resolve_run(spec: str, runs_root: str | Path | None = None) -> Path:
    """`name`, `host/name` or a path -> the run's local folder. Ambiguous or missing names are errors.
    runs_root: default $REVAL_RUNS_DIR or ./runs, read at call time (the rule of runs.local_runs_root)."""
    runs_root = Path(runs_root or os.environ.get("REVAL_RUNS_DIR", "runs"))
    p = Path(spec)
    if p.is_dir() and any((p / f).exists() for f in (protocol.RESULTS_JSON, protocol.STATUS_JSON,
                                                     protocol.RUN_JSON)):
        return p
    parts = spec.strip("/").split("/")
    if len(parts) == 2:
        host, name = parts
        cand = runs_root / host / name
        if cand.is_dir():
            return cand
        raise RunNotFound(f"run {spec!r} not found under {runs_root}/{host}/",
                          hint=f"pull it first: reval pull {spec}   (or reval compare --pull {spec})")
    if len(parts) == 1 and parts[0]:
        protocol.validate_run_name(parts[0])
        found = sorted(d for d in runs_root.glob(f"*/{parts[0]}") if d.is_dir()) if runs_root.is_dir() else []
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            options = ", ".join(f"{d.parent.name}/{d.name}" for d in found)
            raise ConfigError(f"run name {spec!r} is on several hosts: {options}", hint="say which: HOST/NAME")
    raise RunNotFound(f"run {spec!r} not found (looked in {runs_root}/*/{parts[-1]} and as a path)",
                      hint="list runs: reval ls   · pull it: reval compare --pull HOST/NAME")


# ---------------------------------------------------------------------------------------------------------
# comparability

@dataclass
class Difference:
    run: str          # label of the run that differs
    field: str        # comparability_key field
    value: Any
    expected: Any
    reference: str    # label of the run it was compared with

    def __str__(self) -> str:
        return (f"{self.run}: {FIELD_WORDS.get(self.field, self.field)} {_short(self.value)} "
                f"differs from {_short(self.expected)} ({self.reference})")


def _short(v: Any) -> str:
    s = str(v)
    return s[:19] + "..." if isinstance(v, str) and len(s) > 22 and s.startswith("sha256") else s


@dataclass
class Comparison:
    runs: list[RunRecord]              # baseline first when there is one
    labels: dict[str, str]             # run path (str) -> display label
    baseline: RunRecord | None = None
    differences: list[Difference] = field(default_factory=list)

    def label(self, run: RunRecord) -> str:
        return self.labels[str(run.path)]

    def incomparable(self, run: RunRecord) -> bool:
        return any(d.run == self.label(run) for d in self.differences)

    def rankable(self, run: RunRecord) -> bool:
        return run.result is not None and not run.suspect and not self.incomparable(run)


def run_labels(runs: list[RunRecord]) -> dict[str, str]:
    """Display labels: the bare name where it is unique among `runs`, else host/name."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.name] = counts.get(r.name, 0) + 1
    return {str(r.path): r.name if counts[r.name] == 1 else r.spec for r in runs}


def build_comparison(runs: list[RunRecord], baseline: RunRecord | None = None) -> Comparison:
    """Order runs (baseline first) and find every comparability field that differs from the reference
    (the baseline, else the first run with results). Runs without results take no part."""
    if baseline is not None:
        runs = [baseline] + [r for r in runs if r.path.resolve() != baseline.path.resolve()]
    cmp = Comparison(runs=runs, labels=run_labels(runs), baseline=baseline)
    with_results = [r for r in runs if r.result is not None]
    if not with_results:
        return cmp
    ref = baseline if baseline is not None and baseline.result is not None else with_results[0]
    ref_key = ref.result.comparability.key()
    for r in with_results:
        if r is ref:
            continue
        key = r.result.comparability.key()
        for f, expected in ref_key.items():
            if f == "attention" and (key[f] is None or expected is None):
                continue  # not recorded (a file from before reval.results/2): unknown, not different
            if key[f] != expected:
                cmp.differences.append(Difference(cmp.label(r), f, key[f], expected, cmp.label(ref)))
    return cmp


def require_comparable(cmp: Comparison) -> None:
    """Raise (exit 3) naming every differing field, unless all runs are comparable."""
    if not cmp.differences:
        return
    lines = "\n".join(str(d) for d in cmp.differences)
    raise ConfigError(f"runs are not comparable, refusing to rank them:\n{lines}",
                      hint="compare runs evaluated with the same cache, prompts, max-blocks and metric "
                           "definitions, or pass --allow-incomparable to show them side by side (marked)")


def comparability_note(cmp: Comparison) -> str:
    if not cmp.differences:
        return "same cache, prompts, max-blocks and metric definitions: comparable"
    fields = sorted({FIELD_WORDS.get(d.field, d.field) for d in cmp.differences})
    runs = sorted({d.run for d in cmp.differences})
    return f"NOT comparable ({', '.join(fields)} differ for {', '.join(runs)}): marked, not ranked"


# ---------------------------------------------------------------------------------------------------------
# tables (pure)

@dataclass
class Column:
    key: str
    label: str
    ranked: bool = False     # highlight the best (highest) value
    digits: int | None = 2   # None: text column


@dataclass
class Cell:
    value: Any = None        # float/int for numbers, str for text, None for empty
    text: str = ""
    ratio: float | None = None   # vs baseline
    delta: float | None = None
    best: bool = False


@dataclass
class Row:
    cells: dict[str, Cell]
    marks: list[str] = field(default_factory=list)  # base, SUSPECT, INCOMPARABLE, FAILED, ...
    rankable: bool = True


@dataclass
class Table:
    title: str
    columns: list[Column]
    rows: list[Row]
    best_per: str = "column"   # "column": best run per metric; "row": best run per position/prompt
    notes: list[str] = field(default_factory=list)




def checkpoint_step(result: Result | None, name: str = "") -> int | None:
    """The drafter's training step: results.drafter.step, else a `step-N`/`ckpt-N` in its path or the run name."""
    if result is not None and result.drafter.step is not None:
        return result.drafter.step
    for s in (result.drafter.path if result is not None else "", name):
        m = _STEP.search(Path(s.rstrip("/")).name) or _STEP.search(s)
        if m:
            return int(m.group(1))
    return None


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = round(seconds)
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _iso_s(ts: str | None) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(ts, "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError):
        return None


def run_duration_s(run: RunRecord) -> float | None:
    t = run.result.timing.total_s if run.result is not None else None
    if t is not None:
        return float(t)
    st = run.status or {}
    a, b = _iso_s(st.get("started_at")), _iso_s(st.get("finished_at"))
    return b - a if a is not None and b is not None else None


def _budgets(runs: list[RunRecord], key: str) -> list[str]:
    keys = {k for r in runs if r.result for k in getattr(r.result.metrics, key)}
    return sorted(keys, key=lambda k: int(k))


def metric_values(result: Result) -> dict[str, float | None]:
    """The ranked numbers of one result, flat: tau, streak, ddtree_best, ddtree_<B>, width_<k>, pos1_acc."""
    m = result.metrics
    out: dict[str, float | None] = {"tau": m.tau, "streak": m.streak,
                                    "ddtree_best": m.ddtree_best.tau if m.ddtree_best else None}
    for b, v in m.ddtree_tau.items():
        out[f"ddtree_{b}"] = v
    for w, v in m.tree_width_tau.items():
        out[f"width_{w}"] = v
    out["pos1_acc"] = m.position_1_accuracy
    return out


def run_marks(cmp: Comparison, run: RunRecord) -> list[str]:
    marks = []
    if run is cmp.baseline:
        marks.append("base")
    if run.result is None:
        marks.append(run.state.upper())
    if run.suspect:
        marks.append("SUSPECT")
    if cmp.incomparable(run):
        marks.append("INCOMPARABLE")
    return marks


def _num_cell(v: float | None, digits: int, base: float | None) -> Cell:
    if v is None:
        return Cell()
    c = Cell(value=v, text=f"{v:.{digits}f}")
    if base is not None:
        c.delta = v - base
        c.ratio = v / base if base else None
    return c


def main_table(cmp: Comparison) -> Table:
    """One row per run: name, host, drafter, step, prompts x blocks, tau, streak, DDTree best and per budget,
    width-k trees, position-1 accuracy, duration; ratios/deltas against the baseline when there is one."""
    budgets = _budgets(cmp.runs, "ddtree_tau")
    widths = _budgets(cmp.runs, "tree_width_tau")
    cols = [Column("run", "run", digits=None), Column("host", "host", digits=None),
            Column("drafter", "drafter", digits=None), Column("step", "step", digits=None),
            Column("size", "prompts\nx blocks", digits=None),
            Column("tau", "tau", ranked=True), Column("streak", "streak", ranked=True),
            Column("ddtree_best", "DDTree\nbest", ranked=True)]
    cols += [Column(f"ddtree_{b}", f"DDT\n{b}", ranked=True) for b in budgets]
    cols += [Column(f"width_{w}", f"width\n{w}", ranked=True) for w in widths]
    cols += [Column("pos1_acc", "pos-1\nacc", ranked=True, digits=3), Column("duration", "duration", digits=None)]
    base_vals = metric_values(cmp.baseline.result) if cmp.baseline and cmp.baseline.result else {}
    rows = []
    for run in cmp.runs:
        res = run.result
        step = checkpoint_step(res, run.name)
        marks = run_marks(cmp, run)
        name = res.drafter.name if res else None
        size = f"{res.options.num_prompts}x{res.options.max_blocks}" if res else ""
        cells = {"run": Cell(cmp.label(run), cmp.label(run) + "".join(f" ({m})" for m in marks)),
                 "host": Cell(run.host, run.host),
                 "drafter": Cell(name, name or ""),
                 "step": Cell(step, "" if step is None else str(step)),
                 "size": Cell(size or None, size)}
        vals = metric_values(res) if res else {}
        for c in cols:
            if c.ranked:
                base = None if run is cmp.baseline else base_vals.get(c.key)
                cells[c.key] = _num_cell(vals.get(c.key), c.digits, base)
        best = res.metrics.ddtree_best if res else None
        if cells["ddtree_best"].value is not None and best is not None:
            cells["ddtree_best"].text += f" @{best.budget}"
        dur = run_duration_s(run)
        cells["duration"] = Cell(dur, format_duration(dur))
        rows.append(Row(cells, marks, cmp.rankable(run)))
    table = Table("runs" + (f" vs {cmp.label(cmp.baseline)}" if cmp.baseline else ""), cols, rows,
                  notes=[comparability_note(cmp)])
    return mark_best(table)


def per_position_tables(cmp: Comparison) -> list[Table]:
    """Rows k=1..15, one column per run: unconditional and conditional acceptance, teacher-forced accuracy."""
    views = [("per_position_acceptance_unconditional", "per-position acceptance #(acc>=k)/#rounds"),
             ("per_position_acceptance_conditional", "per-position acceptance #(acc>=k)/#(acc>=k-1)"),
             ("position_accuracy", "teacher-forced position accuracy")]
    with_res = [r for r in cmp.runs if r.result is not None]
    tables = []
    for key, title in views:
        n = max((len(getattr(r.result.metrics, key)) for r in with_res), default=0)
        cols = [Column("k", "k", digits=None)] + [Column(cmp.label(r), _col_label(cmp, r), ranked=True, digits=3)
                                                   for r in with_res]
        rows = []
        for k in range(1, n + 1):
            cells = {"k": Cell(k, str(k))}
            for r in with_res:
                seq = getattr(r.result.metrics, key)
                cells[cmp.label(r)] = _num_cell(seq[k - 1] if k <= len(seq) else None, 3, None)
            rows.append(Row(cells))
        tables.append(mark_best(Table(title, cols, rows, best_per="row"), rankable=_rankable_cols(cmp, with_res)))
    return tables


def per_prompt_table(cmp: Comparison) -> Table:
    """Rows = prompts (by name, in first-seen order), one column per run: that prompt's tau."""
    with_res = [r for r in cmp.runs if r.result is not None]
    names: list[str] = []
    for r in with_res:
        for p in r.result.per_prompt:
            if p.name not in names:
                names.append(p.name)
    cols = [Column("prompt", "prompt", digits=None)] + [Column(cmp.label(r), _col_label(cmp, r), ranked=True)
                                                         for r in with_res]
    rows = []
    for name in names:
        cells = {"prompt": Cell(name, str(name))}
        for r in with_res:
            p = next((p for p in r.result.per_prompt if p.name == name), None)
            cells[cmp.label(r)] = _num_cell(p.tau if p else None, 2, None)
        rows.append(Row(cells))
    return mark_best(Table("per-prompt tau", cols, rows, best_per="row"), rankable=_rankable_cols(cmp, with_res))


def _col_label(cmp: Comparison, run: RunRecord) -> str:
    return cmp.label(run) + "".join(f" ({m})" for m in run_marks(cmp, run))


def _rankable_cols(cmp: Comparison, runs: list[RunRecord]) -> set[str]:
    return {cmp.label(r) for r in runs if cmp.rankable(r)}


def mark_best(table: Table, rankable: set[str] | None = None) -> Table:
    """Flag the highest value per ranked column (best_per="column", among rankable rows) or per row
    (best_per="row", among the ranked columns in `rankable`). Ties are all flagged. Mutates and returns."""
    if table.best_per == "column":
        for c in table.columns:
            if not c.ranked:
                continue
            cand = [r.cells[c.key] for r in table.rows if r.rankable and r.cells[c.key].value is not None]
            _flag(cand, c.digits)
    else:
        keys = [c for c in table.columns if c.ranked and (rankable is None or c.key in rankable)]
        for r in table.rows:
            _flag([r.cells[c.key] for c in keys if r.cells[c.key].value is not None], keys[0].digits if keys else 2)
    return table


def _flag(cells: list[Cell], digits: int | None) -> None:
    if len(cells) < 2:
        return  # one value is not a ranking
    top = max(round(c.value, digits or 0) for c in cells)
    for c in cells:
        c.best = round(c.value, digits or 0) == top


def comparison_json(cmp: Comparison, per_position: bool = False, per_prompt: bool = False) -> dict:
    """A machine-readable comparison: comparability, and per run its marks, metrics and ratio/delta vs base."""
    base_vals = metric_values(cmp.baseline.result) if cmp.baseline and cmp.baseline.result else {}
    runs = []
    for r in cmp.runs:
        res = r.result
        vals = metric_values(res) if res else {}
        entry = {"name": r.name, "host": r.host, "label": cmp.label(r), "path": str(r.path), "state": r.state,
                 "marks": run_marks(cmp, r), "rankable": cmp.rankable(r),
                 "drafter": res.drafter.name if res else None, "step": checkpoint_step(res, r.name),
                 "num_prompts": res.options.num_prompts if res else None,
                 "max_blocks": res.options.max_blocks if res else None,
                 "duration_s": run_duration_s(r), "metrics": vals,
                 "suspect_reasons": res.health.reasons if r.suspect else []}
        if base_vals and r is not cmp.baseline and res:
            entry["vs_baseline"] = {k: {"ratio": (v / base_vals[k]) if base_vals.get(k) else None,
                                        "delta": v - base_vals[k]}
                                    for k, v in vals.items() if v is not None and base_vals.get(k) is not None}
        if per_position and res:
            entry["per_position"] = {k: getattr(res.metrics, k) for k in ("per_position_acceptance_unconditional",
                                                                         "per_position_acceptance_conditional",
                                                                         "position_accuracy")}
        if per_prompt and res:
            entry["per_prompt"] = [{"name": p.name, "tau": p.tau} for p in res.per_prompt]
        runs.append(entry)
    return {"baseline": cmp.label(cmp.baseline) if cmp.baseline else None,
            "comparable": not cmp.differences,
            "differences": [{"run": d.run, "field": d.field, "value": d.value, "expected": d.expected,
                             "reference": d.reference} for d in cmp.differences],
            "note": comparability_note(cmp), "runs": runs}
