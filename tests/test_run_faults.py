"""Issue 19: faults of a run's machinery, each with real components (real processes, a real sshd in the private
netns, a real full filesystem): the host's runs/ filling up mid-run (item 3), a stopped payload under `logs -f`
(item 4), a SIGKILLed controller whose ssh master died uncleanly too (item 12)."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.hosts import transport
from remote_payload.contract import protocol
from remote_payload.runtime import stream, wrapper
from tests.runtools import group_members, reval, wait_lines
from tests.sshd import _kill, _pids_mentioning

REPO = Path(__file__).resolve().parents[1]


def reval_popen(cwd: Path, *argv) -> subprocess.Popen:
    """`reval ARGV` as the user runs it, in its own process (text output captured)."""
    env = {k: v for k, v in os.environ.items() if k not in ("REVAL_HOSTS", "REVAL_RUNS_DIR")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.Popen([sys.executable, "-m", "reval", *argv], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# --- item 3: the host's runs/ fills up mid-run ------------------------------------------------------------------
@pytest.fixture
def small_runs(here):
    """The local host's runs/ (here/.reval/local/runs) on a 2 MiB tmpfs of its own, unmounted afterwards
    (whatever still runs under `here` is ended first, by pid)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs as the host's runs/")
    runs = here / ".reval/local/runs"
    runs.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "reval-test-full", str(runs)], check=True)
    try:
        yield runs
    finally:
        _kill(_pids_mentioning(str(here) + "/"))
        subprocess.run(["umount", "-l", str(runs)], check=False)


def fill(path: Path, leave_bytes: int = 0) -> None:
    """Write `path` until its filesystem is full, then give back `leave_bytes` (a file of that size removed)."""
    gap = path.with_name(path.name + ".gap")
    if leave_bytes:
        gap.write_bytes(os.urandom(leave_bytes))
    with open(path, "wb") as f:
        try:
            while True:
                f.write(os.urandom(1 << 16))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    gap.unlink(missing_ok=True)


def test_a_disk_that_fills_mid_run_is_said_and_recorded_never_lost(here, small_runs, capsys):
    p = reval_popen(here, "run", "local", "--payload", "dummy", "--name", "full", "--",
                    "--lines", "3000", "--interval-s", "0.01")
    try:
        wait_lines(small_runs / "full/eval.log", 20)
        fill(small_runs / "filler")  # another writer takes the rest of the disk: the payload's next write fails
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 1, (out, err[-2000:])
    assert f"failed  full on local (no space left on local:{small_runs}/full" in err, err[-2000:]
    assert "lost    full" not in err and "OOM killer" not in err  # what it said before
    # the wrapper wrote its final status with no free block left: into the blocks it had reserved at the start
    st = protocol.read_json(small_runs / "full/status.json")
    assert st["state"] == "failed" and st["no_space"] == str(small_runs / "full") and st["exit_code"] != 0
    assert "no space left on device" in st["error"] and not (small_runs / "full" / wrapper.RESERVE_NAME).exists()
    vfs = os.statvfs(small_runs)  # the disk is still full but for the reserve's blocks it gave back
    assert vfs.f_bavail * vfs.f_frsize <= wrapper.RESERVE_BYTES + vfs.f_frsize
    rc, o, e = reval(capsys, "status", "full")
    assert rc == 1 and o.startswith("full on local: failed") and f"no space left on local:{small_runs}/full" in o
    # the pulled copy says how it ended: never `running` in compare
    assert protocol.read_json(here / "runs/local/full/status.json")["state"] == "failed"
    rc, o, e = reval(capsys, "compare", "local/full")
    assert rc == 0 and "FAILED" in o and "RUNNING" not in o, (o, e)
    rc, o, e = reval(capsys, "compare", "local/full", "--format", "json")
    assert rc == 0 and json.loads(o)["runs"][0]["state"] == "failed", o


def test_a_run_is_not_started_without_room_to_record_its_end(here, small_runs, capsys):
    (here / ".reval/local/locks").mkdir(parents=True)
    fill(small_runs / "filler", leave_bytes=wrapper.RESERVE_BYTES // 4)  # room to start, not for the reserve
    rc, out, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "tight", "--", "--lines", "3")
    assert rc == 3 and "local: no space left on device:" in err and f"{small_runs}/tight" in err, (out, err)
    assert not (small_runs / "tight").exists()  # nothing started, nothing left


# --- item 4: a stopped payload under `logs -f` -----------------------------------------------------------------
class Lines:
    """A process's stdout and stderr lines as they come, each with when it came (reader threads)."""

    def __init__(self, p: subprocess.Popen):
        self.out: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        for pipe, into in ((p.stdout, self.out), (p.stderr, self.err)):
            threading.Thread(target=self._read, args=(pipe, into), daemon=True).start()

    @staticmethod
    def _read(pipe, into) -> None:
        for line in pipe:
            into.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, into: list, text: str, timeout_s: float) -> tuple[float, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hit = next(((t, ln) for t, ln in list(into) if text in ln), None)
            if hit:
                return hit
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {timeout_s}s: {[ln for _, ln in into][-5:]}")


def test_a_stopped_payload_is_said_within_no_progress_s_and_kill_still_works(here, capsys):
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "stopped", "--detach", "--",
                       "--lines", "5000", "--interval-s", "0.05")
    assert rc == 101, err
    run_dir = here / ".reval/local/runs/stopped"
    wait_lines(run_dir / "eval.log", 5)
    st = protocol.read_json(run_dir / "status.json")
    (payload,) = [pid for pid in group_members(st["pgid"]) if pid != st["pgid"]]  # the wrapper's child
    follow = reval_popen(here, "logs", "stopped", "-f")
    try:
        seen = Lines(follow)
        seen.wait_for(seen.out, "prompt20:", 60)  # following live
        os.kill(payload, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # it used to print nothing at all (heartbeats kept the follow content); now within NO_PROGRESS_S
        at, note = seen.wait_for(seen.err, "no progress for", stream.NO_PROGRESS_S + 20)
        assert at - stopped_at <= stream.NO_PROGRESS_S + 5, (at - stopped_at, note)
        assert note.startswith("stopped: no progress for ") and f"the process is stopped: pid {payload}" in note
        assert follow.poll() is None  # and it keeps following
        t0 = time.monotonic()
        rc, out, err = reval(capsys, "kill", "stopped", "--grace-s", "60")
        assert rc == 0 and "cancelled stopped on local" in out, (out, err)
        assert time.monotonic() - t0 < 30  # TERM reached the stopped payload (SIGCONT): no 60 s wait for KILL
        follow.wait(timeout=60)
        assert follow.returncode == 103, (seen.out[-3:], seen.err[-5:])
        seen.wait_for(seen.out, "cancelled stopped on local", 5)
        assert protocol.read_json(run_dir / "status.json")["state"] == "cancelled"
    finally:
        follow.kill()
        follow.wait()
        _kill(_pids_mentioning(str(here) + "/"))


@pytest.mark.parametrize("payload, said", [("while True: pass", None),
                                            ("import time; time.sleep(60)", "the process is not scheduled: no CPU")])
def test_silence_is_explained_only_when_the_payload_gets_no_cpu(payload, said):
    """A busy payload that prints nothing (a long weights load) gets no note; one that uses no CPU does."""
    from remote_payload.contract import runstate
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {payload!r}])"
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)  # wrapper + its payload
    try:
        status = {"pgid": leader.pid, "leader_start": runstate.start_time(leader.pid), "boot_id": runstate.boot_id()}
        deadline = time.monotonic() + 30
        while len(group_members(leader.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        quiet = stream.Silence(1.0, time.monotonic())
        notes = []
        while time.monotonic() - quiet.since < 1.2:
            notes.append(quiet.check(status, time.monotonic()))
            time.sleep(0.02)
        notes = [n.decode() for n in notes if n]
        assert (notes == []) if said is None else (len(notes) == 1 and said in notes[0]), notes
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


# --- item 12: a dead controller's control folder whose master died uncleanly ----------------------------------
CONTROLLER = """
import os, signal, sys
from orchestrator.hosts import transport
from orchestrator.hosts.inventory import load_inventory
t = transport.SSHTransport(load_inventory(sys.argv[1]).get("ssh1"))
t.run("true", timeout_s=60)                     # opens a ControlMaster (ControlPersist: it outlives us)
print(t._control, flush=True)
os.kill(os.getpid(), signal.SIGKILL)            # a controller that cannot clean up
"""


def _master_pid(host, control: str) -> int:
    t = transport.SSHTransport(host)
    t._control = control  # ask that master, through its own socket
    p = subprocess.run(["ssh", *t.ssh_options(), "-O", "check", host.address], capture_output=True, text=True,
                       timeout=30, check=False, stdin=subprocess.DEVNULL)
    transport._OPEN.pop(control, None)  # not ours to close
    m = re.search(r"pid=(\d+)", p.stderr)
    assert m, p.stderr
    return int(m.group(1))


def test_a_dead_controllers_folder_with_a_stale_master_socket_is_removed(ssh_hosts, monkeypatch):
    from orchestrator.hosts.inventory import load_inventory
    cluster = ssh_hosts(1)
    root = Path(os.environ["REVAL_CONTROL_ROOT"]) / "i12"  # short: a socket path has ~100 bytes
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "REVAL_CONTROL_ROOT": str(root)}
    p = subprocess.run([sys.executable, "-c", CONTROLLER, str(cluster.inventory_path)], env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr
    control = p.stdout.strip()
    folder = os.path.dirname(control)
    assert os.listdir(folder) == [os.path.basename(control)]
    host = load_inventory(cluster.inventory_path).get("ssh1")
    master = _master_pid(host, control)
    try:
        assert transport.master_listens(control)
        assert transport.remove_stale_control_dirs(str(root)) == []  # a master lives on there: kept
        assert os.path.exists(control)
    finally:
        os.kill(master, signal.SIGKILL)  # the master dies uncleanly too: its socket file stays
    for _ in range(200):  # gone (or a zombie: its socket is closed either way)
        try:
            if Path(f"/proc/{master}/stat").read_text().rsplit(") ", 1)[1][0] == "Z":
                break
        except OSError:
            break
        time.sleep(0.05)
    assert os.path.exists(control) and not transport.master_listens(control)
    # the next controller's first transport sweeps it (it used to keep that folder forever)
    monkeypatch.setattr(transport, "_CONTROL_DIR", None)
    monkeypatch.setenv("REVAL_CONTROL_ROOT", str(root))
    try:
        mine = transport._control_dir()
        assert sorted(os.listdir(root)) == [os.path.basename(mine)]
    finally:
        transport.close_all()
        monkeypatch.setattr(transport, "_CONTROL_DIR", None)
        shutil.rmtree(root, ignore_errors=True)


def test_a_run_that_records_its_end_between_the_two_reads_is_not_called_lost(tmp_path, monkeypatch):
    """The wrapper writes `succeeded`, then exits. A probe that read `running` before and found the group gone
    after must read status.json again: the run ended, it was not lost (seen once as a sweep slot's run `lost`).
    The seam: the liveness check is where the end is written, as the wrapper's exit would fall there."""
    from remote_payload.contract import runstate
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"state": "running", "pgid": 999999999, "leader_start": 1}))

    def ends_then_gone(status):
        (run / "status.json").write_text(json.dumps({"state": "succeeded", "exit_code": 0}))
        return False
    monkeypatch.setattr(runstate, "run_alive", ends_then_gone)
    rec, = runstate.probe(str(tmp_path / "runs"), ["r1"])
    assert rec["status"]["state"] == "succeeded" and rec["alive"] is False
    # a group that is gone with no end recorded stays what it is (the controller reports it lost)
    monkeypatch.setattr(runstate, "run_alive", lambda status: False)
    (run / "status.json").write_text(json.dumps({"state": "running", "pgid": 999999999, "leader_start": 1}))
    rec, = runstate.probe(str(tmp_path / "runs"), ["r1"])
    assert rec["status"]["state"] == "running" and rec["alive"] is False
