"""Follow a run live: one long-lived remote stream (`python -m remote_payload stream`, framed: log bytes,
events, status, heartbeats) per connection, resumed after a drop at the exact byte offset.

The offset into eval.log only ever advances past whole lines that were handed to the sink, and it is
saved locally (runs/<host>/<run>/.follow.json), so a reconnect — or a later `reval logs -f` — asks the
server for the bytes after the last line shown: no line lost, no line twice. Silence longer than
`stall_s` (the server sends a heartbeat every second) counts as a dropped connection; reconnects back
off exponentially (capped at `max_backoff_s`) and give up after `give_up_s` with exit 4.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import time
from dataclasses import dataclass, field

from remote_payload.contract import protocol

from ..errors import ConfigError, HostKeyError, HostUnreachable, RevalError, RunNotFound
from ..hosts.transport import Transport, q
from .events import EventSink
from .registry import remote_run_dir, reported_state, save_follow_state


@dataclass
class Frame:
    tag: str                     # L (log) | E (events) | S (status) | H (heartbeat) | D (done) | X (error)
    #                              | R (refused) | B (status.json damaged) | N (no progress, and why)
    offset: int = 0
    data: bytes = b""


MAX_EVENT_LINE = 1 << 20  # a longer events.jsonl line is damage: dropped (the host sends it in pieces)


class FrameParser:
    """Incremental parser of the stream's frames (see remote_payload/runtime/stream.py)."""

    def __init__(self):
        self.buf = b""

    def feed(self, chunk: bytes) -> list[Frame]:
        self.buf += chunk
        frames = []
        while True:
            nl = self.buf.find(b"\n")
            if nl < 0:
                return frames
            head = self.buf[:nl].split()
            if not head:
                self.buf = self.buf[nl + 1:]
                continue
            tag = head[0].decode()
            if tag in ("H", "D"):
                frames.append(Frame(tag))
                self.buf = self.buf[nl + 1:]
                continue
            offset, size = (int(head[1]), int(head[2])) if tag in ("L", "E") else (0, int(head[1]))
            if len(self.buf) < nl + 1 + size:
                return frames  # the body is still on its way
            frames.append(Frame(tag, offset, self.buf[nl + 1: nl + 1 + size]))
            self.buf = self.buf[nl + 1 + size:]


def split_lines(data: bytes) -> list[bytes]:
    """Lines with their newline kept (a last piece without one stays as it is); only on b"\n"."""
    parts = data.split(b"\n")
    return [x + b"\n" for x in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


@dataclass
class FollowResult:
    state: str                   # succeeded | failed | cancelled | lost
    status: dict = field(default_factory=dict)
    log_offset: int = 0
    reconnects: int = 0


def stream_command(workdir: str, python: str, run_dir: str, log_offset: int, events_offset: int) -> str:
    """The remote command of one stream connection (pure)."""
    return (f"cd {q(workdir + '/payload')} && exec {q(python)} -m remote_payload stream --run-dir {q(run_dir)} "
            f"--log-offset {int(log_offset)} --events-offset {int(events_offset)}")


def _stop(p: subprocess.Popen) -> str:
    """End our own ssh/stream child (by its pid) and return its stderr."""
    if p.poll() is None:
        p.kill()
    try:
        _, err = p.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        err = b""
    return (err or b"").decode(errors="replace")


class _Frames:
    """One follow's state across its connections, and the frames of each handed to the sink: the log's lines
    (res.log_offset: past whole lines handed over), events.jsonl's lines (events_offset, and the unfinished
    last line), status.json, the host's notes, the end (D) and the refusals (X, R, B)."""

    def __init__(self, res: FollowResult, sink, host: str, name: str, save: bool):
        self.res, self.sink, self.host, self.name, self.save = res, sink, host, name, save
        self.events_offset = 0
        # the tail of events.jsonl after its last newline (only sent once the run is over)
        self.pending = b""
        # an event line over MAX_EVENT_LINE was dropped: its end is skipped when it comes
        self.skip_event = False

    def handle(self, fr: Frame) -> bool:
        """Hand one frame on; True when it says the stream is done (D)."""
        if fr.tag == "L":
            self._log(fr)
        elif fr.tag == "E":
            self._events(fr)
        elif fr.tag == "S":
            st = json.loads(fr.data)
            self.res.status = {k: v for k, v in st.items() if k != "alive"}
            self.res.state = reported_state(self.res.status, bool(st.get("alive")))
            self.sink.status(st)
        elif fr.tag == "N":  # the host says why nothing came for a while; the follow goes on
            self.sink.note(f"{self.name}: {fr.data.decode(errors='replace')}")
        elif fr.tag == "D":
            return True
        else:
            self._refusal(fr)
        return False

    def _log(self, fr: Frame) -> None:
        res = self.res
        skip = res.log_offset - fr.offset  # >0 only if the server re-sent bytes we have
        if skip < 0:
            raise RuntimeError(f"log stream gap: have {res.log_offset}, got {fr.offset}")
        for raw in split_lines(fr.data[skip:]):
            try:
                text = raw.rstrip(b"\n").decode("utf-8", errors="replace")
                self.sink.line_at(res.log_offset, text)
            finally:  # a line handed to the sink counts as shown, even if Ctrl-C hit it
                res.log_offset += len(raw)
        if self.save:
            save_follow_state(self.host, self.name, log_offset=res.log_offset)

    def _events(self, fr: Frame) -> None:
        if fr.offset + len(fr.data) <= self.events_offset:
            return
        data = self.pending + fr.data[max(0, self.events_offset - fr.offset):]
        self.events_offset = fr.offset + len(fr.data)
        lines = data.split(b"\n")
        self.pending = lines.pop()
        if lines and self.skip_event:  # the end of the event line dropped as too long
            lines, self.skip_event = lines[1:], False
        if len(self.pending) > MAX_EVENT_LINE:  # the host sends a long line in pieces: never held
            self.pending, self.skip_event = b"", True
        for raw in lines:
            try:
                self.sink.event(protocol.loads(raw))
            except ValueError:
                continue

    def _refusal(self, fr: Frame) -> None:
        host, name, why = self.host, self.name, fr.data.decode(errors="replace")
        if fr.tag == "X":
            raise RunNotFound(f"{host}: {why}", hint=f"list runs: reval ls {host}")
        if fr.tag == "R":  # a link, or a FIFO where a run file belongs: never read (exit 3)
            raise ConfigError(f"{host}: {why}", hint="reval reads a run only from real folders and regular "
                                                    "files under runs/; remove what is in the way")
        if fr.tag == "B":  # status.json damaged for good: say so, never wait on it forever
            raise RevalError(f"{host}: {why}", hint=f"the log so far: reval logs {host}/{name} ; remove the "
                                                   f"run: reval rm {host}/{name}", exit_code=1)


def _not_reconnecting(transport: Transport, p: subprocess.Popen, err: str, got_frames: bool, stalled: bool,
                      name: str) -> None:
    """Raise when a dropped stream is not worth another connection: a refused host key, or the remote command
    itself failed (no python or payload there)."""
    e = transport.connection_error(p.returncode, err)
    if e is not None:
        if isinstance(e, HostKeyError):
            raise e
    elif not got_frames and not stalled and p.returncode not in (0, -9, None):
        # The remote command itself failed (no python or payload there): retrying will not help. A stream we
        # ended for its silence is a stalled connection, whatever its exit (None: not reaped in _stop's time).
        last = (err.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        host = transport.host.name
        raise RevalError(f"{host}: cannot follow {name}: {last}",
                         hint=f"re-sync the payload: reval sync {host}", exit_code=1)


def follow(transport: Transport, name: str, *, workdir: str, python: str, log_offset: int = 0, sink=None,
           stall_s: float = 3.0, give_up_s: float = 60.0, max_backoff_s: float = 5.0,
           save: bool = True, stream_cmd=None) -> FollowResult:
    """Stream eval.log from `log_offset` until the run is terminal (or lost) and drained. `stream_cmd(log_offset,
    events_offset)`: the remote stream command (a backend's; default: stream_command for this workdir)."""
    sink = sink or EventSink(lambda ev: None)  # the library prints nothing (the CLI's: reval/cli/display.py)
    host = transport.host
    run_dir = remote_run_dir(workdir, name)
    res = FollowResult(state=protocol.RUNNING, log_offset=log_offset)
    frames = _Frames(res, sink, host.name, name, save)
    attempt, down_since = 0, None
    while True:
        cmd = (stream_cmd(res.log_offset, frames.events_offset) if stream_cmd else
               stream_command(workdir, python, run_dir, res.log_offset, frames.events_offset))
        p = transport.popen(cmd)
        parser = FrameParser()
        done = got_frames = stalled = False
        try:
            fd = p.stdout.fileno()
            while not done:
                ready, _, _ = select.select([fd], [], [], stall_s)
                if not ready:
                    stalled = True  # silence: the connection is stalled (we end the ssh: its exit is ours)
                    break
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break  # EOF: the stream ended without D (connection dropped, stream killed)
                attempt, down_since, got_frames = 0, None, True
                for fr in parser.feed(chunk):
                    if frames.handle(fr):
                        done = True
                        break
        finally:
            err = _stop(p)
            if save:
                save_follow_state(host.name, name, log_offset=res.log_offset)
        if done:
            return res
        _not_reconnecting(transport, p, err, got_frames, stalled, name)
        now = time.monotonic()
        down_since = down_since or now
        if now - down_since > give_up_s:
            raise HostUnreachable(
                f"{host.name}: connection lost for {give_up_s:.0f}s while following {name}",
                hint=f"the run goes on on the host. Re-attach: reval logs {name} -f --host {host.name}")
        delay = min(max_backoff_s, 0.25 * 2 ** attempt)
        attempt += 1
        res.reconnects += 1
        sink.note(f"connection to {host.name} dropped; reconnecting in {delay:.1f}s (at byte {res.log_offset})")
        time.sleep(delay)
