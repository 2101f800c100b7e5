"""Slurm as text (orchestrator/hosts/slurmjobs.py) and the cluster entry of hosts.yaml: the batch script reval
submits, run through sh and through the real test Slurm, and the state mapping fed with what the real
scontrol / squeue / sacct of the test cluster print."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from orchestrator.hosts import slurmjobs
from orchestrator.hosts.inventory import SlurmSpec
from orchestrator.hosts.slurmjobs import (
    JobInfo,
    Task,
    batch_script,
    parse_scontrol,
    slurm_run_state,
)
from remote_payload.contract import protocol
from tests.hostsyaml import error_of, parse
from tests.slurm import parse_squeue, wait_state


# --- hosts.yaml ------------------------------------------------------------------------------------------
def test_cluster_entry_parses():
    inv = parse("""
        hosts:
          hpc:
            ssh: hpc-login
            workdir: /shared/me/reval
            venv: {system_site_packages: true}
            slurm:
              partition: gpu
              account: proj-42
              qos: normal
              time: "2:00:00"
              gres: "gpu:a100:1"
              cpus: 8
              mem: 64G
              max_running: 3
              sbatch: [--constraint=h100, --exclude=node7]
          plain: {address: box1}
    """)
    s = inv.get("hpc").slurm
    assert (s.partition, s.account, s.qos, s.time, s.gres, s.gpus, s.cpus, s.mem, s.max_running) == (
        "gpu", "proj-42", "normal", "2:00:00", "gpu:a100:1", None, 8, "64G", 3)
    assert s.sbatch == ["--constraint=h100", "--exclude=node7"]
    assert inv.get("plain").slurm is None
    assert parse("hosts: {c: {ssh: login, slurm: {time: 90, mem: 16000}}}").get("c").slurm.time == "90"


@pytest.mark.parametrize("entry, expect", [
    ("{partiton: gpu}", "line 5: unknown key 'partiton' in host 'c' slurm — did you mean 'partition'?"),
    ("{time: 2h}", "slurm.time '2h' is not a Slurm time limit"),
    ("{mem: lots}", "slurm.mem 'lots' is not a memory size"),
    ("{gpus: 1, gres: 'gpu:1'}", "give either gpus (--gpus=N) or gres"),
    ("{gpus: two}", "slurm.gpus must be GPUs per job (a number), got str 'two'"),
    ("{max_running: 0}", "slurm.max_running must be at least 1"),
    ("{partition: 'gpu; rm -rf /'}", "is not a partition name"),
    ("{sbatch: [--output=/tmp/x]}", "reval sets --output itself"),
    ("{sbatch: ['-J x']}", "reval sets -J itself"),
    ("{sbatch: [constraint=h100]}", "'constraint=h100' is not an sbatch option"),
    ('{sbatch: ["--x\\n#SBATCH --y"]}', "is not an sbatch option"),
])
def test_cluster_entry_errors_are_one_line(entry, expect):
    assert expect in error_of(f"""
        hosts:
          c:
            ssh: login
            slurm: {entry}
    """)


def test_cluster_refuses_host_level_gpus():
    msg = error_of("""
        hosts:
          c: {ssh: login, gpus: [0], slurm: {partition: gpu}}
    """)
    assert "Slurm assigns a cluster's GPUs" in msg


# --- the batch script --------------------------------------------------------------------------------------
def test_sbatch_options_single_and_array():
    spec = SlurmSpec(partition="gpu", account="a", qos="q", time="1:00:00", gpus=2, cpus=4, mem="8G",
                     max_running=2, sbatch=["--constraint=h100"])
    one = slurmjobs.sbatch_options(spec, job_name="reval-x", output="/w/runs/x/eval.log", chdir="/w")
    assert one == ["--job-name=reval-x", "--output=/w/runs/x/eval.log", "--open-mode=append", "--chdir=/w",
                   "--partition=gpu", "--account=a", "--qos=q", "--time=1:00:00", "--gpus=2",
                   "--cpus-per-task=4", "--mem=8G", "--constraint=h100"]
    arr = slurmjobs.sbatch_options(spec, job_name="j", output="o", chdir="/w", n_tasks=6)
    assert arr[-1] == "--array=0-5%2"
    assert slurmjobs.sbatch_options(SlurmSpec(gres="gpu:1"), job_name="j", output="o", chdir="/w", n_tasks=3,
                                    max_running=9)[-2:] == ["--gres=gpu:1", "--array=0-2%3"]


def test_batch_script_runs_the_task_of_its_array_index(tmp_path):
    """Run the script with sh as Slurm would (SLURM_ARRAY_TASK_ID set): task i's argv, quoting intact, from
    <workdir>/payload, with the host's env and the staged run.json copied for the wrapper."""
    wd = tmp_path / "w d"
    (wd / "payload").mkdir(parents=True)
    tasks = []
    for i, name in enumerate(["a", "b"]):
        d = wd / "runs" / name
        d.mkdir(parents=True)
        (d / slurmjobs.STAGED_RUN_JSON).write_text(f'{{"run": "{name}"}}')
        tasks.append(Task(name, str(d), ["sh", "-c", 'echo "$0|$1|$(pwd)|$X|$REVAL_SLURM_JOB" > "$2/out"',
                                         f"it's {name}", "$HOME `x`", str(d)]))
    script = batch_script(SlurmSpec(), workdir=str(wd), tasks=tasks, env={"X": "a b"}, job_name="j",
                          output="o")
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_JOB_ID": "77", "SLURM_JOB_ID": "79"}
    subprocess.run(["sh", "-c", script], env=env, check=True)
    assert (wd / "runs/b/out").read_text() == f"it's b|$HOME `x`|{wd}/payload|a b|77_1\n"
    assert not (wd / "runs/a/out").exists()
    assert (wd / "runs/b/.run.json.in").read_text() == '{"run": "b"}'
    # a requeued restart starts over: the earlier attempt's status and result are removed first
    for f in ("status.json", "results.json"):
        (wd / "runs/b" / f).write_text("{}")
    subprocess.run(["sh", "-c", script], env={**env, "SLURM_RESTART_COUNT": "1"}, check=True)
    assert not (wd / "runs/b/status.json").exists() and not (wd / "runs/b/results.json").exists()
    assert "requeued by Slurm (restart 1)" in (wd / "runs/b/eval.log").read_text()
    bad = subprocess.run(["sh", "-c", script], env={**env, "SLURM_ARRAY_TASK_ID": "5"}, capture_output=True,
                         check=False)
    assert bad.returncode == 3 and b"no run for array task 5" in bad.stderr


# --- states ------------------------------------------------------------------------------------------------
# Captured from the test cluster (Slurm 22.05): a job over its 1-minute limit, as scontrol prints it.
TIMEOUT_LINE = ("JobId=3 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901757 Nice=0 "
                "Account=(null) QOS=(null) JobState=TIMEOUT Reason=TimeLimit Dependency=(null) Requeue=1 "
                "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:9 RunTime=00:01:27 TimeLimit=00:01:00 "
                "NodeList=node1 BatchHost=node1 NumNodes=1 WorkDir=/tmp/slx StdOut=/tmp/slx/to.out Power= ")


@pytest.mark.parametrize("warns", [False, True])
def test_submit_script_takes_the_job_id_from_stdout_not_sbatchs_warnings(tmp_path, warns):
    """sbatch prints warnings on stderr (a deprecated option, a partition note): the job id is stdout's last
    line, so an accepted job is recorded as such; a refusal shows sbatch's own error and leaves nothing."""
    from orchestrator.backends.slurm import submit_script
    wd, bin_dir = tmp_path / "wd", tmp_path / "bin"
    (wd / "payload").mkdir(parents=True)
    bin_dir.mkdir()
    warn = 'echo "sbatch: warning: --mem is deprecated here" >&2; ' if warns else ""
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\n{warn}case \"$2\" in *refuse*) "
                                    "echo 'sbatch: error: Invalid partition name specified' >&2; exit 1;; esac\n"
                                    "echo 4242\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for token, expect in (("tok1", "@@JOB 4242"), ("refuse1", "@@SBATCH")):
        name = f"r-{token}"
        script = submit_script(str(wd), token, [Task(name, str(wd / "runs" / name), ["x"])], ["{}"], "echo hi")
        out = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
        assert expect in out, out
        if token == "tok1":
            assert json.loads((wd / "runs" / name / slurmjobs.JOB_FILE).read_text())["job_id"] == "4242"
        else:
            assert out.strip().splitlines()[-1] == "sbatch: error: Invalid partition name specified"
            assert not (wd / "runs" / name).exists() and not (wd / "slurm" / token).exists()


def test_slurm_run_state_table():
    def v(state, reason="", code=None, status=None):
        return slurm_run_state(JobInfo("1", state, reason, code), status or {})
    assert (v("PENDING", "Priority").state, v("PENDING", "Priority").reason) == (slurmjobs.QUEUED, "Priority")
    assert v("RUNNING").state == protocol.RUNNING
    assert v("COMPLETED", code=0).state == protocol.SUCCEEDED
    assert (v("FAILED", "NonZeroExitCode", 3).state, v("FAILED", "NonZeroExitCode", 3).exit_code) == ("failed", 3)
    # the wrapper saw only a TERM and wrote `cancelled`; Slurm knows it was the time limit
    t = slurm_run_state(parse_scontrol(TIMEOUT_LINE)["3"], {"state": "cancelled", "exit_code": 143})
    assert (t.state, t.reason, t.exit_code) == ("failed", "TIMEOUT", 143)
    for s in ("OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED"):
        assert (v(s, code=137).state, v(s, code=137).reason) == ("failed", s)
    assert v("CANCELLED", status={"state": "running"}).state == protocol.CANCELLED
    # Slurm forgot the job: the wrapper's record, and `lost` for a run that never recorded its end
    assert slurm_run_state(None, {"state": "succeeded", "exit_code": 0}).state == "succeeded"
    assert slurm_run_state(None, {"state": "running"}).state == protocol.LOST
    assert slurm_run_state(None, {}).state == protocol.LOST


def test_final_status_records_slurms_word_once():
    job = parse_scontrol(TIMEOUT_LINE)["3"]
    st = {"state": "cancelled", "exit_code": 143, "pid": 5}
    fixed = slurmjobs.final_status(st, slurm_run_state(job, st), job)
    assert (fixed["state"], fixed["slurm_state"], fixed["reason"], fixed["pid"]) == ("failed", "TIMEOUT",
                                                                                     "TIMEOUT", 5)
    assert slurmjobs.final_status(fixed, slurm_run_state(job, fixed), job) is None  # recorded: nothing more to write
    assert slurmjobs.final_status({}, slurm_run_state(JobInfo("4", "RUNNING"), {}), JobInfo("4", "RUNNING")) is None


@pytest.mark.slurm
@pytest.mark.ssh
def test_states_from_the_real_cluster(slurm):
    """Real jobs in every state reval maps; what the real scontrol/squeue/sacct print is parsed and judged."""
    def sub(*opts):
        return slurm.cmd("sbatch", "--parsable", "-o", "/dev/null", *opts).stdout.strip()
    ok, bad = sub("--wrap", "true"), sub("--wrap", "exit 3")
    hold = sub("--cpus-per-task=100", "--wrap", "true")           # never fits the node: PartitionConfig
    arr = sub("--array=0-2%1", "--wrap", f"while [ ! -e {slurm.root}/go ]; do sleep 0.05; done")
    cancelled = sub("--wrap", "sleep 30")
    for j in (ok, bad):
        wait_state(slurm, j, {"COMPLETED", "FAILED"})
    wait_state(slurm, f"{arr}_0", {"RUNNING"})
    slurm.cmd("scancel", cancelled)
    wait_state(slurm, cancelled, {"CANCELLED"})
    sc = parse_scontrol(slurm.cmd("scontrol", "-o", "show", "job").stdout)
    # the pending tasks of an array show up one per task (squeue -r), with the array's throttle as reason
    sq = parse_squeue(slurm.cmd("squeue", "-h", "-r", "-t", "all", "-o", "%i|%T|%r|%N").stdout)
    for jobs in (sc, sq):
        assert slurm_run_state(jobs[ok], {}).state == "succeeded"
        assert slurm_run_state(jobs[cancelled], {}).state == "cancelled"
        held = slurm_run_state(jobs[hold], {})
        assert (held.state, held.reason) == ("queued", "PartitionConfig")
        assert slurm_run_state(jobs[f"{arr}_0"], {}).state == "running" and jobs[f"{arr}_0"].node == "node1"
        assert slurm_run_state(jobs[f"{arr}_2"], {}).state == "queued"
    assert sq[f"{arr}_1"].reason == "JobArrayTaskLimit"
    failed = slurm_run_state(sc[bad], {})
    assert (failed.state, failed.exit_code, failed.reason) == ("failed", 3, "exit 3")
    # sacct over jobcomp/filetxt (no slurmdbd here): finished jobs with their exit code
    acct = slurmjobs.parse_sacct(slurm.cmd("sacct", "-c", "-n", "-P", "-o", "JobID,State,ExitCode",
                                           "-j", f"{ok},{bad},{cancelled}").stdout)
    assert {j: (i.state, i.exit_code) for j, i in acct.items()} == {
        ok: ("COMPLETED", 0), bad: ("FAILED", 3), cancelled: ("CANCELLED", 0)}
    (slurm.root / "go").touch()


@pytest.mark.slurm
@pytest.mark.ssh
def test_hosts_check_reports_partitions_gpus_and_limits(slurm_login, capsys, monkeypatch):
    from reval import cli
    from tests.slurm import add_cluster_host

    _, login = slurm_login
    add_cluster_host(login.inventory_path, "ssh1", login.root / "shared", slurm={"partition": "debug"})
    add_cluster_host(login.inventory_path, "ssh1", login.root / "shared", name="typo",
                     slurm={"partition": "debgu"})
    monkeypatch.setenv("COLUMNS", "200")
    rc = cli.main(["-i", str(login.inventory_path), "hosts", "check", "hpc"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "debug* (up): 1 node(s) · gpu:2 · 8 CPUs · limit infinite" in out
    assert "hpc: slurm-wlm 22.05.8 · partitions: debug MaxTime=UNLIMITED" in out
    assert "limits: no association limits (sacctmgr: You are not running a supported accounting_storage" in out
    rc = cli.main(["-i", str(login.inventory_path), "hosts", "check", "typo", "--json"])
    [r] = json.loads(capsys.readouterr().out)
    assert rc == 2 and r["error"] == "partition 'debgu' is not on this cluster — did you mean 'debug'?"
    assert r["cluster"]["partitions"][0]["gres"] == "gpu:2"


def test_check_cluster_without_slurm_fails_with_the_fix():
    from orchestrator.hosts.hostcheck import HostCheck
    r = HostCheck("hpc", "login", reachable=True, ok=True)
    slurmjobs.check_cluster(r, SlurmSpec(), {"sinfo": {"rc": 127, "out": "", "err": "No such file: 'sinfo'"}})
    assert not r.ok and r.error.startswith("sinfo failed (exit 127)") and "Slurm login node" in r.hint


# --- the stream of a scheduler's job ---------------------------------------------------------------------
def test_stream_with_alive_cmd_ends_when_the_job_does_not_when_status_says(tmp_path):
    """A requeued job's killed attempt may leave `cancelled` in status.json: the stream follows the job
    (the probe), not the file, and keeps streaming what the next attempt appends."""
    import select
    import sys

    from orchestrator.rundir.follow import FrameParser

    d = tmp_path / "run"
    d.mkdir()
    (d / "status.json").write_text('{"state": "cancelled", "pgid": 999999999}')
    (d / "eval.log").write_text("first attempt\n")
    alive = tmp_path / "job-alive"
    alive.touch()
    p = subprocess.Popen([sys.executable, "-m", "remote_payload", "stream", "--run-dir", str(d),
                          "--alive-cmd", f"test -e {alive}", "--alive-every-s", "0.1"],
                         stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
    parser, log, tags = FrameParser(), b"", []
    try:
        def read_until(pred):
            nonlocal log
            while not pred():
                ready, _, _ = select.select([p.stdout], [], [], 60)
                assert ready, "the stream went silent (no heartbeat)"
                chunk = os.read(p.stdout.fileno(), 65536)
                assert chunk, f"the stream ended early: {tags}"
                for f in parser.feed(chunk):
                    tags.append(f.tag)
                    log += f.data if f.tag == "L" else b""
        read_until(lambda: b"first attempt\n" in log and "H" in tags)
        assert "D" not in tags  # status says cancelled, but the job is still there
        with open(d / "eval.log", "a") as f:
            f.write("[reval] requeued by Slurm (restart 1): starting over\nsecond attempt\n")
        read_until(lambda: b"second attempt\n" in log)
        alive.unlink()
        read_until(lambda: "D" in tags)
        assert p.wait(timeout=60) == 0
        assert log == b"first attempt\n[reval] requeued by Slurm (restart 1): starting over\nsecond attempt\n"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
