"""Sweep reporting: every checkpoint's verdict against the previous one and the baseline, the exit code,
and the report files (report.md, report.json, plots.png)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from remote_payload import protocol

from .. import compare
from ..errors import EXIT_EVAL_FAILED, EXIT_OK, EXIT_PARTIAL, RevalError
from ..ledger import LedgerEntry
from .plan import NOT_RUN, UNREACHABLE, Checkpoint, Outcome

if TYPE_CHECKING:
    from .schedule import Sweep

@dataclass
class SweepReport:
    sweep_id: str
    sweep_dir: Path
    outcomes: list[Outcome]
    baseline: str | None
    hosts_down: dict[str, str]
    threshold: float
    exit_code: int = 0
    files: dict[str, str] = field(default_factory=dict)
    baseline_run: compare.RunRecord | None = None


def verdict(o: Outcome, threshold: float) -> str:
    """improved | regressed | within noise | new (nothing earlier to compare) | suspect | failed | ... (pure)."""
    if o.state in (protocol.FAILED, protocol.CANCELLED, protocol.LOST):
        return "failed" if o.state == protocol.FAILED else o.state
    if o.state in (UNREACHABLE, NOT_RUN):
        return o.state
    if o.suspect:
        return "suspect"
    if o.tau is None or o.prev_tau is None:
        return "new"
    d = o.tau - o.prev_tau
    return "improved" if d > threshold else "regressed" if d < -threshold else "within noise"


def sweep_exit_code(outcomes: list[Outcome], hosts_down: dict[str, str]) -> int:
    """1 when an eval of this sweep failed; else 2 when something was not evaluated (host gone); else 0."""
    mine = [o for o in outcomes if not o.earlier]
    if any(o.state in (protocol.FAILED, protocol.CANCELLED, protocol.LOST) for o in mine):
        return EXIT_EVAL_FAILED
    if hosts_down or any(o.state in (UNREACHABLE, NOT_RUN) for o in mine):
        return EXIT_PARTIAL
    return EXIT_OK


def attach_comparisons(outcomes: list[Outcome], series: list[LedgerEntry], baseline: compare.RunRecord | None,
                       threshold: float) -> None:
    """Fill prev_* (the closest earlier finished, non-suspect checkpoint of the same configuration),
    base_ratio and the verdict of every outcome (pure, given the loaded baseline)."""
    done = [e for e in series if e.state == protocol.SUCCEEDED and e.tau is not None and not e.suspect]
    base_tau = baseline.result.metrics.tau if baseline and baseline.result else None
    for o in outcomes:
        earlier = [e for e in done if e.checkpoint != o.checkpoint and
                   (e.step, e.checkpoint) < (o.step, o.checkpoint)] if o.step is not None else \
            [e for e in done if e.checkpoint < o.checkpoint]
        if earlier:
            o.prev_checkpoint, o.prev_tau = earlier[-1].checkpoint, earlier[-1].tau
        if base_tau and o.tau is not None:
            o.base_ratio = o.tau / base_tau
            if o.local_path and baseline is not None:
                try:
                    cmp = compare.build_comparison([compare.load_run(o.local_path)], baseline)
                    if cmp.differences:
                        o.base_note = "not comparable: " + ", ".join(
                            compare.FIELD_WORDS.get(d.field, d.field) for d in cmp.differences)
                except RevalError:
                    pass
        o.verdict = verdict(o, threshold)


def build_report(sw: Sweep, chosen: list[Checkpoint]) -> SweepReport:
    order = {c.name: i for i, c in enumerate(chosen)}
    outcomes = sorted(sw.outcomes.values(), key=lambda o: order.get(o.checkpoint, 1 << 30))
    attach_comparisons(outcomes, sw.ledger.series(sw.config), sw.baseline, sw.opts.threshold)
    down = {n: hs.down for n, hs in {**sw.sources, **sw.sessions}.items() if hs.down}
    rep = SweepReport(sw.sweep_id, sw.dir, outcomes, sw.opts.baseline, down, sw.opts.threshold,
                      baseline_run=sw.baseline)
    rep.exit_code = sweep_exit_code(outcomes, down)
    return rep


def outcome_text(o: Outcome) -> str:
    """'step-5000  tau 5.02 (+0.69 vs step-4000) · 0.60x baseline   improved' (pure)."""
    if o.tau is None:
        where = f" on {o.host}" if o.host else ""
        return f"{o.checkpoint}  {o.state.upper()}{where}" + (f" ({o.error})" if o.error else "")
    parts = [f"tau {o.tau:.2f}" + (f" ({o.tau - o.prev_tau:+.2f} vs {o.prev_checkpoint})"
                                   if o.prev_tau is not None else "")]
    if o.base_ratio is not None:
        parts.append(f"{o.base_ratio:.2f}x baseline" + (f" ({o.base_note})" if o.base_note else ""))
    return f"{o.checkpoint}  " + " · ".join(parts) + f"   {o.verdict}" + (" (earlier sweep)" if o.earlier else "")


def report_table(rep: SweepReport) -> compare.Table:
    cols = [compare.Column("checkpoint", "checkpoint", digits=None), compare.Column("step", "step", digits=None),
            compare.Column("host", "host", digits=None), compare.Column("tau", "tau", ranked=True),
            compare.Column("vs_prev", "vs previous", digits=None),
            compare.Column("vs_base", "vs " + (rep.baseline or "baseline"), digits=None),
            compare.Column("verdict", "verdict", digits=None)]
    rows = []
    for o in rep.outcomes:
        cells = {
            "checkpoint": compare.Cell(o.checkpoint, o.checkpoint),
            "step": compare.Cell(o.step, "" if o.step is None else str(o.step)),
            "host": compare.Cell(o.host, o.host or ""),
            "tau": compare.Cell(o.tau, "" if o.tau is None else f"{o.tau:.2f}"),
            "vs_prev": compare.Cell(None if o.prev_tau is None or o.tau is None else o.tau - o.prev_tau,
                                    "" if o.prev_tau is None or o.tau is None
                                    else f"{o.tau - o.prev_tau:+.2f} vs {o.prev_checkpoint}"),
            "vs_base": compare.Cell(o.base_ratio, "" if o.base_ratio is None else f"{o.base_ratio:.2f}x"
                                    + (f" ({o.base_note})" if o.base_note else "")),
            "verdict": compare.Cell(o.verdict, o.verdict + (f": {o.error}" if o.error else "")
                                    + (" (earlier sweep)" if o.earlier else "")),
        }
        rows.append(compare.Row(cells, [], rankable=o.tau is not None and not o.suspect))
    notes = [f"threshold ±{rep.threshold:.2f} tau"] + [f"host {h} left out: {why}" for h, why in rep.hosts_down.items()]
    return compare.mark_best(compare.Table(f"sweep {rep.sweep_id}", cols, rows, notes=notes))


def report_json(rep: SweepReport) -> dict:
    return {"sweep": rep.sweep_id, "dir": str(rep.sweep_dir), "baseline": rep.baseline, "threshold": rep.threshold,
            "exit_code": rep.exit_code, "hosts_down": rep.hosts_down,
            "checkpoints": [asdict(o) for o in rep.outcomes], "files": rep.files}


def write_report_files(rep: SweepReport) -> None:
    """report.md, report.json and plots.png (when there are results) in the sweep dir."""
    from .. import plots, report
    md = report.render_markdown([report_table(rep)])
    md += "\n" + "\n".join(f"- {outcome_text(o)}" for o in rep.outcomes) + "\n"
    protocol.atomic_write_text(rep.sweep_dir / "report.md", md)
    rep.files["markdown"] = str(rep.sweep_dir / "report.md")
    paths = [o.local_path for o in rep.outcomes if o.local_path and o.state == protocol.SUCCEEDED]
    if paths:
        recs = [compare.load_run(p) for p in paths]
        rep.files["plot"] = str(plots.save_comparison_plot(compare.build_comparison(recs, rep.baseline_run),
                                                           rep.sweep_dir / "plots.png"))
    rep.files["json"] = str(rep.sweep_dir / "report.json")
    protocol.atomic_write_json(rep.sweep_dir / "report.json", report_json(rep))
