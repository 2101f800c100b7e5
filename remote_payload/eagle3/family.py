"""The `eval` command's family switch: an EAGLE-3 head (its config.json says so: loader.is_eagle3) goes to
eagle3/evaluate.py (several suites: eagle3/suites.py), anything else to the DFlash eval (eval/run.py), all under
eval/run.py's `main` (the run directory, status.json, results.json, exit codes). `--chain` (the EAGLE-3 chain
length) and `--eagle-tree` (EAGLE's dynamic tree): refused for DFlash."""
from __future__ import annotations

import argparse
import os
import sys

from remote_payload.contract import protocol
from remote_payload.contract.spec import SpecError, refuse_eagle3_decoding
from remote_payload.eagle3.evaluate import evaluate
from remote_payload.eagle3.loader import is_eagle3
from remote_payload.eagle3.suites import evaluate_suites
from remote_payload.eval import run

__all__ = ["add_arguments", "main"]

add_arguments = run.add_arguments


def main(args: argparse.Namespace) -> int:
    if is_eagle3(args.drafter):  # one cache: evaluate.py; `--cache NAME=PATH` repeated: suites.py
        return run.main(args, evaluate_fn=lambda opts, rep: (evaluate_suites if opts.suites else evaluate)(opts, rep))
    if not os.path.exists(args.drafter):  # no family to speak of: the DFlash eval's own "does not exist" line
        return run.main(args)
    try:
        refuse_eagle3_decoding(args.drafter, getattr(args, "chain", None), getattr(args, "eagle_tree", None))
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return protocol.EXIT_BAD_INPUT
    return run.main(args)
