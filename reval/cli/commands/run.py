"""`reval run HOST --drafter PATH --target PATH --cache PATH [--name NAME] [--gpus auto|0,1] [--detach]
[--num-prompts N] [--max-blocks M] [-- extra payload args]`: sync -> launch -> follow -> pull -> summary.

On a Slurm cluster (a host with `slurm:` in hosts.yaml: its login node, a workdir on the shared filesystem) the
run is one batch job with the host's job settings: `queued` with Slurm's reason until it starts, then the
same follow and pull; the GPUs are the job's (no --gpus)."""
from __future__ import annotations

import argparse
import sys

import reval
from reval import EXIT_STILL_RUNNING

from ..argparsing import Parser, inventory_option, option_suggestions, seconds
from ..specargs import add_spec_options, spec_from_args
from .runs import detached_message, finish_run, make_sink, out, shown_on


def _add_options(p: argparse.ArgumentParser) -> None:
    add_spec_options(p)
    p.add_argument("--name", help="run name (default <drafter-name>-<UTC time>); refused if already used")
    p.add_argument("--gpus", metavar="auto|none|0,1",
                   help="auto (one free GPU; CPU on a host without GPUs) | none | 0,1 "
                        "(default: the host's gpus in hosts.yaml)")
    p.add_argument("--detach", action="store_true", help="start it and return (exit 101); follow later with logs -f")
    p.add_argument("--give-up-s", type=seconds, default=120.0, metavar="S",
                   help="stop reconnecting after this long (exit 4)")
    inventory_option(p)  # also after HOST: reval run HOST -i FILE ...


_OPTIONS = Parser(prog="reval run", add_help=False)
_add_options(_OPTIONS)

EPILOG = """\
paths: on a remote host give absolute paths on that host; on `local` a relative path is taken from
       the current directory.
exit codes: 0 succeeded · 1 the eval failed · 3 bad input (nothing was evaluated) · 4 host unreachable ·
            101 still running (--detach, Ctrl-C; re-attach: reval logs NAME -f) · 103 cancelled
"""


def register(sub) -> None:
    p = sub.add_parser("run", help="run an eval on a host: sync, launch detached, follow live, pull, summarize",
                       description=__doc__, epilog=EPILOG)
    p.add_argument("host", metavar="HOST",
                   help="an inventory host (or a Slurm cluster: a host with slurm: in hosts.yaml)")
    _add_options(p)
    extra = p.add_argument("extra", nargs=argparse.REMAINDER, metavar="[-- PAYLOAD-ARGS]",
                           help="options after HOST, then -- extra arguments for the payload")
    extra.required = False  # REMAINDER positionals count as required: the usage error would name them
    p.set_defaults(func=cmd_run)


def _split_extra(args) -> argparse.Namespace:
    """argparse hands everything after HOST to `extra`: options before `--` are ours, the rest the payload's."""
    extra = list(args.extra or [])
    if "--" in extra:
        i = extra.index("--")
        opts, extra = extra[:i], extra[i + 1:]
    else:
        opts, extra = extra, []
    ns, unknown = _OPTIONS.parse_known_args(opts, namespace=args)
    if unknown:
        sugg = option_suggestions(_OPTIONS, unknown)
        raise reval.Error(f"reval run: unrecognized arguments: {' '.join(unknown)}",
                          hint=f"did you mean: {', '.join(sugg)}" if sugg else
                          "payload arguments go after --, e.g. reval run HOST ... -- --batch-size 32")
    ns.extra = extra
    return ns


def launch_line(info) -> str:
    """The `launch` line (pure): where the run (Run.launch) started, or the scheduler's job it waits in."""
    if info.queued:
        return (f"{info.name} on {info.host} · {info.handle.backend} job {info.handle.job_id} (GPUs: the job's) · "
                f"log {info.run_dir}/eval.log on the cluster")
    return describe(info, info.requested_gpus)


def describe(info, requested_gpus: str) -> str:
    """The `launch` line for the screen, of a run a host started (Run.launch) (pure)."""
    if info.gpus:
        mem = {g["index"]: g for g in info.gpu_info}
        where = ", ".join(
            f"GPU {i}" + (f" ({'free, ' if requested_gpus == 'auto' else ''}"
                          f"{(mem[i]['memory_total_mib'] - mem[i]['memory_used_mib']) / 1024:.0f} GB)"
                          if i in mem else "") for i in info.gpus)
    else:
        where = "CPU (no GPU on this host)" if requested_gpus == "auto" else "CPU"
    return f"{info.name} on {info.host} · {where} · log {info.run_dir}/eval.log on the server"


def resolve_shown(host, spec, prep, give_up_s: float):
    """reval.resolve_prompts with the build's bar shown and a line per suite (built or in the store)."""
    sink = make_sink()
    try:
        spec, found = reval.resolve_prompts(host, spec, prepared=prep, on_event=shown_on(sink), give_up_s=give_up_s)
    finally:
        sink.close()
    for suite, c in found.items():
        out(f"cache   {suite}: {'built' if c['built'] else 'in the store'} ({c['key'][:12]})")
    return spec, found


def cmd_run(args) -> int:
    """A thin layer over the API: check_spec -> prepare -> submit (or re-attach) -> Run.finish -> the final line."""
    args = _split_extra(args)
    spec = spec_from_args(args, args.extra, gpus=args.gpus)
    inv = reval.Inventory.load(args.inventory)
    host = inv[args.host]
    spec = reval.check_spec(host, spec, name=args.name)  # refused here: nothing synced, launched or written
    prep = reval.prepare(host)  # payload sync + venv check/build, one probe round trip
    synced, env = prep.synced, prep.env
    changed = (f"{synced.files_changed} of {synced.files_total} files changed ({synced.bytes / 1024:.0f} KB)"
               if synced.files_changed or synced.files_deleted else "unchanged")
    out(f"sync    payload: {changed} · venv: {'reused' if env.reused else 'built'} ({env.key})")
    if spec.prompts:  # each suite's cache from the host's store; the missing ones built first, their bar shown
        spec, found = resolve_shown(host, spec, prep, args.give_up_s)
    else:
        found = None
    # the same command, started from here by a controller that did not see it end: follow that one instead
    run = reval.submit(host, spec, name=args.name, prepared=prep, reattach=True, argv=sys.argv[1:],
                       prompt_caches=found)
    if run.reattached:
        out(f"attach  {run.name} on {host.name}: this command's run from before (its controller stopped) "
            f"is {run.state}; following it, not starting another")
    else:
        out(f"launch  {launch_line(run.launch)}")
    if args.detach:
        out(detached_message(run.name, host.name))
        return EXIT_STILL_RUNNING
    sink = make_sink()
    try:  # a re-attached run goes on from where its last follow stopped
        return finish_run(run, sink=sink, give_up_s=args.give_up_s, log_offset=None if run.reattached else 0)
    except KeyboardInterrupt:
        sink.close()
        out(detached_message(run.name, host.name))
        return EXIT_STILL_RUNNING
