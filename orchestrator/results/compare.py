"""Load pulled runs and compare them: name resolution, comparability, intervals and paired comparisons.

The API (what `reval.load()` / `reval.compare()` call): `load_run(path) -> Result` (a pulled run; its
`result` is the typed results.json, remote_payload's results_json.Result) and
`compare(runs, baseline=...) -> ComparedRuns` (`tables.comparison_json` makes it plain records). Nothing here
prints or writes; render/tables.py builds the tables (it imports this module, never the other way round),
render/formats.py renders them (rich, markdown, csv, json), render/html.py writes the HTML report and
render/plots.py draws the curves. A pulled run lives in `runs/<host>/<run>/`.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remote_payload.contract import protocol, runstate
from remote_payload.contract import results as results_json
from remote_payload.contract.contenthash import STEP_PATTERN as _STEP  # one checkpoint-step rule
from remote_payload.contract.results import ResultsError

from ..errors import ConfigError, RunNotFound
from ..rundir.registry import UNKNOWN, is_run_name, iso_s, local_runs_root, symlink_refused
from . import intervals
from .stats import Estimate, Paired

# comparability_key field -> the words used when telling the user what differs
FIELD_WORDS = {"cache_fingerprint": "cache", "prompt_set": "prompt set", "num_prompts": "num_prompts",
               "max_blocks": "max_blocks", "block_size": "block_size", "metrics_version": "metric definitions",
               "attention": "drafter attention (window / causal inside the block)",
               "family": "drafter family (DFlash block / EAGLE-3 chain)",
               "regime": "decoding regime (sampling temperature / top-k / top-p / seed / samples, draft rule; "
                         "none: greedy)"}


_RESULT_SECTIONS = frozenset(f.name for f in dataclasses.fields(results_json.Result)
                             if not f.metadata.get("internal"))


@dataclass(repr=False)
class Result:
    """A pulled run directory as read from disk (load_run; the API's reval.Result: reval.load, Run.wait):
    `result` is its typed results.json (remote_payload/contract/results.py; None when the eval did
    not finish; `metrics`, `per_prompt`, `health`... forward to it), `results` the same file as a plain dict,
    `status` and `run_info` its status.json and run.json as dicts; `state`, `suspect`, `path`, `name`,
    `host`."""
    name: str
    host: str
    path: Path
    result: results_json.Result | None = None
    status: dict | None = None
    run_info: dict | None = None

    def __repr__(self) -> str:
        t = self.result.metrics.tau if self.result is not None else None
        tau = f" · tau {t:.2f}" if isinstance(t, int | float) else ""
        flag = " (SUSPECT)" if self.suspect else ""
        return f"reval.Result({self.spec}: {self.state}{flag}{tau} · {self.path})"

    @property
    def results(self) -> dict | None:
        return None if self.result is None else self.result.to_dict()

    def __getattr__(self, name: str):
        """The typed results.json's sections straight from the run: run.metrics.tau, run.per_prompt[0],
        run.health.suspect (AttributeError naming the run when it has no results)."""
        if name in _RESULT_SECTIONS:
            result = self.__dict__.get("result")
            if result is None:
                raise AttributeError(f"{self.__dict__.get('path')}: no results.json (state {self.state}): "
                                     f"no {name!r}")
            return getattr(result, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def state(self) -> str:
        if self.result is not None:
            return protocol.SUCCEEDED
        return (self.status or {}).get("state", UNKNOWN)

    @property
    def suspect(self) -> bool:
        return self.result is not None and self.result.suspect

    @property
    def spec(self) -> str:
        return f"{self.host}/{self.name}"


def _read_optional(path: Path, limit: int | None = None) -> dict | None:
    try:
        obj = protocol.read_json(path, limit)
    except FileNotFoundError:
        return None
    except OSError as e:  # a folder, a FIFO or a device where the file belongs: never read
        raise ConfigError(f"{path}: cannot be read ({e.strerror})", hint="re-pull the run: reval pull <run>") from None
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{path}: not valid JSON ({e})", hint="re-pull the run: reval pull <run>") from e
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: a JSON {type(obj).__name__}, not an object",
                          hint="re-pull the run: reval pull <run>")
    return obj


def load_run(path: str | Path) -> Result:
    """Read a run directory (results.json, status.json, run.json; any may be missing but not all). A run folder
    that is a symbolic link is refused (exit 3): it is no copy of a run, whatever it points to."""
    path = Path(path)
    if path.is_symlink():
        raise symlink_refused(path)
    results = _read_optional(path / protocol.RESULTS_JSON)
    result = None
    if results is not None:
        try:
            result = results_json.Result.from_dict(results, source=path / protocol.RESULTS_JSON)
        except ResultsError as e:
            raise ConfigError(str(e), hint="re-pull the run (reval pull RUN), or re-run the eval with this "
                                           "version of reval") from None
    status = _read_optional(path / protocol.STATUS_JSON, runstate.MAX_STATUS_BYTES)  # KBs; results.json can be MBs
    run_info = _read_optional(path / protocol.RUN_JSON, runstate.MAX_STATUS_BYTES)
    if results is None and status is None and run_info is None:
        raise RunNotFound(f"{path}: not a run directory (no results.json, status.json or run.json)",
                          hint="pull it first: reval pull <run>, or pass the run's folder")
    host = (run_info or {}).get("host") or path.parent.name
    return Result(name=path.name, host=str(host), path=path, result=result, status=status, run_info=run_info)


def pulled_run_dir(spec: str, runs_root: str | Path | None = None) -> Path:
    """`name`, `host/name` or a path -> the run's local folder. Ambiguous or missing names are errors.
    runs_root: default registry.local_runs_root() ($REVAL_RUNS_DIR or ./runs), read at call time."""
    runs_root = Path(runs_root) if runs_root else local_runs_root()
    p = Path(spec)
    if p.is_dir() and any((p / f).exists() for f in (protocol.RESULTS_JSON, protocol.STATUS_JSON,
                                                     protocol.RUN_JSON)):
        return p
    parts = spec.strip("/").split("/")
    try:  # never `..`: NAME and HOST/NAME name a folder under runs_root, nothing beside it
        for part in parts if len(parts) <= 2 and parts[0] else []:
            protocol.validate_run_name(part)
    except protocol.ProtocolError as e:
        raise ConfigError(f"{spec}: {e}", hint="give NAME, HOST/NAME or a run's folder") from None
    if len(parts) == 2:
        host, name = parts
        cand = runs_root / host / name
        if cand.is_dir():
            return cand
        raise RunNotFound(f"run {spec!r} not found under {runs_root}/{host}/",
                          hint=f"pull it first: reval pull {spec}   (or reval compare --pull {spec})")
    if len(parts) == 1 and parts[0]:
        found = sorted(d for d in runs_root.glob(f"*/{parts[0]}") if d.is_dir()) if runs_root.is_dir() else []
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            options = ", ".join(f"{d.parent.name}/{d.name}" for d in found)
            raise ConfigError(f"run name {spec!r} is on several hosts: {options}", hint="say which: HOST/NAME")
    raise RunNotFound(f"run {spec!r} not found (looked in {runs_root}/*/{parts[-1]} and as a path)",
                      hint="list runs: reval ls   · pull it: reval compare --pull HOST/NAME")


_GLOB_PART = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-*?[]!")
_RUN_FILES = (protocol.RESULTS_JSON, protocol.STATUS_JSON, protocol.RUN_JSON)


def is_run_glob(spec: str) -> bool:
    """A RUN with `*`, `?` or `[` (never in a run name): a glob over the pulled runs."""
    return any(c in spec for c in "*?[")


def expand_runs(spec: str, runs_root: str | Path | None = None) -> list[Path]:
    """A glob over the local registry: `step-*` (every host's runs/<host>/step-*), `HOST/step-*` (the host may
    be a glob too) -> the matching pulled runs, by step where their names carry one (step-N, ckpt-N, ...), then
    the others by name, then by host. None matching: RunNotFound (exit 102); not NAME or HOST/NAME: exit 3."""
    runs_root = Path(runs_root) if runs_root else local_runs_root()
    parts = spec.strip("/").split("/")
    if len(parts) > 2 or any(not p or p in (".", "..") or not set(p) <= _GLOB_PART for p in parts):
        raise ConfigError(f"{spec}: a run glob is NAME or HOST/NAME with * ? [...] among letters, digits, . _ -",
                          hint="e.g. reval compare 'step-*' or 'ct129/step-*' (quoted, so the shell keeps it)")
    host_pat, name_pat = parts if len(parts) == 2 else ("*", parts[0])
    found = []
    for host in sorted(runs_root.iterdir()) if runs_root.is_dir() else []:
        if host.name.startswith(".") or not fnmatch.fnmatchcase(host.name, host_pat) or not host.is_dir():
            continue
        for d in host.iterdir():
            if (fnmatch.fnmatchcase(d.name, name_pat) and is_run_name(d.name) and d.is_dir()
                    and any((d / f).exists() for f in _RUN_FILES)):
                found.append(d)
    if not found:
        raise RunNotFound(f"no pulled run matches {spec!r} (looked in {runs_root}/{host_pat}/{name_pat})",
                          hint="list runs: reval ls   · pull them first: reval pull HOST/NAME")

    def order(d: Path) -> tuple:
        step = checkpoint_step(None, d.name)
        return (step is None, step or 0, d.name, d.parent.name)
    return sorted(found, key=order)


# ---------------------------------------------------------------------------------------------------------
# comparability

@dataclass
class Difference:
    run: str          # label of the run that differs
    field: str        # comparability_key field
    value: Any
    expected: Any
    reference: str    # label of the run it was compared with
    suite: str | None = None  # a benchmark suite's key (compare --by suite), else the run's

    def __str__(self) -> str:
        where = f"suite {self.suite}: " if self.suite is not None else ""
        return (f"{self.run}: {where}{FIELD_WORDS.get(self.field, self.field)} {_short(self.value)} "
                f"differs from {_short(self.expected)} ({self.reference})")


def key_differences(key: dict, expected: dict) -> list[tuple[str, Any, Any]]:
    """(field, value, expected) for every comparability field of `key` that differs from `expected` (an
    attention or a drafter family not recorded on either side, a file from before they were, is unknown, not
    different; runs of two drafter families are matched on results_json.fields_to_match's fields only)."""
    out = []
    match = results_json.fields_to_match(key, expected)
    for f, want in expected.items():
        if f not in match:
            continue
        if f in ("attention", "family") and (key.get(f) is None or want is None):
            continue
        if key.get(f) != want:
            out.append((f, key.get(f), want))
    return out


def _short(v: Any) -> str:
    s = str(v)
    return s[:19] + "..." if isinstance(v, str) and len(s) > 22 and s.startswith("sha256") else s


@dataclass
class ComparedRuns:
    """Runs set side by side (compare()): in order, the baseline first; their labels; what differs from the
    reference; intervals and paired comparisons computed on demand. The API's reval.Comparison is a view of
    it (`.model`), with the rows as plain records."""
    runs: list[Result]              # baseline first when there is one
    labels: dict[str, str]             # run path (str) -> display label
    baseline: Result | None = None
    differences: list[Difference] = field(default_factory=list)
    _estimates: dict = field(default_factory=dict, repr=False)
    _paired: dict = field(default_factory=dict, repr=False)
    views: dict = field(default_factory=dict, repr=False)  # derived views computed once (results/suites.py)

    def label(self, run: Result) -> str:
        return self.labels[str(run.path)]

    def incomparable(self, run: Result) -> bool:
        return any(d.run == self.label(run) for d in self.differences)

    def rankable(self, run: Result) -> bool:
        return run.result is not None and not run.suspect and not self.incomparable(run)

    def estimates(self, run: Result) -> dict[str, Estimate]:
        """95% bootstrap intervals over prompts of the run's headline numbers (computed once)."""
        key = str(run.path)
        if key not in self._estimates:
            self._estimates[key] = intervals.estimates(run.result) if run.result is not None else {}
        return self._estimates[key]

    def use_estimates(self, run: Result, est: dict[str, Estimate]) -> None:
        """The run's intervals, computed before (intervals.estimates of its result: the same numbers)."""
        self._estimates[str(run.path)] = est

    def paired(self, run: Result) -> dict[str, Paired]:
        """The run against the baseline, paired by prompt (empty for the baseline itself, runs without
        results, and runs that are not comparable with the baseline)."""
        base = self.baseline
        if base is None or run is base or run.result is None or base.result is None or self.incomparable(run):
            return {}
        key = str(run.path)
        if key not in self._paired:
            self._paired[key] = intervals.compare_paired(run.result, base.result)
        return self._paired[key]


def run_labels(runs: list[Result]) -> dict[str, str]:
    """Display labels: the bare name where it is unique among `runs`, else host/name."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.name] = counts.get(r.name, 0) + 1
    return {str(r.path): r.name if counts[r.name] == 1 else r.spec for r in runs}


def build_comparison(runs: list[Result], baseline: Result | None = None) -> ComparedRuns:
    """Order runs (baseline first) and find every comparability field that differs from the reference
    (the baseline, else the first run with results). Runs without results take no part."""
    if baseline is not None:
        runs = [baseline] + [r for r in runs if r.path.resolve() != baseline.path.resolve()]
    cmp = ComparedRuns(runs=runs, labels=run_labels(runs), baseline=baseline)
    with_results = [r for r in runs if r.result is not None]
    if not with_results:
        return cmp
    ref = baseline if baseline is not None and baseline.result is not None else with_results[0]
    ref_key = ref.result.comparability.key()
    for r in with_results:
        if r is ref:
            continue
        for f, value, expected in key_differences(r.result.comparability.key(), ref_key):
            cmp.differences.append(Difference(cmp.label(r), f, value, expected, cmp.label(ref)))
    return cmp


def _record(x: Result | results_json.Result | str | Path) -> Result:
    if isinstance(x, Result):
        return x
    if isinstance(x, results_json.Result):
        where = x.source.parent if x.source is not None else Path(x.run)
        return Result(name=x.run, host=x.environment.hostname, path=where, result=x)
    return load_run(x)


def compare(runs: list, baseline=None, *, allow_incomparable: bool = False) -> ComparedRuns:
    """The comparison the CLI prints: runs (Results, results_json.Results or run directories) in order, the
    baseline first; comparability checked (ConfigError naming what differs unless allow_incomparable); intervals and
    paired comparisons computed on demand (`ComparedRuns.estimates(run)`, `.paired(run)`)."""
    cmp = build_comparison([_record(r) for r in runs], None if baseline is None else _record(baseline))
    if not allow_incomparable:
        require_comparable(cmp)
    return cmp


def require_comparable(cmp: ComparedRuns) -> None:
    """Raise (exit 3) naming every differing field, unless all runs are comparable."""
    if not cmp.differences:
        return
    lines = "\n".join(str(d) for d in cmp.differences)
    raise ConfigError(f"runs are not comparable, refusing to rank them:\n{lines}",
                      hint="compare runs evaluated with the same cache, prompts, max-blocks and metric "
                           "definitions, or pass --allow-incomparable to show them side by side (marked)")


def short_attention(signature: str | None) -> str:
    """'sliding_attention/4/causal,sliding_attention/4/causal,full_attention/-/bidirectional' ->
    '2x sliding/4/causal + full/-/bidirectional' (runs of equal layers counted)."""
    if not signature:
        return "not recorded"
    parts = [p.replace("_attention", "") for p in signature.split(",")]
    groups: list[list] = []
    for p in parts:
        if groups and groups[-1][0] == p:
            groups[-1][1] += 1
        else:
            groups.append([p, 1])
    return " + ".join(f"{n}x {p}" if n > 1 else p for p, n in groups)


def comparability_note(cmp: ComparedRuns) -> str:
    if not cmp.differences:
        families = {r.result.comparability.family or "dflash" for r in cmp.runs if r.result is not None}
        if len(families) > 1:
            return (f"comparable across drafter families ({', '.join(sorted(families))}): same prompts and "
                    "completions, max-blocks, metrics, regime; caches, blocks and attention are each decoder's own")
        sigs = {r.result.comparability.attention for r in cmp.runs if r.result is not None}
        layout = f" ({short_attention(sigs.pop())})" if len(sigs) == 1 else ""
        return f"comparable: same cache, prompts, max-blocks, metrics, drafter attention{layout}"
    fields = sorted({FIELD_WORDS.get(d.field, d.field) for d in cmp.differences})
    runs = sorted({d.run for d in cmp.differences})
    return f"NOT comparable ({', '.join(fields)} differ for {', '.join(runs)}): marked, not ranked"




def checkpoint_step(result: results_json.Result | None, name: str = "") -> int | None:
    """The drafter's training step: results.drafter.step, else a `step-N`/`ckpt-N` in its path or the run name."""
    if result is not None and result.drafter.step is not None:
        return result.drafter.step
    for s in (result.drafter.path if result is not None else "", name):
        m = _STEP.search(Path(s.rstrip("/")).name) or _STEP.search(s)
        if m:
            return int(m.group(1))
    return None


def run_duration_s(run: Result) -> float | None:
    """The run's wall time, one figure wherever a run's duration is shown: status.json's started -> finished
    (what `reval status`, `reval ls` and the `done` line say); results.json's timing.total_s (the payload's
    own run, a little shorter) only where status.json is missing."""
    st = run.status or {}
    a, b = iso_s(st.get("started_at")), iso_s(st.get("finished_at"))
    if a is not None and b is not None:
        return b - a
    t = run.result.timing.total_s if run.result is not None else None
    return float(t) if t is not None else None


def run_marks(cmp: ComparedRuns, run: Result) -> list[str]:
    marks = []
    if run is cmp.baseline:
        marks.append("base")
    if run.result is None:
        marks.append(run.state.upper())
    if run.suspect:
        marks.append("SUSPECT")
    if cmp.incomparable(run):
        marks.append("INCOMPARABLE")
    return marks
