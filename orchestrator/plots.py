"""PNG plots of a comparison (matplotlib, Agg, no pyplot global state): per-position acceptance curves,
the acceptance-length histogram and tau against DDTree budget, one curve per run in each panel."""
from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .compare import Comparison
from .errors import ConfigError


def comparison_figure(cmp: Comparison) -> Figure:
    runs = [r for r in cmp.runs if r.result is not None]
    fig = Figure(figsize=(16, 4.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_pos, ax_hist, ax_tree = fig.subplots(1, 3)
    for r in runs:
        m = r.result.metrics
        label = cmp.label(r) + ("" if cmp.rankable(r) or r is cmp.baseline else " (not ranked)")
        style = {"linestyle": "--" if r.suspect or cmp.incomparable(r) else "-",
                 "linewidth": 2.5 if r is cmp.baseline else 1.6, "marker": "o", "markersize": 3}
        acc = m.per_position_acceptance_unconditional
        ax_pos.plot(range(1, len(acc) + 1), acc, label=label, **style)
        hist = m.acceptance_histogram
        total = sum(hist) or 1
        ax_hist.plot(range(len(hist)), [h / total for h in hist], label=label, drawstyle="steps-mid",
                     **{k: v for k, v in style.items() if k != "marker"})
        tree = sorted(((int(b), t) for b, t in m.ddtree_tau.items() if t is not None))
        ax_tree.plot([b for b, _ in tree], [t for _, t in tree], label=label, **style)
    ax_pos.set(title="per-position acceptance  #(acc>=k)/#rounds", xlabel="draft position k",
               ylabel="fraction of rounds", ylim=(0, 1.02))
    ax_hist.set(title="acceptance length (incl. bonus)", xlabel="tokens accepted per round",
                ylabel="fraction of rounds")
    ax_tree.set(title="DDTree tau vs node budget", xlabel="budget B (nodes)", ylabel="tau (incl. bonus)")
    ax_tree.set_xscale("log", base=2)
    for ax in (ax_pos, ax_hist, ax_tree):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def save_comparison_plot(cmp: Comparison, path: str | Path) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--plot {path}: only PNG is written", hint=f"use --plot {path.with_suffix('.png')}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    comparison_figure(cmp).savefig(tmp, format="png")
    tmp.replace(path)  # never a half-written PNG
    return path
