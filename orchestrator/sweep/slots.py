"""A sweep's slot workers, for hosts whose backend starts runs one at a time: one job per free GPU slot,
launched (or re-attached), followed, pulled and recorded in the ledger; with WAIT_THEN_SUBMIT (SSH) a slot's
long poll on its run starts the slot's next staged run in the same round trip. Workers: the threads they run
in. schedule.py's Sweep starts them (BatchWorker, cluster.py, takes the hosts that submit in batches)."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from ..backends.base import WAIT_THEN_SUBMIT, Launch, NoFreeGpu, Submission
from ..errors import HostUnreachable, RevalError, RunExists
from ..render import plotworker
from ..rundir.pull import Pulled
from ..rundir.registry import RunState
from ..runs import lifecycle
from .books import JobQueue, SweepRecord, pull_and_record
from .ledger import LedgerEntry
from .plan import UNREACHABLE, Job, SweepOptions
from .stage import HostPool, HostSession

# a job the long poll started: its ledger entry before, the answer
Fold = tuple[LedgerEntry | None, Launch | RevalError]
Ended = tuple[Job, RunState, Pulled | None]  # a run seen to its end; its files when the long poll brought them

_report_modules = threading.Event()  # their loading started
_report_loaded = threading.Event()   # ... and ended


def load_report_modules() -> None:
    """The report's plotting modules (matplotlib, ~0.5 s), loaded once on a thread of their own while a run is
    followed, and then the plot worker started (a second process that draws plots.png while this one draws
    the HTML report's figures: plotworker.py): writing the report files after the last run then starts at
    once, and nothing before the first launch waits for them. Trouble here is the report writer's to say."""
    if _report_loaded.is_set():
        plotworker.warm()  # a worker gone since (a later sweep in this process) is started again
        return
    if _report_modules.is_set():
        return
    _report_modules.set()

    def load() -> None:
        try:
            with contextlib.suppress(Exception):
                from ..render import html  # noqa: F401
            plotworker.warm()
        finally:
            _report_loaded.set()
    threading.Thread(target=load, name="reval-report-imports", daemon=True).start()


class Workers:
    """The threads of one round of a sweep, each setting its own done event at its end. The sweep waits on the
    events, not on Thread.join: a join that Ctrl-C interrupts can mark its thread stopped while it still runs
    (CPython's lock handling), and a worker the interpreter believes stopped went on launching runs while the
    process exited. The threads are daemons: one still in a call after the grace period never holds the exit."""

    def __init__(self):
        self.done: list[threading.Event] = []

    def start(self, fn: Callable, *args) -> None:
        ev = threading.Event()

        def body() -> None:
            try:
                fn(*args)
            finally:
                ev.set()
        self.done.append(ev)
        threading.Thread(target=body, daemon=True, name=f"reval-sweep-{len(self.done)}").start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every worker ended (True), or `timeout` seconds in all passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for ev in self.done:
            if not ev.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        return True


class SlotWorkers:
    """Hosts whose backend starts runs one at a time (an SSH host, the local folder): a worker per run slot
    takes a job, launches it with the slot's --gpus (or re-attaches to its run), follows it to its end,
    pulls and records it, and meanwhile stages its next job. A run seen to its end is pulled right after the
    slot's next launch (the next eval starts without waiting for the copy), or when the slot stops. Inputs:
    the options (retries, backoff_s, poll_s), the hosts, the queue, the record, the log.

    With a backend that has WAIT_THEN_SUBMIT (SSH), the long poll on a run also starts the slot's next (staged)
    job the moment the run ends, in the same round trip: its ledger entry says `launched` before the call and
    is put back as it was when the call started nothing (the run still going, or its end not told by its
    status.json); a transport error that outlasts the retries leaves both runs to re-attach next time (the
    next one may or may not have started); a retried call that finds the next run started answers RunExists:
    it is re-attached. What the call gave (`folds`) is what the next job's launch would have given. The long
    poll that sees a run end (with a next job to start or not) brings its files when they are small (SSH: up to
    4 MiB), so that the run's pull costs no SSH session of its own; a larger run, files that came incomplete
    and a re-attached run's first look are pulled as before."""

    def __init__(self, opts: SweepOptions, hosts: HostPool, queue: JobQueue, record: SweepRecord,
                 log: Callable[[str], None]):
        self.opts, self.hosts, self.queue, self.record, self.log = opts, hosts, queue, record, log
        self.lock = threading.Lock()
        self.active = 0  # runs being followed now (all slots)

    def worker(self, hs: HostSession, gpu: str, reattach_only: bool = False) -> None:
        held: list[Job] = []  # the next job, taken (and staged) while the current run goes on
        ended: list[Ended] = []  # a run seen to its end, not pulled yet
        folds: dict[str, Fold] = {}  # a held job the long poll started (or tried to): what that gave
        try:
            self._work(hs, gpu, reattach_only, held, ended, folds)
        finally:
            for job in held:
                if job.key in folds:  # started there (or maybe): never handed to another host
                    self.record.record(job, hs.host.name, UNREACHABLE, error=hs.down or "the slot stopped")
                    continue
                job.staged = None
                self.queue.put_back(job)
            if not self.queue.stopped:  # Ctrl-C: ended runs stay `launched` in the ledger, pulled on resume
                self.settle(hs, ended)

    def _work(self, hs: HostSession, gpu: str, reattach_only: bool, held: list[Job],
              ended: list[Ended], folds: dict[str, Fold]) -> None:
        refused = 0  # launches in a row the host refused for want of a free GPU
        while not hs.down or (held and held[-1].key in folds):  # a run started by the long poll is followed
            if self.queue.stopped:
                return
            job = held.pop() if held else self.queue.take(hs.host.name, reattach_only)
            if job is None:
                return
            try:
                self.run_job(hs, job, gpu, held if not reattach_only else None, ended, folds)
                refused = 0
            except HostUnreachable:
                return
            except NoFreeGpu as e:
                refused += 1
                with self.lock:
                    idle = self.active == 0
                if refused >= self.opts.retries and idle:  # nothing of ours will free a GPU: give up this round
                    self.log(f"busy    {hs.host.name}: {str(e).split(': ', 1)[-1]}; slot stops")
                    return
                wait_s = min(self.opts.backoff_s * 2 ** (refused - 1), 60.0)
                self.log(f"busy    {job.ckpt.name}: no free GPU on {hs.host.name}; requeued, retry in {wait_s:.0f}s")
                time.sleep(wait_s)
            except Exception as e:  # noqa: BLE001 - bad input or a bug: this job fails, the sweep goes on
                self.record.failed(hs.host.name, job, e)

    def run_job(self, hs: HostSession, job: Job, gpu: str, held: list[Job] | None = None,
                ended: list[Ended] | None = None, folds: dict[str, Fold] | None = None) -> None:
        ended = [] if ended is None else ended
        folds = {} if folds is None else folds
        try:
            launched = self._start(hs, job, gpu, folds.pop(job.key, None))
        finally:
            self.settle(hs, ended)  # the slot's last run, pulled once this one started (whatever the launch did)
        if launched is None:
            return
        if held is not None and not held:
            self.prefetch(hs, held)
        self.wait(hs, job, ended, launched, gpu, held, folds)

    def _start(self, hs: HostSession, job: Job, gpu: str, fold: Fold | None = None) -> bool | None:
        """Launch the job (True), or re-attach to its run (False: it was there already); None: its checkpoint
        cannot be had (recorded not-run). `fold`: the slot's long poll started it already (or tried to)."""
        c = job.ckpt
        ledger = self.record.ledger
        if job.host is None and fold is not None:  # started by the long poll: its answer, as a launch's
            before, started = fold

            def answer() -> Launch:
                if isinstance(started, BaseException):
                    raise started
                return started
            return self._take(hs, job, before, answer)
        if job.host is None:  # a fresh launch
            if self.queue.stopped:  # Ctrl-C came while it was being taken: not launched, back in the queue
                self.queue.put_back(job)
                return None
            try:
                path = job.staged[1] if job.staged and job.staged[0] == hs.host.name else \
                    self.hosts.stage_checkpoint(hs, c)
            except HostUnreachable as e:
                if hs.down:  # this host went away: another one takes the job
                    self.queue.put_back(job)
                    raise
                self.record.not_stageable(job, e)
                return None
            spec, run_json = self._spec(hs, job, path, gpu)
            before = ledger.get(job.key)
            ledger.put(self.record.launched_entry(hs.host.name, job))  # a killed controller finds it and re-attaches
            try:
                return self._take(hs, job, before, lambda: self.hosts.op(hs, "launch", lambda: lifecycle.submit(
                    hs.backend, spec, python=hs.python, name=job.run, run_json=run_json)).launch)
            except HostUnreachable:
                # Did it start before the connection broke? The next sweep re-attaches (the ledger says launched).
                self.record.record(job, hs.host.name, UNREACHABLE, error=hs.down)
                raise
        self.log(f"attach  {c.name}: run {job.run} on {hs.host.name}")
        return False

    def _spec(self, hs: HostSession, job: Job, path: str, gpu: str):
        """The job's spec and run.json; with --prompts its caches resolved on hs first (the missing ones built:
        no eval starts before its caches exist). The job goes back to the queue when hs went away or no GPU
        was free for the build."""
        spec = self.opts.spec_for(path, gpu)
        info = None
        if spec.prompts:
            try:
                spec, info = self.hosts.resolve_caches(hs, spec, run=job.run)
            except (HostUnreachable, NoFreeGpu):
                self.queue.put_back(job)
                raise
        run_json = self.record.run_json(job, path, spec.payload_argv(job.run))
        return spec, {**run_json, **({"prompt_caches": info} if info else {})}

    def _take(self, hs: HostSession, job: Job, before, launch: Callable[[], Launch]) -> bool:
        """A launch's answer (`launch()`: the Launch, or what it raises): started (True), the run already there
        (re-attached: False), or no free GPU (the ledger entry as it was `before`, the job back in the queue)."""
        try:
            self._launched(hs, job, launch())
            return True
        except NoFreeGpu:  # nothing started: not a result; back in the queue (the worker backs off)
            self.record.ledger.restore(job.key, before)
            self.queue.put_back(job)
            raise
        except RunExists:
            self.log(f"attach  {job.ckpt.name}: run {job.run} already on {hs.host.name}")
        return False

    def _launched(self, hs: HostSession, job: Job, info: Launch) -> None:
        self.log(f"launch  {job.ckpt.name} on {hs.host.name}"
                 + "".join(f" · GPU {g}" for g in info.gpus) + f" · run {job.run}")

    def settle(self, hs: HostSession, ended: list[Ended]) -> None:
        """Pull and record the runs seen to their end (a host gone: `unreachable`, re-attached next time; a
        damaged result: that job failed); nothing here stops the slot."""
        while ended:
            job, st, pulled = ended.pop(0)
            try:
                pull_and_record(self.hosts, self.record, hs, job, st, pulled)
            except HostUnreachable:
                pass  # recorded `unreachable` by pull_and_record
            except Exception as e:  # noqa: BLE001 - bad input or a bug: this job fails, the sweep goes on
                self.record.failed(hs.host.name, job, e)

    def wait(self, hs: HostSession, job: Job, ended: list[Ended], launched: bool, gpu: str = "none",
             held: list[Job] | None = None, folds: dict[str, Fold] | None = None) -> None:
        """Follow the job's run to its end, then leave it in `ended` (pulled and recorded by the slot's next
        settle(): after its next launch, or when it stops). With `held` and a backend that can, the long poll
        also starts the held job once the run ended (its answer in `folds`)."""
        with self.lock:
            self.active += 1
        try:
            self._wait(hs, job, ended, launched, gpu, held if held is not None else [], {} if folds is None else folds)
        finally:
            with self.lock:
                self.active -= 1

    def _wait(self, hs: HostSession, job: Job, ended: list[Ended], launched: bool, gpu: str,
              held: list[Job], folds: dict[str, Fold]) -> None:
        run = lifecycle.attach(hs.backend, job.run, python=hs.python)  # the same handle `reval run` follows
        load_report_modules()
        try:
            # a long poll: one SSH command that returns as soon as the run is no longer running (or after poll_s),
            # so its end is seen at once without a round trip per check; a re-attached run gets a first look
            wait_s = self.opts.poll_s if launched else 0.0
            while True:
                if self.queue.stopped:  # Ctrl-C: the run goes on (the ledger says launched); not followed
                    return
                nxt = self._foldable(hs, held, folds) if wait_s > 0 else None
                sub = self._submission(hs, nxt, gpu) if nxt is not None else None
                pulled = None
                if nxt is not None and sub is not None:
                    st, pulled = self._wait_then_start(hs, job, nxt, sub, wait_s, held, folds)
                elif wait_s > 0 and hs.backend.supports(WAIT_THEN_SUBMIT):  # nothing to start: still its files
                    st, _, pulled = self.hosts.op(hs, "status", lambda w=wait_s: hs.backend.wait_then_submit(
                        job.run, None, wait_s=w, pull=True), bounded=False)
                else:
                    st = self.hosts.op(hs, "status", lambda w=wait_s: run.probe(wait_s=w), bounded=wait_s == 0)
                wait_s = self.opts.poll_s
                if st is None:  # recorded as launched, but the run never started: launch it now
                    self.log(f"missing {job.ckpt.name}: run {job.run} is not on {hs.host.name}; launching")
                    job.host = None
                    return self.run_job(hs, job, "auto" if hs.on_gpu else "none", None, ended)
                if st.terminal:
                    break
        except HostUnreachable:
            self.record.record(job, hs.host.name, UNREACHABLE, error=hs.down)
            raise
        ended.append((job, st, pulled))

    def _foldable(self, hs: HostSession, held: list[Job], folds: dict[str, Fold]) -> Job | None:
        """The held job the long poll may start: a fresh one, staged on this host, not tried yet."""
        if not held or not hs.backend.supports(WAIT_THEN_SUBMIT) or self.queue.stopped:
            return None
        nxt = held[-1]
        if nxt.host is not None or nxt.key in folds or not nxt.staged or nxt.staged[0] != hs.host.name:
            return None
        return nxt

    def _submission(self, hs: HostSession, nxt: Job, gpu: str) -> Submission | None:
        """nxt's Submission (as its launch makes it), or None when that fails: its own launch then says why."""
        path = nxt.staged[1]
        try:
            spec, info = self.opts.spec_for(path, gpu), None
            if spec.prompts:  # only on caches resolved before (prefetch): the long poll builds nothing
                spec, info = self.hosts.known_caches(hs, spec) or (None, None)
                if spec is None:
                    return None
            run_json = self.record.run_json(nxt, path, spec.payload_argv(nxt.run))
            return lifecycle.submission(hs.backend, spec, python=hs.python, name=nxt.run,
                                        run_json={**run_json, **({"prompt_caches": info} if info else {})})
        except Exception:  # noqa: BLE001 - bad input for that checkpoint: not this run's business
            return None

    def _wait_then_start(self, hs: HostSession, job: Job, nxt: Job, sub: Submission, wait_s: float,
                         held: list[Job], folds: dict[str, Fold]) -> tuple[RunState | None, Pulled | None]:
        """The long poll on job's run that starts `nxt` once it ended (Backend.wait_then_submit); the run's
        state, and its files when they came in the same answer (pulled here already). nxt's ledger entry says
        `launched` during the call (a controller killed meanwhile re-attaches, or launches it when it is not
        there), and is put back when the call started nothing."""
        ledger = self.record.ledger
        before = ledger.get(nxt.key)
        self.record.in_flight.add(nxt.key)  # until the call answered, before the ledger says launched
        ledger.put(self.record.launched_entry(hs.host.name, nxt))
        try:
            st, started, pulled = self.hosts.op(
                hs, "status", lambda: hs.backend.wait_then_submit(job.run, sub, wait_s=wait_s, pull=True),
                bounded=False)
        except HostUnreachable:
            # started or not, nobody can tell now: the ledger keeps it `launched`, the next sweep re-attaches
            held.remove(nxt)
            self.record.record(nxt, hs.host.name, UNREACHABLE, error=hs.down)
            raise
        except BaseException:
            # started or not (a bug, or the run folder refused): it stays `launched`, a job of this host only, to
            # re-attach (and launch when it is not there)
            nxt.host, nxt.staged = hs.host.name, None
            raise
        if started is None:
            ledger.restore(nxt.key, before)  # nothing started: as it was
        else:
            folds[nxt.key] = (before, started)
        self.record.in_flight.discard(nxt.key)  # after the ledger says what the answer was
        return st, pulled

    def prefetch(self, hs: HostSession, held: list[Job]) -> None:
        """Take this slot's next job now and copy its checkpoint while the current run goes on (the copy
        then costs nothing on the critical path). Trouble here is left to the job itself."""
        nxt = self.queue.take(hs.host.name)
        if nxt is None:
            return
        held.append(nxt)
        if nxt.host is None:
            try:
                nxt.staged = (hs.host.name, self.hosts.stage_checkpoint(hs, nxt.ckpt))
            except RevalError:
                nxt.staged = None
            if nxt.staged and self.opts.spec.prompts:  # its caches looked up now (built by its own launch)
                with contextlib.suppress(RevalError):
                    self.hosts.resolve_caches(hs, self.opts.spec_for(nxt.staged[1], "auto" if hs.on_gpu else "none"),
                                              run=nxt.run, build=False)
