"""Push the payload to a host: `<workdir>/payload/{remote_payload/..., requirements.txt, MANIFEST.json}`.

Only what changed travels. The content-hash manifest (sha256 per file) is compared with the host's
MANIFEST.json in the first round trip; when they agree nothing else happens (no rsync at all). Otherwise
rsync (over the same ssh options and ControlMaster socket) brings the tree in line with --delete, or,
when either end lacks rsync, a tar of the changed files goes through one ssh command that also removes
the deleted ones. The manifest is the last file to land: an interrupted sync leaves none (tar) or the
old one (rsync --delay-updates), so the next sync repeats the work instead of trusting a half-copy.
"""
from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..errors import ConfigError, HostUnreachable, RemoteCommandError
from .inventory import Host
from .transport import Transport, q, resolve_workdir, workdir_expr

PACKAGE = "remote_payload"
MANIFEST = "MANIFEST.json"
REQUIREMENTS = "requirements.txt"
# Never shipped (and never deleted on the host by --delete: the payload's own __pycache__ lives there).
EXCLUDE_NAMES = (".git", "__pycache__", "runs", ".env*", "*.pt", "*.safetensors", "*.bin", "*.pyc")
METHODS = ("rsync", "tar")
ALSO_MARK = "@@reval-also@@"


@dataclass
class SyncResult:
    files_changed: int      # added or modified
    bytes: int              # content bytes of the added/modified files
    method: str             # none (already in sync) | rsync | tar
    manifest_hash: str
    files_deleted: int = 0
    files_total: int = 0
    also: tuple[int, str] | None = None  # (exit code, stdout) of the `also` snippet run in the probe


@dataclass
class Manifest:
    files: dict[str, str]   # path under payload/ -> sha256 hex
    hash: str               # sha256 over the sorted (path, sha256) pairs

    def to_json(self) -> str:
        return json.dumps({"version": 1, "hash": self.hash, "files": self.files}, indent=1, sort_keys=True) + "\n"


def is_excluded(rel: str) -> bool:
    return any(fnmatch.fnmatch(part, pat) for part in rel.split("/") for pat in EXCLUDE_NAMES)


def safe_rel(rel: str) -> bool:
    """A relative path that stays inside the payload dir (remote manifests are not trusted)."""
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and all(p not in ("", ".", "..") for p in parts) and "\0" not in rel


def payload_source() -> Path:
    """The local `remote_payload` package directory (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    return Path(next(iter(spec.submodule_search_locations)))


def payload_requirements() -> list[str]:
    """The payload's pip requirements: the project's `payload` extra, markers stripped."""
    try:
        reqs = metadata.requires("reval") or []
    except metadata.PackageNotFoundError:
        raise ConfigError("the reval package metadata is missing (cannot list the payload requirements)",
                          hint="install the project: pip install -e .") from None
    out = []
    for r in reqs:
        spec, _, marker = r.partition(";")
        if re.search(r"""extra\s*==\s*["']payload["']""", marker):
            out.append(spec.strip())
    return out


def requirements_text(requirements: list[str]) -> str:
    return "".join(f"{r}\n" for r in requirements)


def payload_files(source: Path, requirements: list[str]) -> dict[str, Path | bytes]:
    """What goes under payload/: `remote_payload/<rel>` -> local file, plus the generated requirements.txt.
    Regular files only (symlinks are skipped: they could point anywhere on this machine)."""
    files: dict[str, Path | bytes] = {}
    for dirpath, dirnames, filenames in os.walk(source):
        rel_dir = os.path.relpath(dirpath, source)
        dirnames[:] = sorted(d for d in dirnames if not is_excluded(d) and not os.path.islink(os.path.join(dirpath, d)))
        for f in sorted(filenames):
            rel = f if rel_dir == "." else f"{rel_dir}/{f}"
            path = Path(dirpath, f)
            if not is_excluded(rel) and path.is_file() and not path.is_symlink():
                files[f"{PACKAGE}/{rel}"] = path
    files[REQUIREMENTS] = requirements_text(requirements).encode()
    return files


def _sha256(content: Path | bytes) -> str:
    if isinstance(content, bytes):
        return hashlib.sha256(content).hexdigest()
    h = hashlib.sha256()
    with open(content, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_manifest(files: dict[str, Path | bytes]) -> Manifest:
    entries = {rel: _sha256(content) for rel, content in sorted(files.items())}
    digest = hashlib.sha256("".join(f"{r}\0{h}\n" for r, h in entries.items()).encode()).hexdigest()
    return Manifest(entries, digest)


def diff_manifests(local: Manifest, remote: dict | None) -> tuple[list[str], list[str]]:
    """(changed or added paths, deleted paths) to turn `remote` (parsed MANIFEST.json or None) into `local`."""
    remote_files = (remote or {}).get("files") if isinstance(remote, dict) else None
    if not isinstance(remote_files, dict):
        return sorted(local.files), []
    changed = sorted(r for r, h in local.files.items() if remote_files.get(r) != h)
    deleted = sorted(r for r in remote_files if r not in local.files and isinstance(r, str) and safe_rel(r))
    return changed, deleted


def _file_size(content: Path | bytes) -> int:
    return len(content) if isinstance(content, bytes) else content.stat().st_size


RSYNC_CONNECTION_EXITS = (12, 30, 35, 255)  # rsync: protocol stream / timeout / connection errors


def rsync_argv(rsh: list[str] | None, src: str, dest: str, *, delete: bool = False,
               options: list[str] | None = None) -> list[str]:
    """rsync argv (pure). Default options: the payload's. --checksum: the payload is small, and a same-size
    edit within the same second must not be skipped by the size+mtime quick check (we only get here when
    the manifest differs)."""
    if options is None:
        options = ["-a", "--no-links", "--checksum", "--delay-updates",
                   *(["--delete"] if delete else []), *[f"--exclude={pat}" for pat in EXCLUDE_NAMES]]
    argv = ["rsync", *options]
    if rsh:
        argv += ["-e", shlex.join(rsh)]
    return argv + [src, dest]


def _probe_command(host: Host, sub: str) -> str:
    """One round trip: create the dir, print the workdir, rsync's presence, and the manifest (if any)."""
    return (f"W={workdir_expr(host)} && mkdir -p \"$W\"/{q(sub)} && "
            f"printf '%s\\n%s\\n' \"$W\" \"$(command -v rsync || true)\" && "
            f"cat \"$W\"/{q(sub)}/{MANIFEST} 2>/dev/null; true")


def push_tree(transport: Transport, files: dict[str, Path | bytes], sub: str, remote_manifest: dict | None,
              *, method: str | None = None, manifest: Manifest | None = None, remote_rsync: bool = True
              ) -> SyncResult:
    """Make `<workdir>/<sub>` hold exactly `files` (+ MANIFEST.json), sending only the changes."""
    manifest = manifest or build_manifest(files)
    changed, deleted = diff_manifests(manifest, remote_manifest)
    total = len(manifest.files)
    if not changed and not deleted and (remote_manifest or {}).get("hash") == manifest.hash:
        return SyncResult(0, 0, "none", manifest.hash, 0, total)
    method = method or os.environ.get("REVAL_SYNC_METHOD") or (
        "rsync" if remote_rsync and shutil.which("rsync") else "tar")
    if method not in METHODS:
        raise ConfigError(f"unknown sync method {method!r}", hint=f"use one of: {', '.join(METHODS)}")
    dest = f"{resolve_workdir(transport)}/{sub}"
    nbytes = sum(_file_size(files[r]) for r in changed)
    if method == "rsync":
        _push_rsync(transport, files, manifest, dest)
    else:
        _push_tar(transport, files, manifest, dest, changed, deleted)
    return SyncResult(len(changed), nbytes, method, manifest.hash, len(deleted), total)


def _push_rsync(transport: Transport, files: dict[str, Path | bytes], manifest: Manifest, dest: str) -> None:
    with tempfile.TemporaryDirectory(prefix="reval-stage-") as stage:
        for rel, content in files.items():
            out = Path(stage, rel)
            out.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                out.write_bytes(content)
            else:
                shutil.copy2(content, out)
        Path(stage, MANIFEST).write_text(manifest.to_json())
        rsync(transport.rsync_rsh(), stage + "/", transport.rsync_target(dest + "/"), host=transport.host.name,
              what="payload rsync", delete=True)


def rsync(rsh: list[str] | None, src: str, dest: str, *, host: str, what: str, delete: bool = False,
          options: list[str] | None = None) -> None:
    """Run rsync (over the host's connection when `rsh`). A connection failure is HostUnreachable (worth a
    retry); any other failure a RemoteCommandError naming `what` with rsync's last line."""
    argv = rsync_argv(rsh, src, dest, delete=delete, options=options)
    p = subprocess.run(argv, check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if p.returncode in RSYNC_CONNECTION_EXITS:
        raise HostUnreachable(f"{host}: {what} failed (rsync exit {p.returncode}): "
                              f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")
    if p.returncode != 0:
        raise RemoteCommandError(host, what, p.returncode, p.stderr)


def _push_tar(transport: Transport, files: dict[str, Path | bytes], manifest: Manifest, dest: str,
              changed: list[str], deleted: list[str]) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in changed + [MANIFEST]:  # the manifest last
            data = manifest.to_json().encode() if rel == MANIFEST else files[rel]
            if isinstance(data, bytes):
                info = tarfile.TarInfo(rel)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.add(data, arcname=rel, recursive=False)
    rm = f" && rm -f -- {' '.join(q(r) for r in deleted)}" if deleted else ""
    # Drop the manifest first: if anything below fails, the next sync re-sends everything.
    cmd = (f"cd {q(dest)} && rm -f {MANIFEST}{rm} && tar -xf - --no-same-owner && "
           f"find {PACKAGE} -depth -mindepth 1 -type d -empty ! -name __pycache__ -delete 2>/dev/null; "
           f"test -f {MANIFEST}")
    try:
        transport.run(cmd, input=buf.getvalue(), timeout_s=600)
    except RemoteCommandError as e:
        raise _transfer_error(transport, "tar", e.returncode, e.stderr) from None


def _transfer_error(transport: Transport, what: str, rc: int, stderr: str) -> RemoteCommandError:
    return RemoteCommandError(transport.host.name, f"payload {what}", rc, stderr)


def sync_payload(transport: Transport, host: Host, *, method: str | None = None, source: Path | None = None,
                 requirements: list[str] | None = None, also: str = "") -> SyncResult:
    """Bring `<workdir>/payload` in line with the local payload. `method` (or $REVAL_SYNC_METHOD) forces
    rsync or tar; `source`/`requirements` default to the installed remote_payload and its `payload` extra.
    `also`: a shell snippet (may use "$W", the workdir) run in the same round trip as the probe; its exit code
    and stdout come back in `SyncResult.also` (environment.provision uses it to save a round trip)."""
    source = source or payload_source()
    reqs = payload_requirements() if requirements is None else requirements
    files = payload_files(source, reqs)
    manifest = build_manifest(files)
    cmd = _probe_command(host, "payload")
    if also:
        cmd += f"; printf '\\n{ALSO_MARK}\\n'; ( {also}\n); echo \"{ALSO_MARK}$?\""
    out = transport.run(cmd, timeout_s=120).stdout
    also_result = None
    if also:
        out, _, also_out = out.partition(f"\n{ALSO_MARK}\n")
        also_out, _, rc = also_out.rpartition(ALSO_MARK)
        also_result = (int(rc.strip() or 1), also_out)
    workdir, rsync_path, manifest_text = (out.split("\n", 2) + ["", ""])[:3]
    transport.workdir = workdir
    try:
        remote = json.loads(manifest_text) if manifest_text.strip() else None
    except json.JSONDecodeError:
        remote = None
    result = push_tree(transport, files, "payload", remote, method=method, manifest=manifest,
                       remote_rsync=bool(rsync_path.strip()))
    result.also = also_result
    return result


def local_manifest_hash(requirements: list[str] | None = None) -> str:
    """The manifest hash a fully synced host reports (for `hosts check`)."""
    reqs = payload_requirements() if requirements is None else requirements
    return build_manifest(payload_files(payload_source(), reqs)).hash
