"""Runs through a real single-node Slurm (tests/slurm.py), reached through a loopback sshd login node, with
the CLI as a user drives it: `reval run/status/ls/logs/kill` on a cluster entry, a failing eval, a job over
its time limit, a requeued job, and the login-node connection cut in the middle of a follow.

One cluster serves the whole module (its daemons start in about a second, but a job over its time limit
takes Slurm's minimum of one minute plus up to 30 s to be noticed): the time-limit run is submitted when the
module starts and judged by the last test, so that wait overlaps the others."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.hosts import transport
from orchestrator.rundir.follow import follow
from orchestrator.runs.lifecycle import EvalSpec
from remote_payload.contract import protocol
from reval import cli
from tests import slurm as slurm_mod
from tests.runtools import wait_lines
from tests.slurm import Cluster
from tests.sweeptools import make_checkpoints

pytestmark = [pytest.mark.slurm, pytest.mark.ssh]
# the silence after which a follow reconnects: follow()'s default (an unnamed literal there), read from it
STALL_S = inspect.signature(follow).parameters["stall_s"].default
FAST = ["--", "--lines", "5", "--interval-s", "0"]


@pytest.fixture(scope="module")
def hpc(tmp_path_factory):
    with slurm_mod.cluster_here(tmp_path_factory.mktemp("hpc")) as c:
        # the time-limit run: submitted now, judged by the last test of the module
        rc = cli.main(["-i", c.inv, "run", "hpc1min", "--payload", "dummy", "--name", "overtime", "--detach",
                       "--", "--lines", "100000", "--interval-s", "0.2"])
        assert rc == 101
        yield c


def reval(capsys, c: Cluster, *argv) -> tuple[int, str, str]:
    rc = cli.main(["-i", c.inv, *argv])
    o, e = capsys.readouterr()
    return rc, o, e


def job_processes(c: Cluster, job: str) -> list[int]:
    """Live processes of a Slurm job (its environment names the job id)."""
    out = []
    for pid in c.slurm.job_pids():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] != "Z" and f"SLURM_JOB_ID={job}".encode() in env:
            out.append(pid)
    return out


# --- one run ------------------------------------------------------------------------------------------------
def test_run_through_slurm_like_an_ssh_run(hpc, capsys, random_eval_inputs):
    """The same eval on the plain SSH box and through Slurm: the same run directory, the same comparison."""
    fx = random_eval_inputs
    args = ["--drafter", str(fx / "drafter"), "--target", str(fx / "target"), "--cache", str(fx / "cache"),
            "--num-prompts", "2", "--max-blocks", "3", "--", "--device", "cpu", "--dtype", "fp32"]
    rc, out, err = reval(capsys, hpc, "run", "ssh2", "--name", "same-ssh", *args)
    assert rc == 0, out + err
    rc, out, err = reval(capsys, hpc, "run", "hpc", "--name", "same-hpc", *args)
    assert rc == 0, out + err
    assert "launch  same-hpc on hpc" in out and "job " in out
    assert "[2/2]" in out and "done    same-hpc succeeded" in out
    ssh_dir, hpc_dir = hpc.here / "runs/ssh2/same-ssh", hpc.here / "runs/hpc/same-hpc"
    assert sorted(p.name for p in ssh_dir.iterdir()) == sorted(p.name for p in hpc_dir.iterdir())
    a, b = (json.loads((d / "results.json").read_text()) for d in (ssh_dir, hpc_dir))
    assert a["metrics"] == b["metrics"] and a["comparability"] == b["comparability"]
    # the GPU is the one Slurm assigned (gres: gpu:1 -> CUDA_VISIBLE_DEVICES), never chosen by reval
    st = protocol.read_json(hpc_dir / "status.json")
    run = protocol.read_json(hpc_dir / "run.json")
    assert st["gpus"] in ([0], [1]) and run["handle"] == {"backend": "slurm", "job_id": hpc.job_id("same-hpc")}
    assert not (hpc.shared / "locks").exists() or not list((hpc.shared / "locks").iterdir())
    assert (hpc_dir / "eval.log").read_bytes() == (hpc.run_dir("same-hpc") / "eval.log").read_bytes()
    rc, cmp_out, _ = reval(capsys, hpc, "compare", "ssh2/same-ssh", "hpc/same-hpc", "--baseline", "ssh2/same-ssh",
                           "--format", "json")
    assert rc == 0, cmp_out
    cmp = json.loads(cmp_out)
    assert cmp["comparable"] and not cmp["differences"]
    ssh_row, hpc_row = cmp["runs"]
    assert ssh_row["metrics"] == hpc_row["metrics"] and ssh_row["metrics"]
    assert all(v["ratio"] in (1.0, None) and v["delta"] == 0 for v in hpc_row["vs_baseline"].values())
    rc, out, _ = reval(capsys, hpc, "status", "hpc/same-hpc")
    assert rc == 0 and "succeeded" in out


def test_queued_with_slurms_reason_then_kill_cancels_it(hpc, capsys):
    """A job that cannot start yet (more CPUs than the node has, via an extra #SBATCH line) is `queued`
    with Slurm's reason; kill = scancel; it never ran, so reval records `cancelled` for it."""
    import yaml
    inv = yaml.safe_load(Path(hpc.inv).read_text())
    inv["hosts"]["hpcbig"] = {**inv["hosts"]["hpc"], "slurm": {"cpus": 64}}
    Path(hpc.inv).write_text(yaml.safe_dump(inv, sort_keys=False))
    rc, out, err = reval(capsys, hpc, "run", "hpcbig", "--payload", "dummy", "--name", "waits", "--detach", *FAST)
    assert rc == 101, out + err
    rc, out, _ = reval(capsys, hpc, "status", "hpcbig/waits")
    assert rc == 101 and "queued" in out and "PartitionConfig" in out, out
    rc, out, _ = reval(capsys, hpc, "ls", "hpcbig")
    assert "waits" in out and "queued" in out
    rc, out, _ = reval(capsys, hpc, "status", "hpcbig/waits", "--json")  # what the text says, for scripts too
    got = json.loads(out)
    assert got["state"] == "queued" and "PartitionConfig" in got["reason"] and got["job_id"] == hpc.job_id("waits")
    rc, out, err = reval(capsys, hpc, "kill", "hpcbig/waits")
    assert rc == 0, out + err
    assert hpc.scontrol(hpc.job_id("waits"))["JobState"] == "CANCELLED"
    rc, out, _ = reval(capsys, hpc, "status", "hpcbig/waits")
    assert rc == 103 and "cancelled" in out
    assert protocol.read_json(hpc.run_dir("waits") / "status.json")["state"] == "cancelled"


def test_kill_a_running_job_leaves_no_process(hpc, capsys, monkeypatch):
    rc, out, err = reval(capsys, hpc, "run", "hpc", "--payload", "dummy", "--name", "victim", "--detach", "--",
                         "--lines", "100000", "--interval-s", "0.05")
    assert rc == 101, out + err
    wait_lines(hpc.run_dir("victim") / "eval.log", 5)
    job = hpc.job_id("victim")
    # written by the backend the moment the job existed: the job id once, the identity a re-run re-attaches by
    follow = json.loads((hpc.here / "runs" / "hpc" / "victim" / ".follow.json").read_text())
    assert follow["job_id"] == job and follow["identity"] and "handle" not in follow
    assert job_processes(hpc, job), "the job's processes should be running now"
    trips = []
    real_run = transport.SSHTransport.run
    monkeypatch.setattr(transport.SSHTransport, "run", lambda self, cmd, **kw: trips.append(cmd) or real_run(
        self, cmd, **kw))
    rc, out, err = reval(capsys, hpc, "kill", "victim")
    monkeypatch.undo()
    assert rc == 0, out + err
    # the state once (the run's files, Slurm's word), scancel and its wait, the state after and Slurm's final word
    # written into status.json: 6 round trips (the CLI and the backend each probed first: 8)
    assert len(trips) == 6, [t[:60] for t in trips]
    assert job_processes(hpc, job) == []
    assert hpc.scontrol(job)["JobState"] == "CANCELLED"
    rc, out, _ = reval(capsys, hpc, "status", "hpc/victim")
    assert rc == 103 and "cancelled" in out


def test_kill_cancels_no_job_that_is_not_the_runs(hpc, capsys):
    """.slurm.json damaged to name another job of this user (a hand edit, a copied run folder): kill proves the
    job by its output (the run's eval.log) and cancels nothing; exit 3, one line."""
    for n in ("mine", "other"):
        rc, out, err = reval(capsys, hpc, "run", "hpc", "--payload", "dummy", "--name", n, "--detach", "--",
                             "--lines", "100000", "--interval-s", "0.05")
        assert rc == 101, out + err
        wait_lines(hpc.run_dir(n) / "eval.log", 3)
    mine, other = hpc.job_id("mine"), hpc.job_id("other")
    f = hpc.run_dir("mine") / ".slurm.json"
    good = f.read_text()
    f.write_text(json.dumps({**json.loads(good), "job_id": other}))
    try:
        rc, out, err = reval(capsys, hpc, "kill", "mine")
        assert rc == 3 and "Traceback" not in err, out + err
        assert err.splitlines()[0].startswith(f"error: hpc: Slurm job {other} is not run 'mine''s")
        assert job_processes(hpc, other) and job_processes(hpc, mine)  # neither was cancelled
    finally:
        f.write_text(good)
        for n in ("mine", "other"):
            reval(capsys, hpc, "kill", n)
    assert job_processes(hpc, other) == [] and job_processes(hpc, mine) == []


def test_slurms_word_never_overwrites_a_status_written_after_it_was_read(hpc, capsys, monkeypatch):
    """status.json is read, then Slurm is asked (two round trips). When the wrapper's last write lands between
    them, the record of Slurm's word must not replace it with one built on the older read: the wrapper's fields
    (its finish time, error, suspect flag) are kept."""
    from orchestrator.backends import get_backend
    from orchestrator.backends.slurm import SlurmBackend
    from orchestrator.hosts.inventory import load_inventory
    rc, out, err = reval(capsys, hpc, "run", "hpc", "--payload", "dummy", "--name", "race", *FAST)
    assert rc == 0, out + err
    f = hpc.run_dir("race") / "status.json"
    final = {k: v for k, v in json.loads(f.read_text()).items() if k != "slurm_state"}
    f.write_text(json.dumps({**final, "state": "running", "finished_at": None}))  # as it was before the end
    final["wrapper_wrote_this"] = True  # only in the last write
    real_query = SlurmBackend._query_jobs

    def query_after_the_wrapper_wrote(self, ids):
        f.write_text(json.dumps(final, indent=2))  # the wrapper's last write, between the two reads
        return real_query(self, ids)
    monkeypatch.setattr(SlurmBackend, "_query_jobs", query_after_the_wrapper_wrote)
    be = get_backend(load_inventory(hpc.inv).get("hpc"))
    assert be.state("race").state == protocol.SUCCEEDED  # Slurm's word, shown
    kept = json.loads(f.read_text())
    assert kept.get("wrapper_wrote_this") is True and kept["finished_at"] == final["finished_at"]
    monkeypatch.undo()
    be.state("race")  # the next look builds on the wrapper's status and records Slurm's word on it
    assert json.loads(f.read_text())["slurm_state"] == "COMPLETED" and \
        json.loads(f.read_text())["wrapper_wrote_this"] is True


def test_a_failing_eval_exit_code_reaches_reval(hpc, capsys):
    rc, out, err = reval(capsys, hpc, "run", "hpc", "--payload", "dummy", "--name", "fails", "--",
                         "--lines", "2", "--interval-s", "0", "--exit-code", "2")
    assert rc == 1, out + err  # reval's "an eval failed"
    assert "failed  fails on hpc (exit 2)" in err
    assert hpc.scontrol(hpc.job_id("fails"))["ExitCode"] == "2:0"
    rc, out, _ = reval(capsys, hpc, "status", "hpc/fails")
    assert rc == 1 and "failed (exit 2)" in out and "· exit 2" in out
    # the payload's own "bad input" (exit 3) is reval's exit 3, as on an SSH host
    rc, out, err = reval(capsys, hpc, "run", "hpc", "--payload", "dummy", "--name", "bad-input", "--",
                         "--lines", "1", "--interval-s", "0", "--exit-code", "3")
    assert rc == 3 and "exit 3" in err
    assert not hpc.run_dir("bad-input").exists()  # bad input leaves nothing behind, on the cluster either
    assert [p.name for p in (hpc.shared / "slurm").iterdir() if (p / "job.sh").read_text().count("bad-input")] == []


def test_a_damaged_status_on_the_cluster_lists_without_its_bad_fields(hpc, capsys):
    """status.json is untrusted on a cluster too: fields of the wrong type are left out, as over SSH."""
    import json
    rc, _, err = reval(capsys, hpc, "run", "hpc", "--payload", "dummy", "--name", "damaged", "--",
                       "--lines", "1", "--interval-s", "0")
    assert rc == 0, err
    st_file = hpc.run_dir("damaged") / "status.json"
    st = json.loads(st_file.read_text())
    st_file.write_text(json.dumps({**st, "exit_code": "0; rm -rf", "finished_at": 17, "started_at": ["x"]}))
    rc, out, err = reval(capsys, hpc, "ls", "hpc", "--json")
    assert rc == 0 and "Traceback" not in err, err
    row = next(r for r in json.loads(out) if r["name"] == "damaged")
    assert row["state"] == "succeeded" and "rm -rf" not in out and row.get("finished_at") != 17
    rc, out, err = reval(capsys, hpc, "status", "hpc/damaged")
    assert rc == 0 and "Traceback" not in err and "succeeded" in out


def test_a_symlinked_run_folder_on_the_cluster_is_refused(hpc, capsys):
    """As over SSH: a run folder that is a symbolic link is no run, refused by name (exit 3), never listed."""
    elsewhere = hpc.shared / "elsewhere-run"
    elsewhere.mkdir()
    (elsewhere / "status.json").write_text(json.dumps({"state": "succeeded", "exit_code": 0}))
    (elsewhere / "eval.log").write_text("SECRET line\n")
    link = hpc.run_dir("evil")
    link.symlink_to(elsewhere)
    try:
        for argv in (["status", "hpc/evil"], ["logs", "hpc/evil"], ["pull", "hpc/evil"], ["kill", "hpc/evil"],
                     ["rm", "hpc/evil", "--yes"]):
            rc, out, err = reval(capsys, hpc, *argv)
            assert rc == 3 and f"hpc: {link} is a symbolic link" in err and "SECRET" not in out + err, (argv, err)
        rc, out, err = reval(capsys, hpc, "ls", "hpc", "--json")
        assert rc == 0 and "evil" not in out, err
        assert link.is_symlink() and not (hpc.here / "runs/hpc/evil").exists()
    finally:
        link.unlink()


def test_bad_paths_are_refused_on_the_login_node_before_anything_is_submitted(hpc, capsys):
    jobs = hpc.slurm.cmd("squeue", "-h", "-r", "-t", "all", "-o", "%i").stdout.split()
    rc, out, err = reval(capsys, hpc, "run", "hpc", "--name", "nopath", "--drafter", "/nonexistent/drafter",
                         "--target", "/nonexistent/target", "--cache", "/nonexistent/cache")
    assert rc == 3, out + err
    assert "error: hpc:" in err and "nonexistent" in err and "nothing was started" in err
    assert not hpc.run_dir("nopath").exists()
    assert hpc.slurm.cmd("squeue", "-h", "-r", "-t", "all", "-o", "%i").stdout.split() == jobs


def test_login_connection_cut_mid_follow_loses_nothing(hpc, capsys):
    """iptables DROP on the login node's sshd while `reval run` follows: the job runs on, the follow
    reconnects at its byte offset, every line shows exactly once, the pulled log equals the server's."""
    n = 100
    p = subprocess.Popen([sys.executable, "-m", "reval", "-i", hpc.inv, "run", "hpc", "--payload", "dummy",
                          "--name", "cut", "--give-up-s", "120", "--", "--lines", str(n), "--interval-s", "0.1"],
                         cwd=hpc.here, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    shown: list[str] = []
    errs: list[str] = []
    reader = threading.Thread(target=lambda: shown.extend(iter(p.stdout.readline, "")))
    err_reader = threading.Thread(target=lambda: errs.extend(iter(p.stderr.readline, "")))
    reader.start()
    err_reader.start()
    try:
        log = hpc.run_dir("cut") / "eval.log"
        deadline = time.monotonic() + 120
        while sum("prompt" in line for line in shown) < 5:  # the follow is streaming now
            assert time.monotonic() < deadline and p.poll() is None, shown
            time.sleep(0.05)
        hpc.login.cut(0, "drop")
        size = log.stat().st_size
        # the cut lasts until the job has written more and the follow has noticed the silence (STALL_S, the
        # follow's default) and said it is reconnecting
        deadline = time.monotonic() + 60 + STALL_S
        while not (log.stat().st_size > size and any("reconnecting" in line for line in errs)):
            assert time.monotonic() < deadline and p.poll() is None, (errs, shown)
            time.sleep(0.1)
        grew = log.stat().st_size > size
    finally:
        hpc.login.restore(0)
    rc = p.wait(timeout=180)
    reader.join(60)
    err_reader.join(60)
    err = "".join(errs)
    assert rc == 0, err
    out = "".join(shown)
    assert grew, "the job must keep running while the login node is unreachable"
    assert "reconnecting" in err
    server = log.read_text().splitlines()
    shown = [line for line in out.splitlines() if line in server]
    assert shown == [line for line in server if line in out.splitlines()]
    for i in range(1, n + 1):
        assert sum(f"[{i}/{n}]" in line for line in out.splitlines()) == 1
    assert (hpc.here / "runs/hpc/cut/eval.log").read_bytes() == log.read_bytes()


def test_a_requeued_job_restarts_cleanly(hpc, capsys):
    """Slurm requeues a running job (as for preemption or a node failure): the run starts over in the same
    run directory; the cut-short attempt's output never becomes the result."""
    rc, out, err = reval(capsys, hpc, "run", "hpc", "--payload", "dummy", "--name", "again", "--detach", "--",
                         "--lines", "20", "--interval-s", "0.1")
    assert rc == 101, out + err
    log = hpc.run_dir("again") / "eval.log"
    wait_lines(log, 4)
    job = hpc.job_id("again")
    requeued_at = time.time()
    hpc.slurm.cmd("scontrol", "requeue", job)
    slurm_mod.wait_state(hpc.slurm, job, {"PENDING"})
    rc, out, _ = reval(capsys, hpc, "status", "hpc/again")
    assert rc == 101 and "queued" in out  # Slurm holds a requeued job back (BeginTime) before it runs again
    # slurmd refuses a credential issued in the same second as the revocation the requeue made ("Job
    # credential revoked", the restart fails with exit 1): real Slurm holds a requeued job back far longer,
    # so release it only once a later second has begun
    time.sleep(max(0.0, requeued_at + 1.5 - time.time()))
    hpc.slurm.cmd("scontrol", "update", f"JobId={job}", "StartTime=now")
    rc, out, err = reval(capsys, hpc, "logs", "hpc/again", "-f")
    assert rc == 0, out + err
    text = log.read_text()
    assert "requeued by Slurm (restart 1)" in text and text.count("[reval] again started") == 2
    assert "done" in out or "succeeded" in out
    st = protocol.read_json(hpc.run_dir("again") / "status.json")
    assert st["state"] == "succeeded"
    res = json.loads((hpc.run_dir("again") / "results.json").read_text())
    assert res["run"] == "again"
    assert hpc.scontrol(job)["Restarts"] == "1"


# --- sweeps ---------------------------------------------------------------------------------------------------
def sweep_argv(c: Cluster, ckpts: Path, hosts: str, sweep_dir: Path, lines: int = 6) -> list[str]:
    return ["sweep", "--checkpoints", f"{ckpts}/step-*", "--hosts", hosts, "--payload", "dummy", "--poll-s", "0.2",
            "--sweep-dir", str(sweep_dir), "--json", "--", "--lines", str(lines), "--interval-s", "0.2"]


def test_sweep_is_one_job_array_at_most_two_running(hpc, capsys):
    ck = make_checkpoints(hpc.root / "ck6", range(100, 700, 100))
    running: list[list[str]] = []
    stop = threading.Event()

    def watch():  # what squeue says, sampled while the sweep goes on
        while not stop.is_set():
            out = hpc.slurm.cmd("squeue", "-h", "-r", "-t", "R", "-o", "%i|%j", check=False).stdout.split()
            running.append([x for x in out if x.split("|")[-1].startswith("reval-step-100-")])
            time.sleep(0.05)
    th = threading.Thread(target=watch)
    th.start()
    try:
        rc, out, err = reval(capsys, hpc, *sweep_argv(hpc, ck, "hpc", hpc.root / "sw6"))
    finally:
        stop.set()
        th.join()
    assert rc == 0, err
    rep = json.loads(out)
    assert [o["state"] for o in rep["checkpoints"]] == ["succeeded"] * 6
    assert max(len(r) for r in running) == 2, running  # %2: two at once, never more
    assert "submit  6 checkpoint(s) on hpc · job array" in err and "(at most 2 at once)" in err
    jobs = {json.loads((hpc.run_dir(o["run"]) / ".slurm.json").read_text())["job_id"] for o in rep["checkpoints"]}
    arrays = {j.split("_")[0] for j in jobs}
    assert len(jobs) == 6 and len(arrays) == 1  # one array, six tasks
    for o in rep["checkpoints"]:  # each checkpoint evaluated exactly once, its own run dir, its own checkpoint
        log = (hpc.run_dir(o["run"]) / "eval.log").read_text()
        assert log.count("[reval] " + o["run"] + " started") == 1
        assert protocol.read_json(hpc.run_dir(o["run"]) / "run.json")["checkpoint"].endswith(o["checkpoint"])
    assert Path(rep["dir"], "report.md").exists()
    n_jobs = len(hpc.slurm.cmd("squeue", "-h", "-r", "-t", "all", "-o", "%i").stdout.split())
    rc, out, err = reval(capsys, hpc, *sweep_argv(hpc, ck, "hpc", hpc.root / "sw6"))
    assert rc == 0 and "6 already evaluated (skipped)" in err and "submit" not in err
    assert len(hpc.slurm.cmd("squeue", "-h", "-r", "-t", "all", "-o", "%i").stdout.split()) == n_jobs


def test_a_checkpoint_that_fails_in_a_cluster_sweep_fails_alone(hpc):
    """Bad input while staging one checkpoint, and a bug while pulling another's result: each of those runs
    is reported failed, the others are evaluated, and the sweep says so (as an SSH host's slots do). The
    faults go in through the sweep's HostPool (its seam for every host operation), not by patching a class."""
    from orchestrator import sweep
    from orchestrator.errors import ConfigError
    from orchestrator.hosts.inventory import load_inventory

    class FaultyHosts(sweep.HostPool):
        def stage_checkpoint(self, hs, ckpt):
            if ckpt.name == "step-12":
                raise ConfigError("step-12: cannot be staged (test)")
            return super().stage_checkpoint(hs, ckpt)

        def pull(self, hs, run):
            if run.startswith("step-13-"):
                raise RuntimeError("a bug (test)")
            return super().pull(hs, run)
    # names of their own: a run name comes from the checkpoint, and the cluster's runs/ is shared by the module
    ck = make_checkpoints(hpc.root / "ckf", [11, 12, 13])
    o = sweep.SweepOptions([f"{ck}/step-*"], ["hpc"], poll_s=0.2, sweep_dir=str(hpc.root / "swf"),
                           spec=EvalSpec(payload="dummy", extra=["--lines", "6", "--interval-s", "0.2"]))
    inv = load_inventory(hpc.inv)
    log: list[str] = []
    rep = sweep.Sweep(o, inv, log=log.append, hosts=FaultyHosts(o, inv, log=log.append)).run()
    got = {x.checkpoint: (x.state, x.error) for x in rep.outcomes}
    assert got["step-11"] == ("succeeded", None), log
    assert got["step-12"] == ("failed", "step-12: cannot be staged (test)")
    assert got["step-13"] == ("failed", "internal error: RuntimeError: a bug (test)")
    assert rep.exit_code == 1


def test_sweep_over_a_mixed_group_ssh_box_and_cluster(hpc, capsys):
    ck = make_checkpoints(hpc.root / "ck4", [1, 2, 3, 4])
    rc, out, err = reval(capsys, hpc, *sweep_argv(hpc, ck, "mixed", hpc.root / "swm"))
    assert rc == 0, err
    rep = json.loads(out)
    assert [o["state"] for o in rep["checkpoints"]] == ["succeeded"] * 4
    hosts = [o["host"] for o in rep["checkpoints"]]
    assert set(hosts) == {"ssh2", "hpc"}, hosts
    for o in rep["checkpoints"]:
        where = hpc.run_dir(o["run"]) if o["host"] == "hpc" else hpc.login.hosts[1].workdir / "runs" / o["run"]
        assert (where / "eval.log").read_text().count("started") == 1


def test_killed_sweep_controller_reattaches_to_its_array(hpc, capsys):
    """The controller dies after the array was submitted: the same command again follows those jobs
    (attach), submits nothing, and every checkpoint is evaluated once."""
    ck = make_checkpoints(hpc.root / "ck3", [7, 8, 9])
    sw = hpc.root / "swk"
    p = subprocess.Popen([sys.executable, "-m", "reval", "-i", hpc.inv, *sweep_argv(hpc, ck, "hpc", sw, 25)],
                         cwd=hpc.here, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and p.poll() is None
            try:
                runs = [e["run"] for e in json.loads((sw / "ledger.json").read_text())["entries"].values()]
            except (OSError, ValueError, KeyError):
                runs = []
            if len(runs) == 3 and all((hpc.run_dir(r) / ".slurm.json").exists() for r in runs):
                break
            time.sleep(0.05)
    finally:
        p.kill()
        p.wait()
    submissions = sorted(x.name for x in (hpc.shared / "slurm").iterdir())
    rc, out, err = reval(capsys, hpc, *sweep_argv(hpc, ck, "hpc", sw, 25))
    assert rc == 0, err
    assert [o["state"] for o in json.loads(out)["checkpoints"]] == ["succeeded"] * 3
    assert err.count("attach  step-") == 3 and "submit  " not in err
    assert sorted(x.name for x in (hpc.shared / "slurm").iterdir()) == submissions
    for r in runs:
        assert (hpc.run_dir(r) / "eval.log").read_text().count("[reval] " + r + " started") == 1


# --- last: the run submitted when the module started ---------------------------------------------------------
def test_a_job_over_its_time_limit_is_failed_timeout(hpc, capsys):
    job = hpc.job_id("overtime")
    slurm_mod.wait_state(hpc.slurm, job, {"TIMEOUT"}, timeout_s=240)
    rc, out, _ = reval(capsys, hpc, "status", "hpc1min/overtime")
    assert rc == 1 and "failed" in out and "TIMEOUT" in out, out
    st = protocol.read_json(hpc.run_dir("overtime") / "status.json")
    assert (st["state"], st["slurm_state"], st["reason"]) == ("failed", "TIMEOUT", "TIMEOUT")
    assert "DUE TO TIME LIMIT" in (hpc.run_dir("overtime") / "eval.log").read_text()
    assert job_processes(hpc, job) == []
