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

This file is the face: the names above, re-exported from reval/hosts.py (inventory, hosts check, sync, prepare,
fixtures), runs.py (one run), listing.py (the runs on hosts: ls, pull_all, rm, prune), results.py (load,
compare) and sweeps.py (sweep); the CLI over them is reval/cli/.
"""
from __future__ import annotations

from orchestrator.errors import RevalError
from orchestrator.hosts.hostcheck import HostCheck
from orchestrator.hosts.inventory import Host, Inventory
from orchestrator.rundir.events import Event, LogLine, Note, Progress, StatusChange
from orchestrator.rundir.registry import RunState
from orchestrator.runs.lifecycle import EvalSpec
from orchestrator.runs.remove import Removal
from orchestrator.sweep import SweepOptions, SweepReport

from .hosts import Fixtures, HostSync, Prepared, build_fixtures, check_hosts, prepare, sync
from .listing import Listing, PulledAll, RemovalPlan, ls, plan_prune, plan_rm, prune, pull_all, rm
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
    status,
    submit,
    unfinished,
)
from .sweeps import SweepInterrupted, sweep

Error = RevalError

__all__ = ["Comparison", "Error", "EvalSpec", "Event", "Finished", "Fixtures", "Host", "HostCheck", "HostSync",
           "Inventory", "Killed", "Listing", "Log", "LogLine", "Note", "Prepared", "Progress", "Pulled",
           "PulledAll", "Removal", "RemovalPlan", "Result", "Run", "RunState", "StatusChange", "SweepInterrupted",
           "SweepOptions", "SweepReport", "attach", "build_fixtures", "check_hosts", "check_spec", "compare", "find",
           "kill", "load", "logs", "ls", "plan_prune", "plan_rm", "prepare", "prune", "pull", "pull_all", "rm",
           "status", "submit", "sweep", "sync", "unfinished"]
