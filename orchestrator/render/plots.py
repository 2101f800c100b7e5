"""Plots of a comparison (matplotlib, Agg, no pyplot global state): per-position acceptance (both conventions),
the acceptance-length histogram, tau against DDTree budget, and for sweeps tau against training step with
its 95% CI band and the baseline as a line. `--plot` writes .png, .svg or .pdf; the HTML report inlines SVG."""
from __future__ import annotations

import io
import re
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from matplotlib.path import Path as MplPath
from matplotlib.ticker import FuncFormatter

from ..errors import ConfigError
from ..results.compare import ComparedRuns
from ..words import printable
from .tables import StepPoint

FORMATS = (".png", ".svg", ".pdf")
PANELS = ("per_position_unconditional", "per_position_conditional", "histogram", "ddtree")


def _runs(cmp: ComparedRuns):
    for r in cmp.runs:
        if r.result is None:
            continue
        label = printable(cmp.label(r)) + ("" if cmp.rankable(r) or r is cmp.baseline else " (not ranked)")
        style = {"linestyle": "--" if r.suspect or cmp.incomparable(r) else "-",
                 "linewidth": 2.5 if r is cmp.baseline else 1.6, "marker": "o", "markersize": 3}
        yield r, label, style


def draw_panel(ax, cmp: ComparedRuns, panel: str) -> None:
    for r, label, style in _runs(cmp):
        m = r.result.metrics
        if panel in ("per_position_unconditional", "per_position_conditional"):
            acc = getattr(m, panel.replace("per_position", "per_position_acceptance"))
            ax.plot(range(1, len(acc) + 1), [float("nan") if a is None else a for a in acc], label=label, **style)
        elif panel == "histogram":
            hist = m.acceptance_histogram
            total = sum(hist) or 1
            ax.plot(range(len(hist)), [h / total for h in hist], label=label, drawstyle="steps-mid",
                    **{k: v for k, v in style.items() if k != "marker"})
        else:
            tree = sorted((int(b), t) for b, t in m.ddtree_tau.items() if t is not None)
            ax.plot([b for b, _ in tree], [t for _, t in tree], label=label, **style)
    titles = {"per_position_unconditional": ("per-position acceptance  #(acc>=k)/#rounds", "draft position k",
                                             "fraction of rounds"),
              "per_position_conditional": ("per-position acceptance  #(acc>=k)/#(acc>=k-1)", "draft position k",
                                           "fraction of rounds reaching k-1"),
              "histogram": ("acceptance length (incl. bonus)", "tokens accepted per round", "fraction of rounds"),
              "ddtree": ("DDTree tau vs node budget", "budget B (nodes)", "tau (tokens per round incl. bonus)")}
    title, xl, yl = titles[panel]
    ax.set(title=title, xlabel=xl, ylabel=yl)
    if panel.startswith("per_position"):
        ax.set_ylim(0, 1.02)
    if panel == "ddtree":
        ax.set_xscale("log", base=2)
        # budgets as written everywhere else (16, 512; not 2^4 as mathtext: ~40% of this panel's drawing)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.grid(alpha=0.3)
    legend_clear_of_data(ax)


def draw_tau_vs_step(ax, points: list[StepPoint], baseline: tuple[str, float, float | None, float | None] | None
                     ) -> None:
    """tau against training step with its 95% CI band; tonight's checkpoints filled, earlier ones hollow."""
    suites = list(dict.fromkeys(p.suite for p in points if p.suite))
    for i, name in enumerate(suites):  # a suite sweep: one curve per suite, and the mean (markers below)
        if name == "mean":
            continue
        _curve(ax, [p for p in points if p.suite == name and not p.suspect], f"C{i + 4}",
               f"{printable(name)} (95% CI band)", 1.0)
    if suites:
        points = [p for p in points if p.suite == "mean"]
    marked = sorted((p for p in points if p.suspect), key=lambda p: p.step)
    pts = sorted((p for p in points if not p.suspect), key=lambda p: p.step)
    xs = [p.step for p in pts]
    if marked:  # off the curve, never dropped
        ax.scatter([p.step for p in marked], [p.tau for p in marked], marker="x", color="C3", zorder=4, s=40,
                   label="suspect (not in the curve): " + ", ".join(p.name for p in marked))
    if pts:
        ax.plot(xs, [p.tau for p in pts], color="C0", linewidth=2.0 if suites else 1.5,
                label="mean over suites (95% CI band)" if suites else "tau (95% CI band)")
        band = [(p.step, p.lo, p.hi) for p in pts if p.lo is not None]
        if band:
            ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], color="C0", alpha=0.2)
        for tonight, kw in ((False, {"facecolors": "white", "label": "earlier sweeps"}),
                            (True, {"facecolors": "C0", "label": "this sweep"})):
            sel = [p for p in pts if p.tonight == tonight]
            if sel:
                ax.scatter([p.step for p in sel], [p.tau for p in sel], edgecolors="C0", zorder=3, s=28, **kw)
    if baseline is not None:
        name, tau, lo, hi = baseline
        off = "NOT COMPARABLE" in name  # drawn, but grey and said: never a silent reference line
        color = "0.5" if off else "C3"
        ax.axhline(tau, color=color, linestyle=":" if off else "--", linewidth=1.5, label=f"baseline {name}")
        if lo is not None:
            ax.axhspan(lo, hi, color=color, alpha=0.08)
    ax.set(title="tau vs training step", xlabel="training step", ylabel="tau (tokens per round incl. bonus)")
    ax.grid(alpha=0.3)
    legend_clear_of_data(ax)


LEGEND_PLACES = ("upper right", "upper left", "lower right", "lower left", "center right", "center left",
                 "upper center", "lower center", "center")


def _data_paths(ax) -> list[tuple[MplPath, bool]]:
    """What the axes shows as data, in display coordinates: (path, filled) per line (a baseline's too), per
    marker and per band."""
    out = []
    for line in ax.lines:
        xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
        xy = xy[np.isfinite(xy).all(axis=1)]
        if len(xy):
            out.append((MplPath(xy), False))
            if line.get_marker() not in (None, "None", ""):
                out += [(MplPath.circle(tuple(p), 3), True) for p in xy]
    for coll in ax.collections:
        if isinstance(coll, PathCollection):  # a scatter: its markers
            out += [(MplPath.circle(tuple(p), 4), True) for p in coll.get_offset_transform().transform(
                coll.get_offsets())]
        else:  # a band (fill_between)
            out += [(p.transformed(coll.get_transform()), True) for p in coll.get_paths()]
    return out


def _covers(legend, paths, renderer) -> bool:
    box = legend.get_window_extent(renderer)
    return any(p.intersects_bbox(box, filled=filled) for p, filled in paths)


def legend_clear_of_data(ax) -> None:
    """The legend where it covers no curve, marker or band: the first place of LEGEND_PLACES that is clear;
    when none is, the y axis grows at the top by the legend's height and it goes there (pure drawing)."""
    if not ax.get_legend_handles_labels()[0]:
        return
    renderer = ax.figure.canvas.get_renderer()
    paths = _data_paths(ax)
    for place in LEGEND_PLACES:
        legend = ax.legend(fontsize=8, loc=place)
        if not _covers(legend, paths, renderer):
            return
    legend = ax.legend(fontsize=8, loc="upper right")
    share = min(0.8, (legend.get_window_extent(renderer).height + 6) / ax.bbox.height)
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + (hi - lo) * share / (1 - share))


def _curve(ax, pts: list[StepPoint], color: str, label: str, width: float) -> None:
    pts = sorted(pts, key=lambda p: p.step)
    if not pts:
        return
    ax.plot([p.step for p in pts], [p.tau for p in pts], color=color, linewidth=width, marker=".", label=label)
    band = [(p.step, p.lo, p.hi) for p in pts if p.lo is not None]
    if band:
        ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], color=color, alpha=0.12)


# Fixed margins (inches) instead of constrained layout: the labels' room is known (titles above, tick labels and
# an axis label left and below), and constrained layout measured every text twice per figure (~40% of drawing
# the report's figures). tests/test_plots.py checks that nothing drawn leaves its figure or meets a neighbour.
MARGIN_IN = {"left": 0.75, "right": 0.2, "bottom": 0.5, "top": 0.32, "between": 1.05}


def _figure(width: float, height: float, panels: int = 1) -> Figure:
    """A figure of `panels` axes side by side (fig.axes), with fixed margins (MARGIN_IN)."""
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    m = MARGIN_IN
    axes_w = (width - m["left"] - m["right"] - (panels - 1) * m["between"]) / panels
    fig.subplots(1, panels, squeeze=False, gridspec_kw={
        "left": m["left"] / width, "right": 1 - m["right"] / width, "bottom": m["bottom"] / height,
        "top": 1 - m["top"] / height, "wspace": m["between"] / axes_w})
    return fig


def comparison_figure(cmp: ComparedRuns, steps: list[StepPoint] | None = None, baseline=None) -> Figure:
    """One figure: the four comparison panels, and the tau-vs-step curve first when `steps` is given."""
    n = len(PANELS) + (1 if steps is not None else 0)
    fig = _figure(4.2 * n, 4.6, n)
    axes = list(fig.axes)
    if steps is not None:
        draw_tau_vs_step(axes.pop(0), steps, baseline)
    for ax, panel in zip(axes, PANELS):
        draw_panel(ax, cmp, panel)
    return fig


def svg_text(fig: Figure) -> str:
    """The figure as an inline <svg> element: text kept as text, no XML prolog or DOCTYPE, no metadata."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "reval"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    return re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.DOTALL)


def panel_figure(cmp: ComparedRuns, panel: str) -> Figure:
    fig = _figure(6.4, 4.2)
    draw_panel(fig.axes[0], cmp, panel)
    return fig


def panel_svg(cmp: ComparedRuns, panel: str) -> str:
    return svg_text(panel_figure(cmp, panel))


def draw_speedup_vs_batch(ax, curves: list, method: str) -> None:
    """One method's projected speedup against batch size, a curve per run (render/speedup.py Series), the
    quartiles' worst..best case as a band, and speedup 1 (below it speculation stops paying) dashed."""
    for s in curves:
        x = s.batches
        y = [float("nan") if v is None else v for v in s.median]
        line, = ax.plot(x, y, marker="o", markersize=3, linewidth=1.6, label=printable(s.run))
        lo = [float("nan") if v is None else v for v in s.low]
        hi = [float("nan") if v is None else v for v in s.high]
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.18, linewidth=0)
    ax.axhline(1.0, color="0.4", linestyle="--", linewidth=1, label="1x (no gain)")
    ax.set(title=f"projected speedup: {method.replace('ddtree_', 'DDTree-')}", xlabel="batch size",
           ylabel="speedup (x)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    legend_clear_of_data(ax)


def speedup_vs_batch_svg(curves: list, method: str) -> str:
    fig = _figure(5.2, 3.8)
    draw_speedup_vs_batch(fig.axes[0], curves, method)
    return svg_text(fig)


def tau_vs_step_figure(points: list[StepPoint], baseline=None) -> Figure:
    fig = _figure(7.5, 4.2)
    draw_tau_vs_step(fig.axes[0], points, baseline)
    return fig


def tau_vs_step_svg(points: list[StepPoint], baseline=None) -> str:
    return svg_text(tau_vs_step_figure(points, baseline))


def save_comparison_plot(cmp: ComparedRuns, path: str | Path, steps: list[StepPoint] | None = None,
                         baseline=None) -> Path:
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ConfigError(f"--plot {path}: unknown format {path.suffix or '(none)'!r}",
                          hint=f"use --plot {path.with_suffix('.png')} (or .svg, .pdf)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    comparison_figure(cmp, steps, baseline).savefig(tmp, format=path.suffix.lower()[1:])
    tmp.replace(path)  # never a half-written file
    return path
