"""Sweep reporting: every checkpoint paired by prompt against the previous checkpoint and the baseline (Δ tau
with its 95% paired-bootstrap CI; improved / regressed only when significant, the CI excluding 0 and the
sign-flip p < 0.05, and |Δ| >= --threshold, else no clear change), the smallest change the prompts can detect, the tau-vs-step history (every checkpoint
the ledger holds for this cache and these options, across nights), the exit code, and the report files
(report.md, report.json, report.html, plots.png)."""
from __future__ import annotations

import statistics
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from remote_payload.contract import protocol

from ..errors import EXIT_EVAL_FAILED, EXIT_OK, EXIT_PARTIAL, RevalError
from ..render.tables import Cell, Column, Row, StepPoint, Table, fmt_ci, fmt_delta, fmt_p, mark_best
from ..results import compare, intervals, stats
from .ledger import LedgerEntry
from .plan import NOT_RUN, UNREACHABLE, Checkpoint, Outcome


@dataclass
class SweepFacts:
    """What a sweep's report is built from, handed over by the sweep once its runs are done (values only:
    the report never reads the Sweep)."""
    sweep_id: str
    sweep_dir: Path
    outcomes: list[Outcome]              # this sweep's and the earlier ones it skipped, in any order
    series: list[LedgerEntry]            # the ledger's entries of this configuration (every night's)
    baseline: str | None                 # --baseline as given
    baseline_run: compare.Result | None
    threshold: float
    hosts_down: dict[str, str]           # host -> why it left the sweep
    loaded: LoadedRuns | None = None     # the runs the sweep pulled, parsed once


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
    baseline_run: compare.Result | None = None
    history: list[StepPoint] = field(default_factory=list)  # tau vs step: every checkpoint of this configuration
    loaded: LoadedRuns | None = None  # the runs' records, parsed once (None: read them when needed)


SCREEN_ERROR_CHARS = 160


def verdict(o: Outcome, threshold: float) -> str:
    """A checkpoint's verdict (the one thing called a verdict): improved | regressed (against the previous
    checkpoint the paired 95% CI excludes 0, p < 0.05 and |Δ tau| >= threshold: stats.classify_change) | no clear
    change | new (nothing earlier to compare) | suspect | failed | ... (pure)."""
    if o.state in (protocol.FAILED, protocol.CANCELLED, protocol.LOST):
        return "failed" if o.state == protocol.FAILED else o.state
    if o.state in (UNREACHABLE, NOT_RUN):
        return o.state
    if o.suspect:
        return "suspect"
    if o.tau is None or o.prev_tau is None:
        return "new"
    return stats.classify_change(o.vs_prev, threshold)


def sweep_exit_code(outcomes: list[Outcome], hosts_down: dict[str, str]) -> int:
    """1 when an eval of this sweep failed; else 2 when a checkpoint was not evaluated (its host gone); else 0."""
    mine = [o for o in outcomes if not o.earlier]
    if any(o.state in (protocol.FAILED, protocol.CANCELLED, protocol.LOST) for o in mine):
        return EXIT_EVAL_FAILED
    # a host that was down is not "partial" when every checkpoint was still evaluated elsewhere (it is noted)
    if any(o.state in (UNREACHABLE, NOT_RUN) for o in mine):
        return EXIT_PARTIAL
    return EXIT_OK


def checkpoint_order(step: int | None, name: str) -> tuple:
    """Training order: by step, then checkpoints without a step (`final`, `best`) after them, by name (pure)."""
    return (step is None, step or 0, name)


def short(text: str, n: int = SCREEN_ERROR_CHARS) -> str:
    """A failure message cut for the screen; report.json keeps it whole (pure)."""
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def build_report(facts: SweepFacts, chosen: list[Checkpoint]) -> SweepReport:
    """The report of a sweep's facts, its checkpoints in the order of `chosen` (training order)."""
    order = {c.name: i for i, c in enumerate(chosen)}
    outcomes = sorted(facts.outcomes, key=lambda o: order.get(o.checkpoint, 1 << 30))
    loaded = facts.loaded or LoadedRuns()
    attach_comparisons(outcomes, facts.series, facts.baseline_run, facts.threshold, loaded)
    rep = SweepReport(facts.sweep_id, facts.sweep_dir, outcomes, facts.baseline, dict(facts.hosts_down),
                      facts.threshold, baseline_run=facts.baseline_run,
                      history=history_points(facts.series, facts.sweep_id, loaded), loaded=loaded)
    rep.exit_code = sweep_exit_code(outcomes, rep.hosts_down)
    return rep


def report_json(rep: SweepReport) -> dict:
    note = detection_note(rep.outcomes, rep.threshold)
    return {"sweep": rep.sweep_id, "dir": str(rep.sweep_dir), "baseline": rep.baseline, "threshold": rep.threshold,
            "exit_code": rep.exit_code, "hosts_down": rep.hosts_down, "detection": note,
            "checkpoints": [asdict(o) for o in rep.outcomes],
            "history": [asdict(p) for p in rep.history], "files": rep.files}


class LoadedRuns:
    """Pulled runs by path, loaded once per sweep (the schedule puts the ones it pulled; the report and its
    files read them); None where the folder is gone or unreadable or holds no result. Their statistics
    (bootstrap intervals, tau paired by prompt) are computed once too, and the sweep computes them as each run
    is pulled (`prepare`), while the next runs go on, so that the report after the last run mostly reads
    them (the same numbers: each is a pure, seeded function of the two runs' files)."""

    def __init__(self):
        self.cache: dict[str, compare.Result | None] = {}
        self.order: dict[str, tuple] = {}  # pulled runs by path -> checkpoint_order (for prepare's neighbours)
        self._estimates: dict[str, dict] = {}
        self._pairs: dict[tuple[str, str], tuple[stats.Paired | None, str]] = {}
        self.lock = threading.Lock()

    def put(self, path, rec: compare.Result) -> None:
        self.cache[str(path)] = rec if rec.result is not None else None

    def get(self, path: str | None) -> compare.Result | None:
        if not path:
            return None
        if path not in self.cache:
            try:
                rec = compare.load_run(path)
                self.cache[path] = rec if rec.result is not None else None
            except (RevalError, OSError):
                self.cache[path] = None
        return self.cache[path]

    def tau(self, path: str) -> stats.Estimate | None:
        """The run's tau with its 95% bootstrap interval (None: no result, or no interval): `estimates`' tau
        (bootstrap_many gives each number what it gives it alone)."""
        return self.estimates(path).get("tau")

    def estimates(self, path: str) -> dict:
        """Every headline number's interval (compare.ComparedRuns.estimates)."""
        if path not in self._estimates:
            run = self.get(path)
            self._estimates[path] = intervals.estimates(run.result) if run is not None else {}
        return self._estimates[path]

    def paired_tau(self, path: str, ref_path: str | None, ref: compare.Result | None = None
                   ) -> tuple[stats.Paired | None, str]:
        """(tau of `path` paired by prompt against `ref_path`'s run, or `ref`, '') or (None, why not)."""
        key = (path, ref_path or "", ref is not None)
        if key not in self._pairs:
            self._pairs[key] = _paired_tau(self.get(path), ref if ref is not None else self.get(ref_path))
        return self._pairs[key]

    def prepare(self, path, order: tuple) -> None:
        """A run just pulled: its intervals, and tau paired with the pulled runs next to it in training order
        (the previous checkpoint the report will most likely pair it with, and it as the next one's)."""
        path = str(path)
        if self.get(path) is None:
            return
        self.estimates(path)
        with self.lock:
            self.order[path] = order
            ok = {p: o for p, o in self.order.items() if self.cache.get(p) is not None and not self.cache[p].suspect}
        before = [p for p, o in ok.items() if o < order]
        after = [p for p, o in ok.items() if o > order]
        if before:
            self.paired_tau(path, max(before, key=ok.__getitem__))
        if after:
            self.paired_tau(min(after, key=ok.__getitem__), path)


def _paired_tau(run: compare.Result | None, ref: compare.Result | None) -> tuple[stats.Paired | None, str]:
    """(tau paired by prompt, '') or (None, why not)."""
    if run is None or ref is None:
        return None, "no per-prompt results to pair with"
    cmp = compare.build_comparison([run], ref)
    if cmp.differences:
        return None, "not comparable: " + ", ".join(compare.FIELD_WORDS.get(d.field, d.field)
                                                    for d in cmp.differences)
    return intervals.compare_paired(run.result, ref.result, keys={"tau"}).get("tau"), ""


def attach_comparisons(outcomes: list, series: list[LedgerEntry], baseline: compare.Result | None,
                       threshold: float, loaded: LoadedRuns | None = None) -> None:
    """Fill, per outcome: prev_* (the closest earlier finished, non-suspect checkpoint of the same
    configuration), tau_ci, vs_prev (paired against it), base_ratio, vs_base and base_verdict (paired against
    the baseline), base_note (why not compared), and the verdict."""
    loaded = loaded or LoadedRuns()
    done = [e for e in series if e.state == protocol.SUCCEEDED and e.tau is not None and not e.suspect]
    base_tau = baseline.result.metrics.tau if baseline and baseline.result else None
    for o in outcomes:
        here = checkpoint_order(o.step, o.checkpoint)
        earlier = [e for e in done if e.checkpoint != o.checkpoint and checkpoint_order(e.step, e.checkpoint) < here]
        run = loaded.get(o.local_path) if o.tau is not None else None
        if run is not None and (tau := loaded.tau(o.local_path)) is not None:
            o.tau_ci = [tau.lo, tau.hi]
        if run is not None and run.result.suites:
            o.suites = suite_taus(run.result)
        if earlier:
            prev = max(earlier, key=lambda e: checkpoint_order(e.step, e.checkpoint))
            o.prev_checkpoint, o.prev_tau = prev.checkpoint, prev.tau
            if run is not None:
                o.vs_prev, o.prev_note = loaded.paired_tau(o.local_path, prev.local_path)
        if base_tau and o.tau is not None:
            o.base_ratio = o.tau / base_tau
            if run is not None and baseline is not None:
                o.vs_base, note = loaded.paired_tau(o.local_path, str(baseline.path), baseline)
                o.base_note = note or None
                o.base_verdict = stats.classify_change(o.vs_base, threshold) if o.vs_base else ""
        o.verdict = verdict(o, threshold)


def suite_taus(result) -> dict[str, dict]:
    """Per benchmark suite its tau with the 95% bootstrap CI over its prompts (as `compare --by suite`), and
    "mean": the unweighted mean over suites (results.json suite_mean) with a CI resampling prompts within each
    suite (pure, seeded)."""
    import numpy as np

    from ..render.suites import suite_view
    out, per = {}, []
    for s in result.suites:
        est = intervals.estimates(suite_view(result, s), keys={"tau"}).get("tau")
        out[s.name] = {"tau": s.metrics.tau, "ci": [est.lo, est.hi] if est else None}
        a, b = s.prompt_range
        per.append(np.array([p.tau for p in result.per_prompt[a:b] if p.tau is not None], dtype=float))
    mean = result.suite_mean.tau if result.suite_mean is not None else None
    ci = None
    if mean is not None and per and all(len(x) for x in per):
        rng = np.random.default_rng(0)
        boot = np.mean([x[rng.integers(0, len(x), (2000, len(x)))].mean(axis=1) for x in per], axis=0)
        ci = [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]
    out["mean"] = {"tau": mean, "ci": ci}
    return out


def suite_points(e: LedgerEntry, run, sweep_id: str) -> list[StepPoint]:
    """A suite run's points on the tau-vs-step plot: one per suite and the mean over suites."""
    return [StepPoint(e.step, v["tau"], *(v["ci"] or (None, None)), e.checkpoint, e.sweep == sweep_id,
                      suspect=e.suspect, suite=name)
            for name, v in suite_taus(run.result).items() if v["tau"] is not None]


def history_points(series: list[LedgerEntry], sweep_id: str, loaded: LoadedRuns | None = None) -> list[StepPoint]:
    """Every finished checkpoint of this configuration with a step (the training run's history across nights),
    with its tau CI when its pulled results are still there; this sweep's marked, a suspect one marked suspect
    (the plot shows it off the curve, never drops it)."""
    loaded = loaded or LoadedRuns()
    out = []
    for e in series:
        if e.state != protocol.SUCCEEDED or e.tau is None or e.step is None:
            continue
        run = loaded.get(e.local_path)
        est = loaded.tau(e.local_path) if run is not None else None
        out.append(StepPoint(e.step, e.tau, est.lo if est else None, est.hi if est else None, e.checkpoint,
                             e.sweep == sweep_id, suspect=e.suspect))
        if run is not None and run.result.suites:
            out += suite_points(e, run, sweep_id)
    return out


def detection_note(outcomes: list, threshold: float) -> str | None:
    """From the spread of this sweep's paired differences: the smallest tau change its prompts can detect,
    and how many prompts would detect --threshold."""
    pairs = [p for o in outcomes for p in (getattr(o, "vs_prev", None), getattr(o, "vs_base", None))
             if p is not None and p.sd_diff is not None]
    if not pairs:
        return None
    sd = statistics.median(p.sd_diff for p in pairs)
    n = min(p.n for p in pairs)
    if sd == 0:  # prompts moved together (or not at all): the formula's 'needs 2 prompts' would mean nothing
        return (f"no spread: the per-prompt differences do not vary (median SD 0 over {len(pairs)} comparisons), "
                f"so any change would show")
    mde, need = stats.detectable_change(sd, n), stats.prompts_needed(sd, threshold)
    return (f"{n} prompts detect a tau change of ±{mde:.2f} (5% two-sided, 80% power; median SD of the "
            f"per-prompt differences {sd:.2f} over {len(pairs)} comparisons); detecting ±{threshold:g} tau "
            f"needs {need} prompts")


def _vs_text(p: stats.Paired | None, point: str, ref: str | None) -> str:
    if p is not None:  # the p where the interval and the test disagree: why a CI off 0 has no star
        return f"Δ {fmt_delta(p, 2)}" + (f" (p {fmt_p(p.p_value)})" if p.disagree else "") + (f" vs {ref}" if ref else "")
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
    return f"{named(o)}  " + " · ".join(parts) + f"   {o.verdict}" + (" (earlier sweep)" if o.earlier else "")


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
                                 + (" (earlier sweep)" if o.earlier else "")),
                 "base_verdict": Cell(o.base_verdict or None, o.base_verdict)}
        rows.append(Row(cells, [], rankable=o.tau is not None and not o.suspect))
    notes = [(f"improved / regressed: significant (*) and |Δ| >= --threshold {rep.threshold:g}; otherwise no "
              "clear change (the CI says what it cannot rule out)"),
             ("Δ paired by prompt; * = significant: the paired 95% CI excludes 0 and the sign-flip p < 0.05 (both; "
              "a p shown beside a Δ: the two disagree, so it is not called); tau in tokens per round incl. the "
              "bonus token")]
    if (note := detection_note(rep.outcomes, rep.threshold)) is not None:
        notes.append(note)
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
        console.print(table.title, markup=False, highlight=False)
    for o in rep.outcomes:
        console.print(outcome_text(o), markup=False)
    if not fits:
        for note in table.notes:
            console.print(note, markup=False, style="dim")


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
