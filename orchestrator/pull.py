"""Pull a run directory to runs/<host>/<run>/: only the contract's files (run.json, status.json, eval.log,
events.jsonl, results.json), byte for byte (a tar stream over the transport), into a temp dir that then
replaces the old copy. Only regular files with exactly those names are taken from the stream, so no
pulled path can land outside the run dir (no `..`, no absolute names, no symlinks). A run folder that is a
symbolic link is refused (exit 3), never entered: what it points to is not a run."""
from __future__ import annotations

import io
import os
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from remote_payload.contract import protocol

from .errors import RemoteCommandError, RunNotFound
from .runs import FOLLOW_JSON, check_local_runs_root, local_run_dir, remote_run_dir, symlink_refused
from .transport import Transport, q


@dataclass
class PullResult:
    path: Path
    files: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # stream members that were not contract files


def pull_script(run_dir: str) -> str:
    """tar the contract files that are regular files (pure); a run folder that is a link: @@LINK."""
    names = " ".join(protocol.RUN_FILES)
    return (f"[ ! -L {q(run_dir)} ] || {{ echo @@LINK; exit 0; }}\n"
            f"cd {q(run_dir)} 2>/dev/null || {{ echo @@NORUN; exit 0; }}\n"
            f'set --; for f in {names}; do [ -f "$f" ] && [ ! -L "$f" ] && set -- "$@" "$f"; done\n'
            'exec tar cf - "$@"')


def extract_contract_files(tar_bytes: bytes, dest: Path) -> tuple[list[str], list[str]]:
    """Write the contract files of a tar stream into `dest`; return (written, refused) names."""
    written, refused = [], []
    with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tf:
        for m in tf:
            if not m.isreg() or m.name not in protocol.RUN_FILES:
                refused.append(m.name)
                continue
            data = tf.extractfile(m).read()
            (protocol.safe_join(dest, m.name)).write_bytes(data)
            written.append(m.name)
    return written, refused


def pull(transport: Transport, name: str, *, workdir: str) -> PullResult:
    host = transport.host.name
    check_local_runs_root(host)  # before the transfer: a `runs` that is a file refuses at once
    final = local_run_dir(host, name)  # and a copy here that is a symbolic link (nothing written through it)
    run_dir = remote_run_dir(workdir, name)
    p = transport.popen(pull_script(run_dir))
    out, err = p.communicate()
    e = transport.connection_error(p.returncode, err.decode(errors="replace"))
    if e is not None:
        raise e
    if out.startswith(b"@@LINK"):
        raise symlink_refused(run_dir, host=host)
    if out.startswith(b"@@NORUN"):
        raise RunNotFound(f"no run {name!r} on {host}", hint=f"list runs: reval ls {host}")
    if p.returncode != 0:
        raise RemoteCommandError(host, "tar cf - <run files>", p.returncode, err.decode(errors="replace"))
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".pull-{name}-{os.getpid()}"
    old = final.parent / f".old-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        written, refused = extract_contract_files(out, tmp)
        if (final / FOLLOW_JSON).exists():
            shutil.copy2(final / FOLLOW_JSON, tmp / FOLLOW_JSON)
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return PullResult(final, sorted(written), refused)
