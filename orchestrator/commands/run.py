"""`reval run HOST --drafter PATH --target PATH --cache PATH [--name NAME] [--gpus auto|0,1] [--detach]
[--num-prompts N] [--max-blocks M] [-- extra payload args]`: sync -> launch -> follow -> pull -> summary.

On a Slurm cluster (a host with `slurm:` in hosts.yaml: its login node, a workdir on the shared filesystem) the
run is one batch job with the host's job settings: `queued` with Slurm's reason until it starts, then the
same follow and pull; the GPUs are the job's (no --gpus)."""
from __future__ import annotations

import argparse
import os
import sys

from .. import lifecycle
from ..argparsing import Parser, option_suggestions, positive_int, seconds
from ..backends import get_backend
from ..backends.ssh import describe, normalize_gpus
from ..errors import EXIT_STILL_RUNNING, ConfigError
from ..inventory import load_inventory
from ..lifecycle import EvalSpec
from ..runs import check_local_runs_root, check_run_name
from .runs import detached_message, finish_run, make_sink, out


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", metavar="PATH", help="drafter checkpoint (dir or .pt) on the host")
    p.add_argument("--target", metavar="PATH",
                   help="target model dir on the host (embed_tokens / lm_head are borrowed)")
    p.add_argument("--cache", metavar="[NAME=]PATH", action="append",
                   help="hidden-state cache dir on the host; repeat it as NAME=PATH to evaluate benchmark suites "
                        "in one process (per-suite tau and their mean; reval compare --by suite)")
    p.add_argument("--name", help="run name (default <drafter-name>-<UTC time>); refused if already used")
    p.add_argument("--gpus", metavar="auto|none|0,1",
                   help="auto (one free GPU; CPU on a host without GPUs) | none | 0,1 "
                        "(default: the host's gpus in hosts.yaml)")
    p.add_argument("--detach", action="store_true", help="start it and return (exit 101); follow later with logs -f")
    p.add_argument("--num-prompts", type=positive_int, metavar="N", help="evaluate the first N prompts of the cache")
    p.add_argument("--max-blocks", type=positive_int, metavar="M", help="at most M draft rounds per prompt")
    p.add_argument("--allow-unknown-config", action="append", default=[], metavar="KEY",
                   help="evaluate although the drafter's config.json has KEY, which reval does not interpret "
                        "(dflash_config.KEY when nested; repeatable; recorded in results.json). Without it "
                        "such a key is refused before the run starts (exit 3)")
    p.add_argument("--payload", choices=("eval", "dummy"), default="eval",
                   help="what to run: the eval, or a torch-free stand-in (tests, demos of the plumbing)")
    p.add_argument("--give-up-s", type=seconds, default=120.0, metavar="S",
                   help="stop reconnecting after this long (exit 4)")


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
        raise ConfigError(f"reval run: unrecognized arguments: {' '.join(unknown)}",
                          hint=f"did you mean: {', '.join(sugg)}" if sugg else
                          "payload arguments go after --, e.g. reval run HOST ... -- --batch-size 32")
    ns.extra = extra
    return ns


def host_paths(args, host) -> None:
    """--drafter/--target/--cache name paths on the host. On the local host a relative path means the
    controller's current directory; on a remote host it would silently mean the payload folder, so refuse it."""
    for k in ("drafter", "target"):
        setattr(args, k, _host_path(k, getattr(args, k, None), host))
    caches = getattr(args, "cache", None)
    if isinstance(caches, list):  # --cache PATH, or NAME=PATH per suite: the PATH part is the host's
        out = []
        for c in caches:
            name, sep, path = c.partition("=")
            suite = sep and path and "/" not in name
            out.append(f"{name}={_host_path('cache', path, host)}" if suite else _host_path("cache", c, host))
        args.cache = out[0] if len(out) == 1 and "=" not in caches[0] else out


def _host_path(k: str, v: str | None, host) -> str | None:
    if not v or os.path.isabs(v):
        return v
    if host.is_local:
        return os.path.abspath(v)
    raise ConfigError(f"--{k} {v!r} is relative: give the absolute path on {host.name}",
                      hint=f"e.g. --{k} /data/{v}")


def spec_from_args(args) -> EvalSpec:
    return EvalSpec(drafter=args.drafter, target=args.target, cache=args.cache, num_prompts=args.num_prompts,
                    max_blocks=args.max_blocks, extra=list(args.extra), payload=args.payload, gpus=args.gpus,
                    allow_unknown_config=list(args.allow_unknown_config or []))


def launch_line(info, gpus: str) -> str:
    """The `launch` line (pure): where the run started, or the scheduler's job it waits in."""
    if info.queued:
        return (f"{info.name} on {info.host} · {info.handle.backend} job {info.handle.job_id} (GPUs: the job's) · "
                f"log {info.run_dir}/eval.log on the cluster")
    return describe(info, gpus)


def cmd_run(args) -> int:
    """A thin layer over lifecycle: prepare -> (re-attach | submit) -> follow -> pull -> the final line."""
    args = _split_extra(args)
    spec = spec_from_args(args).validate()
    inv = load_inventory(args.inventory)
    host = inv.get(args.host)
    host_paths(spec, host)
    gpus = normalize_gpus(spec.gpus or host.gpus)
    if args.name:
        check_run_name(args.name)
    check_local_runs_root(host.name)  # where the follow state and the pulled copy go: before launching

    backend = get_backend(host)
    prep = lifecycle.prepare(backend)  # payload sync + venv check/build, one probe round trip
    synced, env = prep.synced, prep.env
    changed = (f"{synced.files_changed} of {synced.files_total} files changed ({synced.bytes / 1024:.0f} KB)"
               if synced.files_changed or synced.files_deleted else "unchanged")
    out(f"sync    payload: {changed} · venv: {'reused' if env.reused else 'built'} ({env.key})")
    again = lifecycle.unfinished(host.name, spec.identity(host.name), name=args.name)
    if again:  # the same command, started from here by a controller that did not see it end: follow that one
        run = lifecycle.attach(backend, again, python=env.python)
        out(f"attach  {again} on {host.name}: this command's run from before (its controller stopped) "
            f"is {run.state}; following it, not starting another")
    else:
        run = lifecycle.submit(backend, spec, python=env.python, name=args.name, argv=sys.argv[1:],
                               run_json={"payload_hash": synced.manifest_hash, "venv_key": env.key})
        out(f"launch  {launch_line(run.launch, gpus)}")
    if args.detach:
        out(detached_message(run.name, host.name))
        return EXIT_STILL_RUNNING
    sink = make_sink()
    try:
        return finish_run(run, sink=sink, give_up_s=args.give_up_s, log_offset=run.saved_offset() if again else 0)
    except KeyboardInterrupt:
        sink.close()
        out(detached_message(run.name, host.name))
        return EXIT_STILL_RUNNING
