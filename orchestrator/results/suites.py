"""Benchmark suites matched across runs (pure): what `reval compare --by suite` and the API's
`Comparison.by_suite` show. Nothing here prints.

A run evaluated with `--cache NAME=PATH` repeated carries `suites` in results.json (each suite's metrics,
comparability key and slice of the top-level per_prompt, named `<suite>/<prompt>`). Suites are matched across
runs by name, never by the order of `--cache`: one column per suite name. A one-cache run (no `suites`) is a
suite of its own: it lands in the column whose cache has the same content (fingerprint), else in the column
named by its cache folder (as `--cache PATH` among several names it). A run without a suite has an empty cell
there; runs that share only some suites are compared on those. A column is one suite in one decoding regime
(comparability.regime: greedy, or the sampling transform and draft rule): when any run is not greedy, columns
are named `<suite> <regime tag>` (`gsm8k T=0`, `gsm8k T=1`: the DDTree paper's layout; a one-cache run lands
where its cache's content and regime match), a run over several regimes in one process (`regime.mixed`) filling
one column per suite, so cells of different regimes are set side by side and never ranked against each other.

A cell is comparable with its column's reference (the baseline's cell when the baseline has that suite, else
the first run's) when their comparability keys are equal (cache, prompts, max blocks, block size, metric
definitions, drafter attention); otherwise it is `≠`: shown, never ranked, and `compare` refuses it unless
incomparable runs are allowed. Each cell's interval is the 95% bootstrap over that suite's prompts
(intervals.estimates of the suite's view of the result), each Δ against the baseline the paired comparison
over the prompts both runs evaluated in that suite (intervals.compare_paired).

The mean over suites (results.json `suite_mean`: each suite counts once) is ranked only among runs over the
same set of suites as the reference run (the baseline's, else the first run's with suites), every one of
them comparable; its interval and paired Δ resample the prompts of those suites with each prompt weighted 1/n
of its suite, so the statistic is exactly the unweighted mean over suites (stats.Sample: sum(num)/sum(den)).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from remote_payload.contract import results as results_json
from remote_payload.contract.results import Suite

from ..errors import ConfigError
from . import intervals, stats
from .compare import ComparedRuns, Difference, Result, key_differences

MISMATCH = "≠"
_VIEW = "by_suite"


def suite_view(result: results_json.Result, suite: Suite) -> results_json.Result:
    """The result as if it held only `suite`'s prompts (what intervals and the tables read), its prompts named
    as a one-cache run of that cache names them (`<suite>/` dropped), so the two pair prompt by prompt."""
    a, b = suite.prompt_range
    prefix = f"{suite.name}/"
    prompts = [dataclasses.replace(p, name=p.name[len(prefix):]) if p.name.startswith(prefix) else p
               for p in result.per_prompt[a:b]]
    return dataclasses.replace(result, per_prompt=prompts, metrics=suite.metrics, cache=suite.cache,
                               comparability=suite.comparability, suites=None, suite_mean=None)


@dataclass
class SuiteCell:
    """One run's suite in one column: `suite` (None: a one-cache run, its whole result), `view` (the result
    over that suite's prompts only), `differences` from the column's reference (empty: comparable)."""
    run: Result
    column: str
    suite: Suite | None
    view: results_json.Result
    differences: list[tuple[str, Any, Any]] = field(default_factory=list)

    @property
    def comparable(self) -> bool:
        return not self.differences

    @property
    def name(self) -> str:
        """The suite's own name in its run (a one-cache run: its cache folder's)."""
        return self.suite.name if self.suite is not None else cache_name(self.view)

    @property
    def key(self) -> dict:
        return self.view.comparability.key()

    @property
    def tau(self) -> float | None:
        return self.view.metrics.tau


def cache_name(result: results_json.Result) -> str:
    """A one-cache run's suite name: its cache folder's, as `--cache PATH` among several would name it."""
    path = result.cache.path
    return os.path.basename(path.rstrip("/")) or path


@dataclass
class SuiteComparison:
    """The runs of a comparison matched suite by suite: `columns` (suite names, with their regime's tag when any
    run is not greedy; in the order first seen),
    `cells[(run path, column)]`, `reference[column]` (the run whose cell the others are compared with)."""
    cmp: ComparedRuns
    columns: list[str] = field(default_factory=list)
    cells: dict[tuple[str, str], SuiteCell] = field(default_factory=dict)
    reference: dict[str, Result] = field(default_factory=dict)
    landed: list[tuple[Result, str]] = field(default_factory=list)  # one-cache runs placed by cache content
    regimes: dict[str, str | None] = field(default_factory=dict)  # column -> its regime signature (None: greedy)
    heads: dict[str, str] = field(default_factory=dict)  # column -> its header (`gsm8k\nT=1`)
    _est: dict = field(default_factory=dict, repr=False)
    _pair: dict = field(default_factory=dict, repr=False)

    def cell(self, run: Result, column: str) -> SuiteCell | None:
        return self.cells.get((str(run.path), column))

    def run_cells(self, run: Result) -> list[SuiteCell]:
        return [c for n in self.columns if (c := self.cell(run, n)) is not None]

    @property
    def differences(self) -> list[Difference]:
        """Every cell that differs from its column's reference, as the run-level Differences are written."""
        out = []
        for run in self.cmp.runs:
            for c in self.run_cells(run):
                ref = self.cmp.label(self.reference[c.column])
                out += [Difference(self.cmp.label(run), f, v, want, ref, suite=c.column) for f, v, want in
                        c.differences]
        return out

    def estimate(self, run: Result, column: str) -> stats.Estimate | None:
        """tau's 95% bootstrap interval over this suite's prompts in this run (computed once)."""
        key = (str(run.path), column)
        if key not in self._est:
            c = self.cells.get(key)
            self._est[key] = intervals.estimates(c.view, keys={"tau"}).get("tau") if c is not None else None
        return self._est[key]

    def paired(self, run: Result, column: str) -> stats.Paired | None:
        """This suite's tau in `run` against the baseline's, paired by prompt; None for the baseline itself,
        a run or baseline without this suite, or keys that differ (other cache, prompts, max blocks ...)."""
        base = self.cmp.baseline
        c, b = self.cell(run, column), self.cell(base, column) if base is not None else None
        if c is None or b is None or run is base or key_differences(c.key, b.key):
            return None
        key = (str(run.path), column)
        if key not in self._pair:
            self._pair[key] = intervals.compare_paired(c.view, b.view, keys={"tau"}).get("tau")
        return self._pair[key]

    # ---- the mean over suites
    def mean_columns(self) -> list[str]:
        """The reference set of suites for the mean: the baseline's (runs[0]), else the first run's with
        suites."""
        for r in self.cmp.runs:
            if r.result is not None and r.result.suites:
                return [n for n in self.columns if self.cell(r, n) is not None]
        return []

    def mean_comparable(self, run: Result) -> bool:
        """The run's mean over suites is over the reference set of suites, each of them comparable."""
        res = run.result
        if res is None or not res.suites or res.suite_mean is None or res.suite_mean.tau is None:
            return False
        mine = self.run_cells(run)
        return [c.column for c in mine] == self.mean_columns() and all(c.comparable for c in mine)

    def mean_ranked(self, run: Result) -> bool:
        """The mean is set against the others': comparable, and the run rankable (not suspect)."""
        return self.mean_comparable(run) and not run.suspect

    def mean_sample(self, run: Result) -> stats.Sample | None:
        """The mean over suites as a ratio of sums over prompts: each prompt's tau weighted 1/n of its suite
        (n: that suite's prompts with a tau), so sum(num)/sum(den) is the unweighted mean of the suites' tau.
        None unless it rebuilds the mean results.json states."""
        if not self.mean_comparable(run):
            return None
        names, num, den = [], [], []
        for c in self.run_cells(run):
            taus = [(p.name, p.tau) for p in c.view.per_prompt if p.tau is not None]
            for name, tau in taus:
                names.append(f"{c.column}/{name}")
                num.append(tau / len(taus))
                den.append(1 / len(taus))
        if not names:
            return None
        sample = stats.Sample(names, np.array(num, dtype=np.float64), np.array(den, dtype=np.float64))
        stated = run.result.suite_mean.tau
        return sample if math.isclose(sample.value, stated, rel_tol=1e-3, abs_tol=1e-6) else None

    def mean_estimate(self, run: Result) -> stats.Estimate | None:
        key = (str(run.path), None)
        if key not in self._est:
            s = self.mean_sample(run)
            self._est[key] = stats.bootstrap(s) if s is not None and s.n >= 2 else None
        return self._est[key]

    def mean_paired(self, run: Result) -> stats.Paired | None:
        """The mean over suites against the baseline's, paired by prompt (both over the same suites)."""
        base = self.cmp.baseline
        if base is None or run is base:
            return None
        key = (str(run.path), None)
        if key not in self._pair:
            a, b = self.mean_sample(run), self.mean_sample(base)
            ok = a is not None and b is not None and stats.align(a, b)[0].n > 0
            self._pair[key] = stats.paired(a, b) if ok else None
        return self._pair[key]


def _place(sc: SuiteComparison, run: Result, column: str, suite: Suite | None, view) -> None:
    if column not in sc.columns:
        sc.columns.append(column)
        sc.regimes[column] = view.comparability.regime
    sc.cells[(str(run.path), column)] = SuiteCell(run, column, suite, view)


def regime_tags(signatures) -> dict[str | None, str]:
    """Each regime signature (Comparability.regime; None: greedy) -> a short column tag: `T=0`, `T=1`, `T=0.6
    top_p=0.95 draft=sampled`; seed and samples added where two regimes would read the same."""
    def fields(sig):
        return dict(x.split("=", 1) for x in sig.split("/") if "=" in x)

    def short(sig):
        if sig is None:
            return "T=0"
        f = fields(sig)
        return " ".join([f"T={f.get('T')}"] + [f"{k}={f[k]}" for k, off in (("top_k", "0"), ("top_p", "1"))
                                                 if f.get(k, off) != off]
                        + (["draft=sampled"] if f.get("draft") == "sampled" else []))
    sigs = list(dict.fromkeys(signatures))
    tags = {s: short(s) for s in sigs}
    alike = [s for s in sigs if s is not None and list(tags.values()).count(tags[s]) > 1]
    for s in alike:
        f = fields(s)
        tags[s] = f"{tags[s]} seed={f.get('seed')} samples={f.get('samples')}"
    return tags


def match(cmp: ComparedRuns) -> SuiteComparison:
    """The comparison's runs matched suite by suite and regime (computed once per comparison): a column is a
    suite name in one decoding regime, named `<suite>` when every run is greedy, else `<suite> <regime tag>`
    (`gsm8k T=0`, `gsm8k T=1`: the DDTree paper's layout), so cells of different regimes are never ranked."""
    if _VIEW in cmp.views:
        return cmp.views[_VIEW]
    sc = SuiteComparison(cmp)
    with_results = [r for r in cmp.runs if r.result is not None]
    placed: list[tuple[Result, str, Suite | None, results_json.Result, bool]] = []
    for run in with_results:  # named suites first: the columns are the suites' names
        placed += [(run, s.name, s, suite_view(run.result, s), False) for s in run.result.suites or []]
    for run in (r for r in with_results if not r.result.suites):  # one cache: its suite by content, else name
        key = run.result.comparability.key()
        same = next((x for x in placed if (x[3].comparability.cache_fingerprint, x[3].comparability.regime)
                     == (key["cache_fingerprint"], key["regime"])), None)
        placed.append((run, same[1] if same else cache_name(run.result), None, run.result, same is not None))
    tags = regime_tags(x[3].comparability.regime for x in placed)
    tagged = any(s is not None for s in tags)
    for run, name, suite, view, landed in placed:
        column = f"{name} {tags[view.comparability.regime]}" if tagged else name
        sc.heads[column] = f"{name}\n{tags[view.comparability.regime]}" if tagged else name
        if landed:
            sc.landed.append((run, column))
        _place(sc, run, column, suite, view)
    for n in sc.columns:
        holders = [r for r in cmp.runs if sc.cell(r, n) is not None]
        base = cmp.baseline
        sc.reference[n] = base if base is not None and base in holders else holders[0]
        ref_key = sc.cell(sc.reference[n], n).key
        for r in holders:
            c = sc.cell(r, n)
            c.differences = [] if r is sc.reference[n] else key_differences(c.key, ref_key)
    cmp.views[_VIEW] = sc
    return sc


def require_comparable(sc: SuiteComparison) -> None:
    """Raise (exit 3) naming every suite whose cache, prompts, max blocks ... differ from its column's
    reference, unless every suite is comparable."""
    diffs = sc.differences
    if not diffs:
        return
    lines = "\n".join(str(d) for d in diffs)
    raise ConfigError(f"suites are not comparable, refusing to rank them:\n{lines}",
                      hint="a suite's name stands for one cache evaluated the same way: compare runs over "
                           "the same caches, or pass --allow-incomparable to show them side by side (marked "
                           f"{MISMATCH}, not ranked)")
