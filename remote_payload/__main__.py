"""`python -m remote_payload COMMAND ...` — all a GPU box needs.

Sub-commands are imported lazily so that the torch-free ones (wrap, dummy) start fast and run where
torch is missing. Each module exposes `add_arguments(parser)` and `main(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from remote_payload import __version__
from remote_payload.contract import protocol
from remote_payload.runtime import kcache

COMMANDS = {
    # name: (module, one-line help)
    "eval": ("remote_payload.eagle3.family",
             "evaluate a drafter (DFlash or EAGLE-3) on a cache of target hidden states"),
    "extract": ("remote_payload.extract.storecmd", "run a target model over prompts and write a hidden-state cache"),
    "caches": ("remote_payload.extract.store", "list or remove the caches of a cache store (extract --store)"),
    "import-cache": ("remote_payload.extract.importcache",
                     "convert a seeds-layout cache (completions.json + aux/last_hidden)"),
    "fixtures": ("remote_payload.tools.fixtures", "build the tiny offline fixture models + cache (demo, tests)"),
    "bench": ("remote_payload.tools.bench", "time eval at real Qwen3.6-27B-DFlash sizes vs a naive loop"),
    "warm": ("remote_payload.tools.warm", "compile this host's kernels into the kernel caches ahead of the first run"),
    "wrap": ("remote_payload.runtime.wrapper", "run a command detached-safe: status.json, eval.log, exit code"),
    "dummy": ("remote_payload.runtime.dummy", "a torch-free stand-in job that logs and emits events (tests)"),
    "preflight": ("remote_payload.runtime.preflight",
                  "check an eval's paths and layer compatibility (no torch; before a run)"),
    "hash": ("remote_payload.contract.contenthash",
             "print the content hash of checkpoints (the one results.json records)"),
    "stream": ("remote_payload.runtime.stream", "stream a run's log, events and status as frames (reval logs -f)"),
}


# Commands that compile GPU kernels: their caches (runtime/kcache.py: in the venv) are set before torch is imported.
KERNEL_COMMANDS = ("eval", "extract", "bench", "fixtures", "warm")


class Parser(argparse.ArgumentParser):
    """Bad usage is bad input: exit 3 (argparse's own 2 means "partial" to the controller)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(3, f"{self.prog}: error: {message}\n")


def command_of(argv: list[str]) -> str | None:
    """The sub-command named in argv (its first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = Parser(prog="python -m remote_payload", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version",
                   version=f"remote_payload {__version__} (run-directory protocol {protocol.PROTOCOL_VERSION})")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    # Only import the module of the command asked for (torch stays out of `wrap`).
    wanted = command_of(argv)
    if wanted in KERNEL_COMMANDS:
        note = kcache.setup()
        if note:
            print(note, file=sys.stderr, flush=True)
    if wanted == "eval":  # the GPU's context and the CUDA C cubin beside torch's import (eval/early.py)
        from remote_payload.eval import early
        early.start(argv[argv.index("eval") + 1:])
    for name, (mod, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if name == wanted:
            m = importlib.import_module(mod)
            m.add_arguments(sp)
            sp.set_defaults(func=m.main)
    args = p.parse_args(argv)
    if not getattr(args, "func", None):
        p.print_help()
        return 0 if not argv else 3
    return int(args.func(args) or 0)


# Commands whose main() returns only once everything it makes is on disk (results.json, the cache, both
# written whole and renamed into place; their thread pools joined). They leave by os._exit: the interpreter's
# teardown after them (torch freeing gigabytes of device memory and its CUDA handles, the module graph's
# collection) costs a good part of a second after the result is written (docs/benchmarks.md).
FAST_EXIT = ("eval", "extract")


def fast_exit(rc: int) -> None:
    """Flush what this process printed and end it now, skipping the interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a stream already closed: nothing to keep
            pass
    os._exit(rc)


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling (e.g. while torch imports): one line
        print("interrupted", file=sys.stderr)
        sys.exit(protocol.EXIT_CANCELLED)
    if command_of(sys.argv[1:]) in FAST_EXIT:
        fast_exit(code)
    sys.exit(code)
