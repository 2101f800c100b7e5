"""`reval sweep --checkpoints SPEC --hosts GROUP ...`: evaluate a night of checkpoints over a group's hosts."""
from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

import reval
from orchestrator.render import formats
from orchestrator.sweep import render
from reval import EXIT_CANCELLED, EXIT_STILL_RUNNING, printable

from ..argparsing import positive_int, seconds
from ..specargs import add_spec_options, spec_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep", help="evaluate every new checkpoint over a group's hosts; report vs baseline and previous",
        description="Find checkpoints (HOST:/dir/glob or a local dir/glob), skip those the ledger already has, "
                    "run the rest one per free GPU over the hosts, pull, and report. Killed? Run the same "
                    "command again: it re-attaches, pulls what finished and launches only what is missing. "
                    "A checkpoint that is not on the host running it is copied to <workdir>/checkpoints/<hash>/ "
                    "there and kept for later sweeps (the laptop's relay copy is deleted once staged); prune "
                    "them by removing <workdir>/checkpoints on the host while no sweep runs. "
                    "With --prompts NAME=FILE each host resolves the suites to its cache store (reval caches): "
                    "what is missing is built there once, by one extract run before its first eval. "
                    "Exit 0 ok, 1 an eval failed, 2 partial (a host failed or was unreachable, or no GPU was "
                    "free: the next sweep runs what is left), 3 bad input or config, 4 no host reachable, "
                    "101 interrupted (Ctrl-C) with runs going on, 103 interrupted with none, "
                    "102 --baseline run not found.")
    p.add_argument("--checkpoints", action="append", required=True, metavar="SPEC",
                   help="'HOST:/root/ckpt/step-*' or a local './ckpt/step-*' (synced to the hosts); repeatable")
    p.add_argument("--hosts", action="append", required=True, metavar="GROUP|HOST",
                   help="where to run; repeatable. A Slurm cluster (slurm: in hosts.yaml) takes its share "
                        "as one job array, at most slurm.max_running tasks at once")
    add_spec_options(p, drafter=False, payload_help=argparse.SUPPRESS)
    p.add_argument("--latest", type=positive_int, metavar="N",
                   help="only the N newest checkpoints (by step, then mtime)")
    p.add_argument("--since", metavar="WHEN", help="only checkpoints modified since: 36h, 7d, or 2026-11-30")
    p.add_argument("--baseline", metavar="RUN", help="a pulled run to compare every checkpoint with")
    p.add_argument("--threshold", type=float, default=0.1,
                   help="minimum effect size: improved/regressed need a paired 95%% CI excluding 0 AND a tau "
                        "change of at least this much (default 0.1)")
    p.add_argument("--force", action="store_true", help="re-run checkpoints the ledger already has")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout (progress on stderr)")
    p.add_argument("--sweep-dir", default="sweeps", help="ledger and per-sweep reports (default ./sweeps)")
    p.add_argument("--max-ssh", type=positive_int, default=8,
                   help="concurrent short SSH operations over all hosts (default 8; one connection per host)")
    p.add_argument("--poll-s", type=seconds, default=10.0,
                   help="longest single wait on a run's status (a long poll that returns when the run ends)")
    p.add_argument("--retries", type=positive_int, default=3, help="attempts per SSH operation on transport errors")
    p.add_argument("eval_args", nargs="*", metavar="-- EVAL-ARGS",
                   help="more options for the eval payload (e.g. -- --dtype bf16 --batch-size 64); --speedup, "
                        "--online and --allow-unknown-config are options of reval sweep itself")
    p.set_defaults(func=main)


def interrupted_text(e: reval.SweepInterrupted) -> str:
    """What Ctrl-C left behind and how to go on, in one line (pure)."""
    if e.launched:
        shown = ", ".join(f"{host}/{run}" for host, run in e.launched[:4]) + (
            f" and {len(e.launched) - 4} more" if len(e.launched) > 4 else "")
        going = f"the {len(e.launched)} run(s) it launched keep running on their hosts ({shown})"
    else:
        going = "no run of it is running"
    if e.maybe:
        going += (f"; {', '.join(f'{host}/{run}' for host, run in e.maybe)} may have started (its launch was under "
                  "way)")
    what = f"sweep {e.sweep_id}" if e.sweep_id else "the sweep"
    return (f"interrupted: {what} stopped here; {going}. Resume: run the same command again (it re-attaches to "
            "running runs, pulls those that finished and launches only what is missing)")


def main(args: argparse.Namespace) -> int:
    opts = reval.SweepOptions(
        checkpoints=args.checkpoints, hosts=args.hosts, spec=spec_from_args(args, args.eval_args),
        latest=args.latest, since=args.since, baseline=args.baseline, threshold=args.threshold, force=args.force,
        sweep_dir=args.sweep_dir, max_ssh=args.max_ssh, poll_s=args.poll_s, retries=max(1, args.retries))
    err = Console(stderr=True, highlight=False)
    try:
        rep = reval.sweep(opts, inventory=args.inventory,
                          on_line=lambda line: err.print(printable(line), markup=False))
    except reval.SweepInterrupted as e:
        err.print(interrupted_text(e), markup=False, soft_wrap=True)
        return EXIT_STILL_RUNNING if e.launched or e.maybe else EXIT_CANCELLED
    if args.json:
        sys.stdout.write(json.dumps(render.report_json(rep), indent=2, default=str) + "\n")
    else:
        render.print_report(rep, formats.listing_console(highlight=False))  # folds a table too wide to lines
    words = {0: "ok", 1: "an eval failed", 2: "partial: not every checkpoint was evaluated"}
    err.print(f"report  {rep.files.get('html')} · {rep.files.get('markdown')}"
              + (f" · plots {rep.files['plot']}" if "plot" in rep.files else ""), markup=False)
    err.print(f"exit {rep.exit_code} ({words[rep.exit_code]})", markup=False)
    return rep.exit_code
