"""`reval demo`: the embedded default, end to end, with no server and no downloads.

On the `local` host of the inventory (the default hosts.yaml has one): sync the payload, build the tiny
offline fixtures there (a synthetic language, a tiny Qwen3 target trained on it, a hidden-state cache,
DFlash drafters trained against it; cached after the first build), then evaluate an early checkpoint and
the final drafter through the `reval` API (the same lifecycle as `reval run`), and compare the two
("checkpoint vs checkpoint", the final drafter as the baseline).
"""
from __future__ import annotations

import shlex
import sys
import time

import reval
from orchestrator.render import formats, tables
from reval import EXIT_CANCELLED, EXIT_OK, EXIT_STILL_RUNNING, printable

from ..argparsing import HelpFormatter, positive_int
from .run import launch_line
from .runs import finish_run, make_sink


def register(sub) -> None:
    p = sub.add_parser("demo", help="the embedded default: tiny offline models, two evals on the local host, compare",
                       description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--host", default="local", help="inventory host to run on (default: local)")
    p.add_argument("--max-blocks", type=positive_int, default=30, help="draft rounds per prompt (default 30)")
    p.add_argument("--early", default=None,
                   help="the early checkpoint to compare (default: the second saved step, drafters/step-*)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="also write the comparison plots")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    """A thin layer over the `reval` API: prepare (once), build_fixtures, submit / finish, compare; the CLI's
    display on top. Ctrl-C says what goes on (an eval keeps running on its host) and how to resume: the same
    command re-attaches to that eval (reval.unfinished) and reuses the fixtures."""
    inv = reval.Inventory.load(args.inventory)
    host = inv[args.host]
    doing: list = ["prepare"]  # what Ctrl-C interrupts: prepare | fixtures | the Run being followed | compare
    try:
        return _demo(args, host, doing)
    except KeyboardInterrupt:
        print(interrupted_text(host.name, doing[0]), file=sys.stderr)
        return EXIT_STILL_RUNNING if isinstance(doing[0], reval.Run) else EXIT_CANCELLED


def interrupted_text(host: str, doing) -> str:
    """What Ctrl-C in `reval demo` left behind and how to go on, in one line (pure)."""
    again = "Resume: reval demo (the same command"
    if isinstance(doing, reval.Run):
        return (f"interrupted: {doing.name} keeps running on {host} (follow it: reval logs {doing.ref} -f). "
                f"{again} re-attaches to it, then runs what is left)")
    if doing == "fixtures":
        return (f"interrupted: building the tiny fixtures on {host} was cut short; nothing was evaluated. "
                f"{again}: it builds them again; a finished build is reused)")
    if doing == "compare":
        return "interrupted while comparing: both evals are done and pulled (reval ls); nothing is running"
    return f"interrupted: nothing was started on {host}. {again})"


def _demo(args, host, doing: list) -> int:
    t0 = time.monotonic()
    prep = reval.prepare(host)  # the payload and its venv, once for the fixtures and both evals
    fixtures = f"{prep.workdir}/fixtures"
    print(f"demo    building the tiny fixtures on {host.name} (cached after the first time): {fixtures}")
    doing[0] = "fixtures"
    try:
        # extract's lines as the host wrote them, shown escaped
        fx = reval.build_fixtures(host, out=fixtures, prepared=prep,
                                  on_line=lambda line: print("  " + printable(line, "\t"), flush=True))
    except reval.Error as e:
        sys.stderr.write(printable(getattr(e, "stderr", ""), "\t\n"))
        raise
    early = args.early or fx.drafters[min(1, len(fx.drafters) - 1)]  # drafters/step-NNNN in training order
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    results, refs = [], []
    for label, drafter in (("early", early), ("final", fx.drafter_good)):
        spec = fx.spec(drafter, max_blocks=args.max_blocks)
        run = reval.unfinished(host, spec)  # this eval, started by a demo that was interrupted: follow that one
        if run is not None:
            print(f"\ndemo    eval {label} drafter {drafter}: {run.name} from before (its controller stopped) "
                  f"is {run.state}; following it, not starting another")
        else:
            name = f"demo-{label}-{stamp}"
            print(f"\ndemo    eval {label} drafter {drafter} as {name}")
            run = reval.submit(host, spec, name=name, prepared=prep)
            print(f"launch  {launch_line(run.launch)}", flush=True)
        doing[0] = run
        rc = finish_run(run, sink=make_sink())  # the same follow/pull/final line as `reval run`
        doing[0] = "compare"
        if rc != EXIT_OK:
            return rc
        results.append(reval.load(run.ref))
        refs.append(run.ref)
    print(f"\ndemo    comparing: reval compare {' '.join(refs)} --baseline {refs[-1]}")
    cmp = reval.compare(results, baseline=results[-1], allow_incomparable=False)
    paired = tables.paired_table(cmp.model)  # the early checkpoint paired by prompt with the final one
    formats.print_tables([tables.main_table(cmp.model)] + ([paired] if paired else []))
    if args.plot:
        print(f"plot    {cmp.save_plot(args.plot)}", file=sys.stderr)
    print(f"\ndemo    done in {time.monotonic() - t0:.0f}s. Next: reval compare {shlex.join(refs)} --per-position "
          f"--plot demo.png")
    return EXIT_OK
