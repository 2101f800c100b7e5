"""Sweep reporting: every checkpoint paired by prompt against the previous checkpoint and the baseline (Δ tau
with its 95% paired-bootstrap CI; improved / regressed only when significant, the CI excluding 0 and the
sign-flip p < 0.05, and |Δ| >= --threshold, else no clear change), the smallest change the prompts can
detect, the tau-vs-step history (every checkpoint the ledger holds for this cache and these options, across
nights) and the exit code: a SweepReport, built from a SweepFacts value. render.py shows it (the table, the
lines, the report files)."""
from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field
from pathlib import Path

from remote_payload.contract import protocol

from ..errors import EXIT_EVAL_FAILED, EXIT_OK, EXIT_PARTIAL, RevalError
from ..render.tables import StepPoint
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
        if run is not None:
            o.suites = suite_taus(run.result) if run.result.suites else None
            o.speedup, o.online = serving(run.result)
        prev = max(earlier, key=lambda e: checkpoint_order(e.step, e.checkpoint)) if earlier else None
        if prev is not None:
            o.prev_checkpoint, o.prev_tau = prev.checkpoint, prev.tau
            if run is not None:
                o.vs_prev, o.prev_note = loaded.paired_tau(o.local_path, prev.local_path)
        o.verdict_note = passed_over(o, prev, series)
        if base_tau and o.tau is not None:
            o.base_ratio = o.tau / base_tau
            if run is not None and baseline is not None:
                o.vs_base, note = loaded.paired_tau(o.local_path, str(baseline.path), baseline)
                o.base_note = note or None
                o.base_verdict = stats.classify_change(o.vs_base, threshold) if o.vs_base else ""
        o.verdict = verdict(o, threshold)


def passed_over(o: Outcome, prev: LedgerEntry | None, series: list[LedgerEntry]) -> str | None:
    """The earlier checkpoints between `o` and the one it is compared with (prev; None: none) that were not
    compared because they are suspect or did not finish: 'after step-200 (suspect, not compared)' (pure)."""
    if o.tau is None or o.suspect:
        return None
    here = checkpoint_order(o.step, o.checkpoint)
    low = checkpoint_order(prev.step, prev.checkpoint) if prev is not None else None
    skipped = sorted((e for e in series if e.checkpoint != o.checkpoint
                      and (e.suspect or e.state != protocol.SUCCEEDED or e.tau is None)
                      and checkpoint_order(e.step, e.checkpoint) < here
                      and (low is None or checkpoint_order(e.step, e.checkpoint) > low)),
                     key=lambda e: checkpoint_order(e.step, e.checkpoint))
    if not skipped:
        return None
    why = ", ".join(f"{e.checkpoint} {'suspect' if e.suspect else e.state}" for e in skipped)
    if prev is None:
        return f"nothing earlier to compare with: {why}, not compared"
    return f"vs {prev.checkpoint}, the last earlier one that can be compared ({why} between)"


def serving(result) -> tuple[dict | None, dict | None]:
    """The run's serving figures for the report: (projected speedup and its method (--speedup), the online
    decode's measured speedup and agreement (--online)); None where the run did not measure them (pure)."""
    sp, on = result.speedup, result.online
    speedup = None if sp is None else {"projected": sp.best_speedup, "method": sp.best_method,
                                        "block": sp.projected.get("block")}
    online = None if on is None else {"measured_speedup": on.measured_speedup, "prompts": on.prompts,
                                      "prompts_agreeing": on.prompts_agreeing, "rounds": on.rounds,
                                      "tau_online": on.tau_online, "tau_offline": on.tau_offline,
                                      "rounds_agreeing": on.rounds_agreeing}
    return speedup, online


def suite_taus(result) -> dict[str, dict]:
    """Per benchmark suite its tau with the 95% bootstrap CI over its prompts (as `compare --by suite`), and
    "mean": the unweighted mean over suites (results.json suite_mean) with a CI resampling prompts within each
    suite (pure, seeded)."""
    import numpy as np

    from ..results.suites import suite_view
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
