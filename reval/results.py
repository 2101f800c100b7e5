"""Pulled runs through the API: `reval.load` (a run directory, NAME or HOST/NAME -> Result) and
`reval.compare` (what `reval compare` prints, as data: Comparison)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import ConfigError
from orchestrator.render import suites as _suites_view
from orchestrator.render import tables as _tables
from orchestrator.results import compare as _compare
from orchestrator.results import suites as _suites
from orchestrator.results.compare import Result
from remote_payload.contract import protocol
from remote_payload.contract import results as results_json

BY = ("run", "suite")


def load(run: str | Path, *, runs_dir: str | Path | None = None) -> Result:
    """A pulled run: a run directory (runs/<host>/<name>/, or any folder holding its results.json/status.json),
    or as the CLI takes it, NAME or HOST/NAME under `runs_dir` (default: $REVAL_RUNS_DIR, else ./runs). A run
    whose status says it succeeded but whose results.json is missing (a copy pulled part way) is refused."""
    path = run if isinstance(run, Path) else _compare.pulled_run_dir(str(run), runs_dir)
    return _complete(_compare.load_run(path))


def _complete(res: Result) -> Result:
    if res.result is None and res.state == protocol.SUCCEEDED:
        raise ConfigError(f"run {res.spec}: it succeeded but {res.path}/{protocol.RESULTS_JSON} is missing "
                          "(a copy pulled part way, or the file was removed)",
                          hint=f"pull it again: reval pull {res.spec}")
    return res


@dataclass
class Comparison:
    """The comparison `reval compare` prints: `rows` (one plain dict per run: metrics, marks, ratio/delta
    vs the baseline), `best` (label of the highest-tau rankable run), `comparable`, `differences`, `note`;
    `model` is the comparison the tables, plots and HTML report are drawn from."""
    model: _compare.ComparedRuns = field(repr=False)
    rows: list[dict] = field(default_factory=list, repr=False)
    best: str | None = None
    comparable: bool = True
    differences: list[dict] = field(default_factory=list)
    note: str = ""

    def __repr__(self) -> str:
        base = f" vs {self.model.label(self.model.baseline)}" if self.model.baseline is not None else ""
        return (f"reval.Comparison({len(self.rows)} runs{base} · best {self.best or '-'}"
                + ("" if self.comparable else " · NOT comparable") + ")")

    @functools.cached_property
    def by_suite(self) -> dict:
        """The papers' layout as data (`reval compare --by suite --json`): `suites` (the columns, matched by
        name and decoding regime, `regimes` naming each column's; a one-cache run by its cache's content), per
        run its marks and per suite tau with its 95% interval over that suite's prompts, `comparable` (and what
        differs) and, against the baseline, the paired Δ; the mean over suites likewise (ranked only over the
        same suites)."""
        return _suites_view.suite_json(self.model)

    def save_plot(self, path: str | Path) -> Path:
        """Acceptance curves, histogram and DDTree plots (.png, .svg or .pdf; needs matplotlib)."""
        from orchestrator.render import plots
        return plots.save_comparison_plot(self.model, path)

    def write_html(self, path: str | Path, *, threshold: float = 0.1) -> Path:
        """The self-contained HTML report (tables, plots, definitions, provenance)."""
        from orchestrator.render import html
        return html.write_comparison_report(self.model, path, threshold=threshold)


def compare(results: list[Result | str | Path], *, baseline: Result | str | Path | None = None,
            allow_incomparable: bool = False, by: str = "run",
            runs_dir: str | Path | None = None) -> Comparison:
    """Compare results (Results, run directories, or NAME / HOST/NAME as in `reval.load`; a glob such as
    'step-*' or 'ct129/step-*' is every pulled run it matches, by step). Runs that are not comparable are
    refused (reval.Error naming what differs), as `reval compare` does; with allow_incomparable=True they are
    marked, never ranked. by="suite" (`reval compare --by suite`) judges comparability suite by suite
    (`Comparison.by_suite`): runs over the same suites in another order, or sharing only some, are compared;
    a suite over another cache is what is refused. A baseline without results is refused; a baseline glob
    must match exactly one run."""
    if by not in BY:
        raise ConfigError(f"by={by!r}: compare by 'run' or 'suite'", hint="reval.compare(runs, by='suite')")
    def where(x):  # every run found before any is read (a wrong name is that line, whatever else is damaged)
        if isinstance(x, str) and _compare.is_run_glob(x):
            return _compare.expand_runs(x, runs_dir)
        if isinstance(x, _compare.Result | results_json.Result | Path):
            return [x]
        return [_compare.pulled_run_dir(x, runs_dir)]

    def read(x):
        return _complete(_compare.load_run(x)) if isinstance(x, Path) else x
    found, seen = [], set()
    for x in (w for r in results for w in where(r)):  # a run named twice (two globs, a glob and its name): once
        key = x.resolve() if isinstance(x, Path) else id(x)
        if key not in seen:
            seen.add(key)
            found.append(x)
    bases = None if baseline is None else where(baseline)
    if bases is not None and len(bases) != 1:
        names = ", ".join(f"{d.parent.name}/{d.name}" for d in bases[:5]) + (", ..." if len(bases) > 5 else "")
        raise ConfigError(f"baseline {baseline!r} matches {len(bases)} runs: {names}",
                          hint="the baseline is one run: give its NAME or HOST/NAME, or a glob that matches one")
    runs = [read(x) for x in found]
    base = None if bases is None else read(bases[0])
    if isinstance(base, _compare.Result) and base.result is None:
        what = baseline if isinstance(baseline, str) else str(base.path)
        raise ConfigError(f"baseline {what!r} has no results ({base.state})", hint="pick a finished run as --baseline")
    model = _compare.compare(runs, base, allow_incomparable=allow_incomparable or by == "suite")
    if by == "suite" and not allow_incomparable:
        _suites.require_comparable(_suites.match(model))
    data = _tables.comparison_json(model)
    ranked = [r for r in data["runs"] if r["rankable"] and r["metrics"].get("tau") is not None]
    best = max(ranked, key=lambda r: r["metrics"]["tau"])["label"] if ranked else None
    return Comparison(model, data["runs"], best, data["comparable"], data["differences"], data["note"])
