"""`reval logs RUN [-f]`, `reval status [RUN]`, `reval ls [HOST]`, `reval pull RUN|--all`, `reval kill RUN`.

RUN is `name` (looked up in runs/ here, then on every inventory host) or `host/name`. Each command is one call
of the `reval` API (reval.find / status / ls / logs / pull / pull_all / kill, Run.finish); this module parses
and prints: every name and every line a host sent with its control characters escaped (reval.printable)."""
from __future__ import annotations

import codecs
import itertools
import json
import sys

import reval
from orchestrator.render import formats
from orchestrator.render.tables import duration_text
from reval import (
    CANCELLED,
    EXIT_CANCELLED,
    EXIT_EVAL_FAILED,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_STILL_RUNNING,
    EXIT_UNREACHABLE,
    FAILED,
    LOST,
    NO_ANSWER,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    RunState,
    printable,
)

from .. import output
from ..argparsing import positive_int, seconds
from ..display import JsonLinesSink, PlainSink, RichSink, json_line

# `reval status RUN`'s exit code by state (failed, lost and `unknown`, an unreadable status.json:
# EXIT_EVAL_FAILED); `no-answer`, a scheduler that cannot answer now, is not reached: ask again (EXIT_UNREACHABLE)
STATUS_EXIT = {SUCCEEDED: EXIT_OK, RUNNING: EXIT_STILL_RUNNING, QUEUED: EXIT_STILL_RUNNING,
               CANCELLED: EXIT_CANCELLED, NO_ANSWER: EXIT_UNREACHABLE}


def state_text(s: RunState) -> str:
    """`queued (Priority)`, `failed (TIMEOUT)`, `succeeded (SUSPECT)`, `running` (pure): the state, a
    scheduler's reason, and whether the result is suspect."""
    text = f"{s.state} ({s.reason})" if s.reason and s.state != RUNNING else s.state
    return f"{text} (SUSPECT)" if s.suspect else text  # a suspect result is marked in every listing



def failure_cause(host: str, status: dict) -> str | None:
    """The one-line cause of a failure (pure): `no space left on HOST:PATH` when the wrapper found its run
    directory's filesystem full, else status.json's error (the wrapper records the payload's error event or
    its traceback's exception line there: remote_payload/runtime/cause.py), else None."""
    if isinstance(status.get("no_space"), str):
        return f"no space left on {host}:{status['no_space']}"
    return status.get("error") or None


def failure_why(host: str, status: dict) -> str:
    """Why a run failed, for one line (pure): `exit 1: RuntimeError: CUDA out of memory ...`, `no space left on
    HOST:PATH`, or the exit code alone when nothing says more."""
    why = failure_cause(host, status)
    if why and isinstance(status.get("no_space"), str):
        return why
    head = f"exit {status.get('exit_code')}"
    return f"{head}: {why}" if why else head


def out(text: str = "") -> None:
    output.write(sys.stdout, printable(text, "\t\n") + "\n")


def err(text: str) -> None:
    output.write(sys.stderr, printable(text, "\t\n") + "\n")


def write_log(chunks) -> None:
    """eval.log's pieces of bytes on stdout as text, its control characters escaped (printable; a byte that is
    not UTF-8 as \\xNN), until the reader goes."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
    for data in itertools.chain(chunks, [None]):  # streamed: never the whole log at once
        text = decoder.decode(b"", final=True) if data is None else decoder.decode(data)
        if not output.write(sys.stdout.buffer, printable(text, "\t\n").encode("utf-8")):
            return  # the reader has gone


def make_sink():
    """rich live display on a terminal, plain lines otherwise."""
    if sys.stdout.isatty():
        from rich.console import Console
        return RichSink(Console())
    return PlainSink()


def detached_message(name: str, host: str) -> str:
    return f"detached: {name} keeps running on {host}. Re-attach: reval logs {name} -f"


def fitted(text: str, width: int | None, indent: str = "        ") -> list[str]:
    """`text` (parts joined by " · ") as lines of at most `width` columns after `indent`, broken only between
    parts, so that no interval `[a, b]` is cut by the terminal; one line when width is None (a pipe) (pure)."""
    if width is None:
        return [indent + text]
    lines: list[str] = []
    for part in text.split(" · "):
        if lines and len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += " · " + part
        else:
            lines.append(indent + part)
    return lines


def report_final(fin: reval.Finished, say=None, shown: int = 0, width: int | None = None) -> int:
    """Print the end of a run (done / failed / cancelled / lost) and return its exit code. `say`: where the lines
    that go to stdout go instead (`logs -f --json` keeps stdout for its JSON lines: stderr). `shown`: log lines
    the live display has just put on this terminal (their tail is not repeated under a failure). `width`: the
    terminal's columns, which the summary is fitted to (None: one line)."""
    say = say or out
    name, host, state, status = fin.name, fin.host, fin.state, fin.status
    where = f"pulled to {fin.path}/"
    if state == SUCCEEDED:
        if not fin.has_results:
            err(f"failed  {name} exited 0 but wrote no readable results.json · {where}")
            for line in fin.last_lines:
                err(f"        {line}")
            return fin.exit_code
        result = fin.result.result
        flag = " (SUSPECT result)" if result.health.suspect else ""
        say(f"done    {name} succeeded{flag} in {duration_text(status)} · {where}")
        for line in fitted(formats.summary_line(result), width):
            say(line)
        if result.health.suspect:
            err(f"warning: SUSPECT RESULT — {'; '.join(result.health.reasons or ['see results.json health'])}")
        return fin.exit_code
    if state == CANCELLED:
        say(f"cancelled {name} on {host} after {duration_text(status)} · {where}")
        return fin.exit_code
    if fin.last_lines and shown < len(fin.last_lines):  # not just shown live on this terminal: the log's tail
        err("        last lines of eval.log:")
        for line in fin.last_lines:
            err(f"        | {line}")
    if state == LOST:  # the last line says how it ended, and why
        err(f"lost    {name}: status.json on {host} says running but its process group {status.get('pgid')} is "
            f"gone (host rebooted? OOM killer?); no result · {where}")
    else:
        why = failure_why(host, status)
        err(f"failed  {name} on {host} ({why}) after {duration_text(status)} · {where}")
    return fin.exit_code  # the payload's exit 3 (bad input) is ours too


def report_extract(fin, say=None) -> int:
    """The end of an extract run (reval.ExtractFinished): each suite's cache, built or reused, or how it
    failed."""
    say = say or out
    if not fin.ok:
        if fin.finished.ok:
            err(f"failed  {fin.name} exited 0 but wrote no caches.json · pulled to {fin.path}/")
            return 1
        return report_final(fin.finished, say)
    say(f"done    {fin.name} on {fin.host} · pulled to {fin.path}/ (caches.json)")
    for c in fin.caches:
        agree = f", agreement {c.agreement:.4f}" if c.agreement is not None else ""
        say(f"        {c.suite}: {'built' if c.built else 'reused'} {c.key[:12]} · {c.entries} prompts, "
            f"{c.tokens} tokens, layers {c.layers}{agree}")
    return 0


def shown_on(sink):
    """The API's typed events (reval.LogLine / Progress / StatusChange / Note) onto a display sink (display.py)."""
    def show(ev) -> None:
        if isinstance(ev, reval.LogLine):
            sink.line_at(ev.offset, ev.text)
        elif isinstance(ev, reval.Progress):
            sink.event(ev.raw)
        elif isinstance(ev, reval.StatusChange):
            sink.status(ev.status)
        elif isinstance(ev, reval.Note):
            sink.note(ev.text)
    return show


def finish_run(run: reval.Run, *, sink, log_offset: int | None = None, tail: int | None = None,
               give_up_s: float = 120.0, say=None) -> int:
    """Follow `run` until it is over, pull it (Run.finish), print how it ended (report_final's `say`); the
    exit code. Bad input (exit 3) left nothing: the API removed the run on both sides."""
    try:
        fin = run.finish(on_event=shown_on(sink), log_offset=log_offset, tail=tail, give_up_s=give_up_s)
    finally:
        sink.close()
    ex = reval.extract_finished(fin)
    if ex is not None:  # `logs -f` on an extract run: its caches, not an eval's summary
        return report_extract(ex, say)
    rc = report_final(fin, say, shown=getattr(sink, "shown_on_terminal", 0), width=getattr(sink, "width", None))
    if fin.discarded:
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

    p = sub.add_parser("status", help="a run's state (queued / running / succeeded / failed / cancelled / lost; "
                                      "unknown / no-answer)",
                       description="With RUN: one line, and the exit code says the state: 0 succeeded, "
                                   "101 running, 1 failed, lost or unknown (no readable status.json), "
                                   "103 cancelled, 102 no such run, 4 host unreachable or no-answer (its "
                                   "scheduler cannot answer now: not an end, ask again) (101 also while a "
                                   "Slurm job is queued). Without RUN: a table of the runs in runs/ here "
                                   "(launched or pulled from this folder) as their hosts report them now; "
                                   "runs no longer on their host are left out, unreachable hosts are listed "
                                   "(exit 2, also when a run's scheduler cannot answer).")
    p.add_argument("run", metavar="RUN", nargs="?",
                   help="name or host/name (default: the runs in runs/ here that their hosts still have)")
    p.add_argument("--host", help="the run's host")
    p.add_argument("--json", action="store_true", help="print the state(s) as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("ls", help="the runs on a host or group (default: every inventory host)",
                       description="List the runs on HOST (or every host of a group; default: every inventory "
                                   "host) as the hosts report them now. Unreachable hosts are listed (exit 2); "
                                   "so is a run whose scheduler cannot answer now (state no-answer, exit 2).")
    p.add_argument("host", metavar="HOST", nargs="?", help="a host or group")
    p.add_argument("--json", action="store_true", help="print the runs as JSON (oldest first)")
    p.add_argument("--names", action="store_true", help="only the names of the runs kept here (runs/), NAME and "
                                                        "HOST/NAME one a line, no host asked (shell completion)")
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
    run = reval.find(args.run, host=args.host, inventory=args.inventory)
    if not args.follow:  # streamed (or, with --tail, read from the end): a 1.5 GB log is never held whole
        if args.json:
            for line in run.log(tail=args.tail).lines() if args.tail else run.log_lines():
                out(json_line(line.offset, line.text).rstrip("\n"))
        else:
            write_log([run.log(tail=args.tail).data] if args.tail else run.log_chunks())
        return EXIT_OK
    # --tail: from the start of the last N lines; None: where this folder's last follow stopped
    offset = 0 if args.from_start and not args.tail else None
    sink = JsonLinesSink() if args.json else make_sink()
    say = err if args.json else out  # --json: stdout holds the JSON lines only
    try:
        return finish_run(run, sink=sink, log_offset=offset, tail=args.tail, give_up_s=args.give_up_s, say=say)
    except KeyboardInterrupt:
        sink.close()
        say(detached_message(run.name, run.host))
        return EXIT_STILL_RUNNING


def states_table(states: list[RunState], unreachable: dict[str, str]):
    """A rich Table of runs (pure). Narrower than the table: the timestamp (what tells runs apart) and the short
    columns stay whole on one line; host, run and cause fold onto more lines, never cut. Every cell as text
    (no markup), its control characters escaped: what a host's status.json or events say is shown, not
    obeyed."""
    from rich.table import Table
    from rich.text import Text
    table = Table(box=None, pad_edge=False)
    kinds = any(s.kind != "eval" for s in states)  # a kind column once a cache build (extract) is among them
    for col in ("host", "run", *(["kind"] if kinds else []), "state", "started", "took", "exit", "gpus",
                "progress / cause"):
        table.add_column(col, no_wrap=col in ("kind", "state", "started", "took", "exit", "gpus"), overflow="fold")

    def row(host, run, kind, *cells) -> None:
        table.add_row(*(Text(printable(c)) for c in (host, run, *([kind] if kinds else []), *cells)))

    for s in states:
        st = s.status
        last = (s.progress if s.state == RUNNING
                else failure_cause(s.host, st) or "" if s.state == FAILED
                else s.reason if s.state == NO_ANSWER else "")
        # no-answer: the word in the state column, Slurm's why in the cause column (as an unreachable host's)
        row(s.host, s.name, s.kind, s.state if s.state == NO_ANSWER else state_text(s), st.get("started_at", ""),
            duration_text(st) if st.get("finished_at") else "", str(st.get("exit_code", "")),
            ",".join(map(str, st.get("gpus", []))) or (st.get("device") or ""), last)
    for h, why in unreachable.items():
        row(h, "", "", "unreachable", "", "", "", "", why)  # the why in the cause column
    return table


def _print_states(args, listing: reval.Listing) -> int:
    """The listing (oldest run first): a table, or with --json one JSON document; exit 2 when a host was
    unreachable or a run's scheduler could not answer (no-answer): ask again later for the whole picture."""
    if getattr(args, "json", False):
        out(json.dumps(listing.to_json(), indent=1))
    else:
        formats.listing_console().print(states_table(listing.runs, listing.unreachable))
    return EXIT_PARTIAL if listing.unreachable or any(s.state == NO_ANSWER for s in listing.runs) else EXIT_OK


def cmd_status(args) -> int:
    inv = reval.Inventory.load(args.inventory)
    if args.run:
        run = reval.find(args.run, host=args.host, inventory=inv)
        s = run.status()
        st = s.status
        extra = f" · exit {st['exit_code']}" if "exit_code" in st else ""
        extra += f" · {failure_cause(run.host, st)}" if st.get("error") else ""
        took = f" · {duration_text(st)}" if st.get("finished_at") else (
            f" · since {st.get('started_at')}" if st.get("started_at") else "")
        if s.state == RUNNING and s.last_event:
            took += f" · {s.progress}"
        took += f" · job {st['job_id']}" if st.get("job_id") else ""
        if s.suspect:
            extra += f" · {'; '.join(st.get('suspect_reasons') or ['see results.json health'])}"
        text = f"{run.name} on {run.host}: {state_text(s)}{took}{extra}"
        out(json.dumps(s.to_json(), indent=1) if args.json else text)
        return STATUS_EXIT.get(s.state, EXIT_EVAL_FAILED)
    return _print_states(args, reval.ls(here=True, inventory=inv))


def cmd_ls(args) -> int:
    if args.names:  # for shell completion: instant, from runs/ here
        known = reval.local_runs()
        names = sorted({r for _, r in known}) + [f"{h}/{r}" for h, r in known]
        out("\n".join(n for n in names if not args.host or n.startswith(f"{args.host}/")))
        return EXIT_OK
    return _print_states(args, reval.ls(args.host, inventory=args.inventory))


def cmd_pull(args) -> int:
    inv = reval.Inventory.load(args.inventory)
    if not args.all:
        if not args.run:
            raise reval.Error("reval pull: give a RUN or --all", hint="reval pull HOST/NAME ; reval pull --all")
        p = reval.pull(args.run, host=args.host, inventory=inv)
        out(f"pulled  {p.host}/{p.name} ({p.state or '?'}) -> {p.path}/ · {', '.join(p.files)}")
        return EXIT_OK
    done = reval.pull_all(args.host, inventory=inv)
    for p in done.runs:
        out(f"pulled  {p.host}/{p.name} ({p.state}) -> {p.path}/")
    for h, why in done.unreachable.items():
        err(f"failed  {h}: {why}")
    return EXIT_PARTIAL if done.unreachable else EXIT_OK


def cmd_kill(args) -> int:
    run = reval.find(args.run, host=args.host, inventory=args.inventory)
    k = run.kill(grace_s=args.grace_s)
    s = k.state
    if k.already_ended:
        out(f"{run.name} on {run.host} already ended: {s.state}; nothing to kill")
        return EXIT_OK
    what = f"Slurm job {s.status['job_id']}" if s.status.get("job_id") else f"process group {s.status.get('pgid')}"
    out(f"cancelled {run.name} on {run.host}: {what} is gone · status {s.state}")
    return EXIT_OK
