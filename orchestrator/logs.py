"""A run's eval.log as data: read it whole from the host, its lines with their byte offsets, where the
last N lines start, and one line as JSON (`reval logs --json`)."""
from __future__ import annotations

import json

from remote_payload import protocol

from .errors import RemoteCommandError
from .follow import split_lines
from .runs import remote_run_dir
from .transport import Transport, q, resolve_workdir


def read_log(t: Transport, name: str) -> bytes:
    """The run's eval.log as it is now (b"" when there is none yet)."""
    log = q(remote_run_dir(resolve_workdir(t), name) + "/" + protocol.EVAL_LOG)
    cmd = f"[ ! -e {log} ] || exec cat {log}"  # no log yet: nothing to show; a failed read: an error
    p = t.popen(cmd)
    data, e = p.communicate()
    e = e.decode(errors="replace")
    if p.returncode != 0:
        raise t.connection_error(p.returncode, e) or RemoteCommandError(t.host.name, cmd, p.returncode, e)
    return data


def lines_with_offsets(data: bytes, start: int = 0) -> list[tuple[int, bytes]]:
    """[(byte offset of the line in the file, the line with its newline)] of `data` read from `start` (pure)."""
    out, off = [], start
    for raw in split_lines(data):
        out.append((off, raw))
        off += len(raw)
    return out


def tail_start(data: bytes, n: int | None) -> int:
    """The byte offset where the last `n` lines of `data` begin (0 for all of it) (pure)."""
    lines = lines_with_offsets(data)
    return lines[-n][0] if n and len(lines) > n else 0


def json_line(offset: int, text: str) -> str:
    return json.dumps({"offset": offset, "line": text}, ensure_ascii=False) + "\n"

