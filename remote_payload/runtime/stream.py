"""`python -m remote_payload stream --run-dir D [--log-offset N] [--events-offset M]`

The server end of `reval logs -f` (stdlib only): one long-lived process per follow connection that
polls the run directory and writes framed bytes to stdout, so the controller can tell apart

    L <offset> <n>\\n<n bytes>   new bytes of eval.log starting at byte <offset> (whole lines only)
    E <offset> <n>\\n<n bytes>   new bytes of events.jsonl (whole lines only)
    S <n>\\n<n bytes>            status.json changed (JSON + "alive": is the process group still there)
    H\\n                         heartbeat (the controller treats silence as a dropped connection)
    D\\n                         the run is terminal (or lost) and both files are drained: done
    X <n>\\n<message>            an error (no such run); the stream ends
    R <n>\\n<message>            refused: the run folder, eval.log or events.jsonl is a symbolic link, or
                                status.json, eval.log or events.jsonl is not a regular file (a FIFO would
                                block every read): never followed; the stream ends
    B <n>\\n<message>            status.json is damaged (not a status object) and stays so; the stream ends
    N <n>\\n<message>            no new log or events bytes for NO_PROGRESS_S (then each time that silence
                                doubles) while the payload's processes are stopped or get no CPU time: why
                                (heartbeats only say the connection lives); the stream goes on

Offsets make resuming exact: the controller reconnects with the offset after the last line it has.
A trailing partial line is held back until its newline arrives (or the run is over).

With `--alive-cmd CMD` (a scheduler's job, which may run on another machine than this stream): CMD (`sh -c`)
says whether the job is still queued or running (exit 0) or over (exit 1; anything else: the scheduler cannot
answer, the last answer stands and an N frame says so, again when it answers), every `--alive-every-s`; the run
is over when the job is, whatever status.json says meanwhile (a requeued job's killed attempt may have written
`cancelled` before it starts again).
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from remote_payload.contract import protocol, runstate

NO_PROGRESS_S = 10.0  # silence (no log or events bytes) after which the stream says why, when it can tell


def add_arguments(p) -> None:
    p.add_argument("--run-dir", required=True)
    p.add_argument("--log-offset", type=int, default=0)
    p.add_argument("--events-offset", type=int, default=0)
    p.add_argument("--poll-s", type=float, default=0.05)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--alive-cmd", help="a scheduler's liveness probe (sh -c): exit 0 queued/running, 1 over, "
                                       "else unknown; replaces the process-group check")
    p.add_argument("--alive-every-s", type=float, default=2.0)
    p.add_argument("--no-progress-s", type=float, default=NO_PROGRESS_S,
                   help="say why after this long without new log or events bytes (an N frame)")
    p.add_argument("--damaged-s", type=float, default=2.0,
                   help="how long status.json may stay damaged (a hand edit in progress) before the stream says so")


class JobProbe:
    """`--alive-cmd`, run every `every_s` (every 0.5 s once status.json says the run ended) on a thread of its
    own: a scheduler that is slow to say it cannot answer (squeue retries an unreachable slurmctld for ~20 s)
    never holds the stream's frames back, so its heartbeats go on and the follow does not take the silence
    for a dropped connection. Until its first answer the job counts as alive."""

    def __init__(self, cmd: str, every_s: float):
        self.cmd, self.every_s = cmd, every_s
        self.alive = True
        self.no_answer: int | None = None  # the probe's exit code while the scheduler cannot answer, else None
        self.ending = False
        self._wake = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._closed = False
        threading.Thread(target=self._loop, name="reval-job-probe", daemon=True).start()

    def _once(self) -> int:
        try:
            self._proc = subprocess.Popen(["/bin/sh", "-c", self.cmd], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            return 2
        except OSError:
            return 2

    def _loop(self) -> None:
        while not self._closed:
            self._wake.clear()
            rc = self._once()
            if rc in (0, 1):
                self.alive = rc == 0
            self.no_answer = None if rc in (0, 1) else rc
            self._wake.wait(min(0.5, self.every_s) if self.ending else self.every_s)

    def __call__(self, ending: bool) -> bool:
        if ending and not self.ending:
            self._wake.set()  # status.json says it ended: ask the scheduler now, then every 0.5 s
        self.ending = ending
        return self.alive

    def close(self) -> None:
        """End a probe still running (the stream is over): nothing is left behind on the host."""
        self._closed, p = True, self._proc
        if p is not None and p.poll() is None:
            p.kill()

    def said(self, before: int | None) -> bytes | None:
        """The note when the scheduler stops answering (`before`: None) or answers again, else None."""
        if (before is None) == (self.no_answer is None):
            return None
        if self.no_answer is not None:
            return (f"the scheduler cannot answer now (its job probe: exit {self.no_answer}): still following; "
                    "the run's end is known once it answers").encode()
        return b"the scheduler answers again"


def payload_activity(status) -> tuple[list[tuple[int, str]], int] | None:
    """([(pid, state)], CPU ticks used so far) of the run's payload processes (its proven process group less the
    wrapper, which only waits), from /proc; None when the group cannot be proven the run's here (gone, or a
    scheduler's job on another machine)."""
    pgid = runstate.proven_group(status)
    if pgid is None:
        return None
    procs, ticks = [], 0
    for pid in runstate.group_members(pgid):
        if pid == pgid:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read()
            fields = raw[raw.rfind(b")") + 1:].split()  # field 3 (state) on; utime, stime: fields 14, 15
            procs.append((pid, fields[0].decode()))
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return procs, ticks


class Silence:
    """No new log or events bytes since `since`: after `after_s`, one N frame saying why when the host can tell
    (a payload process stopped, or the payload given no CPU time since the half-way sample), then again each
    time the silence doubles; a busy payload that only prints nothing (a long weights load) gets none."""

    def __init__(self, after_s: float, now: float):
        self.after_s = after_s
        self.progress(now)

    def progress(self, now: float) -> None:
        self.since, self.next_s, self.base = now, self.after_s, None

    def check(self, status, now: float) -> bytes | None:
        quiet = now - self.since
        if self.base is None and quiet >= self.after_s / 2:
            self.base = (now, payload_activity(status))
        if quiet < self.next_s:
            return None
        self.next_s *= 2
        act = payload_activity(status)
        if act is None:
            return None
        stopped = [str(pid) for pid, state in act[0] if state in ("T", "t")]
        if stopped:
            why = f"the process is stopped: pid {', '.join(stopped)}; kill -CONT {' '.join(stopped)} resumes it"
        elif act[0] and self.base and self.base[1] is not None and act[1] == self.base[1][1]:
            why = f"the process is not scheduled: no CPU time in {now - self.base[0]:.0f} s"
        else:
            return None
        self.base = (now, act)
        return f"no progress for {quiet:.0f} s ({why})".encode()


def read_status(run_dir: Path, probe=None) -> tuple[dict | None, bool, bytes, str | None]:
    """(status, alive, raw bytes, why it is damaged). Not there yet: (None, alive, b"", None) (the wrapper is
    starting). Liveness is read first: a group that was gone before the read left its final status.
    `probe()` (a scheduler's liveness) replaces the process-group check."""
    path = run_dir / protocol.STATUS_JSON
    try:
        first = protocol.read_json(path, runstate.MAX_STATUS_BYTES)  # too deep or too big: a ValueError too
        alive = probe() if probe is not None else protocol.run_alive(first)
        raw = runstate.read_limited(path, runstate.MAX_STATUS_BYTES)
        status = protocol.loads(raw)
    except FileNotFoundError:
        return None, probe() if probe else True, b"", None
    except OSError as e:  # not a regular file (open_regular), a permission taken away
        return None, probe() if probe else True, b"", f"unreadable: {e.strerror}"
    except runstate.TooLarge as e:
        return None, probe() if probe else True, b"", str(e)
    except ValueError:  # not JSON (json.JSONDecodeError is a ValueError), or not UTF-8
        return None, probe() if probe else True, b"", "not JSON"
    if not isinstance(status, dict):
        return None, probe() if probe else True, raw, f"a JSON {type(status).__name__}, not an object"
    if status.get("state") not in (protocol.RUNNING, *protocol.TERMINAL_STATES):
        return None, probe() if probe else True, raw, f"state {status.get('state')!r} is not a run state"
    return status, alive, raw, None


CHUNK = 1 << 16      # bytes per frame: small enough that log and events interleave while a log replays
MAX_LINE = 1 << 20   # a line longer than CHUNK is still sent whole, up to this; a longer one in pieces of it


def read_new(path: Path, offset: int, final: bool, limit: int = CHUNK) -> bytes:
    """Bytes of `path` from `offset` up to the last newline (everything when `final`)."""
    try:  # O_NOFOLLOW: a file that became a symbolic link is not read through (ELOOP: nothing new)
        with runstate.open_regular(path, nofollow=True) as f:
            f.seek(offset)
            data = f.read(limit)
    except FileNotFoundError:
        return b""
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EINVAL):  # became a link, or not a regular file: never read
            return b""
        raise
    if final and len(data) < limit:
        return data
    cut = data.rfind(b"\n")
    if cut < 0 and len(data) == limit and limit < MAX_LINE:
        return read_new(path, offset, final, MAX_LINE)
    if cut < 0 and len(data) == MAX_LINE:  # no newline in 1 MiB: a piece now (never held back, nor what follows)
        return data[:_whole_utf8(data)]
    return data[: cut + 1] if cut >= 0 else b""


def _whole_utf8(data: bytes) -> int:
    """len(data), less a UTF-8 character cut at its end (a piece of a long line ends between characters)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # ASCII or a lead byte: its character needs `need` bytes
            need = 1 if b < 0xC0 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return len(data) - back if need > back and back < len(data) else len(data)
    return len(data)


def _line_starts(path: Path, offset: int) -> bool:
    """Whether a line of `path` starts at `offset` (the byte before it is a newline)."""
    if offset == 0:
        return True
    try:
        with runstate.open_regular(path, nofollow=True) as f:
            f.seek(offset - 1)
            return f.read(1) == b"\n"
    except OSError:
        return False


def new_frames(run_dir: Path, log_off: int, ev_off: int, final: bool) -> tuple[list[bytes], int, int]:
    """L and E frames of what is new, alternating chunk by chunk: replaying a long log, the events (the
    progress bar) keep up with the lines instead of arriving after all of them."""
    offs = {b"L": log_off, b"E": ev_off}
    paths = {b"L": protocol.EVAL_LOG, b"E": protocol.EVENTS_JSONL}
    frames, pending = [], [b"L", b"E"]
    while pending:
        for tag in list(pending):
            data = read_new(run_dir / paths[tag], offs[tag], final=final)
            if not data:
                pending.remove(tag)
                continue
            if (tag == b"L" and len(data) > MAX_LINE - 4 and not data.endswith(b"\n")
                    and _line_starts(run_dir / paths[tag], offs[tag])):  # said once a line, before its first piece
                note = b"eval.log has a line over 1 MiB at byte %d: shown in pieces of 1 MiB" % offs[tag]
                frames.append(b"N %d\n" % len(note) + note)
            frames.append(b"%s %d %d\n" % (tag, offs[tag], len(data)) + data)
            offs[tag] += len(data)
    return frames, offs[b"L"], offs[b"E"]


def main(args) -> int:
    run_dir = Path(args.run_dir)
    out = sys.stdout.buffer
    parent = os.getppid()
    links = [p for p in (run_dir, run_dir / protocol.EVAL_LOG, run_dir / protocol.EVENTS_JSONL) if p.is_symlink()]
    odd = [p for p in (run_dir / protocol.STATUS_JSON, run_dir / protocol.EVAL_LOG, run_dir / protocol.EVENTS_JSONL)
           if not links and p.exists() and not p.is_file()]  # a FIFO: every read of it blocks
    if links or odd or not run_dir.is_dir():
        msg = (f"{links[0]} is a symbolic link: refused, never followed" if links
               else f"{odd[0]} is not a regular file: refused, never read" if odd
               else f"no run directory {run_dir}").encode()
        out.write((b"R %d\n" if links or odd else b"X %d\n") % len(msg) + msg)
        out.flush()
        return 3 if links or odd else 102
    log_off, ev_off = args.log_offset, args.events_offset
    last_status = last_alive = None
    last_beat = 0.0
    probe = JobProbe(args.alive_cmd, args.alive_every_s) if args.alive_cmd else None
    no_answer = None  # the probe's no-answer as last said
    ending = False
    damaged_since = None
    silence = Silence(args.no_progress_s, time.monotonic())
    try:
        while True:
            status, alive, raw, damaged = read_status(run_dir, (lambda e=ending: probe(e)) if probe else None)
            if damaged:
                damaged_since = damaged_since or time.monotonic()
                if time.monotonic() - damaged_since >= args.damaged_s:
                    msg = (f"{run_dir}/{protocol.STATUS_JSON} is damaged ({damaged}): cannot tell whether the "
                           "run goes on or how it ended").encode()
                    out.write(b"B %d\n" % len(msg) + msg)
                    out.flush()
                    return 1
            else:
                damaged_since = None
            state = (status or {}).get("state")
            ending = state in protocol.TERMINAL_STATES
            if probe:
                over = not alive
            else:
                over = ending or (state == protocol.RUNNING and not alive)
            frames, log_off, ev_off = new_frames(run_dir, log_off, ev_off, over)
            if frames:
                silence.progress(time.monotonic())
            elif status is not None and not over and (note := silence.check(status, time.monotonic())):
                frames.append(b"N %d\n" % len(note) + note)
            if probe and (note := probe.said(no_answer)):
                no_answer = probe.no_answer
                frames.append(b"N %d\n" % len(note) + note)
            # re-sent when the group dies too (status.json unchanged): the controller's last word is the truth
            if status is not None and (raw != last_status or alive != last_alive):
                last_status, last_alive = raw, alive
                body = json.dumps({**status, "alive": alive}).encode()
                frames.append(b"S %d\n" % len(body) + body)
            now = time.monotonic()
            if not frames and now - last_beat >= args.heartbeat_s:
                frames.append(b"H\n")
            if over:
                frames.append(b"D\n")
            if frames:
                out.write(b"".join(frames))
                out.flush()
                last_beat = now
            if over:
                return 0
            if os.getppid() != parent:
                return 0  # our ssh session is gone: nobody is reading
            time.sleep(args.poll_s)
    except BrokenPipeError:
        return 0
    finally:
        if probe:
            probe.close()
