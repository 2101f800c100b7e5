"""Following a run: frames, exact resume by byte offset, and a connection cut (iptables DROP inside the netns)
in the middle of a follow over a real sshd: the run goes on, the follower reconnects and resumes with no
line lost or repeated, and the pulled eval.log equals the server's byte for byte."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from orchestrator.backends.ssh import launch
from orchestrator.hosts.transport import SSHTransport
from orchestrator.rundir.follow import FrameParser, follow
from orchestrator.rundir.pull import extract_contract_files, pull
from orchestrator.rundir.registry import load_follow_state
from remote_payload.contract import protocol
from reval.cli.display import PlainSink
from tests.runtools import synced_local, synced_ssh, wait_lines, wait_status

pytestmark = pytest.mark.usefixtures("runs_here")


class Recorder(PlainSink):
    def __init__(self, stop_after: int | None = None):
        self.lines, self.events, self.notes, self.stop_after = [], [], [], stop_after
        self.first_line = threading.Event()

    def line(self, text):
        self.lines.append(text)
        self.first_line.set()
        if self.stop_after is not None and len(self.lines) >= self.stop_after:
            raise KeyboardInterrupt  # what Ctrl-C does in the middle of a follow

    def event(self, ev):
        self.events.append(ev)

    def note(self, text):
        self.notes.append(text)


def test_frame_parser_byte_by_byte_equals_whole():
    stream = (b"L 0 6\nab\ncd\nE 0 3\n{}\nH\nS 2\n{}L 6 0\nD\n")
    whole = [(f.tag, f.offset, f.data) for f in FrameParser().feed(stream)]
    p, pieces = FrameParser(), []
    for i in range(len(stream)):
        pieces += [(f.tag, f.offset, f.data) for f in p.feed(stream[i:i + 1])]
    assert whole == pieces
    assert [w[0] for w in whole] == ["L", "E", "H", "S", "L", "D"] and whole[0][2] == b"ab\ncd\n"


def test_follow_local_then_resume_after_detach_has_no_gap_or_repeat(tmp_path):
    host, t, wd = synced_local(tmp_path / "work")
    launch(host, t, name="f1", payload_argv=["dummy", "--lines", "30", "--interval-s", "0.02"], gpus="none",
           run_json={}, python=sys.executable)
    first = Recorder(stop_after=7)
    with pytest.raises(KeyboardInterrupt):
        follow(t, "f1", workdir=wd, python=sys.executable, sink=first)
    offset = load_follow_state("local", "f1")["log_offset"]
    assert offset > 0
    second = Recorder()
    res = follow(t, "f1", workdir=wd, python=sys.executable, log_offset=offset, sink=second)
    server_log = (tmp_path / "work" / "runs" / "f1" / "eval.log").read_bytes()
    assert res.state == "succeeded" and res.log_offset == len(server_log)
    assert first.lines[:7] + second.lines == server_log.decode().splitlines()
    assert second.events[-1]["stage"] == "done" and res.status["exit_code"] == 0


def test_follow_reports_lost_when_group_is_gone(tmp_path):
    _, t, wd = synced_local(tmp_path / "work")
    d = tmp_path / "work" / "runs" / "ghost"
    d.mkdir(parents=True)
    (d / "eval.log").write_text("[reval] ghost started\nhalf a line without newline")
    dead = __import__("subprocess").Popen(["true"])
    dead.wait()
    protocol.atomic_write_json(d / "status.json", {"state": "running", "pid": dead.pid, "pgid": dead.pid})
    rec = Recorder()
    res = follow(t, "ghost", workdir=wd, python=sys.executable, sink=rec)
    assert res.state == "lost"
    # a run that is over is drained completely, partial last line included
    assert rec.lines == ["[reval] ghost started", "half a line without newline"]


@pytest.fixture
def zombie_group():
    """A process group whose only member has exited but is not reaped (a zombie: what a KILLed wrapper
    leaves where PID 1 does not reap). Yields its pgid; reaped at the end."""
    import os
    import subprocess
    p = subprocess.Popen(["true"], start_new_session=True)
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
    yield p.pid
    p.wait()


def _status_of(p, **kw) -> dict:
    """What the wrapper records for a group led by `p` (start time in this boot), plus `kw`."""
    from remote_payload.contract import runstate
    return {"state": "running", "pid": p.pid, "pgid": p.pid, "leader_start": runstate.start_time(p.pid),
            "boot_id": protocol.boot_id(), **kw}


def test_run_alive_live_zombie_dead(zombie_group):
    import os
    import subprocess
    live = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        st = _status_of(live)
        assert protocol.run_alive(st) is True
    finally:
        live.kill()
        live.wait()
    os.killpg(zombie_group, 0)  # kill -0 still finds the zombie's group ...
    assert protocol.run_alive({"state": "running", "pgid": zombie_group, "leader_start": 1,
                               "boot_id": protocol.boot_id()}) is False  # ... but nothing in it runs
    assert protocol.run_alive(st) is False  # dead and reaped
    assert protocol.run_alive({"pgid": None}) is False and protocol.run_alive(["not", "a", "dict"]) is False


def test_follow_and_status_agree_a_zombie_only_group_is_lost(tmp_path, zombie_group):
    """A KILLed wrapper left as a zombie: `reval status` says lost, and `logs -f` ends (lost) too."""
    from orchestrator.backends.ssh import run_state
    _, t, wd = synced_local(tmp_path / "work")
    d = tmp_path / "work" / "runs" / "zomb"
    d.mkdir(parents=True)
    (d / "eval.log").write_text("[reval] zomb started\n")
    protocol.atomic_write_json(d / "status.json", {"state": "running", "pid": zombie_group, "pgid": zombie_group})
    assert run_state(t, "zomb").state == "lost"
    res = follow(t, "zomb", workdir=wd, python=sys.executable, sink=Recorder())
    assert res.state == "lost"


def test_pull_takes_only_contract_files(tmp_path):
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in [("eval.log", b"ok\n"), ("../evil", b"x"), ("/etc/evil", b"x"), ("sub/run.json", b"{}"),
                           ("notes.txt", b"x")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("status.json")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
    dest = tmp_path / "d"
    dest.mkdir()
    written, refused = extract_contract_files(buf.getvalue(), dest)
    assert written == ["eval.log"] and len(refused) == 5
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["eval.log"]


CUT_LINES = 40  # lines the run writes on the server while the connection is cut


@pytest.mark.ssh
@pytest.mark.slow
def test_connection_cut_mid_follow_resumes_exactly(ssh_hosts, tmp_path):
    c = ssh_hosts(1)
    host, t, wd = synced_ssh(c)
    n_lines = 120
    launch(host, t, name="cut1", payload_argv=["dummy", "--lines", str(n_lines), "--interval-s", "0.06"],
           gpus="none", run_json={}, python=sys.executable)
    server_log = c.hosts[0].workdir / "runs" / "cut1" / "eval.log"
    rec, result, error = Recorder(), {}, []

    def run():
        try:
            result["res"] = follow(t, "cut1", workdir=wd, python=sys.executable, sink=rec, stall_s=1.0,
                                   give_up_s=60, max_backoff_s=2.0)
        except BaseException as e:  # noqa: BLE001 - reported below
            error.append(e)

    th = threading.Thread(target=run)
    th.start()
    try:
        wait_lines(server_log, 15)
        assert rec.first_line.wait(30)
        c.cut(0, "drop")
        size_at_cut = server_log.stat().st_size
        seen_at_cut = len(rec.lines)
        # wait for what the cut must show: the follower notices the silence (its "reconnecting" note, after
        # stall_s) while the run writes CUT_LINES more lines on the server (or ends) -- lines that must not
        # reach the follower through the dropped connection
        target = server_log.read_bytes().count(b"\n") + CUT_LINES
        deadline = time.monotonic() + 60
        while not (any("reconnecting" in n for n in rec.notes)
                   and (server_log.read_bytes().count(b"\n") >= target or f"[{n_lines}/{n_lines}]".encode()
                        in server_log.read_bytes())):
            assert th.is_alive() and time.monotonic() < deadline, (rec.notes, error)
            time.sleep(0.05)
        grew = server_log.stat().st_size > size_at_cut
        stalled = len(rec.lines) - seen_at_cut
    finally:
        c.restore(0)
    th.join(120)
    assert not th.is_alive() and not error, error
    res = result["res"]
    assert grew, "the run must keep going on the server while the connection is cut"
    assert stalled < CUT_LINES // 2, "lines kept arriving through a cut connection?"
    assert res.reconnects >= 1 and any("reconnecting" in n for n in rec.notes)
    assert res.state == "succeeded"
    server = server_log.read_bytes()
    assert rec.lines == server.decode().splitlines()  # no line lost, none twice
    assert sum(f"[{n_lines}/{n_lines}]" in line for line in rec.lines) == 1
    pulled = pull(t, "cut1", workdir=wd)
    assert (pulled.path / "eval.log").read_bytes() == server
    assert wait_status(c.hosts[0].workdir / "runs" / "cut1")["state"] == "succeeded"


def test_rich_sink_renders_bar_and_lines_on_a_fixed_width_terminal():
    import io

    from rich.console import Console

    from reval.cli.display import RichSink
    buf = io.StringIO()
    sink = RichSink(Console(file=buf, force_terminal=True, width=100, color_system=None))
    sink.event({"stage": "load_cache", "step": 3, "steps": 5, "message": "Loading cached hidden states"})
    sink.event({"stage": "load_cache", "step": 3, "steps": 5, "i": 6, "n": 10})
    sink.line("      [6/10] fizzbuzz: 536 tokens [not markup]")
    sink.progress.refresh()
    sink.close()
    text = buf.getvalue()
    assert "[6/10] fizzbuzz: 536 tokens [not markup]" in text  # printed verbatim, not as rich markup
    assert "[3/5] Loading cached hidden states" in text and "6/10" in text


@pytest.mark.ssh
def test_follow_gives_up_with_exit_4_and_the_reattach_command(ssh_hosts, tmp_path):
    from orchestrator.errors import HostUnreachable
    c = ssh_hosts(1)
    host, t, wd = synced_ssh(c)
    launch(host, t, name="gone", payload_argv=["dummy", "--lines", "100", "--interval-s", "0.05"], gpus="none",
           run_json={}, python=sys.executable)
    rec = Recorder()
    threading.Thread(target=lambda: rec.first_line.wait(60) and c.cut(0, "reject")).start()
    with pytest.raises(HostUnreachable) as e:
        follow(t, "gone", workdir=wd, python=sys.executable, sink=rec, stall_s=0.5, give_up_s=2, max_backoff_s=0.5)
    c.restore(0)
    assert e.value.exit_code == 4 and "reval logs gone -f --host ssh1" in e.value.hint
    assert rec.lines and "reconnecting" in rec.notes[-1], (rec.lines, rec.notes)
    # the run went on meanwhile: re-attaching resumes after the last line shown
    rest = Recorder()
    res = follow(SSHTransport(host), "gone", workdir=wd, python=sys.executable, sink=rest,
                 log_offset=load_follow_state("ssh1", "gone")["log_offset"])
    assert res.state == "succeeded"
    assert rec.lines + rest.lines == (c.hosts[0].workdir / "runs/gone/eval.log").read_text().splitlines()


def test_probe_records_and_progress_text():
    from orchestrator.backends.ssh import state_from_probe
    from orchestrator.rundir.registry import progress_text
    recs = [{"name": "a", "alive": True, "status": {"state": "running", "pgid": 7},
             "last_event": {"stage": "eval", "step": 5, "steps": 5, "i": 6, "n": 10}},
            {"name": "b", "alive": False, "status": {"state": "running", "pgid": 8}, "last_event": {}},
            {"name": "c", "alive": False, "status": {"state": "failed", "exit_code": 2}, "last_event": "junk"},
            {"name": "d", "alive": False, "status": None, "status_error": "not valid JSON"},
            {"name": "bad;name", "alive": False, "status": {"state": "succeeded"}}, {"name": 7}]
    a, b, c, d = [s for s in (state_from_probe(r, "h") for r in recs) if s]
    assert (a.name, a.state, a.alive) == ("a", "running", True) and progress_text(a.last_event) == "[5/5] eval 6/10"
    assert (b.state, b.last_event) == ("lost", {})  # running, group gone
    assert (c.state, c.status["exit_code"], c.last_event) == ("failed", 2, {})
    assert d.state == "unknown"


def test_a_group_recorded_in_another_boot_is_lost_and_never_signalled(tmp_path):
    """After a reboot a recorded pgid can belong to anything: status says lost, logs -f ends, kill sends nothing."""
    import subprocess

    from orchestrator.backends.ssh import kill_run, run_state
    assert protocol.boot_id(), "this test needs /proc/sys/kernel/random/boot_id (Linux)"
    _, t, wd = synced_local(tmp_path / "work")
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)  # holds the pgid now
    try:
        d = tmp_path / "work" / "runs" / "old"
        d.mkdir(parents=True)
        (d / "eval.log").write_text("[reval] old started\n")
        protocol.atomic_write_json(d / "status.json", {"state": "running", "pid": stranger.pid, "pgid": stranger.pid,
                                                       "boot_id": "00000000-0000-0000-0000-000000000000"})
        assert protocol.run_alive(_status_of(stranger)) is True  # the group would prove itself in this boot ...
        assert protocol.run_alive(_status_of(stranger, boot_id="00000000-0000-0000-0000-000000000000")) is False
        assert run_state(t, "old").state == "lost"
        assert follow(t, "old", workdir=wd, python=sys.executable, sink=Recorder()).state == "lost"
        kill_run(t, "old", grace_s=0.5)
        assert stranger.poll() is None  # never signalled
    finally:
        stranger.kill()
        stranger.wait()


def test_a_stalled_stream_whose_ssh_is_not_reaped_in_time_is_a_dropped_connection(tmp_path):
    """A silent first connection that follow ends (stall_s) and whose process is not reaped within _stop's wait
    (returncode None) is a connection that dropped: follow reconnects and, the host staying silent, gives up
    with exit 4 and the re-attach command — never "cannot follow NAME: exit None" (exit 1)."""
    import subprocess
    from types import SimpleNamespace

    from orchestrator.errors import HostUnreachable

    started: list[subprocess.Popen] = []

    class Unreaped(subprocess.Popen):
        def communicate(self, input=None, timeout=None):  # the ssh outlives _stop's wait
            raise subprocess.TimeoutExpired(self.args, timeout)

    class Silent:
        host = SimpleNamespace(name="h1")

        def popen(self, cmd):
            p = Unreaped(["sleep", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            started.append(p)
            return p

        def connection_error(self, returncode, stderr):
            return None

    rec = Recorder()
    try:
        with pytest.raises(HostUnreachable) as e:
            follow(Silent(), "quiet", workdir=str(tmp_path), python=sys.executable, sink=rec, stall_s=0.2,
                   give_up_s=0.5, max_backoff_s=0.1, save=False)
    finally:
        for p in started:  # ours, by pid: killed by follow, reaped here
            p.kill()
            p.wait()
    assert e.value.exit_code == 4 and "reval logs quiet -f --host h1" in e.value.hint
    assert len(started) >= 2 and any("reconnecting" in n for n in rec.notes), rec.notes
