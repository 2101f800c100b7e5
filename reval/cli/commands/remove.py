"""`reval rm RUN...` and `reval prune [HOST|GROUP] --failed|--older-than AGE`: remove runs from their host and
from runs/ here, after showing what goes and asking (or --yes)."""
from __future__ import annotations

import sys

import reval
from reval import EXIT_OK, EXIT_PARTIAL, PLAUSIBLE_SINCE

from ..argparsing import age_s
from .runs import err, out


def register(sub) -> None:
    p = sub.add_parser("rm", help="remove runs: their folder on the host and the copy in runs/ here",
                       description="Remove runs: the run directory on its host and the copy in runs/<host>/<run>/ "
                                   "here. A running run is refused (reval kill it first). Afterwards the name is "
                                   "free again. Shows what goes and asks first, unless --yes. Exit 0 removed, "
                                   "3 refused (running, or no terminal to ask on), 102 no such run.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="name or host/name")
    p.add_argument("--host", help="the runs' host (when a name alone is ambiguous)")
    _common(p)
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("prune", help="remove failed or old runs, on every host or one",
                       description="Remove the runs that match: --failed (failed, lost or cancelled; a run with no "
                                   "readable status.json is left alone: it may be starting, remove it with reval rm) "
                                   "and/or --older-than AGE (ended that long ago by the host's own clock; a run that "
                                   "ended after the host's clock now, or before "
                                   f"{PLAUSIBLE_SINCE[:10]} (a wrong clock), is skipped and named), on HOST or "
                                   "every host of a group (default: every inventory host); never a running run. "
                                   "Shows what goes and asks first, unless --yes. Exit 2 when a host was unreachable.")
    p.add_argument("host", metavar="HOST|GROUP", nargs="?", help="where to prune (default: every host)")
    p.add_argument("--failed", action="store_true", help="runs that did not succeed")
    p.add_argument("--older-than", type=age_s, metavar="AGE", help="runs that ended more than AGE ago: 36h, 7d, 2w")
    _common(p)
    p.set_defaults(func=cmd_prune)


def _common(p) -> None:
    p.add_argument("-y", "--yes", action="store_true", help="do not ask")
    p.add_argument("--local-only", action="store_true", help="only the copies in runs/ here; keep the hosts' runs")


def confirm(question: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise reval.Error("not removing anything without asking, and there is no terminal to ask on",
                          hint="add --yes to remove them")
    try:
        return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")
    except EOFError:
        return False


def cmd_rm(args) -> int:
    # every run planned first: a running or missing run refuses all before anything goes
    plan = reval.plan_rm(args.runs, host=args.host, local_only=args.local_only, inventory=args.inventory)
    return _carry_out(plan, args.yes)


def _carry_out(plan: reval.RemovalPlan, yes: bool) -> int:
    for r in plan.runs:
        out(f"remove  {r.describe()}")
    if not plan.runs:
        out("nothing to remove")
        return EXIT_OK
    if not confirm(f"remove {len(plan.runs)} run(s)?", yes):
        out("nothing removed")
        return EXIT_OK
    out(f"removed {len(plan.apply())} run(s)")
    return EXIT_OK


def cmd_prune(args) -> int:
    plan = reval.plan_prune(args.host, failed=args.failed, older_than_s=args.older_than, local_only=args.local_only,
                            inventory=args.inventory)
    for s, why in plan.skipped:
        err(f"skipped {s.host}/{s.name} ({s.state}): {why}; not pruned by age (reval rm {s.host}/{s.name} "
            "removes it)")
    for h, why in plan.unreachable.items():
        err(f"skipped {h}: {why}")
    rc = _carry_out(plan, args.yes)
    return EXIT_PARTIAL if plan.unreachable else rc
