"""What reval says about a Slurm run is what Slurm proved, through a real single-node Slurm (tests/slurm.py)
reached through a loopback sshd login node (the same Cluster as test_slurm_backend.py):

- a run over its time limit, followed to its end with `reval run`: the pulled status.json says
  `failed (TIMEOUT)`, as `reval status` does (Slurm's word is recorded before the pull).
"""
from __future__ import annotations

import os

import pytest

from orchestrator import cli
from remote_payload.contract import protocol
from tests import slurm as slurm_mod
from tests import sshd
from tests.test_slurm_backend import Cluster

pytestmark = [pytest.mark.slurm, pytest.mark.ssh]


@pytest.fixture(scope="module")
def hpc(tmp_path_factory):
    reason = slurm_mod.slurm_skip_reason() or sshd.netns_skip_reason()
    if reason:
        pytest.skip(reason)
    c = Cluster(tmp_path_factory.mktemp("trust"))
    old = os.getcwd()
    os.chdir(c.here)
    try:
        yield c
    finally:
        os.chdir(old)
        c.close()


def reval(capsys, c: Cluster, *argv) -> tuple[int, str, str]:
    rc = cli.main(["-i", c.inv, *argv])
    o, e = capsys.readouterr()
    return rc, o, e


# --- 12a: the pulled copy of a TIMEOUT run says what `reval status` says ----------------------------------
def test_a_followed_timeout_run_is_pulled_as_failed_timeout(hpc, capsys):
    """`reval run` on a 1-minute job that runs longer: Slurm ends it (TIMEOUT), the wrapper only sees the TERM
    and writes `cancelled`; the copy pulled at the end of the follow says failed (TIMEOUT), as status does."""
    rc, out, err = reval(capsys, hpc, "run", "hpc1min", "--payload", "dummy", "--name", "overtime",
                         "--", "--lines", "100000", "--interval-s", "0.2")
    assert rc == 1, (out, err)
    pulled = protocol.read_json(hpc.here / "runs" / "hpc1min" / "overtime" / "status.json")
    assert (pulled["state"], pulled.get("slurm_state"), pulled.get("reason")) == ("failed", "TIMEOUT", "TIMEOUT")
    rc, out, _ = reval(capsys, hpc, "status", "hpc1min/overtime")
    assert rc == 1 and "failed (TIMEOUT)" in out, out
    assert protocol.read_json(hpc.run_dir("overtime") / "status.json") == pulled

