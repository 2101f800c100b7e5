"""Sweeps on a host whose backend submits in batches (BATCH_SUBMIT + BATCH_STATE: a Slurm cluster): its
share of the new checkpoints goes out as ONE submission (Slurm: a job array `--array=0-N%K`, K = its run
slots, the host's `slurm.max_running`), one checkpoint per run; the scheduler decides when and where each
runs, reval never picks GPUs there. The same ledger as everywhere (each run recorded `launched` before the
submission, so a killed controller re-attaches), the same pull and report; one poller per host asks the
backend about all of its runs at once (Slurm: two round trips per poll, whatever the array's size).

In a mixed group (SSH boxes + a cluster) the cluster takes its share of the fresh checkpoints when the
sweep starts — K of every (K + the other hosts' slots) — and the slot workers take the rest as they go.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from remote_payload.contract import protocol

from ..backends.base import BATCH_STATE, BATCH_SUBMIT, Backend, Submission
from ..errors import HostUnreachable, RevalError
from ..rundir.registry import NO_ANSWER
from .books import JobQueue, SweepRecord, pull_and_record
from .plan import UNREACHABLE, Job, SweepOptions
from .stage import HostPool, HostSession


def cluster_share(n_fresh: int, cluster_slots: int, other_slots: int) -> int:
    """How many of `n_fresh` checkpoints a cluster with K slots takes next to `other_slots` others (pure)."""
    if n_fresh <= 0:
        return 0
    return min(n_fresh, math.ceil(n_fresh * cluster_slots / max(1, cluster_slots + other_slots)))


def batches(backend: Backend) -> bool:
    """Whether the sweep hands this backend its runs in batches (it submits many at once and answers for
    many at once) rather than one per slot."""
    return backend.supports(BATCH_SUBMIT) and backend.supports(BATCH_STATE)


class BatchWorker:
    """One poller per batch host: takes the host's share of the queue, submits it in one batch, then asks
    for all of its runs' states at once until each is over and pulled. Inputs: the options (poll_s), the
    hosts (operations, staging, pulls), the queue, the record, the log."""

    def __init__(self, opts: SweepOptions, hosts: HostPool, queue: JobQueue, record: SweepRecord,
                 log: Callable[[str], None]):
        self.opts, self.hosts, self.queue, self.record, self.log = opts, hosts, queue, record, log

    def run(self, hs: HostSession) -> None:
        others = sum(len(s.slots) for s in self.hosts.up() if s is not hs)
        attach, fresh = self.queue.take_share(hs.host.name, lambda n: cluster_share(n, len(hs.slots), others))
        try:
            if fresh:
                self._submit(hs, fresh)
            for j in attach:
                self.log(f"attach  {j.ckpt.name}: run {j.run} on {hs.host.name}")
            self._poll(hs, {j.run: j for j in fresh + attach})
        except HostUnreachable:
            for j in fresh + attach:
                if j.key not in self.record.outcomes:
                    self.record.record(j, hs.host.name, UNREACHABLE, error=hs.down)

    def _submit(self, hs: HostSession, jobs: list[Job]) -> None:
        gpus = hs.slots[0]  # the scheduler's word (`scheduler`): the GPUs are the job's
        subs, entries = [], []
        for job in list(jobs):
            c = job.ckpt
            try:
                path = self.hosts.stage_checkpoint(hs, c)
            except HostUnreachable as e:
                if hs.down:
                    raise
                jobs.remove(job)
                self.record.not_stageable(job, e)
                continue
            except Exception as e:  # noqa: BLE001 - this checkpoint fails (as on a slot host), the batch goes on
                jobs.remove(job)
                self.record.failed(hs.host.name, job, e)
                continue
            spec, info = self.opts.spec_for(path, gpus), None
            try:  # --prompts: the caches resolved (the missing ones built by one extract job) before the array
                if spec.prompts:
                    spec, info = self.hosts.resolve_caches(hs, spec, run=job.run)
            except HostUnreachable:
                raise
            except Exception as e:  # noqa: BLE001 - this checkpoint fails (its caches could not be had)
                jobs.remove(job)
                self.record.failed(hs.host.name, job, e)
                continue
            argv = spec.payload_argv(job.run)
            run_json = {**self.record.run_json(job, path, argv), **({"prompt_caches": info} if info else {})}
            subs.append(Submission(job.run, argv, hs.python, gpus, run_json))
            entries.append(self.record.launched_entry(hs.host.name, job))
        if not subs:
            return
        if self.queue.stopped:  # Ctrl-C while staging: nothing submitted, nothing recorded
            for job in jobs:
                self.queue.put_back(job)
            jobs.clear()
            return
        for e in entries:  # before submitting: a killed controller finds them and re-attaches
            self.record.ledger.put(e)
        try:
            launches = self.hosts.op(hs, "submit", lambda: hs.backend.submit_many(subs))
        except RevalError as e:
            if isinstance(e, HostUnreachable):
                raise
            for job in jobs:  # refused by the scheduler or a used name: reported for each, not retried blindly
                self.record.record(job, hs.host.name, protocol.FAILED, error=str(e).splitlines()[0])
            jobs.clear()
            return
        self.log(f"submit  {len(subs)} checkpoint(s) on {hs.host.name} · {hs.backend.describe_batch(launches)}")

    def _poll(self, hs: HostSession, pending: dict[str, Job]) -> None:
        silent: dict[str, str] = {}  # runs the scheduler cannot answer for now: said once, waited for
        while pending and not hs.down and not self.queue.stopped:  # Ctrl-C: the runs go on, re-attached next time
            states = {s.name: s for s in self.hosts.op(hs, "status", lambda: hs.backend.states(list(pending)))}
            for name, job in list(pending.items()):
                st = states.get(name)
                if st is not None and st.state == NO_ANSWER:  # not an end (never `lost`): keep waiting, say so
                    if name not in silent:
                        self.log(f"waiting {job.ckpt.name}: run {name} on {hs.host.name}: {st.reason}; "
                                 "its end is recorded once the scheduler answers")
                    silent[name] = st.reason
                    continue
                if name in silent:
                    del silent[name]
                    self.log(f"answer  {job.ckpt.name}: run {name} on {hs.host.name} is {st.state if st else 'gone'}")
                if st is None:  # recorded as launched, never submitted (a killed controller): submit it now
                    self.log(f"missing {job.ckpt.name}: run {name} is not on {hs.host.name}; submitting")
                    del pending[name]
                    job.host = None
                    again = [job]
                    self._submit(hs, again)
                    pending.update({j.run: j for j in again})
                elif st.terminal:
                    del pending[name]
                    try:
                        pull_and_record(self.hosts, self.record, hs, job, st)
                    except HostUnreachable:
                        raise
                    except Exception as e:  # noqa: BLE001 - a damaged result fails this run, not the others
                        self.record.failed(hs.host.name, job, e)
            if pending:
                self.queue.stopping.wait(self.opts.poll_s)
