"""A run's eval.log as data: read whole from the host, streamed in chunks, or its last N lines read from its
end (never the whole of a 1.5 GB log in memory); its lines with their byte offsets, where the last N lines
start."""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from remote_payload.contract import protocol

from ..errors import ConfigError, RemoteCommandError
from ..hosts.transport import Transport, q, resolve_workdir
from .follow import split_lines
from .registry import remote_run_dir, symlink_refused

_LINK_EXIT = 113  # the host's answer: the run folder or its eval.log is a symbolic link (never read through it)
_ODD_EXIT = 114   # ... its eval.log is there but not a regular file (a FIFO: cat would wait on it for ever)
CHUNK = 1 << 20            # bytes per piece of a streamed log
MAX_LINE = 1 << 20         # a longer line comes in pieces of this size (`logs --json`), never held whole
TAIL_WINDOW = 1 << 16      # `--tail N` reads this much of the log's end first, 4x more until it holds N lines,
MAX_TAIL_BYTES = 1 << 26   # ... at most this much (its first line then cut)


def _script(t: Transport, name: str, action: str | None) -> tuple[str, dict]:
    """The host's command: refuse a run folder or an eval.log that is a symbolic link (exit _LINK_EXIT), then
    `action` on the log ({log}: its quoted path) when there is one (no log yet: nothing)."""
    d = remote_run_dir(resolve_workdir(t), name)
    paths = {"d": d, "log": f"{d}/{protocol.EVAL_LOG}"}
    cmd = "; ".join(f'if [ -L {q(p)} ]; then echo {k} >&2; exit {_LINK_EXIT}; fi' for k, p in paths.items())
    log = q(paths["log"])
    cmd += f"; if [ -e {log} ] && [ ! -f {log} ]; then exit {_ODD_EXIT}; fi"
    if action:
        cmd += f"; [ ! -e {log} ] || {action.format(log=log)}"
    return cmd, paths


def _check(t: Transport, cmd: str, paths: dict, returncode: int, e: str) -> None:
    """A linked run folder or log: symlink_refused (exit 3); a failed read: an error."""
    if returncode == _LINK_EXIT and e.strip() in paths:
        raise symlink_refused(paths[e.strip()], host=t.host.name,
                              what="a run folder" if e.strip() == "d" else "the run's log")
    if returncode == _ODD_EXIT:
        raise ConfigError(f"{t.host.name}: {paths['log']} is not a regular file: refused, never read",
                          hint="a FIFO or a device where the run's log belongs is no log; remove it")
    if returncode != 0:
        raise t.connection_error(returncode, e) or RemoteCommandError(t.host.name, cmd, returncode, e)


def _run(t: Transport, name: str, *, read: bool, action: str = "exec cat {log}") -> bytes:
    """Refuse a run folder or an eval.log that is a symbolic link (symlink_refused, exit 3); with `read`: what
    `action` prints (the log)."""
    cmd, paths = _script(t, name, action if read else None)
    p = t.popen(cmd)
    data, e = p.communicate()
    _check(t, cmd, paths, p.returncode, e.decode(errors="replace"))
    return data


def drain(stream, keep: int = 1 << 16):
    """Read `stream` (a process's stderr) to its end on a thread, keeping its last `keep` bytes, so that the
    process never blocks on it while its stdout is streamed; call the result for the text (it waits)."""
    buf = bytearray()

    def run():
        for chunk in iter(lambda: stream.read(8192), b""):
            buf.extend(chunk)
            del buf[:-keep]
    th = threading.Thread(target=run, daemon=True)
    th.start()

    def text() -> str:
        th.join()
        return buf.decode(errors="replace")
    return text


def iter_log(t: Transport, name: str) -> Iterator[bytes]:
    """The run's eval.log as it is now, in pieces of at most CHUNK bytes, streamed from the host (memory stays
    bounded whatever its size); refusals as read_log's, once the stream has ended."""
    cmd, paths = _script(t, name, "exec cat {log}")
    p = t.popen(cmd)
    err = drain(p.stderr)
    done = False
    try:
        yield from iter(lambda: p.stdout.read(CHUNK), b"")
        done = True
    finally:
        if not done:  # the reader stopped early (`reval logs RUN | head`): so does the host's cat
            p.kill()
        p.wait()
    _check(t, cmd, paths, p.returncode, err())


def read_log_tail(t: Transport, name: str, n: int) -> tuple[bytes, int]:
    """(the last n lines of the run's eval.log, the byte offset where they start), read from its end: a
    window of TAIL_WINDOW bytes, grown until it holds n whole lines or the whole log, at most MAX_TAIL_BYTES
    (then its first line is cut). Bounded memory and time whatever the log's size."""
    size = int(_run(t, name, read=True, action="exec wc -c < {log}").strip() or 0)
    window = TAIL_WINDOW
    while True:
        start = max(0, size - window)  # bytes [start, size): the log only grows, so these are the same bytes
        data = _run(t, name, read=True, action=f"tail -c +{start + 1} {{log}} | head -c {size - start}")
        s = tail_start(data, n)
        if s or start == 0 or window >= MAX_TAIL_BYTES:
            return data[s:], start + s
        window *= 4


def iter_lines(chunks: Iterable[bytes], start: int = 0, max_line: int = MAX_LINE) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line with its newline) of a streamed log from `start`; a line longer than `max_line`
    comes in pieces of that size (without a newline), the last piece of the stream as it is."""
    pending, off = b"", start
    for chunk in chunks:
        pending += chunk
        while True:
            nl = pending.find(b"\n", 0, max_line)
            if nl < 0 and len(pending) < max_line:
                break
            cut = nl + 1 if nl >= 0 else max_line
            yield off, pending[:cut]
            off += cut
            pending = pending[cut:]
    if pending:
        yield off, pending


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

