"""Nightly checkpoint sweeps: discover checkpoints, skip what the ledger already has, schedule one run per
free GPU (one at a time on a CPU host) over a group's hosts, follow, pull, and report every checkpoint
against the baseline and the previous checkpoint.

Survives the controller: the ledger (ledger.py) records each run when it is launched, with its host and
its deterministic name, so a re-run re-attaches to runs still going, pulls finished ones and launches only
what is missing (it finds its own runs by checkpoint, not by ledger key: the key moves when the payload
changed in between). A host that fails or goes away never stops the others: its queued checkpoints go to the
remaining hosts, a run in flight there is reported `unreachable` (exit 2) and re-attached next time.
Only transport errors are retried (with backoff); a failed eval is reported, never retried blindly.

GPUs: a host's backend counts its run slots (Backend.run_slots: nvidia-smi's GPUs on an SSH host, each slot
launching with `--gpus auto` so that the wrapper there picks a free GPU and flocks it; a scheduler's cap of
runs at once on a cluster). A launch refused for "no free GPU" is put back in the queue and retried with
backoff, never recorded as a failure. A host whose backend submits in batches (Backend.supports
BATCH_SUBMIT and BATCH_STATE: Slurm) gets its share as one submission and one poller (cluster.py); the
sweep never asks which backend a host has. A slot whose backend has WAIT_THEN_SUBMIT (SSH) starts its next
staged run in the long poll's own round trip, the moment the run before it ended; the long poll that sees a
run end brings its files too (up to 4 MiB; a larger run is pulled on its own).

The package by stage: discover (checkpoints and their content hashes), plan (the pure step from ledger +
checkpoints to a queue; the data types and outcome states live there so the parts never import each other
in a circle), stage (HostPool: hosts made ready, checkpoints copied, every host operation retried), books
(JobQueue: the jobs left; SweepRecord: outcomes and ledger entries), schedule (the Sweep wiring those parts
explicitly), slots (SlotWorkers: launch/re-attach, follow, pull, record per slot), cluster (BatchWorker),
report (built from a SweepFacts value: verdicts, exit code), render (the report shown: table, lines, report
files) and ledger (what was evaluated how, across sweeps).
"""
from __future__ import annotations

from .books import JobQueue, SweepRecord, failure_line
from .discover import (
    CHECKPOINT_NAME,
    discover,
    hash_command,
    list_script,
    local_content_hash,
    parse_checkpoint_spec,
    parse_hashes,
)
from .plan import (
    NOT_RUN,
    SKIPPED,
    UNREACHABLE,
    Checkpoint,
    Job,
    Outcome,
    SweepOptions,
    outcome_from_entry,
    parse_since,
    plan_queue,
    run_name_for,
    select,
)
from .render import outcome_text, print_report, report_json, report_table, write_report_files
from .report import (
    SweepFacts,
    SweepReport,
    attach_comparisons,
    build_report,
    sweep_exit_code,
    verdict,
)
from .schedule import Sweep, load_baseline
from .slots import SlotWorkers
from .stage import HostPool, HostSession, retrying

__all__ = ["CHECKPOINT_NAME", "NOT_RUN", "SKIPPED", "UNREACHABLE", "Checkpoint", "HostPool", "HostSession", "Job",
           "JobQueue", "Outcome", "SlotWorkers", "Sweep", "SweepFacts", "SweepOptions", "SweepRecord", "SweepReport",
           "attach_comparisons", "build_report", "discover", "failure_line",
           "hash_command", "list_script", "load_baseline", "local_content_hash", "outcome_from_entry",
           "outcome_text", "parse_checkpoint_spec", "parse_hashes", "parse_since", "plan_queue", "print_report",
           "report_json", "report_table",
           "retrying", "run_name_for", "select", "sweep_exit_code", "verdict", "write_report_files"]
