"""The real-sshd harness itself (tests/sshd.py): its sessions skip the login shell's ~/.bashrc unless asked
(`SetEnv SHLVL=1`), and extra `SetEnv` lines (the Slurm login node's SLURM_CONF) still reach the sessions
although sshd honours only its first `SetEnv` line."""
from __future__ import annotations

import pytest

from orchestrator.hosts.inventory import load_inventory
from orchestrator.hosts.transport import get_transport
from tests import sshd


def test_setenv_lines_are_merged_into_the_first():
    assert sshd.sshd_setenv(["SetEnv A=1", "KexAlgorithms x", "setenv B=2 C=3"], login_rc=False) == [
        "SetEnv A=1 B=2 C=3 SHLVL=1", "KexAlgorithms x"]
    assert sshd.sshd_setenv(["SetEnv A=1"], login_rc=True) == ["SetEnv A=1"]
    assert sshd.sshd_setenv(["LogLevel ERROR"], login_rc=True) == ["LogLevel ERROR"]
    assert sshd.sshd_setenv([], login_rc=False) == ["SetEnv SHLVL=1"]


def _session_env(cluster) -> list[str]:
    t = get_transport(load_inventory(cluster.inventory_path).get("ssh1"))
    # bash reads ~/.bashrc for an ssh command only when its SHLVL (the session's + 1) is below 2
    return t.run('printf "%s %s %s\\n" "$SHLVL" "${FOO-unset}" "${BAR-unset}"').stdout.split()


@pytest.mark.parametrize("login_rc", [False, True])
def test_sessions_skip_the_login_rc_and_get_every_setenv(ssh_hosts, login_rc):
    cluster = ssh_hosts(1, sshd_extra=["SetEnv FOO=f1", "LogLevel ERROR", "SetEnv BAR=b2"], login_rc=login_rc)
    shlvl, foo, bar = _session_env(cluster)
    assert (foo, bar) == ("f1", "b2")  # the second SetEnv line alone would be ignored by sshd
    assert int(shlvl) == (1 if login_rc else 2)  # 2: ~/.bashrc skipped; 1: read, as a plain sshd does
