"""Sweep scheduling: the Sweep (discover -> plan -> run the queue over the hosts -> report) and the slot
workers of hosts that start runs one at a time: one job per free GPU slot, launched (or re-attached),
followed, pulled and recorded in the ledger; the sweep directory (sweep.json) for resuming.

The Sweep is composed of parts with explicit inputs, each replaceable (a test's fault goes in through them):
HostPool (stage.py: the hosts and every operation on them), JobQueue and SweepRecord (books.py: the jobs
left, what happened), SlotWorkers (here) and BatchWorker (cluster.py: a backend that submits in batches);
the report is built from a SweepFacts (report.py), never from the Sweep."""
from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from remote_payload.contract import protocol

from ..backends.base import WAIT_THEN_SUBMIT, Launch, NoFreeGpu, Submission
from ..errors import EXIT_BAD_INPUT, ConfigError, HostUnreachable, RevalError, RunExists
from ..hosts.inventory import Inventory
from ..hosts.sync import local_manifest_hash
from ..render import plotworker
from ..results import compare
from ..rundir import registry as runs
from ..rundir.pull import Pulled
from ..rundir.registry import RunState
from ..runs import lifecycle
from .books import JobQueue, SweepRecord, pull_and_record
from .cluster import BatchWorker, batches
from .discover import discover
from .ledger import Ledger, LedgerEntry
from .plan import NOT_RUN, UNREACHABLE, Checkpoint, Job, SweepOptions, parse_since, plan_queue, select
from .report import SweepFacts, SweepReport, build_report
from .stage import HostPool, HostSession

Fold = tuple[LedgerEntry | None, Launch | RevalError]  # a job the long poll started: its ledger entry before, the answer
Ended = tuple[Job, RunState, Pulled | None]  # a run seen to its end; its files when the long poll brought them


def load_baseline(spec: str | None) -> compare.Result | None:
    """The --baseline run, loaded before anything runs: a wrong name fails at once (exit 102 or 3), not
    after a night of evals."""
    if not spec:
        return None
    try:
        rec = compare.load_run(compare.pulled_run_dir(spec, runs.local_runs_root()))
    except protocol.ProtocolError as e:
        raise ConfigError(f"--baseline {spec!r}: {e}") from None
    except RevalError as e:
        raise type(e)(f"--baseline: {e}", hint=e.hint, exit_code=e.exit_code) from None
    if rec.result is None:
        raise ConfigError(f"--baseline {spec!r}: {rec.path} has no results.json (state {rec.state})",
                          hint="pick a finished run (reval ls), or pull it again: reval pull HOST/NAME")
    return rec


PAYLOAD_MAX_BLOCKS = 30  # the eval payload's --max-blocks default (remote_payload/eval/evalopts.py)
STOP_GRACE_S = 10.0  # Ctrl-C: how long the sweep waits for its workers to return (Workers.wait)


def baseline_differences(opts: SweepOptions, baseline: compare.Result | None, cache_fingerprint: str) -> list[str]:
    """What the sweep's evals will certainly differ in from the --baseline run (known before anything runs:
    max blocks, prompts asked for, the cache's fingerprint), as 'max_blocks 30 there, 20 here' (pure)."""
    if baseline is None or baseline.result is None:
        return []
    c, res = baseline.result.comparability, baseline.result
    eval_payload = opts.payload == "eval"
    blocks = opts.max_blocks if opts.max_blocks is not None else (PAYLOAD_MAX_BLOCKS if eval_payload else None)
    out = []
    if blocks is not None and c.max_blocks != blocks:
        out.append(f"{compare.FIELD_WORDS['max_blocks']} {c.max_blocks} there, {blocks} here")
    total = res.cache.num_prompts_total if res.cache is not None else None
    if opts.num_prompts is not None and c.num_prompts != opts.num_prompts and not (
            c.num_prompts < opts.num_prompts and c.num_prompts == total):  # both ran the whole (smaller) cache
        out.append(f"{compare.FIELD_WORDS['num_prompts']} {c.num_prompts} there, {opts.num_prompts} here")
    if eval_payload and cache_fingerprint and c.cache_fingerprint != cache_fingerprint:
        out.append(f"cache {c.cache_fingerprint[:19]} there, {cache_fingerprint[:19]} here")
    return out


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
            before = ledger.get(job.key)
            ledger.put(self.record.launched_entry(hs.host.name, job))  # a killed controller finds it and re-attaches
            run_json = self.record.run_json(job, path, self.opts.spec(path).payload_argv(job.run))
            try:
                spec = self.opts.spec(path, gpu)
                return self._take(hs, job, before, lambda: self.hosts.op(hs, "launch", lambda: lifecycle.submit(
                    hs.backend, spec, python=hs.python, name=job.run, run_json=run_json)).launch)
            except HostUnreachable:
                # Did it start before the connection broke? The next sweep re-attaches (the ledger says launched).
                self.record.record(job, hs.host.name, UNREACHABLE, error=hs.down)
                raise
        self.log(f"attach  {c.name}: run {job.run} on {hs.host.name}")
        return False

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
            return lifecycle.submission(hs.backend, self.opts.spec(path, gpu), python=hs.python, name=nxt.run,
                                        run_json=self.record.run_json(nxt, path,
                                                                      self.opts.spec(path).payload_argv(nxt.run)))
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
                hs, "status", lambda: hs.backend.wait_then_submit(job.run, sub, wait_s=wait_s, pull=True), bounded=False)
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


class Sweep:
    """One sweep: `run()` makes the hosts ready, discovers and plans the checkpoints, runs the queue over
    the hosts (a BatchWorker for a host whose backend submits in batches, SlotWorkers for the others) and
    returns the report. `hosts`: the HostPool to use (default: one over --hosts; a test's seam)."""

    def __init__(self, opts: SweepOptions, inventory: Inventory, *, log=None,
                 baseline: compare.Result | None = None, hosts: HostPool | None = None):
        self.opts = opts
        self.inventory = inventory
        self.log = log or (lambda line: None)
        self.baseline = baseline or load_baseline(opts.baseline)
        self.root = Path(opts.sweep_dir)
        self.ledger = Ledger(self.root / "ledger.json")
        self.hosts = hosts or HostPool(opts, inventory, log=self.log)
        self.queue = JobQueue()
        self.record = SweepRecord(self.ledger, "", log=self.log)  # made again once the sweep has its id
        self.sweep_id = ""
        self.dir = self.root
        self.config = ""

    # -- state dir ------------------------------------------------------------------------------------------
    def open_sweep_dir(self) -> None:
        """Resume the newest unfinished sweep of the same command line, else start a new one."""
        ident = self.opts.identity()
        for d in sorted(self.root.glob("*/sweep.json"), reverse=True):
            try:
                st = protocol.read_json(d)
            except (OSError, ValueError):
                continue
            if st.get("identity") == ident and not st.get("complete"):
                self.sweep_id, self.dir = st["id"], d.parent
                self.log(f"resume  sweep {self.sweep_id} (started {st.get('created_at')})")
                return
        self.sweep_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.dir = self.root / self.sweep_id
        n = 1
        while self.dir.exists():
            n += 1
            self.dir = self.root / f"{self.sweep_id}-{n}"
        self.sweep_id = self.dir.name
        self.dir.mkdir(parents=True)
        self._write_state(False)

    def _write_state(self, complete: bool) -> None:
        protocol.atomic_write_json(self.dir / "sweep.json", {
            "id": self.sweep_id, "identity": self.opts.identity(), "created_at": protocol.now_iso(),
            "complete": complete, "options": asdict(self.opts)})

    # -- planning -------------------------------------------------------------------------------------------
    def plan(self, checkpoints: list[Checkpoint]) -> None:
        fp = next(hs.cache_fingerprint for hs in self.hosts.up())
        queue, outcomes, self.config, kept = plan_queue(checkpoints, self.ledger, self.sweep_id, fp,
                                                        local_manifest_hash(), self.opts)
        self.queue.add(queue)
        self.record.outcomes.update(outcomes)
        if kept:
            self.log(f"resume  {kept} run(s) kept from before a payload/cache change (not run again)")

    # -- running --------------------------------------------------------------------------------------------
    def execute(self) -> None:
        """Workers per host slot until the queue is empty or no host is left. Re-attach jobs get a thread of
        their own (their run already holds its GPU); a CPU host launches new runs only after those end. A
        host whose backend submits in batches gets one BatchWorker for its share."""
        slots = SlotWorkers(self.opts, self.hosts, self.queue, self.record, self.log)
        batch = BatchWorker(self.opts, self.hosts, self.queue, self.record, self.log)
        why = "no reachable host left"
        last = None
        while True:
            up = self.hosts.up()
            names = {hs.host.name for hs in up}
            for job in self.queue.drop(lambda j, names=names: j.host is not None and j.host not in names):
                self.record.left(job, UNREACHABLE, f"{job.host} is unreachable; re-attached next time")
            if not len(self.queue) or not up:
                break
            if last == (len(self.record.outcomes), len(up)):  # a whole round ended nothing: every GPU is busy
                why = "no free GPU (all busy or locked by other runs); the next sweep tries again"
                break
            last = (len(self.record.outcomes), len(up))
            workers = Workers()
            for hs in up:
                if batches(hs.backend):  # one batch for its share, one poller
                    workers.start(batch.run, hs)
                    continue
                n_attach = self.queue.count(hs.host.name)
                for _ in range(n_attach):
                    workers.start(slots.worker, hs, "none", True)
                if hs.on_gpu or not n_attach:
                    for g in hs.slots:
                        workers.start(slots.worker, hs, g)
            try:
                workers.wait()
            except KeyboardInterrupt:
                self.queue.stop()  # Ctrl-C: nothing more is taken, launched or followed
                workers.wait(STOP_GRACE_S)  # a call under way answers first (a second Ctrl-C stops the wait)
                raise
        for job in self.queue.drop(lambda j: True):  # no host left for these
            self.record.left(job, NOT_RUN, why)

    def facts(self) -> SweepFacts:
        """What the report is built from, as values."""
        return SweepFacts(self.sweep_id, self.dir, list(self.record.outcomes.values()),
                          self.ledger.series(self.config), self.opts.baseline, self.baseline, self.opts.threshold,
                          self.hosts.down(), self.record.loaded)

    def run(self) -> SweepReport:
        existed = self.root.exists()
        bad_input = False
        self.ledger.lock()
        try:
            # hosts and checkpoints first: bad input (an unknown --hosts group, a glob matching nothing) ends
            # the sweep with exit 3 before its sweep.json exists
            self.hosts.prepare()
            fp = next(hs.cache_fingerprint for hs in self.hosts.up())
            if diff := baseline_differences(self.opts, self.baseline, fp):
                raise ConfigError(f"--baseline {self.opts.baseline} is not comparable with this sweep: "
                                  + "; ".join(diff) + " (nothing launched)",
                                  hint="pick a baseline evaluated with the same cache, --max-blocks and "
                                       "--num-prompts, or sweep with the baseline's")
            up = {hs.host.name: hs.transport for hs in self.hosts.up()}
            skipped: list[str] = []
            found = discover(self.opts.checkpoints, self.inventory, self.ledger, up, skipped,
                             self.hosts.remote_hashes)
            if skipped:
                shown = ", ".join(repr(n) for n in skipped[:8]) + (f" and {len(skipped) - 8} more"
                                                                   if len(skipped) > 8 else "")
                self.log(f"skip    {len(skipped)} name(s) that are not checkpoint names (letters, digits, . _ -; "
                         f"not starting with - or .): {shown}")
            chosen = select(found, self.opts.latest, parse_since(self.opts.since))
            self.open_sweep_dir()
            self.record = SweepRecord(self.ledger, self.sweep_id, log=self.log)
            self.plan(chosen)
            n_skip = sum(1 for o in self.record.outcomes.values() if o.earlier)
            up_now = self.hosts.up()
            free = sum(len(hs.slots) for hs in up_now)
            self.log(f"{len(chosen)} checkpoints · {n_skip} already evaluated (skipped) · {len(self.queue)} to run "
                     f"on {len(up_now)} host(s), {free} slot(s)")
            self.execute()
            report = build_report(self.facts(), chosen)
            self._write_state(complete=not any(o.state in (UNREACHABLE, NOT_RUN) for o in report.outcomes))
            return report
        except RevalError as e:
            bad_input = e.exit_code == EXIT_BAD_INPUT
            raise
        finally:
            self.ledger.unlock()  # deletes ledger.json.lock
            if bad_input and not existed:  # nothing of this invocation is kept (only it wrote there)
                shutil.rmtree(self.root, ignore_errors=True)
