"""The real-Slurm test cluster itself (tests/slurm.py): a job submitted through the login node's sshd runs,
completes, gets a fake GPU from gres, and stays queryable after it finished."""
from __future__ import annotations

import shlex

import pytest

from orchestrator.hosts import inventory, transport
from tests.slurm import wait_state

pytestmark = [pytest.mark.slurm, pytest.mark.ssh]


def test_sbatch_through_login_node_completes_with_a_gpu(slurm_login, tmp_path):
    slurm, login = slurm_login
    host = inventory.load_inventory(login.inventory_path).get("ssh1")
    t = transport.SSHTransport(host)
    out = login.hosts[0].workdir / "job.out"
    script = "#!/bin/sh\necho CVD=$CUDA_VISIBLE_DEVICES\necho node=$SLURMD_NODENAME\n"
    r = t.run(f"sbatch --parsable --gres=gpu:1 -o {shlex.quote(str(out))} --wrap {shlex.quote(script)}")
    job = r.stdout.strip()
    assert job.isdigit(), r.stdout
    assert wait_state(slurm, job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED"
    lines = out.read_text().splitlines()
    assert lines[0] in ("CVD=0", "CVD=1"), lines
    assert lines[1] == "node=node1"
    # finished jobs stay queryable: jobcomp/filetxt through sacct -c, over the login node too
    acct = t.run(f"sacct -c -n -P -j {job} -o JobID,State").stdout.split()
    assert f"{job}|COMPLETED" in acct


def test_two_gpu_jobs_run_at_once_on_distinct_gpus(slurm):
    """config_overrides + DefMemPerCPU: several 1-CPU jobs share the node; gres hands each its own GPU.
    Both jobs wait for a file the test creates only once squeue shows both RUNNING."""
    go = slurm.root / "go"
    outs = [slurm.root / f"j{i}.out" for i in range(2)]
    wait_go = f"echo $CUDA_VISIBLE_DEVICES; while [ ! -e {go} ]; do sleep 0.05; done"
    jobs = [slurm.cmd("sbatch", "--parsable", "--gres=gpu:1", "-o", str(o), "--wrap", wait_go).stdout.strip()
            for o in outs]
    for j in jobs:
        assert wait_state(slurm, j, {"RUNNING"}) == "RUNNING"
    running = slurm.cmd("squeue", "-h", "-t", "RUNNING", "-o", "%i").stdout.split()
    assert sorted(running) == sorted(jobs)
    go.touch()
    for j in jobs:
        assert wait_state(slurm, j, {"COMPLETED"}) == "COMPLETED"
    assert sorted(o.read_text().strip() for o in outs) == ["0", "1"]
