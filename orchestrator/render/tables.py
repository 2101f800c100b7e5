"""The comparison's tables (pure): one row per run with 95% bootstrap intervals, the paired comparison against
the baseline (Δ and ratio with paired-bootstrap intervals, p-values, the smallest detectable change),
per-position and per-prompt views, and the machine-readable comparison; durations as text. formats.py
renders them."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..results import stats
from ..results.compare import (
    ComparedRuns,
    Result,
    checkpoint_step,
    comparability_note,
    run_duration_s,
    run_marks,
)
from ..results.intervals import metric_values
from ..results.stats import Estimate, Paired
from ..rundir.registry import iso_s
from ..words import online_agreement
from .families import decoding_text, families


def format_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):  # NaN / Infinity: no duration
        return ""
    s = round(seconds)
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def duration_text(status: dict) -> str:
    """`2m41s` from status.json's started_at/finished_at, `?` without both (pure)."""
    a, b = iso_s(status.get("started_at")), iso_s(status.get("finished_at"))
    return format_duration(b - a) if a is not None and b is not None else "?"


CI_NOTE = (f"[a, b] = 95% bootstrap CI over prompts (seeded; {stats.RESAMPLES:,} resamples up to 10 prompts, "
           "fewer for more); SD and n in --format csv/json")
PAIRED_NOTE = ("Δ = run - baseline, paired by prompt, with its 95% paired-bootstrap CI; p = two-sided sign-flip "
               "permutation test; * = a difference the data supports: the CI excludes 0 and p < 0.05 (both); "
               "ratio = run / baseline")
MAIN_NOTE = ("tau = tokens per round incl. the bonus token (macro over prompts); pos-1 acc is teacher-forced; "
             "duration = the run's wall time, started -> finished, as reval status and ls show it; bold = "
             "best per column among ranked runs")


@dataclass
class Column:
    key: str
    label: str
    ranked: bool = False     # highlight the best (highest) value
    digits: int | None = 2   # None: text column
    headline: bool = True    # shown by default (else only with --wide)


@dataclass
class Cell:
    value: Any = None        # float/int for numbers, str for text, None for empty
    text: str = ""
    ratio: float | None = None   # vs baseline (point values)
    delta: float | None = None
    best: bool = False
    est: Estimate | None = None  # the value's bootstrap interval
    pair: Paired | None = None   # paired against the baseline
    ranked: bool = True          # False: shown, never ranked (a suite that is not comparable: ≠)


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


@dataclass
class StepPoint:
    """One checkpoint on the tau-vs-step curve."""
    step: int
    tau: float
    lo: float | None
    hi: float | None
    name: str
    tonight: bool
    suspect: bool = False   # drawn as a marked point off the curve, never dropped
    suite: str = ""         # a benchmark suite's curve ("": the run's tau; "mean": the mean over suites)


def fmt_ci(lo: float, hi: float, digits: int, sign: bool = False) -> str:
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f"[{f.format(lo)}, {f.format(hi)}]"


def fmt_delta(p: Paired, digits: int) -> str:
    """'+0.19 [+0.07, +0.31] *' (the star: significant, the interval excludes 0 and p < 0.05)."""
    return f"{p.delta:+.{digits}f} {fmt_ci(p.delta_lo, p.delta_hi, digits, sign=True)}" + \
        (" *" if p.significant else "")


def disagreement(p: Paired) -> str:
    """Why a Δ is not starred although one of the two says so ('' when they agree): the interval and the test."""
    if not p.disagree:
        return ""
    if p.excludes_zero:
        return f"the CI excludes 0 but p {fmt_p(p.p_value)} >= {stats.ALPHA:g}: not called"
    return f"p {fmt_p(p.p_value)} < {stats.ALPHA:g} but the CI includes 0: not called"


def fmt_ratio(p: Paired) -> str:
    if p.ratio is None:
        return ""
    return f"{p.ratio:.2f}x" + (f" {fmt_ci(p.ratio_lo, p.ratio_hi, 2)}" if p.ratio_lo is not None else "")


def fmt_p(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def shorten(name: str, width: int = 22) -> str:
    """Long run names shortened in the middle: 'step-0080-3f9c…02ab'."""
    if len(name) <= width:
        return name
    keep = width - 1
    return name[: (keep + 1) // 2] + "…" + name[len(name) - keep // 2:]


def _budgets(runs: list[Result], key: str) -> list[str]:
    keys = {k for r in runs if r.result for k in getattr(r.result.metrics, key)}
    return sorted(keys, key=lambda k: int(k))


def _num_cell(v: float | None, digits: int, base: float | None) -> Cell:
    if v is None:
        return Cell()
    c = Cell(value=v, text=f"{v:.{digits}f}")
    if base is not None:
        c.delta = v - base
        c.ratio = v / base if base else None
    return c


def metric_columns(runs: list[Result]) -> list[Column]:
    """The ranked numbers: tau, tau pooled, streak, DDTree best and per budget, width-k, position-1 accuracy."""
    budgets, widths = _budgets(runs, "ddtree_tau"), _budgets(runs, "tree_width_tau")
    cols = [Column("tau", "tau\ntok/round", ranked=True), Column("tau_pooled", "tau\npooled", ranked=True,
                                                                  headline=False),
            Column("streak", "streak", ranked=True, headline=False),
            Column("ddtree_best", "DDTree\nbest", ranked=True)]
    cols += [Column(f"ddtree_{b}", f"DDT\n{b}", ranked=True, headline=False) for b in budgets]
    cols += [Column(f"width_{w}", f"width\n{w}", ranked=True, headline=False) for w in widths]
    cols.append(Column("pos1_acc", "pos-1 acc\nteacher-\nforced", ranked=True, digits=3))
    return cols


def main_table(cmp: ComparedRuns, threshold: float = 0.1) -> Table:
    """One row per run: name, host, drafter, step, prompts x blocks, every headline number with its 95%
    bootstrap interval (and, against the baseline, the paired comparison in each cell), duration."""
    cols = [Column("run", "run", digits=None), Column("host", "host", digits=None, headline=False),
            Column("drafter", "drafter", digits=None, headline=False),
            Column("step", "step", digits=None, headline=False),
            Column("size", "prompts\nx blocks", digits=None)]
    fams = families(cmp.runs)
    if "eagle3" in fams:  # which decoder each row is: shown by default when families mix
        cols.append(Column("decoding", "family\ndecoding", digits=None, headline=len(fams) > 1))
    cols += metric_columns(cmp.runs)
    cols += [Column("best_ddtree_budget", "DDTree\nbest at", digits=None, headline=False)]
    cols += serving_columns(cmp.runs)
    cols += [Column("duration", "duration\n(wall)", digits=None)]
    unknown = unknown_config_note(cmp)
    if unknown:  # drafter config keys reval does not read: the one thing two runs may differ by
        cols.append(Column("unknown_config", "config keys\nnot read", digits=None, headline=False))
    if cmp.baseline is not None:
        cols += detectable_columns(threshold)
    base_vals = metric_values(cmp.baseline.result) if cmp.baseline and cmp.baseline.result else {}
    rows = []
    for run in cmp.runs:
        res = run.result
        step = checkpoint_step(res, run.name)
        marks = run_marks(cmp, run)
        name = res.drafter.name if res else None
        size = f"{res.options.num_prompts}x{res.options.max_blocks}" if res else ""
        label = cmp.label(run)
        cells = {"run": Cell(label, label + "".join(f" ({m})" for m in marks)),
                 "host": Cell(run.host, run.host),
                 "drafter": Cell(name, name or ""),
                 "step": Cell(step, "" if step is None else str(step)),
                 "size": Cell(size or None, size), "decoding": Cell(decoding_text(res) or None, decoding_text(res))}
        vals = metric_values(res) if res else {}
        est, pair = cmp.estimates(run), cmp.paired(run)
        for c in cols:
            if c.ranked:
                base = None if run is cmp.baseline else base_vals.get(c.key)
                cells[c.key] = _num_cell(vals.get(c.key), c.digits, base)
                if cells[c.key].value is not None:
                    cells[c.key].est, cells[c.key].pair = est.get(c.key), pair.get(c.key)
        best = res.metrics.ddtree_best if res else None
        cells["best_ddtree_budget"] = Cell(best.budget if best else None, str(best.budget) if best else "")
        if cells["ddtree_best"].value is not None and best is not None:
            cells["ddtree_best"].text += f" @{best.budget}"
        cells.update(serving_cells(res, cols))
        dur = run_duration_s(run)
        cells["duration"] = Cell(dur, format_duration(dur))
        if unknown:
            text = unknown_config_text(res)
            cells["unknown_config"] = Cell(text or None, text)
        if cmp.baseline is not None:
            cells.update(detectable_cells(pair.get("tau"), threshold))
        rows.append(Row(cells, marks, cmp.rankable(run)))
    notes = [
        CI_NOTE, MAIN_NOTE, comparability_note(cmp), *serving_notes(cols),
        *([unknown] if unknown else [])]
    title = "runs" + (f" vs {cmp.label(cmp.baseline)}" if cmp.baseline else "")
    table = Table(title, cols, rows, notes=notes)
    return mark_best(table)


SPEEDUP_NOTE = ("speedup (proj.) = the best projected speedup and its method (@B: DDTree budget B; block: "
                "the plain block): tau x t(decode) / (t(draft) + t(verify)) "
                "from the run's measured latencies "
                "(--speedup; speedup block: the plain block's)")
ONLINE_NOTE = ("online = the measured wall-clock speedup of a real speculative decode (the plain block) over "
               "target-only greedy decoding of the same prompts (this device, batch 1, eager), and a/b = the "
               "online prompts whose every round agreed with the offline walk (--online)")


def serving_columns(runs: list[Result]) -> list[Column]:
    """The serving figures, shown in the default table where any run measured them: the projected speedup
    (--speedup) and the online decode's measured speedup with its agreement (--online)."""
    cols = []
    if any(r.result is not None and r.result.speedup is not None for r in runs):
        cols += [Column("speedup_block", "speedup\nblock\n(proj.)", ranked=True, headline=False),
                 Column("speedup_best", "speedup\n(proj.)", ranked=True)]
    if any(r.result is not None and r.result.online is not None for r in runs):
        cols.append(Column("online", "online\nspeedup\n· agree", digits=None))
    return cols


def serving_cells(res, cols: list[Column]) -> dict[str, Cell]:
    """The run's cells of serving_columns (empty where it did not measure them)."""
    keys = {c.key for c in cols}
    out = {k: Cell() for k in ("speedup_block", "speedup_best", "online") if k in keys}
    sp = res.speedup if res is not None else None
    if sp is not None:
        block, best_x = sp.projected.get("block"), sp.best_speedup
        out["speedup_block"] = Cell(block, "" if block is None else f"{block:.2f}x")
        out["speedup_best"] = Cell(best_x, "" if best_x is None else
                                   f"{best_x:.2f}x {(sp.best_method or '').replace('ddtree_', '@')}")
    on = res.online if res is not None else None
    if on is not None:
        x = "-" if on.measured_speedup is None else f"{on.measured_speedup:.2f}x"
        agree = online_agreement(on).removesuffix(" agree")
        out["online"] = Cell(on.measured_speedup, f"{x} · {agree}" if agree else x)
    return out


def serving_notes(cols: list[Column]) -> list[str]:
    keys = {c.key for c in cols}
    return ([SPEEDUP_NOTE] if keys & {"speedup_best", "speedup"} else []) + ([ONLINE_NOTE] if "online" in keys
                                                                               else [])


def unknown_config_text(res) -> str:
    """'frobnicate=3, x.y=true': the drafter config keys reval does not read that the run allowed."""
    allowed = (res.drafter.allowed_unknown_config or {}) if res is not None else {}
    return ", ".join(f"{k}={v}" for k, v in sorted(allowed.items()))


def unknown_config_note(cmp: ComparedRuns) -> str | None:
    """What the runs' drafter configs hold that reval does not read (--allow-unknown-config), key by key: the
    same in every run, or each run's value where they differ (None: no run has such a key)."""
    runs = [r for r in cmp.runs if r.result is not None]
    allowed = {cmp.label(r): r.result.drafter.allowed_unknown_config or {} for r in runs}
    keys = sorted({k for a in allowed.values() for k in a})
    if not keys:
        return None
    parts = []
    for k in keys:
        vals = {label: a.get(k) for label, a in allowed.items()}
        if len(set(vals.values())) == 1:
            parts.append(f"{k}={vals[next(iter(vals))]} in every run")
        else:
            parts.append(f"{k} DIFFERS: " + ", ".join(f"{label} {'not set' if v is None else v}"
                                                     for label, v in vals.items()))
    return ("drafter config keys reval does not read, allowed with --allow-unknown-config (results may "
            "differ by them): " + "; ".join(parts))


def detectable_columns(threshold: float, headline: bool = False) -> list[Column]:
    return [Column("tau_mde", "detectable\nΔ tau", digits=None, headline=headline),
            Column("tau_needed", f"prompts\nfor ±{threshold:g}", digits=None, headline=headline)]


def detectable_cells(tau: Paired | None, threshold: float) -> dict[str, Cell]:
    """The smallest tau change these prompts detect, and the prompts that ±threshold needs (from the SD of
    the per-prompt differences against the baseline)."""
    if tau is not None and tau.sd_diff == 0:  # every prompt moved by the same amount: nothing to size
        return {"tau_mde": Cell(0.0, "no spread"), "tau_needed": Cell(None, "any change shows")}
    mde = stats.detectable_change(tau.sd_diff, tau.n) if tau else None
    need = stats.prompts_needed(tau.sd_diff, threshold) if tau else None
    return {"tau_mde": Cell(mde, "" if mde is None else f"±{mde:.2f}"),
            "tau_needed": Cell(need, "" if need is None else str(need))}


def paired_table(cmp: ComparedRuns, threshold: float = 0.1) -> Table | None:
    """Against the baseline, paired by prompt: per run Δ [CI] of every headline number, ratio [CI] and p,
    and the smallest tau change its prompts can detect. None without a baseline or another run."""
    others = [r for r in cmp.runs if r is not cmp.baseline and r.result is not None]
    if cmp.baseline is None or not others:
        return None
    cols = [Column("run", "run", digits=None)]
    for c in metric_columns(cmp.runs):
        name = {"tau": "tau", "pos1_acc": "pos-1 acc"}.get(c.key, c.label.replace("\n", " "))
        cols.append(Column(f"{c.key}_delta", f"Δ {name}\n[95% CI]", digits=c.digits, headline=c.key == "tau"))
        cols.append(Column(f"{c.key}_ratio", f"{name}\nratio", digits=2, headline=c.key == "tau"))
        cols.append(Column(f"{c.key}_p", f"p\n({name})" if c.key != "tau" else "p", digits=3,
                           headline=c.key == "tau"))
    cols += detectable_columns(threshold, headline=True)
    rows, notes = [], []
    for run in others:
        label, pairs = cmp.label(run), cmp.paired(run)
        cells = {"run": Cell(label, label + "".join(f" ({m})" for m in run_marks(cmp, run)))}
        for c in metric_columns(cmp.runs):
            p = pairs.get(c.key)
            cells[f"{c.key}_delta"] = Cell(p.delta, fmt_delta(p, c.digits), pair=p) if p else Cell()
            cells[f"{c.key}_ratio"] = Cell(p.ratio, fmt_ratio(p), pair=p) if p and p.ratio is not None else Cell()
            cells[f"{c.key}_p"] = Cell(p.p_value, fmt_p(p.p_value)) if p else Cell()
        tau = pairs.get("tau")
        cells.update(detectable_cells(tau, threshold))
        mde, need = cells["tau_mde"].value, cells["tau_needed"].value
        if tau is not None and (why := disagreement(tau)):
            least = 2 / 2 ** tau.n if tau.n <= stats.EXACT_PERMUTATION_MAX_N else 0.0
            notes.append(f"{label}: Δ tau {fmt_delta(tau, 2)}: {why} (the two disagree: more prompts settle it"
                         + (f"; {tau.n} prompts cannot give p < {stats.ALPHA:g}, the least is {least:.4g}"
                            if least >= stats.ALPHA else "") + ")")
        if tau is not None and tau.sd_diff == 0:
            notes.append(f"{label}: no spread: the per-prompt differences are all {tau.delta:+.2f} (SD 0), so "
                         "any change would show")
        elif mde is not None:
            notes.append(f"{label}: {tau.n} prompts detect a tau change of ±{mde:.2f} (5% two-sided, 80% power, "
                         f"SD of per-prompt differences {tau.sd_diff:.2f}); ±{threshold:g} needs {need} prompts")
        elif not pairs:
            notes.append(f"{label}: not compared (not comparable with the baseline, or no per-prompt data)")
        rows.append(Row(cells, run_marks(cmp, run), cmp.rankable(run)))
    return Table(f"paired by prompt vs {cmp.label(cmp.baseline)}", cols, rows, notes=[PAIRED_NOTE] + notes)


def per_position_tables(cmp: ComparedRuns) -> list[Table]:
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


def per_prompt_table(cmp: ComparedRuns) -> Table:
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


def _col_label(cmp: ComparedRuns, run: Result) -> str:
    return cmp.label(run) + "".join(f" ({m})" for m in run_marks(cmp, run))


def _rankable_cols(cmp: ComparedRuns, runs: list[Result]) -> set[str]:
    return {cmp.label(r) for r in runs if cmp.rankable(r)}


def mark_best(table: Table, rankable: set[str] | None = None) -> Table:
    """Flag the highest value per ranked column (best_per="column", among rankable rows) or per row
    (best_per="row", among the ranked columns in `rankable`). Ties are all flagged. Mutates and returns."""
    if table.best_per == "column":
        for c in table.columns:
            if not c.ranked:
                continue
            cand = [r.cells[c.key] for r in table.rows
                    if r.rankable and r.cells[c.key].value is not None and r.cells[c.key].ranked]
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


def comparison_json(cmp: ComparedRuns, per_position: bool = False, per_prompt: bool = False) -> dict:
    """A machine-readable comparison: comparability, and per run its marks, metrics with 95% intervals
    (value, ci, sd, n), and against the baseline the point ratio/delta plus the paired comparison."""
    base_vals = metric_values(cmp.baseline.result) if cmp.baseline and cmp.baseline.result else {}
    runs = []
    for r in cmp.runs:
        res = r.result
        vals = metric_values(res) if res else {}
        best = res.metrics.ddtree_best if res else None
        entry = {"name": r.name, "host": r.host, "label": cmp.label(r), "path": str(r.path), "state": r.state,
                 "marks": run_marks(cmp, r), "rankable": cmp.rankable(r),
                 "drafter": res.drafter.name if res else None, "step": checkpoint_step(res, r.name),
                 "num_prompts": res.options.num_prompts if res else None,
                 "max_blocks": res.options.max_blocks if res else None,
                 "size": f"{res.options.num_prompts}x{res.options.max_blocks}" if res else None,
                 "ddtree_best_budget": best.budget if best else None,
                 "duration_s": run_duration_s(r), "metrics": vals,
                 "speedup": res.speedup.to_dict() if res is not None and res.speedup is not None else None,
                 "online": res.online.to_dict() if res is not None and res.online is not None else None,
                 "allowed_unknown_config": res.drafter.allowed_unknown_config if res is not None else None,
                 "intervals": {k: e.as_dict() for k, e in cmp.estimates(r).items()},
                 "suspect_reasons": res.health.reasons if r.suspect else []}
        if base_vals and r is not cmp.baseline and res:
            pairs = cmp.paired(r)
            entry["vs_baseline"] = {k: {"ratio": (v / base_vals[k]) if base_vals.get(k) else None,
                                        "delta": v - base_vals[k],
                                        **({"paired": pairs[k].as_dict()} if k in pairs else {})}
                                    for k, v in vals.items() if v is not None and base_vals.get(k) is not None}
            tau = pairs.get("tau")
            if tau is not None:
                entry["tau_detectable_change"] = stats.detectable_change(tau.sd_diff, tau.n)
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
            "note": comparability_note(cmp), "confidence": stats.CONFIDENCE,
            "runs": runs}
