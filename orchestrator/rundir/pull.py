"""Pull a run directory to runs/<host>/<run>/: only the contract's files (run.json, status.json, eval.log,
events.jsonl, results.json), byte for byte (a tar stream over the transport), into a temp dir that then
replaces the old copy. Only regular files with exactly those names are taken from the stream, so no
pulled path can land outside the run dir (no `..`, no absolute names, no symlinks). A run folder that is a
symbolic link is refused (exit 3), never entered: what it points to is not a run. `install_pulled`: the same
files when they came back inside another command's answer (the sweep's long poll; backends/ssh.py)."""
from __future__ import annotations

import io
import os
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from remote_payload.contract import protocol

from ..errors import RemoteCommandError, RevalError, RunNotFound
from ..hosts.transport import Transport, q
from .logs import drain
from .registry import FOLLOW_JSON, check_local_runs_root, local_run_dir, remote_run_dir, symlink_refused


@dataclass
class Pulled:
    """A run's files copied to runs/<host>/<name>/ (`path`): `files` (the contract's files only), `refused`
    (stream members that were not contract files); `state` as its host reported it (None where it was not
    asked: reval.pull and pull_all ask)."""
    path: Path
    files: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    host: str = ""
    name: str = ""
    state: str | None = None


def pull_script(run_dir: str) -> str:
    """tar the contract files that are regular files (pure); a run folder that is a link: @@LINK."""
    names = " ".join(protocol.RUN_FILES)
    return (f"[ ! -L {q(run_dir)} ] || {{ echo @@LINK; exit 0; }}\n"
            f"cd {q(run_dir)} 2>/dev/null || {{ echo @@NORUN; exit 0; }}\n"
            f'set --; for f in {names}; do [ -f "$f" ] && [ ! -L "$f" ] && set -- "$@" "$f"; done\n'
            'exec tar cf - "$@"')


def extract_contract_files(tar_bytes: bytes, dest: Path) -> tuple[list[str], list[str]]:
    """Write the contract files of a tar stream into `dest`; return (written, refused) names."""
    return extract_contract_stream(io.BytesIO(tar_bytes), dest)


def extract_contract_stream(stream, dest: Path) -> tuple[list[str], list[str]]:
    """extract_contract_files from a readable stream, as it arrives: each file copied in pieces (a 1.5 GB
    eval.log never in memory)."""
    written, refused = [], []
    with tarfile.open(fileobj=stream, mode="r|") as tf:
        for m in tf:
            if not m.isreg() or m.name not in protocol.RUN_FILES:
                refused.append(m.name)
                continue
            with tf.extractfile(m) as src, open(protocol.safe_join(dest, m.name), "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            written.append(m.name)
    return written, refused


class _Prefixed:
    """A stream's first bytes (already read, to look for the script's @@ answers) and then the rest of it."""

    def __init__(self, head: bytes, rest):
        self.head, self.rest = head, rest

    def read(self, size: int = -1) -> bytes:
        if self.head:
            out = self.head if size < 0 else self.head[:size]
            self.head = self.head[len(out):]
            return out
        return self.rest.read(size)


def pull(transport: Transport, name: str, *, workdir: str) -> Pulled:
    host = transport.host.name
    check_local_runs_root(host)  # before the transfer: a `runs` that is a file refuses at once
    final = local_run_dir(host, name)  # and a copy here that is a symbolic link (nothing written through it)
    run_dir = remote_run_dir(workdir, name)
    p = transport.popen(pull_script(run_dir))
    err = drain(p.stderr)
    head = p.stdout.read(7)  # "@@LINK\n", "@@NORUN", or the tar stream's first bytes
    if head.startswith((b"@@LINK", b"@@NORUN")) or len(head) < 7:
        p.stdout.read()  # nothing else comes (or a failed connection): its exit status says which
        _pull_failed(transport, p, err, head, run_dir, name)

    def fill(tmp: Path) -> tuple[list[str], list[str]]:
        try:  # streamed into tmp/ as it arrives: memory stays bounded whatever the files' sizes
            got = extract_contract_stream(_Prefixed(head, p.stdout), tmp)
        except (tarfile.TarError, EOFError) as ex:  # cut off: the connection, the host, or a damaged stream
            p.kill()
            _pull_failed(transport, p, err, head, run_dir, name)
            raise RemoteCommandError(host, "tar cf - <run files>", p.returncode, f"damaged tar stream: {ex}") from None
        p.stdout.read()
        _pull_failed(transport, p, err, head, run_dir, name)
        return got
    return _install(final, host, name, fill)


def install_pulled(host: str, name: str, tar_bytes: bytes, expected: list[str]) -> Pulled | None:
    """A run's contract files that came back as a tar inside another command's answer (the sweep's long poll
    carries a finished run's files: backends/ssh.py) put in runs/<host>/<name>/ as pull() puts them; None
    (nothing changed here) when the stream is damaged or does not hold exactly the files `expected` (the
    host's list of them: a file tar could not read is missing from the stream). The caller then pulls."""
    try:
        check_local_runs_root(host)
        final = local_run_dir(host, name)
    except RevalError:  # runs/ here refuses it: the pull says so
        return None

    def fill(tmp: Path) -> tuple[list[str], list[str]]:
        written, refused = extract_contract_files(tar_bytes, tmp)
        if refused or sorted(written) != sorted(set(expected)):
            raise _Incomplete
        return written, refused
    try:
        return _install(final, host, name, fill)
    except (_Incomplete, tarfile.TarError, EOFError):
        return None


class _Incomplete(Exception):
    pass


def _install(final: Path, host: str, name: str, fill: Callable[[Path], tuple[list[str], list[str]]]
             ) -> Pulled:
    """fill(tmp) writes the files into a temp dir that then replaces `final` (its .follow.json kept)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".pull-{name}-{os.getpid()}"
    old = final.parent / f".old-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        written, refused = fill(tmp)
        keep = final / FOLLOW_JSON
        if keep.is_file() and not keep.is_symlink():  # anything else (a FIFO: copy2 refused it) is no state
            shutil.copy2(keep, tmp / FOLLOW_JSON)
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return Pulled(final, sorted(written), refused, host, name)


def _pull_failed(transport: Transport, p, err: Callable[[], str], head: bytes, run_dir: str, name: str) -> None:
    """Wait for the pull's process; raise what its end says went wrong (nothing when it went right)."""
    p.wait()
    host = transport.host.name
    e = transport.connection_error(p.returncode, err())
    if e is not None:
        raise e
    if head.startswith(b"@@LINK"):
        raise symlink_refused(run_dir, host=host)
    if head.startswith(b"@@NORUN"):
        raise RunNotFound(f"no run {name!r} on {host}", hint=f"list runs: reval ls {host}")
    if p.returncode != 0:
        raise RemoteCommandError(host, "tar cf - <run files>", p.returncode, err())
