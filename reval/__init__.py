"""reval as a library: run DFlash drafter evals on GPU hosts, follow them, load and compare results.

    import reval
    inv = reval.Inventory.load("hosts.yaml")             # the CLI's validation and one-line errors
    run = reval.submit(inv["gpu1"], reval.EvalSpec(drafter="/m/step4000", target="/m/Qwen3.6-27B",
                       cache="/eval/cache", num_prompts=10, max_blocks=30), name="step4000")
    for ev in run.events():                              # typed progress (what the CLI's bar draws):
        ...                                              #   reval.LogLine / Progress / StatusChange / Note
    res = run.wait()                                     # follows, pulls, returns a reval.Result
    res.metrics.tau, res.per_prompt[0].acceptance_lengths, res.health.suspect, res.path
    base = reval.load("runs/gpu1/zlab_full")             # any pulled run directory, or NAME / HOST/NAME
    cmp = reval.compare([res, base], baseline=base)      # what `reval compare` prints, as data
    cmp.best, cmp.rows                                   # the top-tau rankable run; one plain dict per run

Every `reval` command is one of these calls; the CLI only parses its arguments and prints what they return:

    reval hosts check [HOST|GROUP]   check_hosts(target) -> [HostCheck]
    reval sync HOST|GROUP            sync(target) -> [HostSync]            prepare(host) -> Prepared
    reval run HOST ...               submit(host, spec) -> Run; Run.finish() -> Finished (Run.wait() -> Result)
    reval extract HOST ...           extract(host, ExtractSpec) -> ExtractRun; .finish() -> ExtractFinished
    reval caches [HOST] / caches rm  caches(target) -> CacheListing / remove_caches(host, keys) -> [key]
    reval status RUN / reval status  status(run) -> RunState / ls(here=True) -> Listing
    reval ls [HOST|GROUP]            ls(target) -> Listing (oldest first, unreachable hosts named)
    reval logs RUN [-f]              logs(run, tail=N) -> Log / find(run).finish(tail=N)
    reval pull RUN | --all           pull(run) -> Pulled / pull_all(target) -> PulledAll
    reval kill RUN                   kill(run) -> Killed
    reval rm RUN... / reval prune    plan_rm(runs) / plan_prune(target, failed=, older_than_s=) -> RemovalPlan,
                                     .apply() (rm(...) / prune(...): both at once)
    reval compare RUN...             compare(runs, baseline=) -> Comparison (.save_plot, .write_html)
    reval sweep ...                  sweep(SweepOptions(...)) -> SweepReport
    reval demo                       prepare, build_fixtures(host) -> Fixtures, submit, finish, compare

RUN is `name` (looked up in runs/ here, then on every inventory host) or `host/name`; `find(run)` is the
Run it names. Functions that take a host or a RUN take `inventory=` (an Inventory, or the path of a
hosts.yaml; default: $REVAL_HOSTS, else ./hosts.yaml, else the built-in local host).

Nothing here prints. Errors are `reval.Error` (a RevalError: `str(e)` is the one line, `e.hint` the fix,
`e.exit_code` the CLI's code). Underneath is one lifecycle (orchestrator/runs/lifecycle.py) through a backend
(orchestrator/backends/: SSH or the local folder, or a Slurm cluster). `Result` is a pulled run directory as
read from disk: its typed results.json (`res.result`, remote_payload/contract/results.py; `res.metrics`,
`res.per_prompt`, `res.health`... forward to it), status.json, run.json, `res.state`, `res.suspect`, `res.path`.

Beside the verbs: the run states (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, LOST; UNKNOWN and NO_ANSWER,
the controller's own), the exit codes (EXIT_OK ... EXIT_CANCELLED: `exit_code` of reval.Error, Finished and
SweepReport), local_runs() (the runs kept in runs/ here, no host asked), is_run_glob(RUN), hosts_exit_code(
[HostCheck | HostSync]), did_you_mean and duration_s (the words every command reads one way), printable (a
name or line with its control characters escaped, as every command shows one) and PLAUSIBLE_SINCE (prune ages
no run that ended before it).

This file is the face: the names above, re-exported from reval/hosts.py (inventory, hosts check, sync, prepare,
fixtures), runs.py (one run), listing.py (the runs on hosts: ls, pull_all, rm, prune), results.py (load,
compare) and sweeps.py (sweep); the CLI over them is reval/cli/.
"""
from __future__ import annotations

from orchestrator import __version__ as __version__
from orchestrator.errors import (
    EXIT_BAD_INPUT,
    EXIT_CANCELLED,
    EXIT_EVAL_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_STILL_RUNNING,
    EXIT_UNREACHABLE,
    RevalError,
)
from orchestrator.hosts.hostcheck import HostCheck, hosts_exit_code
from orchestrator.hosts.inventory import Host, Inventory
from orchestrator.results.compare import is_run_glob
from orchestrator.rundir.events import Event, LogLine, Note, Progress, StatusChange
from orchestrator.rundir.registry import NO_ANSWER, UNKNOWN, RunState
from orchestrator.runs.lifecycle import EvalSpec
from orchestrator.runs.remove import PLAUSIBLE_SINCE, Removal
from orchestrator.sweep import SweepOptions, SweepReport
from orchestrator.words import did_you_mean, duration_s, printable
from remote_payload.contract.protocol import CANCELLED, FAILED, LOST, QUEUED, RUNNING, SUCCEEDED

from .extracts import (
    CacheInfo,
    CacheListing,
    ExtractFinished,
    ExtractRun,
    ExtractSpec,
    caches,
    extract,
    extract_finished,
    remove_caches,
)
from .hosts import Fixtures, HostSync, Prepared, build_fixtures, check_hosts, prepare, sync
from .listing import Listing, PulledAll, RemovalPlan, local_runs, ls, plan_prune, plan_rm, prune, pull_all, rm
from .results import Comparison, Result, compare, load
from .runs import (
    Finished,
    Killed,
    Log,
    Pulled,
    Run,
    attach,
    check_spec,
    find,
    kill,
    logs,
    pull,
    resolve_prompts,
    status,
    submit,
    unfinished,
)
from .sweeps import SweepInterrupted, sweep

Error = RevalError

__all__ = ["CANCELLED", "EXIT_BAD_INPUT", "EXIT_CANCELLED", "EXIT_EVAL_FAILED", "EXIT_NOT_FOUND", "EXIT_OK",
           "EXIT_PARTIAL", "EXIT_STILL_RUNNING", "EXIT_UNREACHABLE", "FAILED", "LOST", "NO_ANSWER",
           "PLAUSIBLE_SINCE", "QUEUED", "RUNNING", "SUCCEEDED", "UNKNOWN", "CacheInfo", "CacheListing",
           "Comparison", "Error", "EvalSpec", "Event", "ExtractFinished", "ExtractRun", "ExtractSpec",
           "Finished", "Fixtures", "Host", "HostCheck", "HostSync", "Inventory", "Killed", "Listing", "Log",
           "LogLine", "Note", "Prepared", "Progress", "Pulled", "PulledAll", "Removal", "RemovalPlan",
           "Result", "Run", "RunState", "StatusChange", "SweepInterrupted", "SweepOptions", "SweepReport",
           "attach", "build_fixtures", "caches", "check_hosts", "check_spec", "compare", "did_you_mean",
           "duration_s", "extract", "extract_finished", "find", "hosts_exit_code", "is_run_glob", "kill", "load",
           "local_runs", "logs", "ls", "plan_prune", "plan_rm", "prepare", "printable", "prune", "pull", "pull_all",
           "remove_caches", "resolve_prompts", "rm", "status", "submit", "sweep", "sync", "unfinished"]
