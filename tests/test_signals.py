"""Issue 10, breaks 10 and 11: `reval kill` never signals a process group it cannot prove is the run's, and
liveness does not depend on how status.json is formatted (JSON is parsed as JSON, on the host too).

Each test uses strangers that the test itself starts (a process in a session of its own that reports every
signal it gets) and checks they got none; the pgid-1 case is checked at the proof function, so that even a
regression cannot signal -1."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from orchestrator.backends.ssh import kill_run, list_runs, run_state
from remote_payload.contract import protocol, runstate
from tests.runtools import group_members, synced_local, synced_ssh, wait_status

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")


# Writes the name of each catchable signal it gets, and PONG for each SIGRTMIN (the ping). The kernel delivers
# the lowest-numbered pending signal first and Python runs the handlers of pending signals in that order, so any
# standard signal (TERM, HUP, ...) sent before a ping is reported before its PONG; a SIGKILL ends the output.
STRANGER = r"""
import os, signal
def report(n, _frame):
    os.write(1, (signal.Signals(n).name + "\n").encode())
for n in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(n, report)
signal.signal(signal.SIGRTMIN, lambda n, f: os.write(1, b"PONG\n"))
os.write(1, b"ready\n")
while True:
    signal.pause()
"""


class Stranger:
    """A process group that is not any run's (what a reused pgid points at), which says what reached it."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", STRANGER], start_new_session=True,
                                     stdout=subprocess.PIPE)
        self.pid, self._buf = self.proc.pid, b""
        assert self._read_until(b"ready\n") == [], "the stranger did not start"

    def _read_until(self, marker: bytes, timeout_s: float = 30) -> list[str]:
        """The signal names it wrote before `marker`; "KILLED" last when its output ended (it died)."""
        deadline, fd = time.monotonic() + timeout_s, self.proc.stdout.fileno()
        while marker not in self._buf:
            left = deadline - time.monotonic()
            assert left > 0, f"the stranger did not answer within {timeout_s}s: {self._buf!r}"
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return self._buf.decode().split() + ["KILLED"]
                self._buf += chunk
        before, self._buf = self._buf.split(marker, 1)
        return before.decode().split()

    def signals(self) -> list[str]:
        """Every signal it got until now (a SIGKILL as "KILLED"): pings it and reads up to the answer, so a
        signal sent before the call, however slow its delivery, is in the list."""
        try:
            os.kill(self.pid, signal.SIGRTMIN)
        except ProcessLookupError:
            return ["KILLED"]
        return self._read_until(b"PONG\n")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def stranger():
    s = Stranger()
    yield s
    s.close()


def _fake_run(workdir, name: str, status) -> None:
    d = workdir / "runs" / name
    d.mkdir(parents=True)
    (d / "eval.log").write_text(f"[reval] {name} started\n")
    (d / "status.json").write_text(status if isinstance(status, str) else json.dumps(status, indent=2))


def test_the_stranger_reports_what_reaches_it(stranger):
    """The instrument of the tests below: a signal to its group is in the next signals(), a KILL too."""
    assert stranger.signals() == []
    os.killpg(stranger.pid, signal.SIGTERM)
    os.killpg(stranger.pid, signal.SIGHUP)
    assert sorted(stranger.signals()) == ["SIGHUP", "SIGTERM"]
    assert stranger.signals() == []
    os.killpg(stranger.pid, signal.SIGKILL)
    assert stranger.signals() == ["KILLED"]


def test_pgid_one_and_nonsense_prove_nothing():
    here = {"state": "running", "boot_id": protocol.boot_id()}
    for st in ({**here, "pgid": 1}, {**here, "pgid": 1, "leader_start": runstate.start_time(1)},
               {**here, "pgid": 0}, {**here, "pgid": -1}, {**here, "pgid": "1"}, {**here, "pgid": True},
               {**here, "pgid": os.getpgid(0), "leader_start": runstate.start_time(os.getpgid(0))},
               [1], "x", None):
        assert runstate.proven_group(st) is None, st


def test_kill_with_damaged_pgid_one_signals_nothing(tmp_path, stranger):
    """status.json damaged to `"pgid": 1`: the old code ran `kill -TERM -- -1`. Now: no signal, run is lost."""
    _, t, _ = synced_local(tmp_path / "work")
    _fake_run(tmp_path / "work", "dmg", {"state": "running", "pid": 1, "pgid": 1, "boot_id": protocol.boot_id()})
    assert run_state(t, "dmg").state == "lost"
    s = kill_run(t, "dmg", grace_s=0.5)
    assert stranger.signals() == [] and s.state == "cancelled"  # recorded as ended, nothing signalled


def test_reused_pgid_gets_no_signal(tmp_path, stranger):
    """The wrapper died unrecorded and its pgid now belongs to a stranger (same boot): the stranger's start time
    is not the recorded leader_start, and it carries no run id, so it is neither alive for us nor signalled."""
    _, t, _ = synced_local(tmp_path / "work")
    rec = {"state": "running", "pid": stranger.pid, "pgid": stranger.pid, "boot_id": protocol.boot_id(),
           "leader_start": runstate.start_time(stranger.pid) - 1, "run_id": "0" * 32}
    _fake_run(tmp_path / "work", "reused", rec)
    assert run_state(t, "reused").state == "lost"
    kill_run(t, "reused", grace_s=0.5)
    assert stranger.signals() == []
    # the same group WITH the right start time is proven (so the test above fails for the right reason)
    assert runstate.proven_group({**rec, "leader_start": runstate.start_time(stranger.pid)}) == stranger.pid


def test_payload_left_alone_by_its_dead_wrapper_is_proven_by_its_run_id(tmp_path):
    """The wrapper was KILLed alone: the payload runs on in the group, without the leader. Its run id in its
    environment proves the group: status says running, kill ends it."""
    _, t, _ = synced_local(tmp_path / "work")
    run_id = "ab" * 16
    orphan = subprocess.Popen(["sleep", "120"], start_new_session=True,
                              env={**os.environ, runstate.RUN_ID_ENV: run_id})
    try:
        _fake_run(tmp_path / "work", "orph", {"state": "running", "pid": 999999, "pgid": orphan.pid,
                                               "leader_start": 1, "run_id": run_id, "boot_id": protocol.boot_id()})
        assert run_state(t, "orph").state == "running"
        s = kill_run(t, "orph", grace_s=2)
        assert orphan.wait(timeout=10) == -15 and s.state == "cancelled"
    finally:
        orphan.kill()
        orphan.wait()


def _launch_sleeper(t, wd, name):
    from pathlib import Path

    from orchestrator.backends.ssh import launch
    info = launch(t.host, t, name=name, payload_argv=["dummy", "--lines", "10000", "--interval-s", "0.1"],
                  gpus="none", run_json={}, python=sys.executable)
    wait_status(Path(wd) / "runs" / name, (protocol.RUNNING,))
    return info


@pytest.mark.parametrize("fmt", ["oneline", "compact", "reordered"])
def test_liveness_does_not_depend_on_status_json_formatting(tmp_path, fmt):
    """A running run whose status.json is rewritten as other valid JSON is still running, and kill works."""
    _, t, wd = synced_local(tmp_path / "work")
    info = _launch_sleeper(t, wd, "fmt")
    path = tmp_path / "work/runs/fmt/status.json"
    st = json.loads(path.read_text())
    text = {"oneline": json.dumps(st), "compact": json.dumps(st, separators=(",", ":")),
            "reordered": json.dumps(dict(reversed(list(st.items()))))}[fmt]
    path.write_text(text)
    assert run_state(t, "fmt").state == "running"
    assert [s.state for s in list_runs(t) if s.name == "fmt"] == ["running"]
    s = kill_run(t, "fmt", grace_s=5)
    assert s.state == "cancelled" and group_members(info.pgid) == []


@pytest.mark.ssh
def test_kill_over_ssh_proves_then_signals(ssh_hosts, tmp_path, stranger):
    """Over a real sshd: a real run is killed (group gone), a damaged status.json next to it signals nothing."""
    c = ssh_hosts(1)
    _, t, wd = synced_ssh(c)
    info = _launch_sleeper(t, wd, "real")
    _fake_run(c.hosts[0].workdir, "fake", {"state": "running", "pid": stranger.pid, "pgid": stranger.pid,
                                            "boot_id": protocol.boot_id()})
    states = {s.name: s.state for s in list_runs(t)}
    assert states["real"] == "running" and states["fake"] == "lost"
    kill_run(t, "fake", grace_s=0.5)
    assert stranger.signals() == []
    assert kill_run(t, "real", grace_s=5).state == "cancelled" and group_members(info.pgid) == []
