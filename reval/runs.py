"""One run through the API: submit (check_spec first) or find/attach/unfinished -> Run, and its verbs:
status, events, log, finish (-> Finished), wait (-> Result), pull (-> Pulled), kill (-> Killed); the
one-call forms status/logs/pull/kill take a RUN reference."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.backends import get_backend
from orchestrator.backends.base import Launch
from orchestrator.errors import ConfigError, EvalFailed, RunNotFound
from orchestrator.hosts.gpuspec import normalize_gpus
from orchestrator.hosts.inventory import Host, Inventory
from orchestrator.rundir import logs as _logs
from orchestrator.rundir import registry as _runs
from orchestrator.rundir.events import Event, EventSink, LogLine
from orchestrator.rundir.pull import Pulled
from orchestrator.rundir.registry import RunState
from orchestrator.runs import extracts as _extracts
from orchestrator.runs import lifecycle as _lifecycle
from orchestrator.runs import locate as _locate
from orchestrator.runs.lifecycle import EvalSpec, Finished

from .hosts import Prepared, as_host, as_inventory, prepare
from .results import Result


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


class Run:
    """A run on a host: `state`/`status()`, `events()`, `finish()`, `wait()`, `log()`, `pull()`, `kill()`."""

    def __init__(self, handle: _lifecycle.RunHandle, *, reattached: bool = False,
                 runs_dir: str | Path | None = None):
        self._run = handle
        self.reattached = reattached  # submit(reattach=True) found this command's unfinished run and attached
        self.runs_dir = runs_dir  # where its copy here goes (find(runs_dir=)); None: $REVAL_RUNS_DIR or ./runs

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
        with _runs.runs_root(self.runs_dir):
            return self._finish(on_event, log_offset, tail, give_up_s)

    def _finish(self, on_event, log_offset, tail, give_up_s) -> Finished:
        h, t = self._run, self._run.backend.transport
        if h.launch is None:  # a run found rather than started now: a linked run folder or log is never followed
            _logs.refuse_links(t, self.name)
        if tail:
            log_offset = _logs.read_log_tail(t, self.name, tail)[1]
        return h.finish(EventSink(on_event) if on_event else None, log_offset=log_offset, give_up_s=give_up_s)

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
        with _runs.runs_root(self.runs_dir):
            return self._run.pull()

    def kill(self, *, grace_s: float = 10.0) -> Killed:
        """Cancel it (TERM, wait grace_s, KILL; confirmed; a Slurm job: scancel, then until Slurm says it is
        gone). A run that has already ended is left as it is (`already_ended`)."""
        be = self._run.backend
        before = be.state(self.name)
        # a damaged status.json proves no end: the backend says so (exit 3, nothing signalled), not "already ended"
        if before is not None and before.terminal and before.status:
            return Killed(self.host, self.name, before, already_ended=True)
        return Killed(self.host, self.name, be.cancel(self.name, grace_s=grace_s, known=before))


def find(run: str, *, host: str | None = None, inventory: Inventory | str | Path | None = None,
         runs_dir: str | Path | None = None) -> Run:
    """The run a RUN reference names: `host/name`, or `name` (with `host`, else looked up in runs/ here, then
    on every inventory host; on several: reval.Error naming them; nowhere: exit_code 102). `runs_dir`: the
    runs/ here that is looked in and that its pull and finish write to (default: $REVAL_RUNS_DIR, else ./runs)."""
    with _runs.runs_root(runs_dir):
        h, name = _locate.locate_run(as_inventory(inventory), run, host)
        return Run(_lifecycle.attach(get_backend(h), name), runs_dir=runs_dir)


def attach(host: Host | str, name: str, *, inventory: Inventory | str | Path | None = None) -> Run:
    """A handle on a run that already exists on `host` (started by the CLI, the API or a sweep)."""
    return Run(_lifecycle.attach(get_backend(as_host(host, inventory)), name))


def unfinished(host: Host | str, spec: EvalSpec, *, name: str | None = None,
               inventory: Inventory | str | Path | None = None) -> Run | None:
    """The run this folder started on `host` with the same spec (and `name`, when given) whose end it did not
    see (its controller was stopped: Ctrl-C in `reval demo`, a killed terminal): a Run to finish() instead of
    starting the same eval again (`reattached`); None when there is none."""
    h = as_host(host, inventory)
    again = _lifecycle.unfinished(h.name, spec.identity(h.name), name=name)
    return Run(_lifecycle.attach(get_backend(h), again), reattached=True) if again else None


def check_spec(host: Host | str, spec: EvalSpec, *, name: str | None = None,
               inventory: Inventory | str | Path | None = None) -> EvalSpec:
    """What submit refuses before anything happens anywhere (reval.Error, exit_code 3): the spec itself, a
    relative path on a remote host (it would silently mean the payload folder there; on a local host it is taken
    from the current directory), the GPUs, the run name, a runs/ here that is a file or unwritable. Returns the
    spec with its paths made absolute (the drafter, target and every cache)."""
    h = as_host(host, inventory)
    missing = spec.missing()
    if missing:
        raise ConfigError(f"reval run: missing {', '.join(missing)}",
                          hint="reval run HOST --drafter PATH --target PATH --cache PATH")
    spec = spec.with_paths(lambda k, v: host_path(k, v, h))
    normalize_gpus(spec.gpus or h.gpus)
    if name is not None:
        _runs.check_run_name(name)
    _runs.check_local_runs_root(h.name)  # where the follow state and the pulled copy go
    return spec


def host_path(k: str, v: str | None, h: Host) -> str | None:
    if not v or os.path.isabs(v):
        return v
    if h.is_local:
        return os.path.abspath(v)
    raise ConfigError(f"--{k} {v!r} is relative: give the absolute path on {h.name}", hint=f"e.g. --{k} /data/{v}")


def submit(host: Host | str, spec: EvalSpec, *, name: str | None = None,
           inventory: Inventory | str | Path | None = None, prepared: Prepared | None = None,
           reattach: bool = False, argv: list[str] | None = None, prompt_caches: dict | None = None) -> Run:
    """Check the spec (check_spec), sync the payload and venv to `host` (unless `prepared` for it), check the
    spec's paths there, and start the eval detached. `host`: an inventory Host (`inv["gpu1"]`) or its name.
    reattach: when this controller started the same command on that host (and name) and did not see it end,
    attach to that run instead of starting another (`run.reattached`). argv: the command line to record in
    run.json (the CLI's; an API run records `"via": "reval API"`). A spec with --prompts is resolved first
    (resolve_prompts: the missing caches built); run.json records each suite's cache key (`prompt_caches`: what
    resolve_prompts returned, when the caller resolved them itself)."""
    h = as_host(host, inventory)
    spec = check_spec(h, spec, name=name)
    if prepared is not None and prepared.host != h.name:
        raise ConfigError(f"prepared for {prepared.host}, not {h.name}", hint=f"reval.prepare({h.name!r})")
    prep = prepared or prepare(h)
    backend = prep.backend
    if spec.prompts:  # each suite's cache from the host's store, built first when missing
        spec, prompt_caches = resolve_prompts(h, spec, prepared=prep)
    again = _lifecycle.unfinished(h.name, spec.identity(h.name), name=name) if reattach else None
    if again:
        return Run(_lifecycle.attach(backend, again, python=prep.python), reattached=True)
    extra = {"via": "reval API"} if argv is None else {}
    extra.update({"prompt_caches": prompt_caches} if prompt_caches else {})
    return Run(_lifecycle.submit(backend, spec, python=prep.python, name=name, argv=argv,
                                 run_json={"payload_hash": prep.synced.manifest_hash, "venv_key": prep.env.key,
                                           **extra}))


def resolve_prompts(host: Host | str, spec: EvalSpec, *, prepared: Prepared | None = None,
                    on_event: Callable[[Event], None] | None = None, inventory: Inventory | str | Path | None = None,
                    give_up_s: float = 120.0) -> tuple[EvalSpec, dict]:
    """A spec's --prompts suites resolved to their caches in the host's store (`reval run --prompts`): the
    missing ones built first by one extract run (its events to `on_event`), then (the spec with those caches as
    --cache NAME=PATH, {suite: {"key", "built", "file"}}). submit() does it when the spec still has prompts."""
    h = as_host(host, inventory)
    if not spec.prompts:
        return spec, {}
    prep = prepared or prepare(h)
    return _extracts.resolve_prompts(prep, spec, sink=EventSink(on_event) if on_event else None,
                                     give_up_s=give_up_s)


def status(run: str, *, host: str | None = None, inventory: Inventory | str | Path | None = None) -> RunState:
    """A run's state now (`reval status RUN`); without a RUN, `reval status` is ls(here=True)."""
    return find(run, host=host, inventory=inventory).status()


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


def kill(run: str, *, host: str | None = None, grace_s: float = 10.0,
         inventory: Inventory | str | Path | None = None) -> Killed:
    """Cancel a run (`reval kill RUN`): see Run.kill."""
    return find(run, host=host, inventory=inventory).kill(grace_s=grace_s)
