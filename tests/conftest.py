from __future__ import annotations

import pytest


# --- real OpenSSH sshd hosts (hosts engineer) -----------------------------------------------------------
@pytest.fixture
def ssh_hosts(tmp_path_factory):
    """Factory: `ssh_hosts(n, known=True, host_key="strict", extra=None) -> tests.sshd.SshHosts`.

    Starts n real sshd on 127.0.0.2.. (port 2222) inside the private netns, writes an inventory yaml
    (`.inventory_path`, hosts ssh1..sshN, group `cluster`). Skips, saying why, outside scripts/netns-run.
    Teardown: iptables rules undone, every sshd (and its sessions) killed by pid, ssh masters closed."""
    from tests import sshd
    from orchestrator import transport

    reason = sshd.netns_skip_reason()
    if reason:
        pytest.skip(reason)
    made: list[sshd.SshHosts] = []
    next_addr = [2]

    def factory(n: int, **kw) -> sshd.SshHosts:
        cluster = sshd.make_ssh_hosts(tmp_path_factory.mktemp("sshd"), n, first_address=next_addr[0], **kw)
        next_addr[0] += n
        made.append(cluster)
        return cluster

    yield factory
    transport.close_all()
    for cluster in made:
        cluster.close()


# --- trained tiny fixtures (cache/target engineer) ------------------------------------------------------
@pytest.fixture(scope="session")
def trained_fixtures():
    """The fixture dir (layout: remote_payload/fixtures.py docstring; fixtures.json holds paths + quality).

    Built once into <repo>/.cache/fixtures/ (~1-3 min on 2 busy cores) and reused while its recipe hash
    matches; concurrent test sessions wait on a file lock instead of building twice."""
    from pathlib import Path

    from remote_payload import fixtures

    root = Path(__file__).resolve().parents[1] / ".cache" / "fixtures"
    fixtures.build(root, log=lambda line: None)
    return root
