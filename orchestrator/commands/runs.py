"""`reval logs RUN [-f]`, `reval status [RUN]`, `reval ls [HOST]`, `reval pull RUN|--all`, `reval kill RUN`.

RUN is `name` (looked up in runs/ here, then on every inventory host) or `host/name`."""
from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from remote_payload.contract import protocol
from remote_payload.contract.results import Result

from .. import lifecycle, logs, output, report
from ..argparsing import positive_int, seconds
from ..backends import get_backend
from ..compare import _iso_s, format_duration
from ..errors import (
    EXIT_CANCELLED,
    EXIT_EVAL_FAILED,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_STILL_RUNNING,
    RevalError,
    RunNotFound,
)
from ..inventory import load_inventory
from ..runs import (
    RunState,
    by_start_time,
    local_registry,
    progress_text,
    resolve_run,
)
from .display import JsonLinesSink, PlainSink, RichSink

LAST_LINES = 15
# `reval status RUN`'s exit code by state (failed, lost and an unreadable status.json: EXIT_EVAL_FAILED)
STATUS_EXIT = {protocol.SUCCEEDED: EXIT_OK, protocol.RUNNING: EXIT_STILL_RUNNING, protocol.QUEUED: EXIT_STILL_RUNNING,
               protocol.CANCELLED: EXIT_CANCELLED}


def state_text(s: RunState) -> str:
    """`queued (Priority)`, `failed (TIMEOUT)`, `succeeded (SUSPECT)`, `running` (pure): the state, a
    scheduler's reason, and whether the result is suspect."""
    text = f"{s.state} ({s.reason})" if s.reason and s.state != protocol.RUNNING else s.state
    return f"{text} (SUSPECT)" if s.suspect else text  # a suspect result is marked in every listing



def out(text: str = "") -> None:
    output.write(sys.stdout, text + "\n")


def err(text: str) -> None:
    output.write(sys.stderr, text + "\n")


def make_sink():
    """rich live display on a terminal, plain lines otherwise."""
    if sys.stdout.isatty():
        from rich.console import Console
        return RichSink(Console())
    return PlainSink()


def detached_message(name: str, host: str) -> str:
    return f"detached: {name} keeps running on {host}. Re-attach: reval logs {name} -f"


def duration_text(status: dict) -> str:
    """`2m41s` from started_at/finished_at, `?` without both (pure)."""
    a, b = _iso_s(status.get("started_at")), _iso_s(status.get("finished_at"))
    return format_duration(b - a) if a is not None and b is not None else "?"


def last_lines(path: Path, n: int = LAST_LINES) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:]
    except FileNotFoundError:
        return []


def report_final(host: str, name: str, state: str, status: dict, pulled: Path, say=None) -> int:
    """Print the end of a run (done / failed / cancelled / lost) and return its exit code. `say`: where the lines
    that go to stdout go instead (`logs -f --json` keeps stdout for its JSON lines: stderr)."""
    say = say or out
    where = f"pulled to {pulled}/"
    if state == protocol.SUCCEEDED:
        try:
            result = Result.load(pulled / protocol.RESULTS_JSON)
        except (FileNotFoundError, ValueError):  # ResultsError is a ValueError
            err(f"failed  {name} exited 0 but wrote no readable results.json · {where}")
            for line in last_lines(pulled / protocol.EVAL_LOG):
                err(f"        {line}")
            return EXIT_EVAL_FAILED
        flag = " (SUSPECT result)" if result.health.suspect else ""
        say(f"done    {name} succeeded{flag} in {duration_text(status)} · {where}")
        say(f"        {report.summary_line(result)}")
        if result.health.suspect:
            err(f"warning: SUSPECT RESULT — {'; '.join(result.health.reasons or ['see results.json health'])}")
        return EXIT_OK
    if state == protocol.CANCELLED:
        say(f"cancelled {name} on {host} after {duration_text(status)} · {where}")
        return lifecycle.failure_exit_code(state, status)
    if state == protocol.LOST:
        err(f"lost    {name}: status.json on {host} says running but its process group {status.get('pgid')} is "
            f"gone (host rebooted? OOM killer?); no result · {where}")
    else:
        why = status.get("error") or f"exit {status.get('exit_code')}"
        err(f"failed  {name} on {host} ({why}) after {duration_text(status)} · {where}")
    lines = last_lines(pulled / protocol.EVAL_LOG)
    if lines:
        err("        last lines of eval.log:")
        for line in lines:
            err(f"        | {line}")
    return lifecycle.failure_exit_code(state, status)  # the payload's exit 3 (bad input) is ours too


def finish_run(run, *, sink, log_offset: int | None = None, give_up_s: float = 120.0, say=None) -> int:
    """Follow `run` (a lifecycle.Run) until it is over, pull it, print how it ended (report_final's `say`);
    the exit code."""
    try:
        fin = run.wait(sink, log_offset=log_offset, give_up_s=give_up_s)
    finally:
        sink.close()
    rc = report_final(fin.host, fin.name, fin.state, fin.status, fin.path, say)
    if lifecycle.bad_input(fin):  # exit 3 leaves nothing on either side; the name is free again
        run.discard()
        err(f"        nothing was kept: {fin.host}/{fin.name} removed there and here (the name is free again)")
    return rc


# -- commands ----------------------------------------------------------------------------------------------
def register(sub) -> None:
    p = sub.add_parser("logs", help="print a run's eval.log; -f follows it live (resumes where it stopped)",
                       description="Print a run's eval.log. With -f: follow it live from where this folder's "
                                   "last follow stopped (byte offsets: no line lost or twice), until the run "
                                   "ends, then pull it and print the summary; Ctrl-C detaches. Exit codes as "
                                   "`reval run`.")
    p.add_argument("run", metavar="RUN", help="name or host/name")
    p.add_argument("-f", "--follow", action="store_true", help="follow until the run ends, then pull it")
    p.add_argument("--host", help="the run's host (when the name alone is ambiguous)")
    p.add_argument("--from-start", action="store_true", help="with -f: from the log's first byte")
    p.add_argument("--tail", type=positive_int, metavar="N", help="only the last N lines (with -f: start there)")
    p.add_argument("--json", action="store_true",
                   help='one JSON object a line: {"offset": byte offset in eval.log, "line": text}')
    p.add_argument("--give-up-s", type=seconds, default=120.0, help="stop reconnecting after this long (exit 4)")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("status", help="a run's state (queued / running / succeeded / failed / cancelled / lost)",
                       description="With RUN: one line, and the exit code says the state: 0 succeeded, "
                                   "101 running, 1 failed or lost, 103 cancelled, 102 no such run, "
                                   "4 host unreachable (101 also while a Slurm job is queued). Without RUN: "
                                   "a table of the runs in runs/ here "
                                   "(launched or pulled from this folder) as their hosts report them now; "
                                   "runs no longer on their host are left out, unreachable hosts are listed "
                                   "(exit 2).")
    p.add_argument("run", metavar="RUN", nargs="?",
                   help="name or host/name (default: the runs in runs/ here that their hosts still have)")
    p.add_argument("--host", help="the run's host")
    p.add_argument("--json", action="store_true", help="print the state(s) as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("ls", help="the runs on a host or group (default: every inventory host)",
                       description="List the runs on HOST (or every host of a group; default: every inventory "
                                   "host) as the hosts report them now. Unreachable hosts are listed (exit 2).")
    p.add_argument("host", metavar="HOST", nargs="?", help="a host or group")
    p.add_argument("--json", action="store_true", help="print the runs as JSON (oldest first)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("pull", help="copy a run directory to runs/<host>/<run>/",
                       description="Copy a run's files (only the run-directory contract's) to "
                                   "runs/<host>/<run>/ here; --all: every run of every host (or of --host).")
    p.add_argument("run", metavar="RUN", nargs="?", help="name or host/name")
    p.add_argument("--all", action="store_true", help="every run on every host (or --host)")
    p.add_argument("--host", help="a host or group")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("kill", help="cancel a run: TERM its process group, wait, KILL, confirm it is gone "
                                    "(a Slurm job: scancel, then wait until Slurm says all of it is gone)",
                       description="Cancel a run: TERM its process group, wait --grace-s, KILL, confirm it is "
                                   "gone (a Slurm job: scancel, then wait until Slurm says all of it is gone); "
                                   "its status becomes cancelled.")
    p.add_argument("run", metavar="RUN", help="name or host/name")
    p.add_argument("--host", help="the run's host")
    p.add_argument("--grace-s", type=seconds, default=10.0, help="seconds between TERM and KILL")
    p.set_defaults(func=cmd_kill)


def cmd_logs(args) -> int:
    inv = load_inventory(args.inventory)
    host, name = resolve_run(inv, args.run, args.host)
    be = get_backend(host)
    t = be.transport
    if not args.follow:
        if be.state(name) is None:
            raise RunNotFound(f"no run {name!r} on {host.name}", hint=f"list runs: reval ls {host.name}")
        data = logs.read_log(t, name)
        start = logs.tail_start(data, args.tail)
        if args.json:
            for off, raw in logs.lines_with_offsets(data[start:], start):
                out(logs.json_line(off, raw.rstrip(b"\n").decode("utf-8", errors="replace")).rstrip("\n"))
        else:
            output.write(sys.stdout.buffer, data[start:])
        return EXIT_OK
    logs.refuse_links(t, name)  # a run folder or eval.log that is a symbolic link is never followed
    run = lifecycle.attach(be, name)  # the python its follow state recorded, else the host's
    if args.tail:  # follow from the start of the last N lines
        offset = logs.tail_start(logs.read_log(t, name), args.tail)
    else:
        offset = 0 if args.from_start else None  # None: where this folder's last follow stopped
    sink = JsonLinesSink() if args.json else make_sink()
    say = err if args.json else out  # --json: stdout holds the JSON lines only
    try:
        return finish_run(run, sink=sink, log_offset=offset, give_up_s=args.give_up_s, say=say)
    except KeyboardInterrupt:
        sink.close()
        say(detached_message(name, host.name))
        return EXIT_STILL_RUNNING


def states_table(states: list[RunState], unreachable: dict[str, str]):
    """A rich Table of runs (pure)."""
    from rich.table import Table
    table = Table(box=None, pad_edge=False)
    for col in ("host", "run", "state", "started", "took", "exit", "gpus", "progress"):
        table.add_column(col)
    for s in states:
        st = s.status
        table.add_row(s.host, s.name, state_text(s), st.get("started_at", ""),
                      duration_text(st) if st.get("finished_at") else "", str(st.get("exit_code", "")),
                      ",".join(map(str, st.get("gpus", []))) or (st.get("device") or ""),
                      progress_text(s.last_event) if s.state == protocol.RUNNING else "")
    for h, why in unreachable.items():
        table.add_row(h, "", "unreachable", why, "", "", "", "")
    return table


def _per_host(hosts, fn) -> tuple[dict, dict[str, str]]:
    """Run fn(backend) on every host in parallel: ({host: result}, {host: why unreachable})."""
    def one(h):
        try:
            return h.name, fn(get_backend(h)), None
        except RevalError as e:
            return h.name, None, str(e)
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as ex:
        done = list(ex.map(one, hosts))
    return ({n: r for n, r, e in done if e is None}, {n: e for n, r, e in done if e is not None})


def _print_states(args, states: list[RunState], unreachable: dict[str, str]) -> None:
    """The listing, oldest run first: a table, or with --json one JSON document."""
    states = by_start_time(states)
    if getattr(args, "json", False):
        out(json.dumps([s.to_json() for s in states]
                       + [{"host": h, "state": "unreachable", "error": why} for h, why in unreachable.items()],
                       indent=1))
    else:
        report.listing_console().print(states_table(states, unreachable))


def cmd_status(args) -> int:
    inv = load_inventory(args.inventory)
    if args.run:
        host, name = resolve_run(inv, args.run, args.host)
        s = get_backend(host).state(name)
        if s is None:
            raise RunNotFound(f"no run {name!r} on {host.name}", hint=f"list runs: reval ls {host.name}")
        st = s.status
        extra = f" · exit {st['exit_code']}" if "exit_code" in st else ""
        extra += f" · {st['error']}" if st.get("error") else ""
        took = f" · {duration_text(st)}" if st.get("finished_at") else (
            f" · since {st.get('started_at')}" if st.get("started_at") else "")
        if s.state == protocol.RUNNING and s.last_event:
            took += f" · {progress_text(s.last_event)}"
        took += f" · job {st['job_id']}" if st.get("job_id") else ""
        if s.suspect:
            extra += f" · {'; '.join(st.get('suspect_reasons') or ['see results.json health'])}"
        out(json.dumps(s.to_json(), indent=1) if args.json else f"{name} on {host.name}: {state_text(s)}{took}{extra}")
        return STATUS_EXIT.get(s.state, EXIT_EVAL_FAILED)
    known = local_registry()
    hosts = [inv.hosts[h] for h in sorted({h for h, _ in known}) if h in inv.hosts]
    found, unreachable = _per_host(hosts, lambda be: be.list_runs())
    wanted = set(known)
    states = [s for h in found.values() for s in h if (s.host, s.name) in wanted]
    _print_states(args, states, unreachable)
    return EXIT_PARTIAL if unreachable else EXIT_OK


def cmd_ls(args) -> int:
    inv = load_inventory(args.inventory)
    hosts = inv.resolve(args.host) if args.host else list(inv.hosts.values())
    found, unreachable = _per_host(hosts, lambda be: be.list_runs())
    _print_states(args, [s for h in hosts for s in found.get(h.name, [])], unreachable)
    return EXIT_PARTIAL if unreachable else EXIT_OK


def cmd_pull(args) -> int:
    inv = load_inventory(args.inventory)
    if not args.all:
        if not args.run:
            raise RevalError("reval pull: give a RUN or --all", hint="reval pull HOST/NAME ; reval pull --all")
        host, name = resolve_run(inv, args.run, args.host)
        be = get_backend(host)
        res = be.pull(name)
        s = be.state(name)
        out(f"pulled  {host.name}/{name} ({s.state if s else '?'}) -> {res.path}/ · {', '.join(res.files)}")
        return EXIT_OK
    hosts = inv.resolve(args.host) if args.host else list(inv.hosts.values())

    def pull_all(be):
        return [(s, be.pull(s.name)) for s in be.list_runs()]
    found, unreachable = _per_host(hosts, pull_all)
    for h in hosts:
        for s, res in found.get(h.name, []):
            out(f"pulled  {h.name}/{s.name} ({s.state}) -> {res.path}/")
    for h, why in unreachable.items():
        err(f"failed  {h}: {why}")
    return EXIT_PARTIAL if unreachable else EXIT_OK


def cmd_kill(args) -> int:
    inv = load_inventory(args.inventory)
    host, name = resolve_run(inv, args.run, args.host)
    be = get_backend(host)
    before = be.state(name)
    # a damaged status.json proves no end: the backend says so (exit 3, nothing signalled), not "already ended"
    if before is not None and before.terminal and before.status:
        out(f"{name} on {host.name} already ended: {before.state}; nothing to kill")
        return EXIT_OK
    s = be.cancel(name, grace_s=args.grace_s, known=before)
    what = f"Slurm job {s.status['job_id']}" if s.status.get("job_id") else f"process group {s.status.get('pgid')}"
    out(f"cancelled {name} on {host.name}: {what} is gone · status {s.state}")
    return EXIT_OK
