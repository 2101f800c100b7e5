"""reval as a library: run DFlash drafter evals on GPU hosts, follow them, load and compare results.

    import reval
    inv = reval.Inventory.load("hosts.yaml")             # the CLI's validation and one-line errors
    run = reval.submit(inv["gpu1"], reval.EvalSpec(drafter="/m/step4000", target="/m/Qwen3.6-27B",
                       cache="/eval/cache", num_prompts=10, max_blocks=30), name="step4000")
    for ev in run.events():                              # typed progress (what the CLI's bar draws):
        ...                                              #   reval.LogLine / Progress / StatusChange / Note
    res = run.wait()                                     # follows, pulls, returns a reval.Result
    res.metrics.tau, res.per_prompt[0].acceptance_lengths, res.health.suspect, res.path
    base = reval.load("runs/gpu1/zlab_full")             # any pulled run directory, or NAME / HOST/NAME
    cmp = reval.compare([res, base], baseline=base)      # what `reval compare` prints, as data
    cmp.best, cmp.rows                                   # the top-tau rankable run; one plain dict per run

Every `reval` command is one of these calls; the CLI only parses its arguments and prints what they return:

    reval hosts check [HOST|GROUP]   check_hosts(target) -> [HostCheck]
    reval sync HOST|GROUP            sync(target) -> [HostSync]            prepare(host) -> Prepared
    reval run HOST ...               submit(host, spec) -> Run; Run.finish() -> Finished (Run.wait() -> Result)
    reval status RUN / reval status  status(run) -> RunState / ls(here=True) -> Listing
    reval ls [HOST|GROUP]            ls(target) -> Listing (oldest first, unreachable hosts named)
    reval logs RUN [-f]              logs(run, tail=N) -> Log / find(run).finish(tail=N)
    reval pull RUN | --all           pull(run) -> Pulled / pull_all(target) -> PulledAll
    reval kill RUN                   kill(run) -> Killed
    reval rm RUN... / reval prune    plan_rm(runs) / plan_prune(target, failed=, older_than_s=) -> RemovalPlan,
                                     .apply() (rm(...) / prune(...): both at once)
    reval compare RUN...             compare(runs, baseline=) -> Comparison (.save_plot, .write_html)
    reval sweep ...                  sweep(SweepOptions(...)) -> SweepReport
    reval demo                       prepare, build_fixtures(host) -> Fixtures, submit, finish, compare

RUN is `name` (looked up in runs/ here, then on every inventory host) or `host/name`; `find(run)` is the
Run it names. Functions that take a host or a RUN take `inventory=` (an Inventory, or the path of a
hosts.yaml; default: $REVAL_HOSTS, else ./hosts.yaml, else the built-in local host).

Nothing here prints. Errors are `reval.Error` (a RevalError: `str(e)` is the one line, `e.hint` the fix,
`e.exit_code` the CLI's code). Underneath is one lifecycle (orchestrator/lifecycle.py) through a backend
(orchestrator/backends/: SSH or the local folder, or a Slurm cluster). `Result` is a pulled run directory as
read from disk: its typed results.json (`res.result`, remote_payload/contract/results.py; `res.metrics`,
`res.per_prompt`, `res.health`... forward to it), status.json, run.json, `res.state`, `res.suspect`, `res.path`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import sweep as _sweep
from orchestrator.backends import get_backend
from orchestrator.backends.base import Launch
from orchestrator.errors import (
    ConfigError,
    EvalFailed,
    HostKeyError,
    HostUnreachable,
    RevalError,
    RunNotFound,
)
from orchestrator.hosts.environment import EnvInfo, provision
from orchestrator.hosts.gpuspec import normalize_gpus
from orchestrator.hosts.hostcheck import HostCheck
from orchestrator.hosts.hostcheck import check_hosts as _check_hosts
from orchestrator.hosts.inventory import Host, Inventory, load_inventory
from orchestrator.hosts.sync import SyncResult
from orchestrator.hosts.transport import get_transport, q
from orchestrator.render import tables as _tables
from orchestrator.results import compare as _compare
from orchestrator.rundir import logs as _logs
from orchestrator.rundir import registry as _runs
from orchestrator.rundir.events import Event, EventSink, LogLine, Note, Progress, StatusChange
from orchestrator.rundir.registry import RunState
from orchestrator.runs import lifecycle as _lifecycle
from orchestrator.runs import locate as _locate
from orchestrator.runs import remove as _remove
from orchestrator.runs.lifecycle import EvalSpec
from orchestrator.runs.remove import Removal
from orchestrator.sweep import SweepOptions, SweepReport
from orchestrator.sweep.ledger import LAUNCHED
from remote_payload.contract import protocol
from remote_payload.contract.results import Result as _ResultsFile

Error = RevalError

__all__ = ["Comparison", "Error", "EvalSpec", "Event", "Finished", "Fixtures", "Host", "HostCheck", "HostSync",
           "Inventory", "Killed", "Listing", "Log", "LogLine", "Note", "Prepared", "Progress", "Pulled",
           "PulledAll", "Removal", "RemovalPlan", "Result", "Run", "RunState", "StatusChange", "SweepInterrupted",
           "SweepOptions", "SweepReport", "attach", "build_fixtures", "check_hosts", "check_spec", "compare", "find",
           "kill", "load", "logs", "ls", "plan_prune", "plan_rm", "prepare", "prune", "pull", "pull_all", "rm",
           "status", "submit", "sweep", "sync", "unfinished"]

LAST_LINES = 15  # eval.log lines a Finished keeps when the run did not succeed (what the CLI shows)


# -- results ---------------------------------------------------------------------------------------------
class Result(_compare.RunRecord):
    """A pulled run directory as read from disk (reval.load, Run.wait): `result` is its typed results.json
    (None when the eval did not finish; `metrics`, `per_prompt`, `health`... forward to it), `status` and
    `run_info` its status.json and run.json as dicts; `state`, `suspect`, `path`, `name`, `host`."""

    def __repr__(self) -> str:
        t = self.result.metrics.tau if self.result is not None else None
        tau = f" · tau {t:.2f}" if isinstance(t, int | float) else ""
        flag = " (SUSPECT)" if self.suspect else ""
        return f"reval.Result({self.spec}: {self.state}{flag}{tau} · {self.path})"


def _as_result(rec: _compare.RunRecord) -> Result:
    if isinstance(rec, Result):
        return rec
    return Result(**{f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)})


def load(run: str | Path, *, runs_dir: str | Path | None = None) -> Result:
    """A pulled run: a run directory (runs/<host>/<name>/, or any folder holding its results.json/status.json),
    or as the CLI takes it, NAME or HOST/NAME under `runs_dir` (default: $REVAL_RUNS_DIR, else ./runs)."""
    path = run if isinstance(run, Path) else _compare.resolve_run(str(run), runs_dir)
    return _as_result(_compare.load_run(path))


@dataclass
class Comparison:
    """The comparison `reval compare` prints: `rows` (one plain dict per run: metrics, marks, ratio/delta
    vs the baseline), `best` (label of the highest-tau rankable run), `comparable`, `differences`, `note`;
    `model` is the comparison the tables, plots and HTML report are drawn from."""
    model: _compare.Comparison = field(repr=False)
    rows: list[dict] = field(default_factory=list, repr=False)
    best: str | None = None
    comparable: bool = True
    differences: list[dict] = field(default_factory=list)
    note: str = ""

    def __repr__(self) -> str:
        base = f" vs {self.model.label(self.model.baseline)}" if self.model.baseline is not None else ""
        return (f"reval.Comparison({len(self.rows)} runs{base} · best {self.best or '-'}"
                + ("" if self.comparable else " · NOT comparable") + ")")

    def save_plot(self, path: str | Path) -> Path:
        """Acceptance curves, histogram and DDTree plots (.png, .svg or .pdf; needs matplotlib)."""
        from orchestrator.render import plots
        return plots.save_comparison_plot(self.model, path)

    def write_html(self, path: str | Path, *, threshold: float = 0.1) -> Path:
        """The self-contained HTML report (tables, plots, definitions, provenance)."""
        from orchestrator.render import html
        return html.write_comparison_report(self.model, path, threshold=threshold)


def compare(results: list[Result | str | Path], *, baseline: Result | str | Path | None = None,
            allow_incomparable: bool = True, runs_dir: str | Path | None = None) -> Comparison:
    """Compare results (Results, run directories, or NAME / HOST/NAME as in `reval.load`; a glob such as
    'step-*' or 'ct129/step-*' is every pulled run it matches, by step). Runs that are not comparable are
    marked, never ranked; with allow_incomparable=False they are refused (reval.Error naming what differs), as
    `reval compare` does. A baseline without results is refused; a baseline glob must match exactly one run."""
    def where(x):  # every run found before any is read (a wrong name is that line, whatever else is damaged)
        if isinstance(x, str) and _compare.is_run_glob(x):
            return _compare.expand_runs(x, runs_dir)
        return [x if isinstance(x, _compare.RunRecord | _ResultsFile | Path) else _compare.resolve_run(x, runs_dir)]

    def read(x):
        return _as_result(_compare.load_run(x)) if isinstance(x, Path) else x
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
    if isinstance(base, _compare.RunRecord) and base.result is None:
        what = baseline if isinstance(baseline, str) else str(base.path)
        raise ConfigError(f"baseline {what!r} has no results ({base.state})", hint="pick a finished run as --baseline")
    model = _compare.compare(runs, base, allow_incomparable=allow_incomparable)
    data = _tables.comparison_json(model)
    ranked = [r for r in data["runs"] if r["rankable"] and r["metrics"].get("tau") is not None]
    best = max(ranked, key=lambda r: r["metrics"]["tau"])["label"] if ranked else None
    return Comparison(model, data["runs"], best, data["comparable"], data["differences"], data["note"])


# -- one run ---------------------------------------------------------------------------------------------
@dataclass(repr=False)
class Finished(_lifecycle.Finished):
    """How a run ended (Run.finish): `state` in the one vocabulary, `status` (status.json), `path` (the pulled
    copy), `result` (that copy as reval.load reads it; None when it cannot be read: `error` says why),
    `last_lines` (eval.log's last lines when it did not succeed), `discarded` (bad input, the payload's exit
    3: the run was removed on its host and here, its name is free again), `exit_code` (the CLI's)."""
    result: Result | None = None
    error: RevalError | None = None
    last_lines: list[str] = field(default_factory=list)
    discarded: bool = False

    @property
    def has_results(self) -> bool:
        return self.ok and self.result is not None and self.result.result is not None

    @property
    def exit_code(self) -> int:
        """0 succeeded with results · 103 cancelled · 3 bad input · 1 anything else (failed, lost, no results)."""
        return 0 if self.has_results else _lifecycle.failure_exit_code(self.state, self.status)

    def __repr__(self) -> str:
        return f"reval.Finished({self.host}/{self.name}: {self.state}, exit {self.exit_code} · {self.path})"


def _load_pulled(path: Path, status: dict) -> tuple[Result | None, RevalError | None]:
    """The pulled copy as reval.load reads it; when a damaged status.json/run.json copy makes that fail, a
    readable results.json alone still says how the eval ended (the error is kept)."""
    try:
        return load(path), None
    except RevalError as e:
        try:
            typed = _ResultsFile.load(path / protocol.RESULTS_JSON)
        except (OSError, ValueError):  # ResultsError is a ValueError
            return None, e
        return Result(name=path.name, host=path.parent.name, path=path, result=typed, status=status), e


def _last_lines(path: Path, n: int = LAST_LINES) -> list[str]:
    """The last n lines of a pulled eval.log, read from its end (its last 64 KiB: a 1.5 GB log stays there)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            return f.read().decode("utf-8", errors="replace").splitlines()[-n:]
    except OSError:
        return []


@dataclass
class Log:
    """A run's eval.log as it is now: `data` from byte `start` on (all of it, or its last `tail` lines)."""
    host: str
    name: str
    data: bytes = field(repr=False)
    start: int = 0

    def lines(self) -> list[LogLine]:
        """Its lines (without the newline), each with its byte offset in eval.log."""
        return [LogLine(raw.rstrip(b"\n").decode("utf-8", errors="replace"), off)
                for off, raw in _logs.lines_with_offsets(self.data, self.start)]


@dataclass
class Killed:
    """What `kill` did: `state` is the run's state after it (cancelled, or how it ended by itself);
    `already_ended`: it had ended before, nothing was signalled."""
    host: str
    name: str
    state: RunState
    already_ended: bool = False


@dataclass
class Pulled:
    """A run's files copied to runs/<host>/<name>/ (`path`): `files` (contract files only); `state` as its
    host reported it (None where it was not asked)."""
    host: str
    name: str
    path: Path
    files: list[str] = field(default_factory=list)
    state: str | None = None


class Run:
    """A run on a host: `state`/`status()`, `events()`, `finish()`, `wait()`, `log()`, `pull()`, `kill()`."""

    def __init__(self, handle: _lifecycle.Run, *, reattached: bool = False):
        self._run = handle
        self.reattached = reattached  # submit(reattach=True) found this command's unfinished run and attached

    def __repr__(self) -> str:
        return f"reval.Run({self.ref})"

    @property
    def name(self) -> str:
        return self._run.name

    @property
    def host(self) -> str:
        return self._run.host

    @property
    def ref(self) -> str:
        """`host/name`, as the CLI takes it."""
        return self._run.ref

    @property
    def launch(self) -> Launch | None:
        """Where it started (host, run_dir, handle, device, gpus; `queued` on a scheduler); None for a run
        attached to rather than started now."""
        return self._run.launch

    def status(self) -> RunState:
        """The host's verdict now (state, status.json, last progress event, a scheduler's reason);
        reval.Error (exit_code 102) when the host has no such run."""
        s = self._run.probe()
        if s is None:
            raise RunNotFound(f"no run {self.name!r} on {self.host}", hint=f"list runs: reval ls {self.host}")
        return s

    @property
    def state(self) -> str:
        """queued | running | succeeded | failed | cancelled | lost — asked from the host now; `unknown`: its
        status.json is missing or damaged; `no-answer`: its scheduler cannot answer now (not an end: ask again;
        finish() and wait() keep waiting)."""
        return self.status().state

    def events(self, *, log_offset: int = 0, give_up_s: float = 120.0) -> Iterator[Event]:
        """Typed events until the run is over (from byte `log_offset` of its eval.log)."""
        return self._run.events(log_offset=log_offset, give_up_s=give_up_s)

    def log(self, *, tail: int | None = None) -> Log:
        """Its eval.log as it is now (the last `tail` lines); a run folder or log that is a symbolic link is
        refused, never read."""
        self.status()
        if tail:  # read from the end: a 1.5 GB log is never read whole for its last lines
            data, start = _logs.read_log_tail(self._run.backend.transport, self.name, tail)
            return Log(self.host, self.name, data, start)
        return Log(self.host, self.name, _logs.read_log(self._run.backend.transport, self.name), 0)

    def log_lines(self) -> Iterator[LogLine]:
        """Its eval.log as it is now, line by line (each with its byte offset), streamed from the host: memory
        stays bounded whatever its size (a line longer than 1 MiB comes in pieces); refusals as log()'s."""
        self.status()
        for off, raw in _logs.iter_lines(_logs.iter_log(self._run.backend.transport, self.name)):
            yield LogLine(raw.rstrip(b"\n").decode("utf-8", errors="replace"), off)

    def log_chunks(self) -> Iterator[bytes]:
        """Its eval.log as it is now, in pieces of bytes, streamed from the host (bounded memory)."""
        self.status()
        return _logs.iter_log(self._run.backend.transport, self.name)

    def finish(self, *, on_event: Callable[[Event], None] | None = None, log_offset: int | None = None,
               tail: int | None = None, give_up_s: float = 120.0) -> Finished:
        """Follow to the end (events to `on_event`, from byte `log_offset` of eval.log, or the start of its
        last `tail` lines; default: where the last follow from this folder stopped), pull, and say how it
        ended. Never raises for a failed eval (see `wait`). Bad input (the payload's exit 3) leaves nothing:
        the run is removed on its host and here (`discarded`), after its log's tail was read."""
        h, t = self._run, self._run.backend.transport
        if h.launch is None:  # a run found rather than started now: a linked run folder or log is never followed
            _logs.refuse_links(t, self.name)
        if tail:
            log_offset = _logs.read_log_tail(t, self.name, tail)[1]
        fin = h.wait(EventSink(on_event) if on_event else None, log_offset=log_offset, give_up_s=give_up_s)
        result, error = _load_pulled(fin.path, fin.status)
        done = Finished(**{f.name: getattr(fin, f.name) for f in dataclasses.fields(fin)}, result=result,
                        error=error)
        if not done.has_results:
            done.last_lines = _last_lines(fin.path / protocol.EVAL_LOG)
        if _lifecycle.bad_input(fin):  # the one clean-up of an exit 3: nothing left on either side
            h.discard()
            done.discarded = True
        return done

    def wait(self, *, give_up_s: float = 120.0, on_event: Callable[[Event], None] | None = None) -> Result:
        """Follow to the end, pull, and load the result. A run that did not succeed raises reval.Error
        (exit_code 1, or 3 for bad input, 103 cancelled) with `.finished` (how it ended) and `.result`."""
        fin = self.finish(on_event=on_event, give_up_s=give_up_s)
        if fin.has_results:
            return fin.result
        if fin.ok and fin.error is not None:
            raise fin.error  # the pulled copy cannot be read: that line, not "failed"
        why = fin.status.get("error") or f"exit {fin.status.get('exit_code')}"
        err = EvalFailed(f"{self.ref}: {fin.state} ({why})", hint=f"see {fin.path}/eval.log", exit_code=fin.exit_code)
        err.finished, err.result = fin, fin.result
        raise err

    def pull(self) -> Pulled:
        """Copy its files to runs/<host>/<name>/ (only the run-directory contract's files)."""
        res = self._run.pull()
        return Pulled(self.host, self.name, res.path, list(res.files))

    def kill(self, *, grace_s: float = 10.0) -> Killed:
        """Cancel it (TERM, wait grace_s, KILL; confirmed; a Slurm job: scancel, then until Slurm says it is
        gone). A run that has already ended is left as it is (`already_ended`)."""
        be = self._run.backend
        before = be.state(self.name)
        # a damaged status.json proves no end: the backend says so (exit 3, nothing signalled), not "already ended"
        if before is not None and before.terminal and before.status:
            return Killed(self.host, self.name, before, already_ended=True)
        return Killed(self.host, self.name, be.cancel(self.name, grace_s=grace_s, known=before))


def _inventory(inventory: Inventory | str | Path | None) -> Inventory:
    return inventory if isinstance(inventory, Inventory) else load_inventory(inventory)


def _host(host: Host | str, inventory: Inventory | str | Path | None) -> Host:
    return host if isinstance(host, Host) else _inventory(inventory).get(host)


def find(run: str, *, host: str | None = None, inventory: Inventory | str | Path | None = None) -> Run:
    """The run a RUN reference names: `host/name`, or `name` (with `host`, else looked up in runs/ here, then
    on every inventory host; on several: reval.Error naming them; nowhere: exit_code 102)."""
    h, name = _locate.resolve_run(_inventory(inventory), run, host)
    return Run(_lifecycle.attach(get_backend(h), name))


def attach(host: Host | str, name: str, *, inventory: Inventory | str | Path | None = None) -> Run:
    """A handle on a run that already exists on `host` (started by the CLI, the API or a sweep)."""
    return Run(_lifecycle.attach(get_backend(_host(host, inventory)), name))


def unfinished(host: Host | str, spec: EvalSpec, *, name: str | None = None,
               inventory: Inventory | str | Path | None = None) -> Run | None:
    """The run this folder started on `host` with the same spec (and `name`, when given) whose end it did not
    see (its controller was stopped: Ctrl-C in `reval demo`, a killed terminal): a Run to finish() instead of
    starting the same eval again (`reattached`); None when there is none."""
    h = _host(host, inventory)
    again = _lifecycle.unfinished(h.name, spec.identity(h.name), name=name)
    return Run(_lifecycle.attach(get_backend(h), again), reattached=True) if again else None


@dataclass
class Prepared:
    """A host made ready for runs (reval.prepare): the payload synced (`synced`), its venv checked or built
    (`env`, `python`). Pass it to submit/build_fixtures to do that once for several runs."""
    host: str
    synced: SyncResult
    env: EnvInfo
    _backend: object = field(default=None, init=False, repr=False, compare=False)

    @property
    def python(self) -> str:
        return self.env.python

    @property
    def workdir(self) -> str:
        """The host's workdir (absolute): runs/, payload/, venvs/ live there."""
        return self._backend.workdir()


def prepare(host: Host | str, *, inventory: Inventory | str | Path | None = None) -> Prepared:
    """Sync the payload to `host` (only what changed) and check or build its venv: one probe round trip."""
    h = _host(host, inventory)
    backend = get_backend(h)
    prep = _lifecycle.prepare(backend)
    ready = Prepared(h.name, prep.synced, prep.env)
    ready._backend = backend  # submit and build_fixtures reuse its transport (and the workdir it resolved)
    return ready


def check_spec(host: Host | str, spec: EvalSpec, *, name: str | None = None,
               inventory: Inventory | str | Path | None = None) -> EvalSpec:
    """What submit refuses before anything happens anywhere (reval.Error, exit_code 3): the spec itself, a
    relative path on a remote host (it would silently mean the payload folder there; on a local host it is taken
    from the current directory), the GPUs, the run name, a runs/ here that is a file or unwritable. Returns the
    spec with its paths made absolute (`cache`: a path, or [NAME=PATH, ...] for benchmark suites)."""
    h = _host(host, inventory)
    spec = dataclasses.replace(spec.validate())
    spec.drafter, spec.target = _host_path("drafter", spec.drafter, h), _host_path("target", spec.target, h)
    caches = spec.cache
    if isinstance(caches, list):  # --cache PATH, or NAME=PATH per suite: the PATH part is the host's
        paths = []
        for c in caches:
            suite, sep, path = c.partition("=")
            named = sep and path and "/" not in suite
            paths.append(f"{suite}={_host_path('cache', path, h)}" if named else _host_path("cache", c, h))
        spec.cache = paths[0] if len(paths) == 1 and "=" not in caches[0] else paths
    else:
        spec.cache = _host_path("cache", caches, h)
    normalize_gpus(spec.gpus or h.gpus)
    if name is not None:
        _runs.check_run_name(name)
    _runs.check_local_runs_root(h.name)  # where the follow state and the pulled copy go
    return spec


def _host_path(k: str, v: str | None, h: Host) -> str | None:
    if not v or os.path.isabs(v):
        return v
    if h.is_local:
        return os.path.abspath(v)
    raise ConfigError(f"--{k} {v!r} is relative: give the absolute path on {h.name}", hint=f"e.g. --{k} /data/{v}")


def _sweep_paths(options: SweepOptions, inventory: Inventory) -> SweepOptions:
    """The sweep's --target/--cache under run's path rule (check_spec): a relative path on local hosts means the
    current directory (made absolute here); with a remote host among --hosts it is refused (exit 3), naming it."""
    hosts = [h for name in options.hosts for h in inventory.resolve(name)]
    remote = next((h for h in hosts if not h.is_local), None)
    here = remote or Host(name="local", local=True)

    def fix(k: str, v: str | None) -> str | None:
        if v and not os.path.isabs(v) and remote is not None:
            raise ConfigError(f"reval sweep: --{k} {v!r} is relative; {remote.name} is a remote host: give the "
                              f"absolute path there", hint=f"e.g. --{k} /data/{v}")
        return _host_path(k, v, here)

    caches = options.cache
    if isinstance(caches, list):
        out = []
        for c in caches:
            suite, sep, path = c.partition("=")
            out.append(f"{suite}={fix('cache', path)}" if sep and path and "/" not in suite else fix("cache", c))
        caches = out
    else:
        caches = fix("cache", caches)
    return dataclasses.replace(options, target=fix("target", options.target), cache=caches)


def submit(host: Host | str, spec: EvalSpec, *, name: str | None = None,
           inventory: Inventory | str | Path | None = None, prepared: Prepared | None = None,
           reattach: bool = False, argv: list[str] | None = None) -> Run:
    """Check the spec (check_spec), sync the payload and venv to `host` (unless `prepared` for it), check the
    spec's paths there, and start the eval detached. `host`: an inventory Host (`inv["gpu1"]`) or its name.
    reattach: when this controller started the same command on that host (and name) and did not see it end,
    attach to that run instead of starting another (`run.reattached`). argv: the command line to record in
    run.json (the CLI's; an API run records `"via": "reval API"`)."""
    h = _host(host, inventory)
    spec = check_spec(h, spec, name=name)
    if prepared is not None and prepared.host != h.name:
        raise ConfigError(f"prepared for {prepared.host}, not {h.name}", hint=f"reval.prepare({h.name!r})")
    prep = prepared or prepare(h)
    backend = prep._backend
    again = _lifecycle.unfinished(h.name, spec.identity(h.name), name=name) if reattach else None
    if again:
        return Run(_lifecycle.attach(backend, again, python=prep.python), reattached=True)
    extra = {"via": "reval API"} if argv is None else {}
    return Run(_lifecycle.submit(backend, spec, python=prep.python, name=name, argv=argv,
                                 run_json={"payload_hash": prep.synced.manifest_hash, "venv_key": prep.env.key,
                                           **extra}))


# -- the runs on hosts -------------------------------------------------------------------------------------
def _per_host(hosts: list[Host], fn) -> tuple[dict, dict[str, str]]:
    """fn(backend) on every host in parallel: ({host: result}, {host: why unreachable}), in host order."""
    def one(h):
        try:
            return h.name, fn(get_backend(h)), None
        except RevalError as e:
            return h.name, None, str(e)
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as ex:
        done = list(ex.map(one, hosts))
    return ({n: r for n, r, e in done if e is None}, {n: e for n, r, e in done if e is not None})


def _hosts(inv: Inventory, target: str | None) -> list[Host]:
    return inv.resolve(target) if target else list(inv.hosts.values())


@dataclass
class Listing:
    """Runs as their hosts report them now, oldest first; `unreachable`: {host: why}."""
    runs: list[RunState] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> list[dict]:
        """What `--json` prints: one object per run, then one per unreachable host."""
        return ([s.to_json() for s in self.runs]
                + [{"host": h, "state": "unreachable", "error": why} for h, why in self.unreachable.items()])


def status(run: str, *, host: str | None = None, inventory: Inventory | str | Path | None = None) -> RunState:
    """A run's state now (`reval status RUN`); without a RUN, `reval status` is ls(here=True)."""
    return find(run, host=host, inventory=inventory).status()


def ls(target: str | None = None, *, here: bool = False, inventory: Inventory | str | Path | None = None) -> Listing:
    """The runs on a host or group (default: every inventory host), as the hosts report them now (`reval ls`);
    here=True: only the runs in runs/ here (launched or pulled from this folder) that their hosts still have
    (`reval status` without RUN)."""
    inv = _inventory(inventory)
    hosts = _hosts(inv, target)
    known = set(_runs.local_registry()) if here else set()
    if here:
        names = {h for h, _ in known}
        hosts = sorted((h for h in hosts if h.name in names), key=lambda h: h.name)
    found, unreachable = _per_host(hosts, lambda be: be.list_runs())
    states = [s for h in hosts for s in found.get(h.name, []) if not here or (s.host, s.name) in known]
    return Listing(_runs.by_start_time(states), unreachable)


def logs(run: str, *, host: str | None = None, tail: int | None = None,
         inventory: Inventory | str | Path | None = None) -> Log:
    """A run's eval.log as it is now (`reval logs RUN [--tail N]`); following it: find(run).finish()."""
    return find(run, host=host, inventory=inventory).log(tail=tail)


def pull(run: str, *, host: str | None = None, inventory: Inventory | str | Path | None = None) -> Pulled:
    """Copy a run's files to runs/<host>/<name>/ and say its state (`reval pull RUN`)."""
    r = find(run, host=host, inventory=inventory)
    p = r.pull()
    s = r._run.probe()
    p.state = s.state if s else None
    return p


@dataclass
class PulledAll:
    """pull_all's answer: every run pulled, host by host; `unreachable`: {host: why}."""
    runs: list[Pulled] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)


def pull_all(target: str | None = None, *, inventory: Inventory | str | Path | None = None) -> PulledAll:
    """Pull every run of a host or group (default: every inventory host) (`reval pull --all`)."""
    hosts = _hosts(_inventory(inventory), target)

    def every(be):
        pulled = []
        for s in be.list_runs():
            res = be.pull(s.name)
            pulled.append(Pulled(be.host.name, s.name, res.path, list(res.files), s.state))
        return pulled
    found, unreachable = _per_host(hosts, every)
    return PulledAll([p for h in hosts for p in found.get(h.name, [])], unreachable)


def kill(run: str, *, host: str | None = None, grace_s: float = 10.0,
         inventory: Inventory | str | Path | None = None) -> Killed:
    """Cancel a run (`reval kill RUN`): see Run.kill."""
    return find(run, host=host, inventory=inventory).kill(grace_s=grace_s)


@dataclass
class RemovalPlan:
    """What rm/prune would remove (`runs`: host/name, its state, on the host and/or here), the runs prune
    left alone because their age cannot be trusted (`skipped`: (RunState, why)), hosts that could not be
    asked (`unreachable`). Nothing is removed until `apply()`."""
    runs: list[Removal] = field(default_factory=list)
    skipped: list[tuple[RunState, str]] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    _backends: list = field(default_factory=list, init=False, repr=False, compare=False)

    def _add(self, backend, removal: Removal) -> None:
        self._backends.append(backend)
        self.runs.append(removal)

    def apply(self) -> list[Removal]:
        """Remove them (each on its host first, then the copy here); the removals done."""
        for be, r in zip(self._backends, self.runs):
            _remove.remove(be, r)
        return self.runs


def plan_rm(runs: list[str] | str, *, host: str | None = None, local_only: bool = False,
            inventory: Inventory | str | Path | None = None) -> RemovalPlan:
    """Plan removing runs (RUN references) from their hosts and runs/ here (`reval rm`); every run is checked
    first: a running one (exit_code 3) or one that is nowhere (102) refuses them all."""
    inv = _inventory(inventory)
    plan = RemovalPlan()
    for ref in [runs] if isinstance(runs, str) else runs:
        h, name = _locate.resolve_run(inv, ref, host)
        be = get_backend(h)
        plan._add(be, _remove.plan(be, name, local_only=local_only))
    return plan


def plan_prune(target: str | None = None, *, failed: bool = False, older_than_s: float | None = None,
               local_only: bool = False, inventory: Inventory | str | Path | None = None) -> RemovalPlan:
    """Plan removing the runs of a host or group (default: every host) that did not succeed (`failed`) and/or
    ended more than `older_than_s` ago by their host's clock (`reval prune`); never a running run."""
    if not (failed or older_than_s is not None):
        raise ConfigError("reval prune: say which runs: --failed and/or --older-than AGE",
                          hint="e.g. reval prune --failed ; reval prune gpu1 --older-than 14d")
    hosts = _hosts(_inventory(inventory), target)
    found, unreachable = _per_host(hosts, lambda be: (be, be.list_runs()))
    plan = RemovalPlan(unreachable=unreachable)
    for h in hosts:
        if h.name not in found:
            continue
        be, states = found[h.name]
        picked, distrusted = _remove.select_for_prune(states, failed=failed, older_than_s=older_than_s)
        for s in picked:
            plan._add(be, _remove.plan(be, s.name, local_only=local_only, state=s))
        plan.skipped += distrusted
    return plan


def rm(runs: list[str] | str, **kw) -> RemovalPlan:
    """plan_rm(...).apply(): remove the runs now (no question asked)."""
    plan = plan_rm(runs, **kw)
    plan.apply()
    return plan


def prune(target: str | None = None, **kw) -> RemovalPlan:
    """plan_prune(...).apply(): remove the matching runs now (no question asked)."""
    plan = plan_prune(target, **kw)
    plan.apply()
    return plan


# -- hosts -----------------------------------------------------------------------------------------------
def check_hosts(target: str | None = None, *, accept_new: bool = False, max_workers: int = 16,
                inventory: Inventory | str | Path | None = None) -> list[HostCheck]:
    """Check a host or group (default: every inventory host) in parallel, one round trip each (`reval hosts
    check`): reachable, host key, python, disk, GPUs, payload and venv; a Slurm cluster's partitions/limits.
    accept_new: record the key of a host seen for the first time (a changed key is still refused)."""
    return _check_hosts(_hosts(_inventory(inventory), target), accept_new=accept_new, max_workers=max_workers)


@dataclass
class HostSync:
    """One host's `sync`: `ok`, or `error` (one line) and `hint`; `reachable`; what changed (`sync`, `env`)."""
    host: str
    ok: bool = False
    reachable: bool = True
    sync: SyncResult | None = None
    env: EnvInfo | None = None
    error: str | None = None
    hint: str | None = None
    elapsed_s: float = 0.0


def _sync_host(host: Host, *, venv: bool = True) -> HostSync:
    t0 = time.monotonic()
    r = HostSync(host.name)
    try:
        r.sync, r.env = provision(get_transport(host), host, venv=venv)
        r.ok = True
    except (HostUnreachable, HostKeyError) as e:
        r.reachable, r.error, r.hint = False, str(e), e.hint
    except RevalError as e:
        r.error, r.hint = str(e).splitlines()[0], "\n".join(str(e).splitlines()[1:] + [e.hint or ""]).strip()
    r.elapsed_s = time.monotonic() - t0
    return r


def sync(target: str, *, venv: bool = True, max_workers: int = 8,
         inventory: Inventory | str | Path | None = None) -> list[HostSync]:
    """Push the payload (only what changed) and provision its venv on a host or every host of a group, in
    parallel (`reval sync`); one failed host does not stop the others."""
    hosts = _inventory(inventory).resolve(target)
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(hosts)))) as pool:
        return list(pool.map(lambda h: _sync_host(h, venv=venv), hosts))


@dataclass
class Fixtures:
    """The tiny offline fixtures built on a host (build_fixtures): `dir` on the host; `target`, `cache`,
    `drafters` (saved steps, in training order), `drafter_good` relative to it."""
    host: str
    dir: str
    target: str
    cache: str
    drafters: list[str]
    drafter_good: str

    def spec(self, drafter: str, **options) -> EvalSpec:
        """An EvalSpec of `drafter` (relative to `dir`) against the fixtures' target and cache."""
        return EvalSpec(drafter=f"{self.dir}/{drafter}", target=f"{self.dir}/{self.target}",
                        cache=f"{self.dir}/{self.cache}", **options)


def build_fixtures(host: Host | str, *, out: str | None = None, prepared: Prepared | None = None,
                   on_line: Callable[[str], None] | None = None,
                   inventory: Inventory | str | Path | None = None) -> Fixtures:
    """Build the tiny offline fixtures on `host` into `out` (default <workdir>/fixtures): a synthetic language,
    a tiny Qwen3 target, a hidden-state cache, DFlash drafters; kept there and reused while their recipe is
    unchanged. The build's output lines go to `on_line`; a failed build raises reval.Error with `.stderr`
    (the last of it)."""
    h = _host(host, inventory)
    prep = prepared or prepare(h)
    t = prep._backend.transport
    fixtures = out or f"{prep.workdir}/fixtures"
    proc = t.popen(f"cd {q(prep.workdir + '/payload')} && PYTHONUNBUFFERED=1 {q(prep.python)} -m remote_payload "
                   f"fixtures --out {q(fixtures)} 2>&1")
    for line in iter(proc.stdout.readline, b""):
        if on_line:
            on_line(line.decode(errors="replace").rstrip())
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    rc = proc.wait()
    if rc:
        e = EvalFailed(f"building the fixtures on {h.name} failed (exit {rc})",
                       hint="see the output above; rerun with: python -m remote_payload fixtures --out DIR")
        e.stderr = stderr[-2000:]
        raise e
    paths = json.loads(t.run(f"cat {q(fixtures + '/fixtures.json')}").stdout)["paths"]
    return Fixtures(h.name, fixtures, paths["target"], paths["cache"], list(paths["drafters"]), paths["drafter_good"])


# -- sweeps ----------------------------------------------------------------------------------------------
def sweep(options: SweepOptions, *, inventory: Inventory | str | Path | None = None,
          on_line: Callable[[str], None] | None = None) -> SweepReport:
    """Evaluate every new checkpoint over the hosts (`reval sweep`): discover, skip what the ledger has, run,
    pull, compare, and write the report files (report.md/.json/.html, plots) into the sweep's folder. Progress
    lines go to `on_line`; the report's `exit_code` is the CLI's."""
    if options.payload == "eval" and not (options.target and options.cache):
        raise ConfigError("reval sweep needs --target and --cache (paths on the hosts)",
                          hint="e.g. --target /root/models/Qwen3.6-27B --cache /root/eval/cache")
    inv = _inventory(inventory)
    options = _sweep_paths(options, inv)
    baseline = _sweep.load_baseline(options.baseline)  # now, not after a night of evals
    sw = _sweep.Sweep(options, inv, log=on_line, baseline=baseline)
    try:
        rep = sw.run()
    except KeyboardInterrupt:  # the runs it launched go on on their hosts; the same sweep() resumes it
        mine = sw.ledger.of_sweep(sw.sweep_id).values() if sw.sweep_id else []
        going = [e for e in mine if e.state == LAUNCHED and e.host and e.run]
        in_flight = set(sw.record.in_flight)
        launched = sorted({(e.host, e.run) for e in going if e.key not in in_flight})
        maybe = sorted({(e.host, e.run) for e in going if e.key in in_flight})
        raise SweepInterrupted(sw.sweep_id or None, launched, maybe) from None
    _sweep.write_report_files(rep)
    return rep


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C (KeyboardInterrupt) during reval.sweep: `launched` lists the (host, run) pairs it had started that
    go on on their hosts (detached: the controller's end does not stop them); `maybe` those whose launch was
    under way (the long poll that starts a slot's next run once the current one ended: started or not, the
    host knows); `sweep_id` is the sweep (None
    when it had not begun). The same sweep() again resumes it: it re-attaches to those runs, pulls what
    finished and launches only what is missing."""

    def __init__(self, sweep_id: str | None, launched: list[tuple[str, str]],
                 maybe: list[tuple[str, str]] | None = None):
        super().__init__()
        self.sweep_id, self.launched, self.maybe = sweep_id, launched, list(maybe or [])
