"""`reval`: a thin argparse layer over the `reval` API (reval/__init__.py). Each sub-command lives in
reval/cli/commands/<name>.py and exposes `register(subparsers)`: it parses its arguments, calls the API and
prints what comes back; this file only builds the parser, dispatches, and turns expected errors into one clear
line + exit code (reval.Error). A command imports only `reval` (the API), reval/cli's own modules and the
rendering modules (orchestrator/render/, orchestrator/sweep/render.py); tests/test_boundaries.py holds it."""
from __future__ import annotations

import argparse
import sys

import reval

from . import output
from .argparsing import Parser, add_inventory_option, bind_usage_errors
from .commands import compare, completion, demo, extract, hosts, remove, run, runs, sweep, sync

# the command modules in --help order: the pipeline reads inventory -> ... -> compare.
COMMAND_MODULES = [hosts, sync, extract, run, runs, remove, compare, sweep, demo, completion]

EPILOG = """\
exit codes: 0 ok · 1 an eval failed · 2 partial (some hosts failed) · 3 bad input or config ·
            4 host unreachable · 101 still running · 102 run not found · 103 cancelled

examples:
  reval demo                                   # the embedded default: tiny models, local host, no server
  reval hosts check gpu-boxes                  # reachability, host key, python, GPUs, payload/venv versions
  reval run ct129 --drafter /models/D --target /models/T --cache /eval/cache --name zlab_full
  reval logs zlab_full -f                      # re-attach after Ctrl-C or a dropped connection
  reval compare ct129/step4000 ct129/zlab_full --baseline zlab_full
"""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="reval",
        description="Run DFlash drafter evals on remote GPU servers over SSH, follow them live, pull and compare.",
        epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"reval {reval.__version__}")
    p.add_argument("-i", "--inventory", metavar="FILE", default=None,
                   help="hosts file (default: $REVAL_HOSTS, else ./hosts.yaml, else the built-in local host)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    add_inventory_option(p)
    bind_usage_errors(p)
    p.set_defaults(_root=p)  # `reval completion` describes the whole tree, its own command included
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:  # the sub-command's own usage and "did you mean", not the top level's
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(rest)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        rc = args.func(args)
    except reval.Error as e:
        for one in (e, *e.more):  # a name or a host's words in it shown, never obeyed
            print("error: " + reval.printable(one, "\t\n"), file=sys.stderr)
            for line in str(one.hint or "").splitlines():
                print("       " + reval.printable(line, "\t"), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of a listing went away (| head): not an error of ours
        output.silence(sys.stdout)
        return 0
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
