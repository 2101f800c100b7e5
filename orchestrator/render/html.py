"""The HTML report: one self-contained file (inline CSS, plots as inline SVG, no script, nothing fetched at
view time) with the comparison table (95% intervals, paired differences, marks), for sweeps the verdicts and
tau against training step, per-position acceptance (both conventions), acceptance-length histograms, DDTree
tau against budget, a per-prompt table, every metric's definition (from results.json) and each run's
provenance. `reval compare ... --html FILE` and every sweep (`sweeps/<id>/report.html`) write it."""
from __future__ import annotations

import html
import time
from pathlib import Path

from remote_payload import __version__
from remote_payload.contract import protocol

from ..results.compare import ComparedRuns, run_duration_s
from ..words import printable
from . import plots, speedup, suites, tables
from .formats import ci_text, visible_columns
from .tables import Cell, Table, format_duration

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;padding:16px 24px;
color:#1d2330;background:#fff}p.note,figcaption{max-width:110ch}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d8dde6}
nav a{margin-right:12px}table{border-collapse:collapse;margin:8px 0}.scroll{overflow-x:auto;max-width:100%}
th,td{padding:3px 8px;border-bottom:1px solid #e4e7ee;text-align:right;vertical-align:top;white-space:nowrap}
th{background:#f3f5f9;font-weight:600}td.text,th.text{text-align:left}
.ci{color:#5b6475;font-size:12px;display:block}.sig{color:#0a7d32;font-weight:600}
.marks{color:#b3261e;font-size:12px}.note{color:#5b6475;font-size:13px;margin:2px 0}
figure{margin:8px 0;display:inline-block;vertical-align:top}figure svg{max-width:100%;height:auto}
dl{display:grid;grid-template-columns:max-content 1fr;gap:4px 16px}dt{font-family:monospace}dd{margin:0}
.better{color:#0a7d32;font-weight:600}.worse{color:#b3261e;font-weight:600;text-decoration:underline dotted}
.word{font-size:11px;font-weight:400;text-transform:uppercase;letter-spacing:.04em}
"""
LEGEND = "▲ better / ▼ worse: a starred Δ, a change the data supports; no arrow: no clear change either way"
# direction of a supported change: every paired number (tau, DDTree, width-k, position accuracy) is higher-better
DIRECTION = {True: ("better", "▲"), False: ("worse", "▼")}
VERDICT_DIRECTION = {"improved": True, "regressed": False}
SECTIONS = ("comparison", "per-position", "histogram", "ddtree", "per-prompt", "definitions", "provenance")
SWEEP_SECTIONS = ("sweep", "tau-vs-step")


def e(x) -> str:
    """Text for the page: its control characters escaped (a name's ESC is no HTML5 character), then HTML's."""
    return html.escape(printable(x, "\n"), quote=True)


def _cell_html(cell: Cell, col) -> str:
    text = e(cell.text)
    if cell.best and text:
        text = f"<strong>{text}</strong>"
    if cell.pair is not None and cell.pair.significant and " *" in cell.text:  # the starred Δ
        word, arrow = DIRECTION[cell.pair.delta > 0]
        text = f'<span class="sig {word}">{arrow} {text} <span class="word">{word}</span></span>'
    if col.key in ("verdict", "base_verdict") and cell.value:
        verdict = str(cell.value)
        word, arrow = DIRECTION.get(VERDICT_DIRECTION.get(verdict), ("", ""))
        text = (f'<span class="verdict-{e(verdict.replace(" ", "-"))}{" " + word if word else ""}">'
                f'{arrow + " " if arrow else ""}{text}</span>')
    ci = ci_text(cell, col)
    return text + (f'<span class="ci">{e(ci)}</span>' if ci else "")


def table_html(table: Table, wide: bool = True) -> str:
    cols = visible_columns(table, wide)
    head = "".join(f'<th class="{"text" if c.digits is None else "num"}">{e(c.label).replace(chr(10), "<br>")}</th>'
                   for c in cols)
    body = []
    for row in table.rows:
        tds = "".join(f'<td class="{"text" if c.digits is None else "num"}">'
                      f'{_cell_html(row.cells.get(c.key, Cell()), c)}</td>' for c in cols)
        body.append(f"<tr>{tds}</tr>")
    notes = "".join(f'<p class="note">{e(n)}</p>' for n in table.notes)
    return (f"<h3>{e(table.title)}</h3><div class=\"scroll\"><table><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table></div>{notes}")


def _section(sid: str, title: str, content: str) -> str:
    return f'<section id="{sid}"><h2>{e(title)}</h2>{content}</section>'


def _figure(svg: str, caption: str) -> str:
    return f'<figure class="plot">{svg}<figcaption class="note">{e(caption)}</figcaption></figure>'


def definitions_html(cmp: ComparedRuns) -> str:
    seen: dict[str, str] = {}
    for r in cmp.runs:
        if r.result is not None:
            for k, v in r.result.definitions.items():
                seen.setdefault(k, v)
    items = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in seen.items())
    return f'<p class="note">From the runs\' results.json (`definitions`).</p><dl>{items}</dl>'


def provenance_table(cmp: ComparedRuns) -> Table:
    cols = [tables.Column(k, label, digits=None) for k, label in (
        ("run", "run"), ("host", "host"), ("gpu", "GPU"), ("drafter", "drafter (path)"),
        ("hash", "checkpoint content hash"), ("cache", "cache fingerprint"), ("attention", "drafter attention"),
        ("payload", "payload version"), ("created", "created (UTC)"), ("load", "load (weights)"),
        ("eval", "eval (drafting + walks)"), ("payload_s", "payload run"), ("wall", "wall (the run)"))]
    rows = []
    for r in cmp.runs:
        res = r.result
        if res is None:
            rows.append(tables.Row({"run": Cell(cmp.label(r), cmp.label(r)), "host": Cell(r.host, r.host),
                                    "gpu": Cell(None, r.state)}))
            continue
        t = res.timing
        vals = {"run": cmp.label(r), "host": f"{r.host} ({res.environment.hostname})",
                "gpu": res.environment.gpu or f"none ({res.options.device})", "drafter": res.drafter.path,
                "hash": res.drafter.content_hash, "cache": res.cache.fingerprint,
                "attention": res.comparability.attention or "not recorded",
                "payload": res.environment.payload_version or "?", "created": res.created_at,
                "load": format_duration(t.load_s), "eval": format_duration(t.eval_s),
                "payload_s": format_duration(t.total_s), "wall": format_duration(run_duration_s(r))}
        rows.append(tables.Row({k: Cell(v, str(v)) for k, v in vals.items()}))
    return Table("provenance", cols, rows, notes=[(
        "durations: load = reading the drafter and the target head; eval = drafting at every anchor and the "
        "walks; payload run = the payload's whole run (results.json timing.total_s: load, eval and the rest); "
        "wall = the run from its start to its end (status.json), the duration every other table and line "
        "shows")])


def render_report(title: str, cmp: ComparedRuns, *, threshold: float = 0.1, sweep_table: Table | None = None,
                  steps: list[tables.StepPoint] | None = None, baseline_point=None,
                  extra_notes: list[str] = ()) -> str:
    """The report as one HTML string (valid HTML5, no external resource)."""
    parts = []
    if sweep_table is not None:
        parts.append(_section("sweep", "sweep: every checkpoint", table_html(sweep_table)
                              + "".join(f'<p class="note">{e(n)}</p>' for n in [LEGEND, *extra_notes])))
        parts.append(_section("tau-vs-step", "tau against training step",
                              _figure(plots.tau_vs_step_svg(steps or [], baseline_point),
                                      "every checkpoint the ledger holds for this cache and these options; "
                                      "filled: this sweep; band: 95% CI; dashed: the baseline")))
    paired = tables.paired_table(cmp, threshold)
    parts.append(_section("comparison", "comparison", table_html(tables.main_table(cmp, threshold))
                          + (table_html(paired) + f'<p class="note">{e(LEGEND)}</p>' if paired else "")))
    if suites.suite_names(cmp.runs):  # runs over several benchmark suites: the papers' layout
        paired_suites = suites.suite_paired_table(cmp)
        parts.append(_section("suites", "tau by suite", table_html(suites.suite_table(cmp))
                              + (table_html(paired_suites) if paired_suites else "")))
    batch = speedup.batch_table(cmp)
    if batch is not None:  # --speedup measured per batch: the table and one plot per method
        curves = speedup.series(cmp)
        methods = list(dict.fromkeys(c.method for c in curves))
        parts.append(_section("speedup", "projected speedup by batch size", table_html(batch) + "".join(
            _figure(plots.speedup_vs_batch_svg([c for c in curves if c.method == m], m),
                    f"{speedup.method_name(m)}: projected speedup against batch size per run; band: the latencies' "
                    "quartiles (worst..best case); dashed: 1x, below it speculation stops paying")
            for m in methods)))
    parts.append(_section("per-position", "per-position acceptance (both conventions)",
                          _figure(plots.panel_svg(cmp, "per_position_unconditional"), "#(acc>=k)/#rounds")
                          + _figure(plots.panel_svg(cmp, "per_position_conditional"), "#(acc>=k)/#(acc>=k-1)")))
    parts.append(_section("histogram", "acceptance-length histogram",
                          _figure(plots.panel_svg(cmp, "histogram"), "rounds by tokens accepted (incl. bonus)")))
    parts.append(_section("ddtree", "DDTree tau against budget",
                          _figure(plots.panel_svg(cmp, "ddtree"), "tau of the DDTree walk per node budget")))
    parts.append(_section("per-prompt", "per prompt", table_html(tables.per_prompt_table(cmp))))
    parts.append(_section("definitions", "definitions", definitions_html(cmp)))
    parts.append(_section("provenance", "provenance", table_html(provenance_table(cmp))))
    ids = (SWEEP_SECTIONS if sweep_table is not None else ()) + SECTIONS[:1] + (
        ("speedup",) if batch is not None else ()) + SECTIONS[1:]
    nav = "".join(f'<a href="#{s}">{e(s)}</a>' for s in ids)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{e(title)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>{e(title)}</h1><p class=\"note\">reval {e(__version__)} · {e(stamp)}</p></header>"
            f"<nav>{nav}</nav>{''.join(parts)}</body></html>\n")


def write_report(text: str, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    protocol.atomic_write_text(path, text)
    return path


def write_comparison_report(cmp: ComparedRuns, path: str | Path, *, threshold: float = 0.1) -> Path:
    names = ", ".join(cmp.label(r) for r in cmp.runs)
    return write_report(render_report(f"reval compare: {names}", cmp, threshold=threshold), path)
