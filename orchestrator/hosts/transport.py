"""How commands and files reach a host: `LocalTransport` (the `local` host: a folder, no SSH) and
`SSHTransport` (the system OpenSSH client, multiplexed through a ControlMaster socket so that every
command after the first reuses one authenticated connection; rsync rides the same socket).

Why the OpenSSH client and not paramiko: it reads ~/.ssh/config (aliases, User, Port, IdentityFile,
ProxyJump) exactly as the user's own `ssh` does, verifies known_hosts the same way, and rsync can share
its connection. Every remote command is a single string built with shlex.quote by the caller.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import HostKeyError, HostUnreachable, RemoteCommandError

if TYPE_CHECKING:
    from .inventory import Host


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str


class Transport:
    """Interface. `cmd` is a POSIX shell command string run with `sh -c` semantics in the host's login dir."""

    host: Host
    workdir: str | None = None  # absolute, set by resolve_workdir()

    def run(self, cmd: str, *, check: bool = True, timeout_s: float | None = None,
            input: str | bytes | None = None) -> Completed:
        raise NotImplementedError

    def popen(self, cmd: str, **kw) -> subprocess.Popen:
        """Start `cmd` with stdout piped (bytes), for streaming (log follow)."""
        raise NotImplementedError

    def rsync_rsh(self) -> list[str] | None:
        """The `-e` argument for rsync to reach this host, or None for a local path."""
        raise NotImplementedError

    def rsync_target(self, path: str) -> str:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def connection_error(self, returncode: int, stderr: str) -> Exception | None:
        """For a command started with popen: the error to raise when its exit code means the connection
        failed (not the remote command), else None."""
        return None

    def _finish(self, cmd: str, p: Completed, check: bool) -> Completed:
        if check and p.returncode != 0:
            raise RemoteCommandError(self.host.name, cmd, p.returncode, p.stderr, p.stdout)
        return p


class LocalTransport(Transport):
    def __init__(self, host: Host):
        self.host = host

    def run(self, cmd, *, check=True, timeout_s=None, input=None):
        data = input.encode() if isinstance(input, str) else input
        try:
            p = subprocess.run(["/bin/sh", "-c", cmd], check=False, input=data, capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise HostUnreachable(f"{self.host.name}: command timed out after {timeout_s}s: {cmd[:120]}") from e
        res = Completed(p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))
        return self._finish(cmd, res, check)

    def popen(self, cmd, **kw):
        return subprocess.Popen(["/bin/sh", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, **kw)

    def rsync_rsh(self):
        return None

    def rsync_target(self, path):
        return path


_CONTROL_DIR = None
_CONTROL_LOCK = threading.Lock()  # the first SSHTransport may be made in worker threads (reval ls GROUP)
_OPEN: dict[str, SSHTransport] = {}  # control socket -> a transport that may own a master
STALE_SOCKET_CONNECT_S = 1.0  # a live master accepts at once; a dead one's socket refuses at once


def _control_dir() -> str:
    # Short path: unix socket paths are limited to ~100 bytes.
    global _CONTROL_DIR
    with _CONTROL_LOCK:
        if _CONTROL_DIR is None:
            # $REVAL_CONTROL_ROOT: where the per-process socket folders go (tests point it at their tmp dir)
            root = os.environ.get("REVAL_CONTROL_ROOT", "/tmp")
            remove_stale_control_dirs(root)
            _CONTROL_DIR = tempfile.mkdtemp(prefix=f"reval-cm-{os.getpid()}-", dir=root)
            atexit.register(close_all)
        return _CONTROL_DIR


def master_listens(path: str) -> bool:
    """Whether an ssh master still answers on the control socket `path` (a connect, closed at once). A socket
    file whose master died uncleanly (SIGKILL, OOM) stays behind and refuses connections: False."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(STALE_SOCKET_CONNECT_S)
    try:
        s.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # a timeout, a permission error: cannot tell, so a master may live on
    finally:
        s.close()


def _drop_stale_sockets(folder: str) -> None:
    """Unlink the sockets in a dead controller's folder that no master listens on; anything else stays."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for n in names:
        path = os.path.join(folder, n)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode) and not master_listens(path):
                os.unlink(path)
        except OSError:
            pass


def remove_stale_control_dirs(root: str) -> list[str]:
    """Remove the `reval-cm-<pid>-*` folders of controllers that are gone (a SIGKILLed one cannot clean up
    after itself), once empty. A socket in one that no master answers on any more (the master died uncleanly
    too) is removed first; a folder that still holds a live socket (a master living on) or anything that is not
    a socket is left alone."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for n in names:
        m = re.fullmatch(r"reval-cm-(\d+)-\w+", n)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # that controller still runs
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        _drop_stale_sockets(os.path.join(root, n))
        try:
            os.rmdir(os.path.join(root, n))  # only if empty
            removed.append(n)
        except OSError:
            pass
    return removed


def close_all() -> None:
    """Close every ControlMaster this process opened (they would otherwise linger ControlPersist seconds)."""
    global _CONTROL_DIR
    for t in list(_OPEN.values()):
        t.close()
    with _CONTROL_LOCK:
        if _CONTROL_DIR and os.path.isdir(_CONTROL_DIR) and not os.listdir(_CONTROL_DIR):
            shutil.rmtree(_CONTROL_DIR, ignore_errors=True)
            _CONTROL_DIR = None


class SSHTransport(Transport):
    # ssh's own exit code for connection/auth failures
    SSH_ERROR = 255

    def __init__(self, host: Host, *, connect_timeout_s: float | None = None, batch: bool = True):
        self.host = host
        self.connect_timeout_s = connect_timeout_s or host.connect_timeout_s
        self.batch = batch
        # One socket per distinct connection (same address with another key/known_hosts = another socket).
        ident = repr((host.address, host.user, host.port, host.identity_file, host.proxy_jump,
                      host.known_hosts_file, host.ssh_config_file, host.host_key_policy))
        self._control = os.path.join(_control_dir(), hashlib.sha256(ident.encode()).hexdigest()[:16])
        _OPEN[self._control] = self

    def ssh_options(self) -> list[str]:
        """The `-o` options shared by ssh and rsync (pure: no I/O)."""
        h = self.host
        opts = [
            "-o", f"ConnectTimeout={max(1, round(self.connect_timeout_s))}",
            "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
            "-o", "ControlMaster=auto", "-o", f"ControlPath={self._control}", "-o", "ControlPersist=60",
        ]
        if h.user:
            opts += ["-l", h.user]
        if h.port:
            opts += ["-p", str(h.port)]
        auth = self._auth_options()
        if h.proxy_jump and "," not in h.proxy_jump and (h.identity_file or h.known_hosts_file or h.ssh_config_file):
            # -J's hop would not see our -F/-i/UserKnownHostsFile: give them to it through a ProxyCommand.
            hop = h.proxy_jump if "@" not in h.proxy_jump and ":" not in h.proxy_jump else f"ssh://{h.proxy_jump}"
            opts += ["-o", "ProxyCommand=" + shlex.join(["ssh", *auth, "-W", "%h:%p", hop])]
        elif h.proxy_jump:
            opts += ["-J", h.proxy_jump]
        return auth[:2] + opts + auth[2:] if h.ssh_config_file else opts + auth

    def _auth_options(self) -> list[str]:
        """Config file (first, as ssh wants it), host-key policy, identity, known_hosts."""
        h = self.host
        opts = ["-F", os.path.expanduser(h.ssh_config_file)] if h.ssh_config_file else []
        opts += ["-o", f"StrictHostKeyChecking={'accept-new' if h.host_key_policy == 'accept-new' else 'yes'}"]
        if self.batch:
            opts += ["-o", "BatchMode=yes"]  # never prompt (parallel workers)
        if h.identity_file:
            opts += ["-i", os.path.expanduser(h.identity_file), "-o", "IdentitiesOnly=yes"]
        if h.known_hosts_file:
            opts += ["-o", f"UserKnownHostsFile={os.path.expanduser(h.known_hosts_file)}"]
        return opts

    def ssh_argv(self, cmd: str) -> list[str]:
        return ["ssh", *self.ssh_options(), self.host.address, "--", cmd]

    def run(self, cmd, *, check=True, timeout_s=None, input=None):
        data = input.encode() if isinstance(input, str) else input
        try:
            p = subprocess.run(self.ssh_argv(cmd), check=False, input=data, capture_output=True, timeout=timeout_s,
                               stdin=None if data is not None else subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise HostUnreachable(f"{self.host.name}: no answer within {timeout_s}s", hint="check the host is up, "
                                  f"then: reval hosts check {self.host.name}") from e
        res = Completed(p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))
        if res.returncode == self.SSH_ERROR:
            raise classify_ssh_failure(self.host, res.stderr)
        return self._finish(cmd, res, check)

    def popen(self, cmd, **kw):
        return subprocess.Popen(self.ssh_argv(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, **kw)

    def connection_error(self, returncode, stderr):
        return classify_ssh_failure(self.host, stderr) if returncode == self.SSH_ERROR else None

    def rsync_rsh(self):
        return ["ssh", *self.ssh_options()]

    def rsync_target(self, path):
        return f"{self.host.address}:{path}"

    def close(self):
        _OPEN.pop(self._control, None)
        if os.path.exists(self._control):
            subprocess.run(["ssh", *self.ssh_options(), "-O", "exit", self.host.address],
                           check=False, capture_output=True, timeout=10, stdin=subprocess.DEVNULL)


def classify_ssh_failure(host: Host, stderr: str) -> Exception:
    """Turn ssh's exit-255 stderr into a clear error with the fix."""
    s = stderr or ""
    last = (s.strip().splitlines() or ["connection failed"])[-1]
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in s or "Host key verification failed" in s and "Offending" in s:
        where = ""
        for line in s.splitlines():
            if "Offending" in line and " in " in line:
                where = line.split(" in ", 1)[1].strip()  # /path/known_hosts:7
        # known_hosts names a non-22 port `[addr]:port`; OpenSSH's own "remove with" line has the exact entry
        said = re.search(r"ssh-keygen -f '([^']+)' -R '([^']+)'", s)
        entry = said.group(2) if said else (f"[{host.address}]:{host.port}" if host.port not in (None, 22)
                                            else host.address)
        kh = where.rsplit(":", 1)[0] if where else (said.group(1) if said else "")
        return HostKeyError(
            f"{host.name}: host key for {host.address} CHANGED ({where or 'known_hosts'}); refusing to connect",
            hint=f"if the server was really reinstalled: ssh-keygen -R {shlex.quote(entry)}"
                 + (f" -f {shlex.quote(kh)}" if kh else "")
                 + f" ; then reval hosts check {host.name} --accept-new")
    if "Host key verification failed" in s or "No matching host key" in s or "host key is not known" in s:
        return HostKeyError(
            f"{host.name}: host key for {host.address} is not known; refusing to connect",
            hint=f"verify it, then: reval hosts check {host.name} --accept-new "
                 "(or set host_key: accept-new in hosts.yaml)")
    if "Permission denied" in s:
        return HostUnreachable(f"{host.name}: authentication failed ({last})",
                               hint="check user / identity_file in hosts.yaml or ~/.ssh/config")
    return HostUnreachable(f"{host.name}: unreachable ({last})",
                           hint=f"check the host is up and reachable, then: reval hosts check {host.name}")


def get_transport(host: Host) -> Transport:
    return LocalTransport(host) if host.is_local else SSHTransport(host)


def q(s: str | os.PathLike) -> str:
    return shlex.quote(str(s))


def workdir_expr(host: Host) -> str:
    """A shell expression for the host's workdir: on a server `~` and relative paths are under $HOME;
    a local host's relative workdir is under the current directory."""
    wd = host.workdir
    if host.is_local:
        return q(os.path.abspath(os.path.expanduser(wd)))
    if wd in ("~", ""):
        return '"$HOME"'
    if wd.startswith("~/"):
        return '"$HOME"/' + q(wd[2:])
    return q(wd) if wd.startswith("/") else '"$HOME"/' + q(wd)


def resolve_workdir(transport: Transport) -> str:
    """The host's workdir as an absolute path (`~` resolved once per transport, then cached)."""
    cached = getattr(transport, "workdir", None)
    if cached:
        return cached
    host = transport.host
    if host.is_local:
        path = os.path.abspath(os.path.expanduser(host.workdir))
    elif host.workdir.startswith("/"):
        path = host.workdir
    else:
        path = transport.run(f"printf '%s' {workdir_expr(host)}", timeout_s=60).stdout
    transport.workdir = path
    return path
