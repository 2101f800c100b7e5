"""`python -m remote_payload stream --run-dir D [--log-offset N] [--events-offset M]`

The server end of `reval logs -f` (stdlib only): one long-lived process per follow connection that
polls the run directory and writes framed bytes to stdout, so the controller can tell apart

    L <offset> <n>\\n<n bytes>   new bytes of eval.log starting at byte <offset> (whole lines only)
    E <offset> <n>\\n<n bytes>   new bytes of events.jsonl (whole lines only)
    S <n>\\n<n bytes>            status.json changed (JSON + "alive": is the process group still there)
    H\\n                         heartbeat (the controller treats silence as a dropped connection)
    D\\n                         the run is terminal (or lost) and both files are drained: done
    X <n>\\n<message>            an error (no such run); the stream ends

Offsets make resuming exact: the controller reconnects with the offset after the last line it has.
A trailing partial line is held back until its newline arrives (or the run is over).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from . import protocol


def add_arguments(p) -> None:
    p.add_argument("--run-dir", required=True)
    p.add_argument("--log-offset", type=int, default=0)
    p.add_argument("--events-offset", type=int, default=0)
    p.add_argument("--poll-s", type=float, default=0.05)
    p.add_argument("--heartbeat-s", type=float, default=1.0)


def read_new(path: Path, offset: int, final: bool, limit: int = 1 << 20) -> bytes:
    """Bytes of `path` from `offset` up to the last newline (everything when `final`)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
    except FileNotFoundError:
        return b""
    if final and len(data) < limit:
        return data
    cut = data.rfind(b"\n")
    return data[: cut + 1] if cut >= 0 else b""


def main(args) -> int:
    run_dir = Path(args.run_dir)
    out = sys.stdout.buffer
    parent = os.getppid()
    if not run_dir.is_dir():
        msg = f"no run directory {run_dir}".encode()
        out.write(b"X %d\n" % len(msg) + msg)
        out.flush()
        return 102
    log_off, ev_off = args.log_offset, args.events_offset
    last_status = None
    last_beat = 0.0
    try:
        while True:
            # Liveness first, then the status: a group that was gone before the read left its final status.
            raw = b""
            try:
                st = protocol.read_json(run_dir / protocol.STATUS_JSON)
                alive = protocol.group_alive(st.get("pgid"), st.get("boot_id"))
                raw = (run_dir / protocol.STATUS_JSON).read_bytes()
                status = json.loads(raw)
            except (FileNotFoundError, ValueError):
                status, alive = None, True  # not written yet (the wrapper is starting)
            state = (status or {}).get("state")
            over = state in protocol.TERMINAL_STATES or (state == protocol.RUNNING and not alive)
            frames = []
            for tag, path, off in ((b"L", protocol.EVAL_LOG, log_off), (b"E", protocol.EVENTS_JSONL, ev_off)):
                data = read_new(run_dir / path, off, final=over)
                while data:
                    frames.append(b"%s %d %d\n" % (tag, off, len(data)) + data)
                    off += len(data)
                    data = read_new(run_dir / path, off, final=over)
                if tag == b"L":
                    log_off = off
                else:
                    ev_off = off
            if status is not None and raw != last_status:
                last_status = raw
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
