"""`reval demo`: the embedded default, end to end, with no server and no downloads.

On the `local` host of the inventory (the default hosts.yaml has one): sync the payload, build the tiny
offline fixtures there (a synthetic language, a tiny Qwen3 target trained on it, a hidden-state cache,
DFlash drafters trained against it; cached after the first build), resolve their prompt file to its cache in
the host's cache store as `reval run --prompts` does (built there by one extract run the first time, found
again by every later demo: `reval caches`), then evaluate an early checkpoint and the final drafter on it
through the `reval` API (the same lifecycle as `reval run`), and compare the two ("checkpoint vs
checkpoint", the final drafter as the baseline).
"""
from __future__ import annotations

import dataclasses
import shlex
import sys
import tempfile
import time
from pathlib import Path

import reval
from orchestrator.render import formats, tables
from reval import EXIT_CANCELLED, EXIT_OK, EXIT_STILL_RUNNING, printable

from ..argparsing import HelpFormatter, positive_int
from .run import launch_line, resolve_shown
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
    if doing == "cache":
        return (f"interrupted: the demo's cache on {host} is still being built by its extract run (reval ls "
                f"{host}); nothing was evaluated. {again} finds that cache, or waits for it)")
    if doing == "compare":
        return "interrupted while comparing: both evals are done and pulled (reval ls); nothing is running"
    return f"interrupted: nothing was started on {host}. {again})"


def _store_cache(host, prep, fx) -> str:
    """The fixtures' prompt file (brought here by build_fixtures: --prompts files are this machine's) resolved to
    its cache in the host's store, with the fixtures' completion cap and the final drafter's layers, as `reval
    run --prompts` does: built by one extract run (its bar shown) the first time; its path on the host."""
    with tempfile.TemporaryDirectory(prefix="reval-demo-") as tmp:
        local = Path(tmp) / "prompts.jsonl"
        local.write_text(fx.prompts_text, encoding="utf-8")
        spec = reval.EvalSpec(drafter=f"{fx.dir}/{fx.drafter_good}", target=f"{fx.dir}/{fx.target}",
                              prompts=[f"demo={local}"], max_new_tokens=fx.max_new_tokens)
        print(f"\ndemo    the fixtures' prompts -> their cache in {host.name}'s cache store (as reval run --prompts; "
              "built once, found again by later demos)")
        spec, _ = resolve_shown(host, spec, prep, 120.0)
    return spec.cache[-1].path


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
    doing[0] = "cache"
    cache = _store_cache(host, prep, fx)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    results, refs = [], []
    for label, drafter in (("early", early), ("final", fx.drafter_good)):
        spec = dataclasses.replace(fx.spec(drafter, max_blocks=args.max_blocks), cache=cache)
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
