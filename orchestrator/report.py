"""Render comparison `Table`s (compare.py): rich (best in bold), markdown (best as **x**), csv, json;
and the one-line summary of a single result. Pure string builders except `print_tables`."""
from __future__ import annotations

import csv
import io
import json

from rich import box
from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from remote_payload.results import Result

from .compare import Cell, Column, Table


def summary_line(result: Result | dict) -> str:
    """'tau 8.37 · streak 7.37 · DDTree-512 12.38 · width-8 11.90 · position-1 accuracy 0.920 · 300 blocks,
    10 prompts' (+ SUSPECT and its reasons) for one results.json (a Result, or the file's dict)."""
    if isinstance(result, dict):
        result = Result.from_dict(result)
    m = result.metrics
    parts = []
    if m.tau is not None:
        parts.append(f"tau {m.tau:.2f}")
    if m.streak is not None:
        parts.append(f"streak {m.streak:.2f}")
    if m.ddtree_best is not None:
        parts.append(f"DDTree-{m.ddtree_best.budget} {m.ddtree_best.tau:.2f}")
    widths = {w: v for w, v in m.tree_width_tau.items() if v is not None}
    if widths:
        w = max(widths, key=int)
        parts.append(f"width-{w} {widths[w]:.2f}")
    if m.position_1_accuracy is not None:
        parts.append(f"position-1 accuracy {m.position_1_accuracy:.3f}")
    parts.append(f"{m.num_rounds} blocks, {m.num_prompts} prompts")
    if result.health.suspect:
        reasons = "; ".join(result.health.reasons)
        parts.append("SUSPECT" + (f" ({reasons})" if reasons else ""))
    return " · ".join(parts)


def vs_text(cell: Cell, col: Column) -> str:
    """'0.45x (-4.04)' for a cell compared with the baseline, '' otherwise."""
    if cell.delta is None:
        return ""
    ratio = f"{cell.ratio:.2f}x " if cell.ratio is not None else ""
    return f"{ratio}({cell.delta:+.{col.digits or 0}f})"


def cell_lines(cell: Cell, col: Column) -> str:
    """The terminal cell: the value, then ratio and delta on their own lines (keeps columns narrow)."""
    if cell.delta is None:
        return cell.text
    ratio = f"{cell.ratio:.2f}x" if cell.ratio is not None else "-"
    return f"{cell.text}\n{ratio}\n{cell.delta:+.{col.digits or 0}f}"


def rich_table(table: Table) -> RichTable:
    t = RichTable(title=table.title, title_justify="left", caption=" · ".join(table.notes) or None,
                  caption_justify="left", box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False,
                  show_lines=any(c.delta is not None for r in table.rows for c in r.cells.values()))
    for i, col in enumerate(table.columns):
        t.add_column(col.label, justify="left" if col.digits is None else "right", no_wrap=i == 0,
                     overflow="fold")
    for row in table.rows:
        cells = []
        for col in table.columns:
            c = row.cells.get(col.key, Cell())
            cells.append(Text(cell_lines(c, col), style="bold" if c.best else ""))
        t.add_row(*cells)
    return t


def render_text(tables: list[Table], width: int = 160) -> str:
    """Tables rendered by rich to plain text at a fixed width (no colour, no bold): tests and logs."""
    con = Console(width=width, file=io.StringIO(), color_system=None, force_terminal=False, record=True)
    for t in tables:
        con.print(rich_table(t))
    return con.export_text()


def print_tables(tables: list[Table], console: Console | None = None) -> None:
    """Print at least at each table's natural width: squeezed into 80 columns (a pipe, a narrow terminal)
    rich would break every number into a column of single characters."""
    own = console is None
    console = console or Console()
    for t in tables:
        rt = rich_table(t)
        if own:
            natural = Console(width=400).measure(rt).maximum
            console.width = max(console.width, min(natural, 400))
        console.print(rt)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render_markdown(tables: list[Table]) -> str:
    """GitHub markdown: one table per `Table`, best values as **x**, notes as a line below."""
    out = []
    for table in tables:
        out.append(f"### {table.title}\n")
        out.append("| " + " | ".join(_md_escape(c.label) for c in table.columns) + " |")  # \n -> space
        out.append("|" + "|".join("---" if c.digits is None else "---:" for c in table.columns) + "|")
        for row in table.rows:
            cells = []
            for col in table.columns:
                c = row.cells.get(col.key, Cell())
                text = _md_escape(c.text)
                if c.best and text:
                    text = f"**{text}**"
                vs = vs_text(c, col)
                cells.append(text + (f" · {vs}" if vs else ""))
            out.append("| " + " | ".join(cells) + " |")
        out += [""] + [f"_{_md_escape(n)}_" for n in table.notes] + [""]
    return "\n".join(out).rstrip() + "\n"


def render_csv(tables: list[Table]) -> str:
    """Raw values (no formatting); with a baseline, `<key>_ratio` and `<key>_delta` columns; a `marks` column.
    Several tables are separated by a blank line, each with its own header."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for i, table in enumerate(tables):
        if i:
            buf.write("\n")
        has_vs = {c.key for c in table.columns for r in table.rows if r.cells.get(c.key, Cell()).delta is not None}
        header = []
        for c in table.columns:
            header.append(c.key)
            if c.key in has_vs:
                header += [f"{c.key}_ratio", f"{c.key}_delta"]
        w.writerow(header + ["marks"])
        for row in table.rows:
            vals = []
            for c in table.columns:
                cell = row.cells.get(c.key, Cell())
                vals.append("" if cell.value is None else cell.value)
                if c.key in has_vs:
                    vals += ["" if cell.ratio is None else round(cell.ratio, 6),
                             "" if cell.delta is None else round(cell.delta, 6)]
            w.writerow(vals + [";".join(row.marks)])
    return buf.getvalue()


def render_json(obj: dict) -> str:
    return json.dumps(obj, indent=2, default=str) + "\n"
