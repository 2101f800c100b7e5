"""`reval`: a thin argparse layer over the library modules. Each sub-command lives in
orchestrator/commands/<name>.py and exposes `register(subparsers)`; this file only builds the parser,
dispatches, and turns expected errors into one clear line + exit code (errors.py)."""
from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .errors import EXIT_BAD_INPUT, RevalError

# (module under orchestrator.commands) in --help order: the pipeline reads inventory -> ... -> compare.
COMMAND_MODULES = ["hosts", "sync", "run", "runs", "compare", "sweep", "demo"]

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


class Parser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error; 2 means "partial" here, so bad usage exits 3 (bad input)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="reval",
        description="Run DFlash drafter evals on remote GPU servers over SSH, follow them live, pull and compare.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"reval {__version__}")
    p.add_argument("-i", "--inventory", metavar="FILE", default=None,
                   help="hosts file (default: $REVAL_HOSTS, else ./hosts.yaml, else the built-in local host)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"orchestrator.commands.{name}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        rc = args.func(args)
    except RevalError as e:
        print(f"error: {e}", file=sys.stderr)
        if e.hint:
            for line in str(e.hint).splitlines():
                print(f"       {line}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
