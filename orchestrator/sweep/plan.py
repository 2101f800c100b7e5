"""Sweep planning: the sweep's data (checkpoints, options, jobs, outcomes), its outcome states, and the
pure step from (ledger, checkpoints) to a queue: which checkpoint runs, which re-attaches to its run,
which is already known. Nothing here does I/O; discover, stage, schedule and report import it, never
the other way round."""
from __future__ import annotations

import calendar
import dataclasses
import hashlib
import json
import re
import time
from dataclasses import dataclass, field

from remote_payload.contract import protocol

from ..errors import ConfigError
from ..results.stats import Paired
from ..runs.lifecycle import EvalSpec
from ..words import duration_s
from .ledger import LAUNCHED, Ledger, LedgerEntry, ledger_key

# outcome states beyond the run states: checkpoints that were not evaluated in this sweep
SKIPPED = "skipped"            # the ledger already has it (from an earlier sweep)
UNREACHABLE = "unreachable"    # its host went away (launched there: re-attached next time)
NOT_RUN = "not-run"            # no reachable host was left to run it


@dataclass
class Checkpoint:
    name: str
    path: str                 # absolute path on `host` (None: on this machine)
    host: str | None
    size: int
    mtime: int
    step: int | None = None
    content_hash: str = ""

    @property
    def location(self) -> str:
        return f"{self.host}:{self.path}" if self.host else self.path


def parse_since(text: str | None, now: float | None = None) -> float | None:
    """'36h', '7d', '90m', '2w' (ago: words.duration_s) or an ISO date/time (UTC) -> epoch seconds."""
    if not text:
        return None
    now = time.time() if now is None else now
    ago = duration_s(text)
    if ago is not None:
        return now - ago
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d"):
        try:
            return float(calendar.timegm(time.strptime(text.strip(), fmt)))
        except ValueError:
            continue
    raise ConfigError(f"--since {text!r}: not a duration or a date", hint="e.g. --since 36h, or --since 2026-11-30")


def select(checkpoints: list[Checkpoint], latest: int | None = None, since: float | None = None
           ) -> list[Checkpoint]:
    """Order by training step (then mtime), keep those modified since `since`, then the last `latest` (pure)."""
    cks = sorted(checkpoints, key=lambda c: (c.step is None, c.step or 0, c.mtime, c.name))
    if since is not None:
        cks = [c for c in cks if c.mtime >= since]
    if latest is not None:
        cks = cks[-latest:] if latest > 0 else []
    return cks


@dataclass
class SweepOptions:
    checkpoints: list[str]
    hosts: list[str]
    spec: EvalSpec = field(default_factory=EvalSpec)  # what each checkpoint's eval is (its drafter aside)
    latest: int | None = None
    since: str | None = None
    baseline: str | None = None
    threshold: float = 0.1        # tau difference that counts as improved/regressed
    force: bool = False
    sweep_dir: str = "sweeps"
    max_ssh: int = 8              # concurrent SSH operations, all hosts together
    poll_s: float = 10.0          # longest single wait (a long poll) on a running run's status
    retries: int = 3              # attempts per transport operation
    backoff_s: float = 1.0

    def eval_options(self) -> dict:
        """What changes the numbers (part of the ledger key)."""
        return self.spec.numbers_key()

    def to_json(self) -> dict:
        """What sweep.json records: the options, the spec's fields among them (its caches as given)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "spec"}
        return {**out, **self.eval_options(), "spec": dataclasses.asdict(self.spec)}

    def spec_for(self, drafter: str, gpus: str | None = None) -> EvalSpec:
        """The eval of one checkpoint: the sweep's spec with its drafter (one builder for run, sweep and API)."""
        return dataclasses.replace(self.spec, drafter=drafter, gpus=gpus)

    def identity(self) -> str:
        """Same command line (what is swept, where, how) = same sweep, for resuming after a kill."""
        blob = json.dumps({"checkpoints": self.checkpoints, "hosts": self.hosts, "latest": self.latest,
                           "since": self.since, "force": self.force, **self.eval_options()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Job:
    ckpt: Checkpoint
    key: str
    config: str
    run: str
    host: str | None = None   # affinity: a re-attach job must run where its run is
    staged: tuple[str, str] | None = None  # (host, path) once its checkpoint was copied there ahead of time
    also: list[str] = field(default_factory=list)  # other checkpoints with the same content: evaluated once


@dataclass
class Outcome:
    checkpoint: str
    step: int | None
    state: str                  # succeeded | failed | cancelled | lost | skipped | unreachable | not-run
    host: str | None = None
    run: str | None = None
    tau: float | None = None
    suspect: bool = False
    error: str | None = None
    local_path: str | None = None
    earlier: bool = False       # from an earlier sweep (skipped by the ledger)
    # filled by the report
    prev_checkpoint: str | None = None
    prev_tau: float | None = None
    base_ratio: float | None = None
    base_note: str | None = None
    verdict: str = ""
    tau_ci: list[float] | None = None      # 95% bootstrap CI over prompts
    vs_prev: Paired | None = None          # tau paired by prompt against prev_checkpoint
    prev_note: str | None = None           # why it was not paired
    vs_base: Paired | None = None          # tau paired by prompt against the baseline
    suites: dict | None = None             # benchmark suites: name (and "mean") -> {"tau", "ci"} (report)
    base_verdict: str = ""
    also: list[str] = field(default_factory=list)  # other names of the same content (evaluated once, as this)
    verdict_note: str | None = None        # why the verdict is what it is when the word alone misleads
    speedup: dict | None = None            # --speedup: {"projected": the best projected speedup, "method",
    #                                        "block": the plain block's}
    online: dict | None = None             # --online: measured speedup, prompts / rounds and how many agreed


def run_name_for(ckpt: Checkpoint, key: str, suffix: str = "") -> str:
    """Deterministic (re-launching after a crash finds its own run): <checkpoint>-<8 hex of the key>."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", ckpt.name).lstrip(".") or "ckpt"
    tail = f"-{key.split(':')[-1][:8]}{suffix}"
    return protocol.validate_run_name(base[: 64 - len(tail)] + tail)


def outcome_from_entry(e: LedgerEntry, earlier: bool) -> Outcome:
    return Outcome(e.checkpoint, e.step, e.state, e.host, e.run, e.tau, e.suspect, e.error, e.local_path, earlier,
                   also=list(e.also))


def plan_queue(checkpoints: list[Checkpoint], ledger: Ledger, sweep_id: str, cache_fingerprint: str,
               payload_version: str, opts: SweepOptions) -> tuple[list[Job], dict[str, Outcome], str, int]:
    """(queue, outcomes known already, the configuration key, runs kept from before a payload/cache
    change) for `checkpoints`, given the ledger (pure: reads the ledger, writes nothing)."""
    fp, version = cache_fingerprint, payload_version
    queue: list[Job] = []
    outcomes: dict[str, Outcome] = {}
    config = ledger_key("", fp, version, opts.eval_options())
    ours = ledger.of_sweep(sweep_id)  # what this sweep launched before it was killed
    kept = 0
    same: dict[str, list[Checkpoint]] = {}  # byte-identical checkpoints (one key): evaluated once, all named
    for c in checkpoints:
        same.setdefault(ledger_key(c.content_hash, fp, version, opts.eval_options()), []).append(c)
    for c in checkpoints:
        key = ledger_key(c.content_hash, fp, version, opts.eval_options())
        if same[key][0] is not c:
            continue
        also = list(dict.fromkeys(x.name for x in same[key][1:] if x.name != c.name))
        # this sweep's own run of the checkpoint first, whatever its key: the payload (or the cache) may
        # have changed since it was launched, and a resumed sweep must not launch it a second time
        e = ours.get((c.location, c.content_hash)) or ledger.get(key)
        mine = e is not None and e.sweep == sweep_id
        if e is not None and e.state == LAUNCHED:
            kept += e.key != key
            queue.append(Job(c, e.key, e.config or config, e.run, host=e.host, also=also))  # re-attach
        elif e is not None and e.state != protocol.LOST and (mine or not opts.force):
            kept += mine and e.key != key
            outcomes[e.key] = outcome_from_entry(e, earlier=not mine)
            if not mine:
                outcomes[e.key].state = SKIPPED if e.state == protocol.SUCCEEDED else e.state
            outcomes[e.key].also = sorted(set(outcomes[e.key].also) | set(also) - {outcomes[e.key].checkpoint})
        else:
            suffix = "" if e is None else time.strftime("-%m%dT%H%M%S", time.gmtime())
            queue.append(Job(c, key, config, run_name_for(c, key, suffix), also=also))
    return queue, outcomes, config, kept
