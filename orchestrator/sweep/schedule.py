"""Sweep scheduling: the queue run one job per free GPU slot over the hosts, each job launched (or
re-attached), followed, pulled and recorded in the ledger; the sweep directory (sweep.json) for resuming."""
from __future__ import annotations

import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path

from remote_payload.contract import protocol

from .. import compare, lifecycle, runs
from ..backends.ssh import NoFreeGpu
from ..errors import EXIT_BAD_INPUT, ConfigError, HostUnreachable, RevalError, RunExists
from ..inventory import Inventory
from ..ledger import LAUNCHED, Ledger, LedgerEntry
from ..sync import local_manifest_hash
from .cluster import ClusterBatches
from .discover import discover
from .plan import (
    NOT_RUN,
    UNREACHABLE,
    Checkpoint,
    Job,
    Outcome,
    SweepOptions,
    parse_since,
    plan_queue,
    select,
)
from .report import LoadedRuns, SweepReport, build_report
from .stage import HostSession, Staging


def load_baseline(spec: str | None) -> compare.RunRecord | None:
    """The --baseline run, loaded before anything runs: a wrong name fails at once (exit 102 or 3), not
    after a night of evals."""
    if not spec:
        return None
    try:
        rec = compare.load_run(compare.resolve_run(spec, runs.local_runs_root()))
    except protocol.ProtocolError as e:
        raise ConfigError(f"--baseline {spec!r}: {e}") from None
    except RevalError as e:
        raise type(e)(f"--baseline: {e}", hint=e.hint, exit_code=e.exit_code) from None
    if rec.result is None:
        raise ConfigError(f"--baseline {spec!r}: {rec.path} has no results.json (state {rec.state})",
                          hint="pick a finished run (reval ls), or pull it again: reval pull HOST/NAME")
    return rec


class Sweep(Staging, ClusterBatches):
    def __init__(self, opts: SweepOptions, inventory: Inventory, *, log=None,
                 baseline: compare.RunRecord | None = None):
        self.opts = opts
        self.inventory = inventory
        self.log = log or (lambda line: None)
        self.baseline = baseline or load_baseline(opts.baseline)
        self.root = Path(opts.sweep_dir)
        self.ledger = Ledger(self.root / "ledger.json")
        self.ssh = threading.BoundedSemaphore(max(1, opts.max_ssh))
        self.lock = threading.Lock()
        self.queue: list[Job] = []
        self.outcomes: dict[str, Outcome] = {}   # key -> outcome
        self.loaded = LoadedRuns()                   # pulled runs, parsed once for the ledger and the report
        self.sessions: dict[str, HostSession] = {}
        self.sources: dict[str, HostSession] = {}  # checkpoint hosts that are not sweep hosts (relay only)
        self.stage_locks: dict[str, threading.Lock] = {}  # per checkpoint content: staged once at a time
        self.active = 0                            # runs being followed now (all slots)
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

    # -- hosts ----------------------------------------------------------------------------------------------

    # -- planning -------------------------------------------------------------------------------------------
    def plan(self, checkpoints: list[Checkpoint]) -> None:
        fp = next(hs.cache_fingerprint for hs in self.sessions.values() if not hs.down)
        queue, outcomes, self.config, kept = plan_queue(checkpoints, self.ledger, self.sweep_id, fp,
                                                        local_manifest_hash(), self.opts)
        self.queue += queue
        self.outcomes.update(outcomes)
        if kept:
            self.log(f"resume  {kept} run(s) kept from before a payload/cache change (not run again)")

    # -- workers --------------------------------------------------------------------------------------------
    def _take(self, hs: HostSession, reattach_only: bool = False) -> Job | None:
        with self.lock:
            for i, j in enumerate(self.queue):
                if j.host == hs.host.name or (j.host is None and not reattach_only):
                    return self.queue.pop(i)
        return None

    def worker(self, hs: HostSession, gpu: str, reattach_only: bool = False) -> None:
        held: list[Job] = []  # the next job, taken (and staged) while the current run goes on
        try:
            self._work(hs, gpu, reattach_only, held)
        finally:
            for job in held:
                job.staged = None
                self._requeue(job)

    def _work(self, hs: HostSession, gpu: str, reattach_only: bool, held: list[Job]) -> None:
        refused = 0  # launches in a row the host refused for want of a free GPU
        while not hs.down:
            job = held.pop() if held else self._take(hs, reattach_only)
            if job is None:
                return
            try:
                self.run_job(hs, job, gpu, held if not reattach_only else None)
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
                self.job_failed(hs, job, e)

    def job_failed(self, hs: HostSession, job: Job, e: Exception) -> None:
        """A job that raised: bad input for its checkpoint (staging, name, a damaged result) is reported, a bug
        logged and reported too; neither is retried, and neither drops the job or stops other hosts."""
        if isinstance(e, RevalError):
            self._record(job, hs, protocol.FAILED, error=str(e).splitlines()[0])
        else:
            self.log(f"error   {job.ckpt.name} on {hs.host.name}: {type(e).__name__}: {e}")
            self._record(job, hs, protocol.FAILED, error=f"internal error: {type(e).__name__}: {e}")

    def not_stageable(self, job: Job, e: HostUnreachable) -> None:
        """The checkpoint's own host went away: no host can get it; not run (the next sweep tries again)."""
        c = job.ckpt
        self.outcomes[job.key] = Outcome(c.name, c.step, NOT_RUN, c.host, job.run, error=str(e).splitlines()[0])
        self.log(f"skip    {c.name}: {str(e).splitlines()[0]}")

    def launched_entry(self, hs: HostSession, job: Job) -> LedgerEntry:
        """The ledger's `launched` record of job on hs (written before the launch: a killed controller finds it)."""
        c = job.ckpt
        return LedgerEntry(job.key, c.name, c.location, c.content_hash, c.step, hs.host.name, job.run, LAUNCHED,
                           self.sweep_id, config=job.config)

    def run_json(self, job: Job, path: str, argv: list[str]) -> dict:
        """What a sweep's run records in run.json: its sweep, checkpoint and ledger key."""
        c = job.ckpt
        return {"sweep": self.sweep_id, "checkpoint": c.location, "checkpoint_hash": c.content_hash,
                "ledger_key": job.key, "drafter": path, "argv": argv}

    def run_job(self, hs: HostSession, job: Job, gpu: str, held: list[Job] | None = None) -> None:
        c = job.ckpt
        entry = self.launched_entry(hs, job)
        if job.host is None:  # a fresh launch
            try:
                path = job.staged[1] if job.staged and job.staged[0] == hs.host.name else \
                    self.stage_checkpoint(hs, c)
            except HostUnreachable as e:
                if hs.down:  # this host went away: another one takes the job
                    self._requeue(job)
                    raise
                self.not_stageable(job, e)
                return
            before = self.ledger.get(job.key)
            self.ledger.put(entry)  # before launching: a killed controller finds it and re-attaches
            run_json = self.run_json(job, path, self.opts.spec(path).payload_argv(job.run))
            try:
                spec = self.opts.spec(path, gpu)
                info = self._op(hs, "launch", lambda: lifecycle.submit(
                    hs.backend, spec, python=hs.python, name=job.run, run_json=run_json)).launch
                self.log(f"launch  {c.name} on {hs.host.name}"
                         + "".join(f" · GPU {g}" for g in info.gpus) + f" · run {job.run}")
            except HostUnreachable:
                # Did it start before the connection broke? The next sweep re-attaches (the ledger says launched).
                self._record(job, hs, UNREACHABLE, error=hs.down)
                raise
            except NoFreeGpu:  # nothing started: not a result; back in the queue (the worker backs off)
                self.ledger.restore(job.key, before)
                self._requeue(job)
                raise
            except RunExists:
                self.log(f"attach  {c.name}: run {job.run} already on {hs.host.name}")
        else:
            self.log(f"attach  {c.name}: run {job.run} on {hs.host.name}")
        if held is not None and not held:
            self.prefetch(hs, held)
        self.wait_and_pull(hs, job)

    def wait_and_pull(self, hs: HostSession, job: Job) -> None:
        with self.lock:
            self.active += 1
        try:
            self._wait_and_pull(hs, job)
        finally:
            with self.lock:
                self.active -= 1

    def _wait_and_pull(self, hs: HostSession, job: Job) -> None:
        run = lifecycle.attach(hs.backend, job.run, python=hs.python)  # the same handle `reval run` follows
        try:
            wait_s = 0.0
            while True:
                # after the first look, a long poll: one SSH command that returns as soon as the run is no longer
                # running (or after poll_s), so its end is seen within ~0.1 s without a round trip per 0.1 s
                st = self._op(hs, "status", lambda w=wait_s: run.probe(wait_s=w), bounded=wait_s == 0)
                wait_s = self.opts.poll_s
                if st is None:  # recorded as launched, but the run never started: launch it now
                    self.log(f"missing {job.ckpt.name}: run {job.run} is not on {hs.host.name}; launching")
                    job.host = None
                    return self.run_job(hs, job, "auto" if hs.on_gpu else "none")
                if st.terminal:
                    break
        except HostUnreachable:
            self._record(job, hs, UNREACHABLE, error=hs.down)
            raise
        self.pull_and_record(hs, job, st)

    def pull_and_record(self, hs: HostSession, job: Job, st: runs.RunState) -> None:
        """A finished run: pull it, record its outcome in the ledger, log it."""
        try:
            run = lifecycle.attach(hs.backend, job.run, python=hs.python)
            res = self._op(hs, "pull", lambda: run.pull(finished=True))
        except HostUnreachable:
            self._record(job, hs, UNREACHABLE, error=hs.down)
            raise
        run = compare.load_run(res.path)
        self.loaded.put(res.path, run)
        if st.state == protocol.SUCCEEDED and run.result is not None:
            tau = run.result.metrics.tau
            self._record(job, hs, protocol.SUCCEEDED, tau=tau, suspect=run.suspect, local=res.path)
            self.log(f"done    {job.ckpt.name} on {hs.host.name} · tau {float('nan') if tau is None else tau:.2f}"
                     + (" · SUSPECT" if run.suspect else ""))
        else:
            err = failure_line(st.status, res.path)
            self._record(job, hs, st.state if st.state != protocol.SUCCEEDED else protocol.FAILED,
                         error=err, local=res.path, exit_code=st.status.get("exit_code"))
            self.log(f"FAILED  {job.ckpt.name} on {hs.host.name} ({err}) — log {res.path}/eval.log")

    def _requeue(self, job: Job) -> None:
        with self.lock:
            self.queue.insert(0, job)

    def _record(self, job: Job, hs: HostSession, state: str, *, tau=None, suspect=False, error=None,
                local=None, exit_code=None) -> None:
        c = job.ckpt
        self.outcomes[job.key] = Outcome(c.name, c.step, state, hs.host.name, job.run, tau, suspect, error,
                                         str(local) if local else None)
        if state != UNREACHABLE:  # unreachable: the ledger keeps `launched`, the next sweep re-attaches
            self.ledger.put(LedgerEntry(job.key, c.name, c.location, c.content_hash, c.step, hs.host.name,
                                        job.run, state, self.sweep_id, exit_code=exit_code, error=error, tau=tau,
                                        suspect=suspect, local_path=str(local) if local else None,
                                        config=job.config))

    def execute(self) -> None:
        """Workers per host slot until the queue is empty or no host is left. Re-attach jobs get a thread of
        their own (their run already holds its GPU); a CPU host launches new runs only after those end."""
        why = "no reachable host left"
        last = None
        while True:
            with self.lock:
                for job in [j for j in self.queue if j.host and (j.host not in self.sessions
                                                                 or self.sessions[j.host].down)]:
                    self.queue.remove(job)
                    self.outcomes[job.key] = Outcome(job.ckpt.name, job.ckpt.step, UNREACHABLE, job.host, job.run,
                                                     error=f"{job.host} is unreachable; re-attached next time")
            up = [hs for hs in self.sessions.values() if not hs.down]
            if not self.queue or not up:
                break
            if last == (len(self.outcomes), len(up)):  # a whole round ended nothing: every GPU is busy
                why = "no free GPU (all busy or locked by other runs); the next sweep tries again"
                break
            last = (len(self.outcomes), len(up))
            threads = []
            for hs in up:
                if hs.host.slurm is not None:  # a cluster: one job array for its share, one poller
                    threads.append(threading.Thread(target=self.cluster_worker, args=(hs,)))
                    continue
                n_attach = sum(1 for j in self.queue if j.host == hs.host.name)
                threads += [threading.Thread(target=self.worker, args=(hs, "none", True)) for _ in range(n_attach)]
                if hs.on_gpu or not n_attach:
                    threads += [threading.Thread(target=self.worker, args=(hs, g)) for g in hs.slots]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        for job in self.queue:  # no host left for these
            self.outcomes[job.key] = Outcome(job.ckpt.name, job.ckpt.step, NOT_RUN, job.host, job.run, error=why)
        self.queue.clear()

    def run(self) -> SweepReport:
        existed = self.root.exists()
        bad_input = False
        self.ledger.lock()
        try:
            # hosts and checkpoints first: bad input (an unknown --hosts group, a glob matching nothing) ends
            # the sweep with exit 3 before its sweep.json exists
            self.prepare_hosts()
            up = {n: hs.transport for n, hs in self.sessions.items() if not hs.down}
            skipped: list[str] = []
            found = discover(self.opts.checkpoints, self.inventory, self.ledger, up, skipped, self.remote_hashes)
            if skipped:
                shown = ", ".join(repr(n) for n in skipped[:8]) + (f" and {len(skipped) - 8} more"
                                                                   if len(skipped) > 8 else "")
                self.log(f"skip    {len(skipped)} name(s) that are not checkpoint names (letters, digits, . _ -; "
                         f"not starting with - or .): {shown}")
            chosen = select(found, self.opts.latest, parse_since(self.opts.since))
            self.open_sweep_dir()
            self.plan(chosen)
            n_skip = sum(1 for o in self.outcomes.values() if o.earlier)
            free = sum(len(hs.slots) for hs in self.sessions.values() if not hs.down)
            n_up = sum(1 for hs in self.sessions.values() if not hs.down)
            self.log(f"{len(chosen)} checkpoints · {n_skip} already evaluated (skipped) · {len(self.queue)} to run "
                     f"on {n_up} host(s), {free} slot(s)")
            self.execute()
            report = build_report(self, chosen)
            self._write_state(complete=not any(o.state in (UNREACHABLE, NOT_RUN) for o in report.outcomes))
            return report
        except RevalError as e:
            bad_input = e.exit_code == EXIT_BAD_INPUT
            raise
        finally:
            self.ledger.unlock()  # deletes ledger.json.lock
            if bad_input and not existed:  # nothing of this invocation is kept (only it wrote there)
                shutil.rmtree(self.root, ignore_errors=True)


def failure_line(status: dict, run_dir: Path) -> str:
    """'exit 1: CUDA out of memory' — the exit code and the wrapper's error or the log's last line."""
    last = ""
    try:
        lines = (run_dir / protocol.EVAL_LOG).read_text(errors="replace").splitlines()
        last = next((ln.strip() for ln in reversed(lines) if ln.strip() and not ln.startswith("[reval]")), "")
    except OSError:
        pass
    why = status.get("error") or last  # whole: report.json keeps it, the screen shortens it
    head = f"exit {status['exit_code']}" if status.get("exit_code") is not None else status.get("state", "?")
    return f"{head}: {why}" if why else head
