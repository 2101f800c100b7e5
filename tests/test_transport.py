"""SSHTransport against real OpenSSH sshd on loopback (private netns): commands, quoting, connection
reuse, and the failure classes (refused, timeout, auth, unknown / changed host key)."""
from __future__ import annotations

import os

import pytest

from orchestrator.errors import HostKeyError, HostUnreachable, RemoteCommandError
from orchestrator.hosts.inventory import Host
from orchestrator.hosts.transport import LocalTransport, SSHTransport, q

pytestmark = pytest.mark.ssh


def host_for(cluster, i=0, **kw) -> Host:
    h = cluster.hosts[i]
    base = {"name": h.name, "address": h.address, "port": h.port, "user": "root",
            "identity_file": str(cluster.client_key), "known_hosts_file": str(cluster.known_hosts),
            "ssh_config_file": "/dev/null", "workdir": str(h.workdir)}
    return Host(**{**base, **kw})


def test_run_echo_through_real_sshd(ssh_hosts):
    c = ssh_hosts(1)
    t = SSHTransport(host_for(c))
    assert t.run("echo hi").stdout == "hi\n"
    # the second command rides the ControlMaster socket opened by the first
    assert os.path.exists(t._control)
    assert t.run("echo again").stdout == "again\n"


def test_quoted_hostile_argument_is_one_literal_argument(ssh_hosts):
    c = ssh_hosts(1)
    t = SSHTransport(host_for(c))
    evil = "a b; touch /tmp/reval-pwned $(id) `id` '\"../x"
    out = t.run(f"printf '%s' {q(evil)}").stdout
    assert out == evil
    assert not os.path.exists("/tmp/reval-pwned")


def test_failed_command_carries_exit_code_and_stderr(ssh_hosts):
    c = ssh_hosts(1)
    t = SSHTransport(host_for(c))
    with pytest.raises(RemoteCommandError) as ei:
        t.run("echo boom >&2; exit 7")
    assert ei.value.returncode == 7 and "boom" in str(ei.value)
    assert t.run("exit 3", check=False).returncode == 3


def test_refused_and_timeout_are_unreachable(ssh_hosts):
    c = ssh_hosts(2)
    c.cut(0, "reject")
    with pytest.raises(HostUnreachable, match="refused"):
        SSHTransport(host_for(c, 0)).run("true")
    c.cut(1, "drop")
    with pytest.raises(HostUnreachable, match="timed out"):
        SSHTransport(host_for(c, 1, connect_timeout_s=1)).run("true")
    c.restore(0)
    assert SSHTransport(host_for(c, 0)).run("echo back").stdout == "back\n"


def test_wrong_key_is_auth_failure(ssh_hosts, tmp_path):
    c = ssh_hosts(1)
    os.system(f"ssh-keygen -q -t ed25519 -N '' -f {tmp_path / 'other'}")
    with pytest.raises(HostUnreachable, match="authentication failed"):
        SSHTransport(host_for(c, identity_file=str(tmp_path / "other"))).run("true")


def test_unknown_host_key_refused_by_default_with_fix(ssh_hosts):
    c = ssh_hosts(1, known=False)
    with pytest.raises(HostKeyError) as ei:
        SSHTransport(host_for(c)).run("true")
    assert "not known" in str(ei.value) and "--accept-new" in ei.value.hint
    assert c.known_hosts.read_text() == ""


def test_accept_new_records_the_key_then_strict_works(ssh_hosts):
    c = ssh_hosts(1, known=False)
    assert SSHTransport(host_for(c, host_key_policy="accept-new")).run("echo ok").stdout == "ok\n"
    assert f"[{c.hosts[0].address}]:{c.hosts[0].port}" in c.known_hosts.read_text()
    from orchestrator.hosts.transport import close_all
    close_all()  # a fresh connection: strict now finds the recorded key
    assert SSHTransport(host_for(c)).run("echo ok").stdout == "ok\n"


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_changed_host_key_always_refused_naming_file_and_line(ssh_hosts, policy):
    c = ssh_hosts(2)
    c.regen_host_key(1)  # second line of known_hosts
    with pytest.raises(HostKeyError) as ei:
        SSHTransport(host_for(c, 1, host_key_policy=policy)).run("true")
    msg = str(ei.value)
    assert "CHANGED" in msg and f"{c.known_hosts}:2" in msg
    assert "ssh-keygen -R" in ei.value.hint


def test_local_transport_runs_shell_string(tmp_path):
    t = LocalTransport(Host(name="local", local=True, workdir=str(tmp_path)))
    assert t.run(f"cd {q(tmp_path)} && printf '%s' {q('x y')} > f && cat f").stdout == "x y"
    with pytest.raises(RemoteCommandError):
        t.run("exit 4")


def test_ssh_config_alias_is_honoured_for_ssh_and_rsync(ssh_hosts, tmp_path):
    c = ssh_hosts(1)
    h = c.hosts[0]
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host box\n  HostName {h.address}\n  Port {h.port}\n  User root\n"
                   f"  IdentityFile {c.client_key}\n  IdentitiesOnly yes\n  UserKnownHostsFile {c.known_hosts}\n")
    inv = tmp_path / "hosts.yaml"
    inv.write_text(f"hosts:\n  box:\n    ssh: box\n    ssh_config_file: {cfg}\n    workdir: {h.workdir}\n")
    from orchestrator.hosts.inventory import load_inventory
    from orchestrator.hosts.sync import sync_payload
    host = load_inventory(inv).get("box")
    t = SSHTransport(host)
    assert t.ssh_options()[:2] == ["-F", str(cfg)]  # ssh wants -F first
    assert t.run("echo $USER").stdout == "root\n"
    (tmp_path / "src" / "remote_payload").mkdir(parents=True)
    (tmp_path / "src" / "remote_payload" / "m.py").write_text("x = 1\n")
    r = sync_payload(t, host, source=tmp_path / "src" / "remote_payload", requirements=[], method="rsync")
    assert r.method == "rsync" and (h.workdir / "payload" / "remote_payload" / "m.py").read_text() == "x = 1\n"


def test_proxy_jump_with_explicit_key_and_known_hosts(ssh_hosts):
    c = ssh_hosts(2)
    jump = c.hosts[0]
    t = SSHTransport(host_for(c, 1, proxy_jump=f"root@{jump.address}:{jump.port}"))
    assert t.run("echo via-jump").stdout == "via-jump\n"
    from orchestrator.hosts.transport import close_all
    close_all()
    c.stop(0)  # no jump host, no way in
    with pytest.raises(HostUnreachable):
        SSHTransport(host_for(c, 1, proxy_jump=f"root@{jump.address}:{jump.port}")).run("true")


def test_first_transports_made_in_parallel_share_one_control_folder(monkeypatch, tmp_path):
    """`reval ls GROUP` may make the first SSHTransports in worker threads: one socket folder, not several."""
    import tempfile
    import threading

    from orchestrator.hosts import transport
    monkeypatch.setattr(transport, "_CONTROL_DIR", None)
    made, real_mkdtemp, start = [], tempfile.mkdtemp, threading.Barrier(8)

    def slow_mkdtemp(**kw):  # widen the window in which a second thread could see no folder yet
        made.append(real_mkdtemp(dir=str(tmp_path), prefix=kw.get("prefix")))
        threading.Event().wait(0.2)
        return made[-1]
    monkeypatch.setattr(transport.tempfile, "mkdtemp", slow_mkdtemp)
    transports = []

    def make(i):
        start.wait()
        transports.append(SSHTransport(Host(name=f"h{i}", address=f"127.0.0.{i + 2}")))
    threads = [threading.Thread(target=make, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in transports:
        t.close()  # no master was opened: only forgets them
    assert len(made) == 1 and {os.path.dirname(t._control) for t in transports} == {made[0]}
