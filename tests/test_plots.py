"""The plots' fixed margins (orchestrator/render/plots.py MARGIN_IN, instead of constrained layout): in every figure the
report draws (each panel, tau vs step, the sweep's many-panel plots.png) everything drawn — tick labels, axis
labels, titles, legends — lies inside the figure, panels side by side never meet, and the axes still fill most
of the figure (no margins wasted)."""
from __future__ import annotations

import itertools

import pytest

from orchestrator.render import plots
from orchestrator.render.tables import StepPoint
from orchestrator.results import compare
from tests import resultsgen


@pytest.fixture(scope="module")
def cmp(tmp_path_factory):
    root = tmp_path_factory.mktemp("plots")
    base = resultsgen.write_run(root, "gpu1", "baseline-drafter", quality=0.9, num_prompts=6, max_blocks=20)
    runs = [resultsgen.write_run(root, "gpu1", f"step-{s:06d}", quality=q, num_prompts=6, max_blocks=20, step=s)
            for s, q in ((500, 0.3), (1000, 0.55), (100000, 0.75), (250000, 0.85))]
    return compare.compare(runs, base)


def _steps() -> list[StepPoint]:
    pts = [StepPoint(s, 2.0 + s / 50000, 1.8 + s / 50000, 2.3 + s / 50000, f"step-{s}", s > 100000)
           for s in (500, 1000, 50000, 100000, 150000, 250000)]
    return pts + [StepPoint(120000, 11.75, 11.2, 12.3, "step-120000", True, suspect=True)]


BASELINE = ("baseline-drafter — NOT COMPARABLE: cache differs", 7.125, 6.9, 7.4)


def _figures(cmp):
    yield "tau vs step", plots.tau_vs_step_figure(_steps(), BASELINE)
    for panel in plots.PANELS:
        yield panel, plots.panel_figure(cmp, panel)
    yield "plots.png", plots.comparison_figure(cmp, _steps(), BASELINE)
    yield "compare --plot", plots.comparison_figure(cmp)


def test_nothing_drawn_leaves_its_figure_or_meets_a_neighbour(cmp):
    for what, fig in _figures(cmp):
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        W, H = fig.bbox.width, fig.bbox.height
        boxes = [ax.get_tightbbox(r) for ax in fig.axes]  # the axes with its labels, title, legend
        for ax, b in zip(fig.axes, boxes):
            assert b.x0 >= 0 and b.y0 >= 0 and b.x1 <= W and b.y1 <= H, (what, ax.get_title(), b.bounds, (W, H))
        for a, b in itertools.pairwise(sorted(boxes, key=lambda b: b.x0)):
            assert a.x1 <= b.x0, (what, a.bounds, b.bounds)
        used = sum(ax.bbox.width * ax.bbox.height for ax in fig.axes) / (W * H)
        assert used > 0.6, (what, used)  # margins sized for the labels, not a frame around them


def test_plots_png_and_the_svg_are_written(cmp, tmp_path):
    png = plots.save_comparison_plot(cmp, tmp_path / "p.png", _steps(), BASELINE)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = plots.panel_svg(cmp, "ddtree")
    assert svg.startswith("<svg") and "DDTree tau vs node budget" in svg
    fig = plots.panel_figure(cmp, "ddtree")
    fig.canvas.draw()
    budgets = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_visible() and t.get_text()]
    assert {"16", "64", "512"} <= set(budgets) and not any("$" in b for b in budgets), budgets  # no mathtext


def _data_points(ax):
    """Every point of the axes' data in display coordinates: each line sampled along its segments (a line
    crossing the legend between two markers counts), each scatter marker, each band's outline."""
    import numpy as np
    pts = []
    for line in ax.lines:
        xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
        xy = xy[np.isfinite(xy).all(axis=1)]
        for a, b in itertools.pairwise(xy):
            pts += [a + (b - a) * t for t in np.linspace(0, 1, 60)]
        pts += list(xy)
    bands = []
    for coll in ax.collections:
        if type(coll).__name__ == "PathCollection" and coll.get_offsets().size:
            pts += list(coll.get_offset_transform().transform(coll.get_offsets()))
        else:
            bands += [p.transformed(coll.get_transform()) for p in coll.get_paths()]
    return pts, bands


def test_no_legend_covers_data(cmp):
    """Issue 32 item 6: a legend placed 'best' still sat on curves (the per-position panels' curves fill every
    corner); now it goes where no line, marker or band is, or the y axis makes room for it."""
    crowded = [StepPoint(s, 2.0 + (s % 3), 1.5, 4.5, f"step-{s}", True) for s in range(0, 100001, 5000)]
    figures = [*_figures(cmp), ("crowded tau vs step", plots.tau_vs_step_figure(crowded, BASELINE))]
    for what, fig in figures:
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is None:
                continue
            box = legend.get_window_extent(r)
            pts, bands = _data_points(ax)
            inside = [tuple(p) for p in pts if box.x0 < p[0] < box.x1 and box.y0 < p[1] < box.y1]
            assert not inside, (what, ax.get_title(), inside[:3])
            corners = [(box.x0, box.y0), (box.x1, box.y0), (box.x0, box.y1), (box.x1, box.y1)]
            assert not any(b.contains_points(corners).any() for b in bands), (what, ax.get_title())
