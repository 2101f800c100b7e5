"""One run's lifecycle, the same for `reval run`, `reval sweep`, `reval demo` and the `reval` API:

    prepare(backend)            payload synced + venv checked (one probe round trip) -> Prepared
    submit(backend, spec, ...)  the name claimed, the paths checked on the host, the run started -> RunHandle
    attach(backend, name)       a RunHandle of a run already there (re-attach after a killed controller)
    RunHandle.events()          typed progress events (events.py), resumable from a byte offset of eval.log
    RunHandle.follow(sink)      the same into a follow sink (the CLI's bar/lines)
    RunHandle.wait()            follow until it is over, pull it, and say how it ended -> Finished
    RunHandle.state / .kill()   the backend's state (queued/running/succeeded/failed/cancelled/lost); cancel

Everything goes through a `Backend` (backends/base.py: SSH or the local folder, a Slurm cluster), so every
backend gets the whole lifecycle. One source of truth for a run's state: the backend's probe
(`Backend.state`: runs.reported_state, slurmjobs.slurm_run_state), also for the end of a follow. Nothing here
prints: progress is events and return values.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from remote_payload.contract import protocol
from remote_payload.contract import results as results_json
from remote_payload.contract import spec as _spec

from .. import __version__
from ..backends.base import Backend, Launch, Submission
from ..errors import (
    EXIT_BAD_INPUT,
    EXIT_CANCELLED,
    EXIT_EVAL_FAILED,
    ConfigError,
    RevalError,
    RunExists,
    RunNotFound,
)
from ..hosts.environment import EnvInfo, provision
from ..hosts.gpuspec import normalize_gpus
from ..hosts.sync import SyncResult
from ..results.compare import Result, load_run
from ..rundir.events import Event, EventSink
from ..rundir.follow import FollowResult, follow
from ..rundir.pull import Pulled
from ..rundir.registry import (
    NO_ANSWER,
    RunState,
    check_run_name,
    load_follow_state,
    local_registry,
    local_run_dir,
    save_follow_state,
)


class EvalSpec(_spec.EvalSpec):
    """What to evaluate: the contract's one spec (remote_payload/contract/spec.py, the value the payload parses
    back), its refusals raised as this half's ConfigError (exit 3)."""

    def __post_init__(self):
        try:
            super().__post_init__()
        except _spec.SpecError as e:
            raise ConfigError(str(e), hint=e.hint) from None
        for ref in self.prompts:  # read here (hashed, copied to the host): refused now, before anything blocks
            check_prompt_file(ref)


def check_prompt_file(ref: _spec.PromptRef) -> None:
    """A prompt file is read on this machine: a regular file, else ConfigError naming what it is (a FIFO or a
    device would block the read)."""
    f = Path(ref.path)
    if not f.is_file():
        what = "no such file here" if not f.exists() else \
            "a folder, not a file" if f.is_dir() else "not a regular file (a FIFO or a device?)"
        raise ConfigError(f"--prompts {ref.text()}: {what}", hint="prompt files are read on this machine and "
                          "copied to the host: give a .jsonl or .txt file")


def default_run_name(spec: EvalSpec) -> str:
    return protocol.default_run_name(spec.drafter or spec.payload)


@dataclass
class Prepared:
    """A host made ready for runs (prepare; reval.prepare): the payload synced (`synced`), its venv checked or
    built (`env`, `python`); `backend` is the host's, whose transport (and the workdir it resolved) submit and
    build_fixtures reuse. Pass it to submit/build_fixtures to do that once for several runs."""
    host: str
    synced: SyncResult
    env: EnvInfo
    backend: Backend | None = field(default=None, repr=False, compare=False)

    @property
    def python(self) -> str:
        return self.env.python

    @property
    def workdir(self) -> str:
        """The host's workdir (absolute): runs/, payload/, venvs/ live there."""
        return self.backend.workdir()


LAST_LINES = 15  # eval.log lines a Finished keeps when the run did not succeed (what the CLI shows)


@dataclass(repr=False)
class Finished:
    """How a run ended (RunHandle.wait; with RunHandle.finish, what reval's Run.finish returns): `state` in
    the one vocabulary, `status` (status.json), `path` (the pulled copy); after finish() also `result` (that
    copy as load_run reads it; None when it cannot be read: `error` says why), `last_lines` (eval.log's last
    lines when it did not succeed), `discarded` (bad input, the payload's exit 3: the run was removed on its
    host and here, its name is free again), `exit_code` (the CLI's)."""
    host: str
    name: str
    state: str
    status: dict
    path: Path
    follow: FollowResult | None = None
    result: Result | None = None
    error: RevalError | None = None
    last_lines: list[str] = field(default_factory=list)
    discarded: bool = False

    @property
    def ok(self) -> bool:
        return self.state == protocol.SUCCEEDED

    @property
    def has_results(self) -> bool:
        return self.ok and self.result is not None and self.result.result is not None

    @property
    def exit_code(self) -> int:
        """0 succeeded with results · 103 cancelled · 3 bad input · 1 anything else (failed, lost, no
        results)."""
        return 0 if self.has_results else failure_exit_code(self.state, self.status)

    def __repr__(self) -> str:
        return f"reval.Finished({self.host}/{self.name}: {self.state}, exit {self.exit_code} · {self.path})"


def prepare(backend: Backend) -> Prepared:
    """Sync the payload and check (or build) its venv on the backend's host: one probe round trip."""
    synced, env = provision(backend.transport, backend.host)
    return Prepared(backend.host.name, synced, env, backend)


def load_pulled(path: Path, status: dict) -> tuple[Result | None, RevalError | None]:
    """The pulled copy as load_run reads it; when a damaged status.json/run.json copy makes that fail, a
    readable results.json alone still says how the eval ended (the error is kept)."""
    try:
        return load_run(path), None
    except RevalError as e:
        try:
            typed = results_json.Result.load(path / protocol.RESULTS_JSON)
        except (OSError, ValueError):  # ResultsError is a ValueError
            return None, e
        return Result(name=path.name, host=path.parent.name, path=path, result=typed, status=status), e


def last_lines(path: Path, n: int = LAST_LINES) -> list[str]:
    """The last n lines of a pulled eval.log, read from its end (its last 64 KiB: a 1.5 GB log stays
    there)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            return f.read().decode("utf-8", errors="replace").splitlines()[-n:]
    except OSError:
        return []


def _silent() -> EventSink:
    return EventSink(lambda ev: None)


NO_ANSWER_POLL_S = 2.0  # how often a wait asks again a scheduler that cannot answer (slurmctld is shared)


class RunHandle:
    """A handle on one run (see the module doc)."""

    def __init__(self, backend: Backend, name: str, *, python: str | None = None, launch: Launch | None = None):
        self.backend = backend
        self.name = check_run_name(name)  # a ConfigError (reval.Error), exit 3
        self.python = python or load_follow_state(backend.host.name, name).get("python") or backend.host.python
        self.launch = launch

    def __repr__(self) -> str:
        return f"RunHandle({self.host}/{self.name})"

    @property
    def host(self) -> str:
        return self.backend.host.name

    @property
    def ref(self) -> str:
        return f"{self.host}/{self.name}"

    @property
    def local_dir(self) -> Path:
        """runs/<host>/<name>/ here (where pull puts it)."""
        return local_run_dir(self.host, self.name)

    def probe(self, *, wait_s: float = 0.0) -> RunState | None:
        """The backend's RunState (None: no such run); wait_s: a long poll until it is over (Backend.state)."""
        return self.backend.state(self.name, wait_s=wait_s)

    @property
    def state(self) -> str:
        """queued | running | succeeded | failed | cancelled | lost (the backend's state, asked now)."""
        s = self.probe()
        if s is None:
            raise RunNotFound(f"no run {self.name!r} on {self.host}", hint=f"list runs: reval ls {self.host}")
        return s.state

    def saved_offset(self) -> int:
        """The byte of eval.log after the last line shown (kept in runs/<host>/<run>/.follow.json)."""
        return load_follow_state(self.host, self.name).get("log_offset", 0)  # validated there

    def wait_started(self, sink=None, *, poll_s: float = 2.0) -> RunState | None:
        """While a scheduler keeps the run queued: a note (`queued NAME on HOST · job J · Reason`) each time
        Slurm's reason changes; returns the first state that is not queued. Polls fast at first (a job that
        starts at once is seen at once), then every poll_s."""
        sink, shown, wait_s = sink or _silent(), None, min(0.25, poll_s)
        while True:
            s = self.probe()
            if s is None or s.state != protocol.QUEUED:
                return s
            if s.reason != shown:
                shown = s.reason
                sink.note(f"queued  {self.name} on {self.host} · job {s.status.get('job_id', '?')} · "
                          f"{s.reason or 'pending'}")
            time.sleep(wait_s)
            wait_s = min(poll_s, wait_s * 2)

    def answered(self, sink=None) -> RunState | None:
        """The backend's state, asked again while the scheduler cannot answer (`no-answer`: not an end, never
        `lost`): a note when it goes silent and when it answers again; returns its first answer."""
        sink, said = sink or _silent(), False
        while (s := self.probe()) is not None and s.state == NO_ANSWER:
            if not said:
                said = True
                sink.note(f"waiting {self.name} on {self.host}: {s.reason}; its end is known once it answers "
                          f"(asked every {NO_ANSWER_POLL_S:g} s)")
            time.sleep(NO_ANSWER_POLL_S)
        if said:
            sink.note(f"answer  {self.name} on {self.host} is {s.state if s is not None else 'gone'}")
        return s

    def follow(self, sink=None, *, log_offset: int | None = None, give_up_s: float = 120.0) -> FollowResult:
        """Stream the run's log and events into `sink` until it is over (follow.py; reconnects on drops);
        a scheduler's run is first waited for while it is queued (wait_started)."""
        be = self.backend
        if be.queues:
            self.wait_started(sink)
        return follow(be.transport, self.name, workdir=be.workdir(), python=self.python,
                      log_offset=self.saved_offset() if log_offset is None else log_offset, sink=sink or _silent(),
                      give_up_s=give_up_s,
                      stream_cmd=lambda lo, eo: be.stream_command(self.name, python=self.python, log_offset=lo,
                                                                  events_offset=eo))

    def events(self, *, log_offset: int = 0, give_up_s: float = 120.0) -> Iterator[Event]:
        """Typed events (events.py) as the run goes, from byte `log_offset` of eval.log, until it is over.
        A follower thread feeds them; stopping the iteration early leaves it to drain in the background."""
        q: queue.Queue = queue.Queue()
        done = object()
        failure: list[BaseException] = []

        def feed():
            try:
                self.follow(EventSink(q.put), log_offset=log_offset, give_up_s=give_up_s)
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                failure.append(e)
            finally:
                q.put(done)
        threading.Thread(target=feed, name=f"reval-events-{self.name}", daemon=True).start()
        while (ev := q.get()) is not done:
            yield ev
        if failure:
            raise failure[0]

    def pull(self, *, finished: bool = False) -> Pulled:
        """Copy the run's files to runs/<host>/<name>/; `finished`: it is over and seen to its end (the same
        command again then starts a new run instead of re-attaching)."""
        res = self.backend.pull(self.name)
        if finished:
            save_follow_state(self.host, self.name, finished=True)
        return res

    def wait(self, sink=None, *, log_offset: int | None = None, give_up_s: float = 120.0) -> Finished:
        """Follow until the run is over, pull it, and report how it ended; the state is the backend's
        word after the end (the same `status` says: a SIGKILLed group is `lost` here too). The probe comes
        first: it records a scheduler's final word in status.json (a TIMEOUT the wrapper saw as a TERM), so
        the pulled copy says what `reval status` says; a probe that does not yet see the end is asked again
        after the pull, and a final word it records then is pulled too."""
        res = self.follow(sink, log_offset=log_offset, give_up_s=give_up_s)
        s = self.answered(sink)  # a scheduler that cannot answer now is waited for, never taken for an end
        pulled = self.pull(finished=True)
        if s is None or not s.terminal:
            after = self.answered(sink)
            if after is not None and after.terminal and (s is None or after.status != s.status):
                pulled = self.pull(finished=True)
            s = after if after is not None else s
        state, status = (s.state, s.status) if s is not None else (res.state, res.status)
        return Finished(self.host, self.name, state, status, pulled.path, res)

    def finish(self, sink=None, *, log_offset: int | None = None, give_up_s: float = 120.0) -> Finished:
        """wait(), then the pulled copy read (`result`, `error`), eval.log's last lines when it did not
        succeed, and bad input (the payload's exit 3) cleaned up: the run removed on its host and here
        (`discarded`), after its log's tail was read."""
        fin = self.wait(sink, log_offset=log_offset, give_up_s=give_up_s)
        fin.result, fin.error = load_pulled(fin.path, fin.status)
        if not fin.has_results:
            fin.last_lines = last_lines(fin.path / protocol.EVAL_LOG)
        if bad_input(fin):  # the one clean-up of an exit 3: nothing left on either side
            self.discard()
            fin.discarded = True
        return fin

    def kill(self, *, grace_s: float = 10.0) -> RunState:
        return self.backend.cancel(self.name, grace_s=grace_s)

    def discard(self) -> None:
        """Remove the run on its host and here: a run that ended in bad input (exit 3) leaves nothing, and its
        name is free again (its log was shown or raised already)."""
        import shutil
        self.backend.remove(self.name)
        shutil.rmtree(self.local_dir, ignore_errors=True)


def bad_input(fin: Finished) -> bool:
    """The payload's exit 3: bad input (a missing key, a shape mismatch, a bad path), reval's exit 3 too."""
    return fin.state == protocol.FAILED and fin.status.get("exit_code") == protocol.EXIT_BAD_INPUT


def failure_exit_code(state: str, status: dict) -> int:
    """reval's exit code for a run that did not succeed: 103 cancelled, 3 when the payload said bad input
    (its exit 3), else 1 (the CLI's final line and the API's reval.Error)."""
    if state == protocol.CANCELLED:
        return EXIT_CANCELLED
    return EXIT_BAD_INPUT if status.get("exit_code") == protocol.EXIT_BAD_INPUT else EXIT_EVAL_FAILED


def attach(backend: Backend, name: str, *, python: str | None = None) -> RunHandle:
    return RunHandle(backend, name, python=python)


def unfinished(host: str, identity: str, name: str | None = None) -> str | None:
    """A run this controller started on `host` with the same command (`identity`) and did not see to its end
    (killed before it pulled): the same command again re-attaches to it instead of starting a second one."""
    for h, r in sorted(local_registry(), reverse=True):
        if h != host or (name and r != name):
            continue
        st = load_follow_state(h, r)  # a dict, {} when damaged
        if st.get("identity") == identity and not st.get("finished"):
            return r
    return None


def submit(backend: Backend, spec: EvalSpec, *, python: str, name: str | None = None, run_json: dict | None = None,
           argv: list[str] | None = None) -> RunHandle:
    """Start `spec` on the backend's host (prepare() first). Refuses a used name (RunExists); bad paths on
    the host are refused before anything is created there or here (exit 3, nothing left behind)."""
    return submit_submission(backend, submission(backend, spec, python=python, name=name, run_json=run_json,
                                                 argv=argv))


def submit_submission(backend: Backend, sub: Submission) -> RunHandle:
    """Start a Submission (an eval's, or an extract's: runs/extracts.py) -> its RunHandle; a used name raises
    RunExists saying what holds it."""
    # the backend wrote the follow state (identity, job id) the moment the run existed: nothing to add here
    try:
        launched = backend.submit(sub)
    except RunExists as e:
        raise name_taken(backend, sub.name, e) from None
    return RunHandle(backend, sub.name, python=sub.python, launch=launched)


def submission(backend: Backend, spec: EvalSpec, *, python: str, name: str | None = None,
               run_json: dict | None = None, argv: list[str] | None = None) -> Submission:
    """What submit() hands the backend (validated; the name checked), without starting it: the sweep hands it
    to Backend.wait_then_submit, which starts it once the slot's run before it is over."""
    name = name or default_run_name(spec)
    check_run_name(name)
    gpus = normalize_gpus(spec.gpus or backend.host.gpus)
    ident = spec.identity(backend.host.name)
    info = {"argv": argv if argv is not None else [], "payload_argv": spec.payload_argv(name),
            "drafter": spec.drafter, "target": spec.target, "cache": [c.text() for c in spec.cache],
            "gpus_requested": gpus,
            "created_at": protocol.now_iso(), "controller_version": __version__, "identity": ident,
            **(run_json or {})}
    return Submission(name, spec.payload_argv(name), python, gpus=gpus, run_json=info,
                      preflight=spec.preflight_argv())


def name_taken(backend: Backend, name: str, refused: RunExists) -> RunExists:
    """The refusal of a used run name, saying what holds it (that run's state, asked from its host) and how to
    free the name (`reval rm HOST/NAME`) or follow it; `refused` as it was when the host cannot tell."""
    try:
        st = backend.state(name)
    except RevalError:
        st = None
    if st is None:
        return refused
    host, ref, other = backend.host.name, f"{backend.host.name}/{name}", f"--name {name}-2"
    if st.state in (protocol.RUNNING, protocol.QUEUED):
        return RunExists(f"run name {name!r} is already used on {host}: that run is {st.state}",
                         hint=f"follow it: reval logs {ref} -f ; or pick another name ({other})")
    free = f"reval rm {ref} (removes it there and here), or pick another name ({other})"
    if st.state == protocol.SUCCEEDED:
        when = f" at {st.status['finished_at']}" if st.status.get("finished_at") else ""
        return RunExists(f"run name {name!r} is already used on {host}: that run succeeded{when}"
                         + (" (SUSPECT result)" if st.suspect else ""),
                         hint=f"its result: reval compare {ref} ; to run it again under this name: {free}")
    why = ": ".join(str(x) for x in (f"exit {st.status['exit_code']}" if "exit_code" in st.status else "",
                                     st.status.get("error")) if x)
    return RunExists(f"run name {name!r} is already used on {host}: that run {st.state}" + (f" ({why})" if why else ""),
                     hint=f"free the name: {free}; its log: reval logs {ref}")


__all__ = [
    "EvalSpec",
    "Finished",
    "Prepared",
    "RunHandle",
    "attach",
    "prepare",
    "submission",
    "submit",
    "unfinished",
]
