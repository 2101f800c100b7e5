"""The sweep's books as it goes: the jobs left (JobQueue: the workers take from it) and what happened to each
job (SweepRecord: its Outcome for the report, its ledger entry for the next sweep, written as it happens).
Both are shared by the slot workers (slots.py) and the batch workers (cluster.py), and hold no host."""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from remote_payload.contract import protocol

from ..errors import HostUnreachable, RevalError
from ..results import compare
from ..rundir.pull import Pulled
from ..rundir.registry import RunState
from .ledger import LAUNCHED, Ledger, LedgerEntry
from .plan import NOT_RUN, UNREACHABLE, Job, Outcome
from .report import LoadedRuns, checkpoint_order
from .stage import HostPool, HostSession


class JobQueue:
    """The jobs not taken yet (thread-safe). A job with a host (a re-attach) is only ever taken by that host;
    a fresh one (host None) by any."""

    def __init__(self, jobs: list[Job] | None = None):
        self.lock = threading.Lock()
        self.jobs: list[Job] = list(jobs or [])
        self.stopping = threading.Event()  # Ctrl-C: no job is taken, launched or followed any more

    def stop(self) -> None:
        """Ctrl-C: the workers start nothing more and return at their next step (the runs they started go on,
        the ledger says so; the next sweep re-attaches)."""
        self.stopping.set()

    @property
    def stopped(self) -> bool:
        return self.stopping.is_set()

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, jobs: list[Job]) -> None:
        with self.lock:
            self.jobs += jobs

    def take(self, host: str, reattach_only: bool = False) -> Job | None:
        """The first job `host` may take (a fresh one too unless reattach_only), off the queue; None once stopped."""
        with self.lock:
            if self.stopped:
                return None
            for i, j in enumerate(self.jobs):
                if j.host == host or (j.host is None and not reattach_only):
                    return self.jobs.pop(i)
        return None

    def take_share(self, host: str, share: Callable[[int], int]) -> tuple[list[Job], list[Job]]:
        """(host's re-attach jobs, the first share(n) of the n fresh ones), taken off the queue at once."""
        with self.lock:
            if self.stopped:
                return [], []
            mine = [j for j in self.jobs if j.host == host]
            fresh = [j for j in self.jobs if j.host is None]
            taken = fresh[:share(len(fresh))]
            for j in mine + taken:
                self.jobs.remove(j)
        return mine, taken

    def put_back(self, job: Job) -> None:
        """A job that did not start (no free GPU, its host went away): first in line again."""
        with self.lock:
            self.jobs.insert(0, job)

    def count(self, host: str) -> int:
        """How many re-attach jobs wait for `host`."""
        with self.lock:
            return sum(1 for j in self.jobs if j.host == host)

    def drop(self, which: Callable[[Job], bool]) -> list[Job]:
        """Take every job `which` says off the queue (no host left for them)."""
        with self.lock:
            out = [j for j in self.jobs if which(j)]
            self.jobs = [j for j in self.jobs if not which(j)]
        return out


class SweepRecord:
    """What happened to each job: `outcomes` (key -> Outcome, for the report) and the ledger (for the next
    sweep and a killed controller). Inputs: the ledger, this sweep's id, the log; `loaded` keeps the runs it
    pulled, parsed once for the ledger and the report."""

    def __init__(self, ledger: Ledger, sweep_id: str, *, log: Callable[[str], None] | None = None,
                 loaded: LoadedRuns | None = None):
        self.ledger = ledger
        self.sweep_id = sweep_id
        self.log = log or (lambda line: None)
        self.loaded = loaded or LoadedRuns()
        self.outcomes: dict[str, Outcome] = {}
        # ledger keys whose launch is under way (a long poll folded with the next launch, SlotWorkers): `launched`
        # in the ledger, but a Ctrl-C meanwhile (it lands in the main thread) cannot say it started
        self.in_flight: set[str] = set()

    def launched_entry(self, host: str, job: Job) -> LedgerEntry:
        """The ledger's `launched` record of job on host (written before the launch: a killed controller finds it)."""
        c = job.ckpt
        return LedgerEntry(job.key, c.name, c.location, c.content_hash, c.step, host, job.run, LAUNCHED,
                           self.sweep_id, config=job.config, also=list(job.also))

    def run_json(self, job: Job, path: str, argv: list[str]) -> dict:
        """What a sweep's run records in run.json: its sweep, checkpoint and ledger key."""
        c = job.ckpt
        return {"sweep": self.sweep_id, "checkpoint": c.location, "checkpoint_hash": c.content_hash,
                "ledger_key": job.key, "drafter": path, "argv": argv}

    def record(self, job: Job, host: str, state: str, *, tau=None, suspect=False, error=None, local=None,
               exit_code=None) -> None:
        """The job's outcome, and its ledger entry (except `unreachable`: the ledger keeps `launched`, the next
        sweep re-attaches)."""
        c = job.ckpt
        self.outcomes[job.key] = Outcome(c.name, c.step, state, host, job.run, tau, suspect, error,
                                         str(local) if local else None, also=list(job.also))
        if state != UNREACHABLE:
            self.ledger.put(LedgerEntry(job.key, c.name, c.location, c.content_hash, c.step, host, job.run, state,
                                        self.sweep_id, exit_code=exit_code, error=error, tau=tau, suspect=suspect,
                                        local_path=str(local) if local else None, config=job.config,
                                        also=list(job.also)))

    def left(self, job: Job, state: str, error: str) -> None:
        """A job no host ran in this sweep (unreachable: its host went away; not-run): reported, not recorded."""
        self.outcomes[job.key] = Outcome(job.ckpt.name, job.ckpt.step, state, job.host, job.run, error=error,
                                         also=list(job.also))

    def not_stageable(self, job: Job, e: HostUnreachable) -> None:
        """The checkpoint's own host went away: no host can get it; not run (the next sweep tries again)."""
        c = job.ckpt
        self.outcomes[job.key] = Outcome(c.name, c.step, NOT_RUN, c.host, job.run, error=str(e).splitlines()[0],
                                         also=list(job.also))
        self.log(f"skip    {c.name}: {str(e).splitlines()[0]}")

    def failed(self, host: str, job: Job, e: Exception) -> None:
        """A job that raised: bad input for its checkpoint (staging, name, a damaged result) is reported, a bug
        logged and reported too; neither is retried, and neither drops the job or stops other hosts."""
        if isinstance(e, RevalError):
            self.record(job, host, protocol.FAILED, error=str(e).splitlines()[0])
        else:
            self.log(f"error   {job.ckpt.name} on {host}: {type(e).__name__}: {e}")
            self.record(job, host, protocol.FAILED, error=f"internal error: {type(e).__name__}: {e}")

    def finished(self, host: str, job: Job, st: RunState, path: Path) -> None:
        """A run that is over and pulled to `path`: its outcome recorded and logged."""
        run = compare.load_run(path)
        self.loaded.put(path, run)
        self.loaded.prepare(path, checkpoint_order(job.ckpt.step, job.ckpt.name))  # the report's statistics, now
        if st.state == protocol.SUCCEEDED and run.result is not None:
            tau = run.result.metrics.tau
            self.record(job, host, protocol.SUCCEEDED, tau=tau, suspect=run.suspect, local=path)
            self.log(f"done    {job.ckpt.name} on {host} · tau {float('nan') if tau is None else tau:.2f}"
                     + (" · SUSPECT" if run.suspect else ""))
        else:
            err = failure_line(st.status, path)
            self.record(job, host, st.state if st.state != protocol.SUCCEEDED else protocol.FAILED,
                        error=err, local=path, exit_code=st.status.get("exit_code"))
            self.log(f"FAILED  {job.ckpt.name} on {host} ({err}) — log {path}/eval.log")


def pull_and_record(hosts: HostPool, record: SweepRecord, hs: HostSession, job: Job, st: RunState,
                    pulled: Pulled | None = None) -> None:
    """A run that is over: pulled from hs (unless `pulled` already: its files, brought by the long poll), its
    outcome recorded and logged (a host gone: `unreachable`)."""
    try:
        res = hosts.pull(hs, job.run) if pulled is None else hosts.pulled(hs, job.run, pulled)
    except HostUnreachable:
        record.record(job, hs.host.name, UNREACHABLE, error=hs.down)
        raise
    record.finished(hs.host.name, job, st, res.path)


def failure_line(status: dict, run_dir: Path) -> str:
    """'exit 1: CUDA out of memory' — the exit code and the wrapper's error or the log's last line."""
    lines = protocol.tail_text(run_dir / protocol.EVAL_LOG, 64 << 10).splitlines()
    last = next((ln.strip() for ln in reversed(lines) if ln.strip() and not ln.startswith("[reval]")), "")
    why = status.get("error") or last  # whole: report.json keeps it, the screen shortens it
    head = f"exit {status['exit_code']}" if status.get("exit_code") is not None else status.get("state", "?")
    return f"{head}: {why}" if why else head
