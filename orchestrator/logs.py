"""A run's eval.log as data: read it whole from the host, its lines with their byte offsets, where the
last N lines start, and one line as JSON (`reval logs --json`)."""
from __future__ import annotations

import json

from remote_payload.contract import protocol

from .errors import RemoteCommandError
from .follow import split_lines
from .runs import remote_run_dir, symlink_refused
from .transport import Transport, q, resolve_workdir

_LINK_EXIT = 113  # the host's answer: the run folder or its eval.log is a symbolic link (never read through it)


def _run(t: Transport, name: str, *, read: bool) -> bytes:
    """Refuse a run folder or an eval.log that is a symbolic link (symlink_refused, exit 3); with `read`: the log."""
    d = remote_run_dir(resolve_workdir(t), name)
    paths = {"d": d, "log": f"{d}/{protocol.EVAL_LOG}"}
    cmd = "; ".join(f'if [ -L {q(p)} ]; then echo {k} >&2; exit {_LINK_EXIT}; fi' for k, p in paths.items())
    if read:  # no log yet: nothing to show; a failed read: an error
        cmd += f"; [ ! -e {q(paths['log'])} ] || exec cat {q(paths['log'])}"
    p = t.popen(cmd)
    data, e = p.communicate()
    e = e.decode(errors="replace")
    if p.returncode == _LINK_EXIT and e.strip() in paths:
        raise symlink_refused(paths[e.strip()], host=t.host.name,
                              what="a run folder" if e.strip() == "d" else "the run's log")
    if p.returncode != 0:
        raise t.connection_error(p.returncode, e) or RemoteCommandError(t.host.name, cmd, p.returncode, e)
    return data


def read_log(t: Transport, name: str) -> bytes:
    """The run's eval.log as it is now (b"" when there is none yet); a run folder or eval.log that is a
    symbolic link is refused (exit 3), never read."""
    return _run(t, name, read=True)


def refuse_links(t: Transport, name: str) -> None:
    """Before following a run (`logs -f`): its folder or eval.log being a symbolic link is refused (exit 3)."""
    _run(t, name, read=False)


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

