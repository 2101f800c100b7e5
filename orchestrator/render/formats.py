"""Render comparison `Table`s (compare.py): rich (best in bold), markdown (best as **x**), csv, json;
and the one-line summary of a single result. Pure string builders except `print_tables`. Every text a table
holds (a prompt, suite or run name among them) is shown with its control characters escaped (words.printable),
and a CSV cell that a spreadsheet would take for a formula is neutralised (csv_cell)."""
from __future__ import annotations

import csv
import io
import json
import math
import sys

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable
from rich.text import Text

from remote_payload.contract import results as results_json

from ..results import intervals
from ..words import printable
from .tables import Cell, Column, Table, fmt_ci, shorten


def summary_line(result: results_json.Result | dict) -> str:
    """'tau 8.37 [7.91, 8.80] · streak 7.37 · DDTree-512 12.38 [11.9, 12.8] · width-8 11.90 [...] · position-1
    accuracy 0.920 [0.901, 0.938] · 300 blocks, 10 prompts' (+ SUSPECT and its reasons) for one results.json (a
    results_json.Result, or the file's dict). The brackets: 95% bootstrap intervals over prompts
    (intervals.py), shown where two prompts or more rebuild the number shown (intervals.estimates: a damaged
    or hand-edited file gets none rather than one around another number)."""
    if isinstance(result, dict):
        result = results_json.Result.from_dict(result)
    m = result.metrics
    widths = {w: v for w, v in m.tree_width_tau.items() if v is not None}
    w = max(widths, key=int) if widths else None
    est = intervals.estimates(result, keys={"tau", "ddtree_best", f"width_{w}", "pos1_acc"})

    def ci(key: str, digits: int) -> str:
        e = est.get(key)
        return " " + fmt_ci(e.lo, e.hi, digits) if e is not None and e.n >= 2 else ""
    parts = []
    if m.tau is not None:
        parts.append(f"tau {m.tau:.2f}{ci('tau', 2)}")
    if m.streak is not None:
        parts.append(f"streak {m.streak:.2f}")
    if m.ddtree_best is not None:
        parts.append(f"DDTree-{m.ddtree_best.budget} {m.ddtree_best.tau:.2f}{ci('ddtree_best', 2)}")
    if w is not None:
        parts.append(f"width-{w} {widths[w]:.2f}{ci(f'width_{w}', 2)}")
    if m.position_1_accuracy is not None:
        parts.append(f"position-1 accuracy {m.position_1_accuracy:.3f}{ci('pos1_acc', 3)}")
    parts.append(f"{m.num_rounds} blocks, {m.num_prompts} prompts")
    if result.health.suspect:
        reasons = "; ".join(result.health.reasons)
        parts.append("SUSPECT" + (f" ({reasons})" if reasons else ""))
    return " · ".join(parts)


def ci_text(cell: Cell, col: Column) -> str:
    """'[7.91, 8.80]' when the cell has a bootstrap interval over more than one prompt."""
    e = cell.est
    if e is None or e.n < 2 or col.digits is None:
        return ""
    return fmt_ci(e.lo, e.hi, col.digits)


def cell_lines(cell: Cell, col: Column, wide: bool = False) -> str:
    """The terminal cell: the value, and its 95% interval on the line below (keeps columns narrow)."""
    if col.key == "run" and not wide and isinstance(cell.value, str) and cell.text.startswith(cell.value):
        # the name shortened, the marks kept
        return shorten(printable(cell.value)) + printable(cell.text[len(cell.value):])
    ci = ci_text(cell, col)
    return f"{printable(cell.text)}\n{ci}" if ci else printable(cell.text)


def visible_columns(table: Table, wide: bool) -> list[Column]:
    return [c for c in table.columns if wide or c.headline]


def rich_table(table: Table, wide: bool = False, whole_names: bool = False) -> RichTable:
    """`whole_names`: run names whole (a pipe), else shortened in the middle unless `wide`."""
    t = RichTable(title=escape(printable(table.title)), title_justify="left",
                  caption=escape("\n".join(map(printable, table.notes))) or None,
                  caption_justify="left", box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False,
                  show_lines=any(c.est is not None and c.est.n > 1 for r in table.rows for c in r.cells.values()))
    for col in visible_columns(table, wide):
        t.add_column(escape(printable(col.label, "\n")), justify="left" if col.digits is None else "right",
                     no_wrap=True, overflow="ellipsis" if col.key == "run" else "fold")
    for row in table.rows:
        cells = []
        for col in visible_columns(table, wide):
            c = row.cells.get(col.key, Cell())
            cells.append(Text(cell_lines(c, col, wide or whole_names), style="bold" if c.best else ""))
        t.add_row(*cells)
    return t


PIPE_WIDTH = 4096  # a listing in a pipe (grep, a file, cron mail) is never cut to 80 columns ("UNREACH…")


def listing_console(**kw) -> Console:
    """A Console for listings on stdout: the terminal's width on a terminal; in a pipe, wide enough for whole
    cells."""
    return Console(width=None if sys.stdout.isatty() else PIPE_WIDTH, **kw)


def natural_width(tables: list[Table], wide: bool = False, whole_names: bool = False) -> int:
    probe = Console(width=1000)
    return max((probe.measure(rich_table(t, wide, whole_names)).maximum for t in tables), default=80)


def print_tables(tables: list[Table], console: Console | None = None, wide: bool = False) -> None:
    """In a terminal: the terminal's width (the default columns fit 100; --wide may need more: then the
    tables' natural width, never squeezed). In a pipe: the tables' natural width, not 80, run names whole."""
    own = console is None
    console = console or Console()
    whole = not console.is_terminal
    if own:
        natural = min(natural_width(tables, wide, whole), 1000)
        console.width = max(console.width, natural) if console.is_terminal else natural
    for t in tables:
        console.print(rich_table(t, wide, whole_names=whole))


def _md_escape(s: str) -> str:
    return printable(s, "\n").replace("|", "\\|").replace("\n", " ")


def render_markdown(tables: list[Table], wide: bool = True) -> str:
    """GitHub markdown: one table per `Table`, best values as **x**, intervals after the value, notes below."""
    out = []
    for table in tables:
        cols = visible_columns(table, wide)
        out.append(f"### {table.title}\n")
        out.append("| " + " | ".join(_md_escape(c.label) for c in cols) + " |")  # \n -> space
        out.append("|" + "|".join("---" if c.digits is None else "---:" for c in cols) + "|")
        for row in table.rows:
            cells = []
            for col in cols:
                c = row.cells.get(col.key, Cell())
                text = _md_escape(c.text)
                if c.best and text:
                    text = f"**{text}**"
                ci = ci_text(c, col)
                cells.append(text + (f" {ci}" if ci else ""))
            out.append("| " + " | ".join(cells) + " |")
        out += [""] + [f"_{_md_escape(n)}_" for n in table.notes] + [""]
    return "\n".join(out).rstrip() + "\n"


def _has(table: Table, key: str, what: str) -> bool:
    return any(getattr(r.cells.get(key, Cell()), what) is not None for r in table.rows)


def _r(x: float | None) -> str | float:
    return "" if x is None else round(x, 6)


FORMULA_LEADS = ("=", "+", "-", "@")  # what a spreadsheet takes for a formula (=HYPERLINK(...), @SUM(...))


def csv_cell(value):
    """A CSV cell as a spreadsheet will open it (pure): a number as it is; a text with its control characters
    escaped (printable) and, when it would start a formula (=, +, -, @ first, also after spaces, tabs or line
    breaks), behind a `'`, so that it is read as text (OWASP's advice on CSV injection)."""
    if not isinstance(value, str):
        return value
    text = printable(value)
    return "'" + text if value.lstrip(" \t\r\n").startswith(FORMULA_LEADS) else text


def render_csv(tables: list[Table]) -> str:
    """Raw values (no formatting), every column; intervals as `<key>_lo/_hi/_sd/_n`; with a baseline
    `<key>_ratio`, `<key>_delta` and the paired `<key>_delta_lo/_delta_hi/_ratio_lo/_ratio_hi/_p`; a `marks`
    column. Several tables are separated by a blank line, each with its own header. Every text cell (the
    header's too: a suite's name is in it) goes through csv_cell."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for i, table in enumerate(tables):
        if i:
            buf.write("\n")
        has = {(c.key, what): _has(table, c.key, what) for c in table.columns for what in ("est", "delta", "pair")}
        header = []
        for c in table.columns:
            header.append(c.key)
            if has[c.key, "est"]:
                header += [f"{c.key}_lo", f"{c.key}_hi", f"{c.key}_sd", f"{c.key}_n"]
            if has[c.key, "delta"]:
                header += [f"{c.key}_ratio", f"{c.key}_delta"]
            if has[c.key, "pair"]:
                header += [f"{c.key}_delta_lo", f"{c.key}_delta_hi", f"{c.key}_ratio_lo", f"{c.key}_ratio_hi",
                           f"{c.key}_p"]
        w.writerow([csv_cell(h) for h in header + ["marks"]])
        for row in table.rows:
            vals = []
            for c in table.columns:
                cell = row.cells.get(c.key, Cell())
                vals.append("" if cell.value is None else cell.value)
                if has[c.key, "est"]:
                    e = cell.est
                    vals += ["", "", "", ""] if e is None else [_r(e.lo), _r(e.hi), _r(e.sd), e.n]
                if has[c.key, "delta"]:
                    vals += [_r(cell.ratio), _r(cell.delta)]
                if has[c.key, "pair"]:
                    p = cell.pair
                    vals += [""] * 5 if p is None else [_r(p.delta_lo), _r(p.delta_hi), _r(p.ratio_lo),
                                                        _r(p.ratio_hi), _r(p.p_value)]
            w.writerow([csv_cell(v) for v in vals + [";".join(row.marks)]])
    return buf.getvalue()


def _finite(v):
    """NaN / Infinity (bare NaN is no JSON) as null, all the way down."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def render_json(obj: dict) -> str:
    return json.dumps(_finite(obj), indent=2, default=str, allow_nan=False) + "\n"
