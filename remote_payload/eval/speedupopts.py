"""`eval`'s options for `--speedup` and `--online N` beyond the switches themselves (torch-free: parsed before
anything loads). Each is refused (exit 3) without the switch it tunes: an option not interpreted is never
silently ignored."""
from __future__ import annotations

import argparse

from remote_payload.contract.errors import PayloadError


def _batches(text: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if not vals or vals[0] < 1 or vals[-1] > 4096:
        raise argparse.ArgumentTypeError(f"expected batch sizes 1..4096, got {text!r}")
    return vals


def _repeats(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 1000:
        raise argparse.ArgumentTypeError(f"expected a whole number 1..1000, got {text!r}")
    return n


def add_speedup_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speedup-batches", type=_batches, default=None, metavar="B,B,...",
                   help="with --speedup: the batch sizes the latencies are measured and the speedup projected at "
                        "(default 1,4,16,64)")
    p.add_argument("--speedup-repeats", type=_repeats, default=None, metavar="N",
                   help="with --speedup: the least timed runs per latency, their median kept with its spread (more "
                        "runs while the spread is wide; default 7)")
    p.add_argument("--remeasure", action="store_true",
                   help="with --speedup: measure the latencies again even when the latency table holds them "
                        "(the new numbers replace the entry)")
    p.add_argument("--latency-table", default=None, metavar="PATH",
                   help="with --speedup: the latency table's file (default: $REVAL_LATENCY_TABLE, which `reval "
                        "run` sets to <workdir>/latency.json, else $REVAL_HOME/latency.json, else "
                        "~/.cache/reval/latency.json)")
    p.add_argument("--online-repeats", type=_repeats, default=None, metavar="N",
                   help="with --online: timed runs of each prompt, each way; the measured speedup is their median, "
                        "with their spread (default 3)")
    p.add_argument("--online-seeds", type=_repeats, default=None, metavar="K",
                   help="with --online on a sampled cache (extract --temperature T): decodes of each prompt, each "
                        "from its own seeded generator; the online tau is their mean, with 95%% intervals "
                        "(default 4; refused on a greedy cache, whose decode is deterministic)")


def speedup_options(args: argparse.Namespace) -> dict:
    """The EvalOptions fields of these options, refused without --speedup / --online."""
    speedup_only = [name for name, v in (("--speedup-batches", args.speedup_batches),
                                         ("--speedup-repeats", args.speedup_repeats),
                                         ("--remeasure", args.remeasure or None),
                                         ("--latency-table", args.latency_table)) if v is not None]
    if speedup_only and not args.speedup:
        raise PayloadError(f"{speedup_only[0]} tunes --speedup: add --speedup, or drop it")
    for name, v in (("--online-repeats", args.online_repeats), ("--online-seeds", args.online_seeds)):
        if v is not None and not args.online:
            raise PayloadError(f"{name} tunes --online N: add --online N, or drop it")
    out = {"remeasure": bool(args.remeasure), "latency_table": args.latency_table}
    if args.speedup_batches is not None:
        out["speedup_batches"] = args.speedup_batches
    if args.speedup_repeats is not None:
        out["speedup_repeats"] = args.speedup_repeats
    if args.online_repeats is not None:
        out["online_repeats"] = args.online_repeats
    if args.online_seeds is not None:
        out["online_seeds"] = args.online_seeds
    return out
