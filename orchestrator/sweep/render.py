"""A sweep's report shown (report.py builds it): the table (one row per checkpoint: tau [CI], paired Δ vs the
previous checkpoint and vs the baseline, verdicts), one line per checkpoint, the terminal report, its JSON,
and the report files in the sweep's folder (report.md, report.json, report.html, plots.png)."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from remote_payload.contract import protocol

from ..render.tables import Cell, Column, Row, Table, fmt_ci, fmt_delta, fmt_p, mark_best, serving_notes
from ..results import compare, stats
from ..words import online_agreement, printable
from .plan import Outcome
from .report import LoadedRuns, SweepReport, detection_note

SCREEN_ERROR_CHARS = 160


def short(text: str, n: int = SCREEN_ERROR_CHARS) -> str:
    """A failure message cut for the screen; report.json keeps it whole (pure)."""
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def report_json(rep: SweepReport) -> dict:
    note = detection_note(rep.outcomes, rep.threshold)
    return {"sweep": rep.sweep_id, "dir": str(rep.sweep_dir), "baseline": rep.baseline, "threshold": rep.threshold,
            "exit_code": rep.exit_code, "hosts_down": rep.hosts_down, "detection": note,
            "checkpoints": [asdict(o) for o in rep.outcomes],
            "history": [asdict(p) for p in rep.history], "files": rep.files}


def _vs_text(p: stats.Paired | None, point: str, ref: str | None) -> str:
    if p is not None:  # the p where the interval and the test disagree: why a CI off 0 has no star
        return (f"Δ {fmt_delta(p, 2)}" + (f" (p {fmt_p(p.p_value)})" if p.disagree else "")
                + (f" vs {ref}" if ref else ""))
    return point


def named(o: Outcome) -> str:
    """'step-100 (= step-200, step-300)': the checkpoint and the other names of the same content (pure)."""
    return o.checkpoint + (f" (= {', '.join(o.also)})" if o.also else "")


def _suite_text(name: str, v: dict) -> str:
    """'gsm8k 4.10 [3.90, 4.31]' (a benchmark suite's tau with its CI)."""
    tau = "-" if v.get("tau") is None else f"{v['tau']:.2f}"
    return f"{name} {tau}" + (f" {fmt_ci(*v['ci'], 2)}" if v.get("ci") else "")


def outcome_text(o: Outcome) -> str:
    """'step-5000  tau 5.02 [4.61, 5.40] · Δ +0.69 [+0.41, +0.98] * vs step-4000 · 0.60x baseline   improved'."""
    if o.tau is None:
        where = f" on {o.host}" if o.host else ""
        return f"{named(o)}  {o.state.upper()}{where}" + (f" ({short(o.error)})" if o.error else "")
    head = f"tau {o.tau:.2f}" + (f" {fmt_ci(*o.tau_ci, 2)}" if o.tau_ci else "")
    parts = [head] + [_suite_text(name, v) for name, v in (o.suites or {}).items()]
    if o.prev_tau is not None:
        parts.append(_vs_text(o.vs_prev, f"{o.tau - o.prev_tau:+.2f} vs {o.prev_checkpoint}"
                              + (f" ({o.prev_note})" if o.prev_note else ""), o.prev_checkpoint))
    if o.base_ratio is not None:
        parts.append(f"{o.base_ratio:.2f}x baseline" + (f" ({o.base_note})" if o.base_note else ""))
    parts += [t for t in (speedup_text(o), online_text(o)) if t]
    return (f"{named(o)}  " + " · ".join(parts) + f"   {o.verdict}"
            + (f" ({o.verdict_note})" if o.verdict_note else "") + (" (earlier sweep)" if o.earlier else ""))


def speedup_text(o: Outcome) -> str:
    """'2.31x @64 proj.' (--speedup: the best projected speedup and its method), '' without (pure)."""
    sp = o.speedup or {}
    if sp.get("projected") is None:
        return ""
    method = (sp.get("method") or "").replace("ddtree_", "@")
    return f"{sp['projected']:.2f}x {method} proj.".replace("  ", " ")


def online_text(o: Outcome) -> str:
    """'online 1.85x (6/6 agree)' (--online: the measured speedup, the prompts whose every round agreed), ''
    without (pure)."""
    on = o.online
    if not on:
        return ""
    x = "-" if on.get("measured_speedup") is None else f"{on['measured_speedup']:.2f}x"
    agree = online_agreement(on)
    return f"online {x} ({agree})" if agree else f"online {x}"


def _suite_cell(v: dict | None) -> Cell:
    if not v or v.get("tau") is None:
        return Cell()
    cell = Cell(v["tau"], f"{v['tau']:.2f}")
    if v.get("ci"):
        cell.est = stats.Estimate(v["tau"], v["ci"][0], v["ci"][1], None, 2)
    return cell


def report_table(rep: SweepReport) -> Table:
    """One row per checkpoint: tau [CI], paired Δ vs the previous checkpoint and vs the baseline, verdicts."""
    base = rep.baseline or "baseline"
    cols = [Column("checkpoint", "checkpoint", digits=None), Column("step", "step", digits=None),
            Column("host", "host", digits=None), Column("tau", "tau", ranked=True)]
    suite_names = list(dict.fromkeys(n for o in rep.outcomes for n in (o.suites or {})))
    cols += [Column(f"suite:{n}", "tau · mean over suites" if n == "mean" else f"tau · {n}", ranked=True)
             for n in suite_names]
    cols += [
            Column("vs_prev", "vs previous\nΔ tau [95% CI]", digits=None),
            Column("vs_base", f"vs {base}\nratio · Δ tau [95% CI]", digits=None),
            Column("verdict", "verdict\n(vs previous)", digits=None),
            Column("base_verdict", f"vs {base}", digits=None)]
    if any(o.speedup for o in rep.outcomes):
        cols.append(Column("speedup", "speedup\n(proj.)", ranked=True))
    if any(o.online for o in rep.outcomes):
        cols.append(Column("online", "online\nspeedup · agree", digits=None))
    rows = []
    for o in rep.outcomes:
        prev = "" if o.prev_tau is None or o.tau is None else \
            _vs_text(o.vs_prev, f"{o.tau - o.prev_tau:+.2f}", None) + f" vs {o.prev_checkpoint}"
        vs_base = "" if o.base_ratio is None else f"{o.base_ratio:.2f}x" + (
            f" · {_vs_text(o.vs_base, '', None)}" if o.vs_base else "") + (f" ({o.base_note})" if o.base_note else "")
        tau = Cell(o.tau, "" if o.tau is None else f"{o.tau:.2f}")
        if o.tau_ci:
            tau.est = stats.Estimate(o.tau, o.tau_ci[0], o.tau_ci[1], None, 2)
        cells = {"checkpoint": Cell(o.checkpoint, named(o)), "step": Cell(o.step, "" if o.step is None
                                                                               else str(o.step)),
                 "host": Cell(o.host, o.host or ""), "tau": tau,
                 **{f"suite:{n}": _suite_cell((o.suites or {}).get(n)) for n in suite_names},
                 "vs_prev": Cell(o.vs_prev.delta if o.vs_prev else None, prev, pair=o.vs_prev),
                 "vs_base": Cell(o.base_ratio, vs_base, pair=o.vs_base),
                 "verdict": Cell(o.verdict, o.verdict + (f": {short(o.error)}" if o.error else "")
                                 + (f" ({o.verdict_note})" if o.verdict_note else "")
                                 + (" (earlier sweep)" if o.earlier else "")),
                 "base_verdict": Cell(o.base_verdict or None, o.base_verdict),
                 "speedup": Cell((o.speedup or {}).get("projected"), speedup_text(o).removesuffix(" proj.")),
                 "online": Cell((o.online or {}).get("measured_speedup"),
                                online_text(o).removeprefix("online "))}
        rows.append(Row(cells, [], rankable=o.tau is not None and not o.suspect))
    notes = [(f"improved / regressed: significant (*) and |Δ| >= --threshold {rep.threshold:g}; otherwise no "
              "clear change (the CI says what it cannot rule out)"),
             ("Δ paired by prompt; * = significant: the paired 95% CI excludes 0 and the sign-flip p < 0.05 (both; "
              "a p shown beside a Δ: the two disagree, so it is not called); tau in tokens per round incl. the "
              "bonus token")]
    if (note := detection_note(rep.outcomes, rep.threshold)) is not None:
        notes.append(note)
    notes += serving_notes(cols)
    notes += [f"host {h} left out: {why}" for h, why in rep.hosts_down.items()]
    return mark_best(Table(f"sweep {rep.sweep_id}", cols, rows, notes=notes))


PIPE_TABLE_WIDTH = 100  # a pipe (a log, cron mail) gets the table only when it fits this; else the lines


def print_report(rep: SweepReport, console) -> None:
    """The terminal report: the table and one line per checkpoint under it when the table fits the console's
    width (in a pipe: PIPE_TABLE_WIDTH); else only the title, one line per checkpoint and the table's notes,
    never a table squashed into '…' cells."""
    from ..render import formats
    table = report_table(rep)
    fits = formats.natural_width([table]) <= (console.width if console.is_terminal else PIPE_TABLE_WIDTH)
    if fits:
        formats.print_tables([table], console)
    else:
        console.print(printable(table.title), markup=False, highlight=False)
    for o in rep.outcomes:  # a suite's name and a host's error as they are written, never obeyed
        console.print(printable(outcome_text(o)), markup=False)
    if not fits:
        for note in table.notes:
            console.print(printable(note), markup=False, style="dim")


def write_report_files(rep: SweepReport) -> None:
    """report.md, report.json, plots.png (with the tau-vs-step curve) and report.html in the sweep dir."""
    from ..render import formats, html, plots, plotworker
    md = formats.render_markdown([report_table(rep)])
    md += "\n" + "\n".join(f"- {outcome_text(o)}" for o in rep.outcomes) + "\n"
    protocol.atomic_write_text(rep.sweep_dir / "report.md", md)
    rep.files["markdown"] = str(rep.sweep_dir / "report.md")
    paths = [o.local_path for o in rep.outcomes if o.local_path and o.state == protocol.SUCCEEDED]
    loaded = rep.loaded or LoadedRuns()
    recs = [r for r in map(loaded.get, paths) if r is not None]
    cmp = compare.build_comparison(recs, rep.baseline_run)
    for p, r in zip(paths, map(loaded.get, paths)):  # the intervals the sweep computed as each run was pulled
        if r is not None:
            cmp.use_estimates(r, loaded.estimates(p))
    base_pt = None
    if rep.baseline_run is not None and rep.baseline_run.result is not None:
        est = cmp.estimates(rep.baseline_run).get("tau")
        why = sorted({o.base_note for o in rep.outcomes if o.base_note and o.base_note.startswith("not comparable")})
        base_pt = (cmp.label(rep.baseline_run) + (f" — {why[0].upper()}" if why else ""),
                   rep.baseline_run.result.metrics.tau, est.lo if est else None, est.hi if est else None)
    png = Path(rep.sweep_dir) / "plots.png"
    # plots.png drawn by the plot worker (a second process, started during the sweep) while report.html's
    # figures are drawn here; without one (or when it fails) drawn here too, the same file
    worker = plotworker.shared() if recs else None
    pending = worker.start("save_comparison_plot", cmp, png.absolute(), rep.history, base_pt) if worker else None
    try:
        text = html.render_report(f"reval sweep {rep.sweep_id}", cmp, threshold=rep.threshold,
                                  sweep_table=report_table(rep), steps=rep.history, baseline_point=base_pt)
    finally:
        drawn = pending.result() if pending else None
    if recs:
        rep.files["plot"] = str(png if drawn else plots.save_comparison_plot(cmp, png, rep.history, base_pt))
    rep.files["html"] = str(html.write_report(text, Path(rep.sweep_dir) / "report.html"))
    rep.files["json"] = str(rep.sweep_dir / "report.json")
    protocol.atomic_write_json(rep.sweep_dir / "report.json", report_json(rep))
