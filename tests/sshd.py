"""Real OpenSSH sshd processes on 127.0.0.2, 127.0.0.3, ... for tests, inside the private network
namespace that scripts/netns-run creates (REVAL_NETNS=1). Generated host keys and a client key, an
authorized_keys, a known_hosts for the client, and an inventory yaml pointing at them.

Fault injection: stop(i)/start(i) the daemon, cut(i)/restore(i) with iptables rules inside the namespace
(DROP = a silent black hole that also stalls live connections; REJECT = connection refused), and
regen_host_key(i) to play a reinstalled server. Everything started here is ended by pid in close().

Sessions skip the login shell's ~/.bashrc (`SetEnv SHLVL=1`: Debian's bash reads ~/.bashrc for an ssh command
only when SHLVL < 2 after its own +1), unless `login_rc=True`: root's ~/.bashrc on a dev machine may run
`pyenv init` (0.1 s a session) or wait 60 s on a stale pyenv shim lock a killed session left, and what reval
does must not depend on that. sshd takes only the FIRST `SetEnv` line (later ones are ignored, whatever
variables they name), so every `SetEnv` of `sshd_extra` is merged into that one line (sshd_setenv).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SSHD = "/usr/sbin/sshd"
PORT = 2222


def netns_skip_reason() -> str | None:
    """Why real-sshd tests cannot run here, or None when they can."""
    if os.environ.get("REVAL_NETNS") != "1":
        return "needs the private network namespace: run under scripts/netns-run (make test does)"
    if os.geteuid() != 0:
        return "needs root to run sshd and iptables"
    for tool in (SSHD, "/usr/bin/ssh", "/usr/bin/ssh-keygen"):
        if not os.path.exists(tool):
            return f"{tool} is missing (apt-get install openssh-server openssh-client)"
    return None


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True)


def _descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (from /proc), children first-level before deeper ones."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _pids_mentioning(text: str) -> list[int]:
    """Live processes whose command line or cwd mentions `text` (runs detached under a test host's dir)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{d}/cwd")
        except OSError:
            continue
        if text in cmd or (cwd + "/").startswith(text):
            out.append(int(d))
    return out


def _kill(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class SshdHost:
    name: str
    address: str
    port: int
    root: Path                     # this host's config, keys, logs
    workdir: Path                  # the reval workdir on "the server"
    proc: subprocess.Popen | None = None

    @property
    def host_key(self) -> Path:
        return self.root / "host_ed25519"

    @property
    def log(self) -> Path:
        return self.root / "sshd.log"


@dataclass
class SshHosts:
    root: Path
    hosts: list[SshdHost]
    client_key: Path
    known_hosts: Path
    inventory_path: Path
    sshd_extra: list[str] = field(default_factory=list)  # more sshd_config lines (e.g. KexAlgorithms ...)
    login_rc: bool = False         # sessions run the login shell's ~/.bashrc (False: SetEnv SHLVL=1 skips it)
    _rules: list[list[str]] = field(default_factory=list)

    # -- daemons -------------------------------------------------------------------------------------
    def start(self, i: int) -> None:
        h = self.hosts[i]
        if h.proc and h.proc.poll() is None:
            return
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir for root's sshd
        cfg = h.root / "sshd_config"
        cfg.write_text("\n".join([
            f"ListenAddress {h.address}:{h.port}",
            f"HostKey {h.host_key}",
            f"PidFile {h.root / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
            "StrictModes no", "UsePAM no", "PermitRootLogin prohibit-password",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
            "MaxStartups 200", "MaxSessions 200", "LogLevel ERROR",
            "Subsystem sftp internal-sftp", *sshd_setenv(self.sshd_extra, login_rc=self.login_rc), "",
        ]))
        with open(h.log, "ab") as log:  # -r: no re-exec per connection (cheaper loopback "servers")
            h.proc = subprocess.Popen([SSHD, "-D", "-e", "-r", "-f", str(cfg)], stdout=log, stderr=log,
                                      stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            if h.proc.poll() is not None:
                raise RuntimeError(f"sshd for {h.name} exited {h.proc.returncode}: {h.log.read_text()[-800:]}")
            try:
                socket.create_connection((h.address, h.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd for {h.name} not listening on {h.address}:{h.port}")
                time.sleep(0.02)

    def stop(self, i: int) -> None:
        """Stop the daemon AND its live sessions (like a host going down): descendants first, by pid."""
        h = self.hosts[i]
        if not h.proc:
            return
        # Freeze the listener first: between killing the sessions and killing it, a client whose master just
        # died would otherwise reconnect at once, and that session (forked after the snapshot) would survive.
        if h.proc.poll() is None:
            h.proc.send_signal(signal.SIGSTOP)
        _kill(_descendants(h.proc.pid))
        if h.proc.poll() is None:
            h.proc.kill()
        h.proc.wait()
        h.proc = None

    def sessions(self, i: int) -> list[int]:
        """The live processes of host i's daemon's sessions (its descendants); [] once every connection ended."""
        h = self.hosts[i]
        return _descendants(h.proc.pid) if h.proc and h.proc.poll() is None else []

    def regen_host_key(self, i: int) -> None:
        """The server was reinstalled: new host key, known_hosts unchanged (so the key is now 'changed')."""
        self.stop(i)
        h = self.hosts[i]
        h.host_key.unlink()
        h.host_key.with_suffix(".pub").unlink()
        _keygen(h.host_key, f"{h.name}-reinstalled")
        self.start(i)

    def forget_host_key(self, i: int) -> None:
        """Remove host i from the client's known_hosts (an unknown host)."""
        marker = f"[{self.hosts[i].address}]:{self.hosts[i].port} "
        lines = self.known_hosts.read_text().splitlines(keepends=True)
        self.known_hosts.write_text("".join(l for l in lines if not l.startswith(marker)))

    # -- network faults (iptables inside the namespace) ------------------------------------------------
    def _rule(self, i: int, action: list[str]) -> list[str]:
        h = self.hosts[i]
        return ["INPUT", "-d", h.address, "-p", "tcp", "--dport", str(h.port), "-j", *action]

    def cut(self, i: int, mode: str = "drop") -> None:
        """drop: packets vanish (live connections stall, new ones time out); reject: refused (TCP reset)."""
        action = ["DROP"] if mode == "drop" else ["REJECT", "--reject-with", "tcp-reset"]
        rule = self._rule(i, action)
        subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
        self._rules.append(rule)

    def restore(self, i: int) -> None:
        for rule in [r for r in self._rules if r[2] == self.hosts[i].address]:
            subprocess.run(["iptables", "-D", *rule], check=True, capture_output=True)
            self._rules.remove(rule)

    def close(self) -> None:
        for rule in list(self._rules):
            subprocess.run(["iptables", "-D", *rule], check=False, capture_output=True)
        self._rules.clear()
        for i in range(len(self.hosts)):
            self.stop(i)
        # Detached runs (setsid) left on "the servers" are no longer sshd's descendants: end them by pid.
        _kill(_pids_mentioning(str(self.root) + "/"))


def sshd_setenv(lines: list[str], *, login_rc: bool) -> list[str]:
    """sshd_config `lines` with every `SetEnv` merged into one line, first (sshd ignores each `SetEnv` line after
    its first), and `SHLVL=1` last in it unless `login_rc` (a line's own SHLVL, given first, wins: sshd keeps a
    variable's first value). Pure."""
    setenv, rest = [], []
    for line in lines:
        words = line.split()
        if words and words[0].lower() == "setenv":
            setenv += words[1:]
        else:
            rest.append(line)
    if not login_rc:
        setenv.append("SHLVL=1")
    return ([f"SetEnv {' '.join(setenv)}"] if setenv else []) + rest


def make_ssh_hosts(root: Path, n: int, *, known: bool = True, host_key: str = "strict",
                   first_address: int = 2, port: int = PORT, extra: dict | None = None,
                   sshd_extra: list[str] | None = None, login_rc: bool = False) -> SshHosts:
    """Start `n` sshd on 127.0.0.<first_address>... and write `root/hosts.yaml` for them.

    Hosts are named ssh1..sshN, grouped as `cluster`. `known=False` leaves known_hosts empty (unknown
    hosts). `extra` is merged into every host's inventory entry (e.g. a managed venv). `login_rc`: sessions
    run the login shell's ~/.bashrc (see the module doc; the default skips it)."""
    root.mkdir(parents=True, exist_ok=True)
    client_key = root / "client_ed25519"
    _keygen(client_key, "reval-test-client")
    (root / "authorized_keys").write_text(client_key.with_suffix(".pub").read_text())
    known_hosts = root / "known_hosts"
    hosts, known_lines, inv = [], [], {}
    for k in range(n):
        name, addr = f"ssh{k + 1}", f"127.0.0.{first_address + k}"
        hroot = root / name
        (hroot / "work").mkdir(parents=True)
        h = SshdHost(name, addr, port, hroot, hroot / "work")
        _keygen(h.host_key, name)
        known_lines.append(f"[{addr}]:{port} {' '.join(h.host_key.with_suffix('.pub').read_text().split()[:2])}\n")
        hosts.append(h)
        inv[name] = {"address": addr, "port": port, "user": "root", "identity_file": str(client_key),
                     "known_hosts_file": str(known_hosts), "ssh_config_file": "/dev/null",
                     "host_key": host_key, "workdir": str(h.workdir), "python": sys.executable,
                     "venv": {"mode": "python"}, "gpus": "none", **(extra or {})}
    known_hosts.write_text("".join(known_lines) if known else "")
    inventory_path = root / "hosts.yaml"
    inventory_path.write_text(yaml.safe_dump({"hosts": inv, "groups": {"cluster": list(inv)}}, sort_keys=False))
    cluster = SshHosts(root, hosts, client_key, known_hosts, inventory_path, list(sshd_extra or []), login_rc)
    try:
        for i in range(n):
            cluster.start(i)
    except BaseException:
        cluster.close()
        raise
    return cluster
