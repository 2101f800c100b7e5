"""Sweeps on a Slurm cluster (a `slurm:` host): its share of the new checkpoints goes out as ONE job array
(`--array=0-N%K`, K = the host's `slurm.max_running`), one checkpoint per task; Slurm decides when and where
each task runs, reval never picks GPUs there. The same ledger as everywhere (each run recorded `launched`
before the submission, so a killed controller re-attaches), the same pull and report; one poller per
cluster asks Slurm about all of its runs at once (two round trips per poll, whatever the array's size).

In a mixed group (SSH boxes + a cluster) the cluster takes its share of the fresh checkpoints when the
sweep starts — K of every (K + the other hosts' slots) — and the SSH workers take the rest as they go.
"""
from __future__ import annotations

import math
import time

from remote_payload.contract import protocol

from ..backends.base import GPUS_SCHEDULER, Submission
from ..errors import HostUnreachable, RevalError
from .plan import UNREACHABLE, Job
from .stage import HostSession


def cluster_share(n_fresh: int, cluster_slots: int, other_slots: int) -> int:
    """How many of `n_fresh` checkpoints a cluster with K slots takes next to `other_slots` others (pure)."""
    if n_fresh <= 0:
        return 0
    return min(n_fresh, math.ceil(n_fresh * cluster_slots / max(1, cluster_slots + other_slots)))


class ClusterBatches:
    """The cluster half of a Sweep (schedule.Sweep mixes it in: it owns queue, lock, ledger, log, _op)."""

    def _take_share(self, hs: HostSession) -> tuple[list[Job], list[Job]]:
        """(re-attach jobs of this cluster, its share of the fresh jobs), taken off the queue."""
        with self.lock:
            mine = [j for j in self.queue if j.host == hs.host.name]
            fresh = [j for j in self.queue if j.host is None]
            others = sum(len(s.slots) for s in self.sessions.values() if s is not hs and not s.down)
            share = fresh[:cluster_share(len(fresh), len(hs.slots), others)]
            for j in mine + share:
                self.queue.remove(j)
        return mine, share

    def cluster_worker(self, hs: HostSession) -> None:
        attach, fresh = self._take_share(hs)
        backend = hs.backend
        try:
            if fresh:
                self._submit_array(hs, backend, fresh)
            for j in attach:
                self.log(f"attach  {j.ckpt.name}: run {j.run} on {hs.host.name}")
            self._poll(hs, backend, {j.run: j for j in fresh + attach})
        except HostUnreachable:
            for j in fresh + attach:
                if j.key not in self.outcomes:
                    self._record(j, hs, UNREACHABLE, error=hs.down)

    def _submit_array(self, hs: HostSession, backend, jobs: list[Job]) -> None:
        subs, entries = [], []
        for job in list(jobs):
            c = job.ckpt
            try:
                path = self.stage_checkpoint(hs, c)
            except HostUnreachable as e:
                if hs.down:
                    raise
                jobs.remove(job)
                self.not_stageable(job, e)
                continue
            except Exception as e:  # noqa: BLE001 - this checkpoint fails (as on an SSH host), the array goes on
                jobs.remove(job)
                self.job_failed(hs, job, e)
                continue
            argv = self.opts.spec(path, GPUS_SCHEDULER).payload_argv(job.run)
            subs.append(Submission(job.run, argv, hs.python, GPUS_SCHEDULER, self.run_json(job, path, argv)))
            entries.append(self.launched_entry(hs, job))
        if not subs:
            return
        for e in entries:  # before submitting: a killed controller finds them and re-attaches
            self.ledger.put(e)
        try:
            launches = self._op(hs, "submit", lambda: backend.submit_many(subs))
        except RevalError as e:
            if isinstance(e, HostUnreachable):
                raise
            for job in jobs:  # refused by sbatch or a used name: reported for each, not retried blindly
                self._record(job, hs, protocol.FAILED, error=str(e).splitlines()[0])
            jobs.clear()
            return
        k = min(len(subs), hs.host.slurm.max_running)
        array = launches[0].handle.job_id.split("_")[0]
        self.log(f"submit  {len(subs)} checkpoint(s) on {hs.host.name} · "
                 + (f"job array {array} (at most {k} at once)" if len(subs) > 1 else f"job {array}"))

    def _poll(self, hs: HostSession, backend, pending: dict[str, Job]) -> None:
        while pending and not hs.down:
            states = {s.name: s for s in self._op(hs, "status", lambda: backend.states(list(pending)))}
            for name, job in list(pending.items()):
                st = states.get(name)
                if st is None:  # recorded as launched, never submitted (a killed controller): submit it now
                    self.log(f"missing {job.ckpt.name}: run {name} is not on {hs.host.name}; submitting")
                    del pending[name]
                    job.host = None
                    again = [job]
                    self._submit_array(hs, backend, again)
                    pending.update({j.run: j for j in again})
                elif st.terminal:
                    del pending[name]
                    try:
                        self.pull_and_record(hs, job, st)
                    except HostUnreachable:
                        raise
                    except Exception as e:  # noqa: BLE001 - a damaged result fails this run, not the others
                        self.job_failed(hs, job, e)
            if pending:
                time.sleep(self.opts.poll_s)
