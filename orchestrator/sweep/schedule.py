"""Sweep scheduling: the Sweep (discover -> plan -> run the queue over the hosts -> report), the workers it
starts per host (slots.py for hosts that start runs one at a time, cluster.py for those that submit in
batches), and the sweep directory (sweep.json) for resuming.

The Sweep is composed of parts with explicit inputs, each replaceable (a test's fault goes in through them):
HostPool (stage.py: the hosts and every operation on them), JobQueue and SweepRecord (books.py: the jobs
left, what happened), SlotWorkers (slots.py) and BatchWorker (cluster.py: a backend that submits in batches);
the report is built from a SweepFacts (report.py), never from the Sweep."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from remote_payload.contract import protocol
from remote_payload.contract.spec import DEFAULT_MAX_BLOCKS

from ..errors import EXIT_BAD_INPUT, ConfigError, RevalError
from ..hosts.inventory import Inventory
from ..hosts.sync import local_manifest_hash
from ..results import compare
from ..rundir import registry as runs
from .books import JobQueue, SweepRecord
from .cluster import BatchWorker, batches
from .discover import discover
from .ledger import Ledger
from .plan import NOT_RUN, UNREACHABLE, Checkpoint, SweepOptions, parse_since, plan_queue, select
from .report import SweepFacts, SweepReport, build_report
from .slots import SlotWorkers, Workers
from .stage import HostPool


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


STOP_GRACE_S = 10.0  # Ctrl-C: how long the sweep waits for its workers to return (Workers.wait)


def baseline_differences(opts: SweepOptions, baseline: compare.Result | None, cache_fingerprint: str) -> list[str]:
    """What the sweep's evals will certainly differ in from the --baseline run (known before anything runs:
    max blocks, prompts asked for, the cache's fingerprint), as 'max_blocks 30 there, 20 here' (pure)."""
    if baseline is None or baseline.result is None:
        return []
    c, res = baseline.result.comparability, baseline.result
    ask = opts.spec
    eval_payload = ask.payload == "eval"
    blocks = ask.max_blocks if ask.max_blocks is not None else (DEFAULT_MAX_BLOCKS if eval_payload else None)
    out = []
    if blocks is not None and c.max_blocks != blocks:
        out.append(f"{compare.FIELD_WORDS['max_blocks']} {c.max_blocks} there, {blocks} here")
    total = res.cache.num_prompts_total if res.cache is not None else None
    if ask.num_prompts is not None and c.num_prompts != ask.num_prompts and not (
            c.num_prompts < ask.num_prompts and c.num_prompts == total):  # both ran the whole (smaller) cache
        out.append(f"{compare.FIELD_WORDS['num_prompts']} {c.num_prompts} there, {ask.num_prompts} here")
    if eval_payload and cache_fingerprint and not ask.prompts and c.cache_fingerprint != cache_fingerprint:
        out.append(f"cache {c.cache_fingerprint[:19]} there, {cache_fingerprint[:19]} here")
    return out


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
            "complete": complete, "options": self.opts.to_json()})

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
