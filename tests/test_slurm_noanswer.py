"""`no-answer`: a Slurm run whose scheduler cannot answer now (slurmctld unreachable) has its own state word,
apart from `unknown` (the run's own status.json missing or damaged):

- at the seams (no Slurm): the Slurm backend's state when scontrol cannot answer; `reval status RUN` exits 4
  for it (ask again) and 1 for `unknown`; `ls` puts Slurm's why in the cause column (exit 2); a wait asks
  again and says so instead of ending on it; the stream of a followed job says when the scheduler stops
  answering and when it answers again; `unknown` is an end as far as waiting goes (`reval rm` takes it);
- on the real single-node Slurm (tests/slurm.py) with slurmctld stopped while a followed run ends under
  slurmd: status / --json / ls / kill / rm say `no-answer` (kill and rm touch nothing), the follow says so and
  waits, and ends `succeeded` once slurmctld is back.
The sweep's side (said once, nothing in the ledger until Slurm answers) is test_slurm_trust.py's outage test.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.rundir.registry import NO_ANSWER, UNKNOWN, RunState
from remote_payload.contract import protocol
from reval import cli

WHY = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"


# --- at the seams --------------------------------------------------------------------------------------------
def _slurm_backend(runs: dict, jobs: dict, unanswered: dict):
    """A SlurmBackend whose two round trips (the run files, Slurm's word) are given."""
    from orchestrator.backends.slurm import SlurmBackend
    be = object.__new__(SlurmBackend)
    be.host = SimpleNamespace(name="hpc")
    be._read_runs = lambda names: {n: r for n, r in runs.items() if names is None or n in names}
    be._query_jobs = lambda ids: (jobs, {j: w for j, w in unanswered.items() if j in ids})
    be._record = lambda fixes: None
    return be


def _files(status: dict, job: str) -> dict:
    return {"STATUS": status, "JOB": {"job_id": job}, "EVENT": {}, "SUM": "", "NOW": None, "KIND": "eval"}


def test_slurm_that_cannot_answer_is_no_answer_and_a_damaged_status_json_is_unknown():
    from orchestrator.backends.ssh import state_from_probe
    be = _slurm_backend({"a": _files({"state": "running", "pgid": 7}, "5"),
                         "b": _files({"state": "succeeded", "exit_code": 0}, "6"),  # its own end: not proven
                         "c": _files({"state": "succeeded", "exit_code": 0, "slurm_state": "COMPLETED"}, "7")},
                        {}, {"5": WHY, "6": WHY})
    a, b, c = sorted(be.states(None), key=lambda s: s.name)
    for s in (a, b):
        assert (s.state, s.reason, s.terminal) == (NO_ANSWER, f"Slurm cannot answer: {WHY}", False)
        assert s.to_json()["state"] == "no-answer" and s.to_json()["reason"] == f"Slurm cannot answer: {WHY}"
    assert (c.state, c.terminal) == ("succeeded", True)  # Slurm's word already recorded: nothing to ask
    d = state_from_probe({"name": "d", "alive": False, "status": None}, "h")
    assert (d.state, d.terminal) == (UNKNOWN, True)  # nothing will tell: no wait, no sweep hangs on it
    # kill while Slurm cannot answer: nothing cancelled, and not said to be (exit 4)
    from orchestrator.errors import HostUnreachable
    with pytest.raises(HostUnreachable, match="Slurm cannot answer: .*nothing was cancelled") as e:
        be.cancel("a", known=a)
    assert e.value.exit_code == 4


def _cli(monkeypatch, capsys, state: RunState, *argv: str) -> tuple[int, str, str]:
    import reval
    monkeypatch.setattr(reval, "find", lambda run, host=None, inventory=None: SimpleNamespace(
        name=state.name, host=state.host, status=lambda: state))
    monkeypatch.setattr(reval, "ls", lambda target=None, here=False, inventory=None: reval.Listing([state], {}))
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_status_exit_codes_and_ls_tell_no_answer_from_unknown(here, monkeypatch, capsys):
    na = RunState("hpc", "a", NO_ANSWER, {"job_id": "5", "started_at": "2026-01-01T00:00:00Z"},
                  reason=f"Slurm cannot answer: {WHY}")
    rc, out, _ = _cli(monkeypatch, capsys, na, "status", "hpc/a")
    assert rc == 4 and out.startswith(f"a on hpc: no-answer (Slurm cannot answer: {WHY})"), out
    rc, out, _ = _cli(monkeypatch, capsys, na, "status", "hpc/a", "--json")
    assert rc == 4 and json.loads(out)["state"] == "no-answer", out
    rc, out, _ = _cli(monkeypatch, capsys, na, "ls", "--json")
    assert rc == 2 and json.loads(out)[0]["state"] == "no-answer", out
    rc, out, _ = _cli(monkeypatch, capsys, na, "ls")
    row = next(ln for ln in out.splitlines() if ln.startswith("hpc"))
    assert rc == 2 and row.split()[2] == "no-answer" and "Slurm cannot answer" in row, out
    unk = RunState("local", "d", UNKNOWN, {})
    rc, out, _ = _cli(monkeypatch, capsys, unk, "status", "local/d")
    assert rc == 1 and out.startswith("d on local: unknown"), out
    rc, out, _ = _cli(monkeypatch, capsys, unk, "ls")
    assert rc == 0 and "unknown" in out, out


def test_a_wait_asks_again_while_slurm_cannot_answer_and_says_so(here, monkeypatch):
    """The follow is over (the job's stream ended) but the probe after it finds slurmctld gone: the wait asks
    again (not `failed`, not `no-answer` as an end), says so once, and ends with Slurm's answer."""
    from orchestrator.rundir.events import EventSink, Note
    from orchestrator.rundir.follow import FollowResult
    from orchestrator.rundir.pull import Pulled
    from orchestrator.runs import lifecycle
    answers = [RunState("hpc", "r", NO_ANSWER, {"job_id": "5"}, reason=f"Slurm cannot answer: {WHY}")] * 3 + [
        RunState("hpc", "r", "succeeded", {"state": "succeeded", "exit_code": 0, "slurm_state": "COMPLETED"})]
    asked: list[float] = []

    def state(name, wait_s=0.0):
        asked.append(time.monotonic())
        return answers[min(len(asked), len(answers)) - 1]
    be = SimpleNamespace(host=SimpleNamespace(name="hpc", python="python3"), queues=True, state=state)
    monkeypatch.setattr(lifecycle, "NO_ANSWER_POLL_S", 0.01, raising=False)
    run = lifecycle.RunHandle(be, "r")
    monkeypatch.setattr(run, "follow", lambda sink, **kw: FollowResult("succeeded", {"state": "succeeded"}))
    monkeypatch.setattr(run, "pull", lambda finished=False: Pulled(here / "runs/hpc/r"))
    notes: list[str] = []
    fin = run.wait(EventSink(lambda ev: notes.append(ev.text) if isinstance(ev, Note) else None))
    assert (fin.state, fin.status.get("slurm_state")) == ("succeeded", "COMPLETED") and len(asked) == 4
    said = f"waiting r on hpc: Slurm cannot answer: {WHY}; its end is known once it answers (asked every 0.01 s)"
    assert notes == [said, "answer  r on hpc is succeeded"], notes


def test_the_stream_says_when_the_scheduler_stops_answering_and_answers_again(tmp_path):
    """--alive-cmd exits 2 (Slurm cannot say): the stream follows on (no end), with one N frame saying so, and
    another when the probe answers again; its end comes from the answer."""
    import select

    from orchestrator.rundir.follow import FrameParser
    d = tmp_path / "run"
    d.mkdir()
    (d / "status.json").write_text('{"state": "succeeded", "exit_code": 0}')  # the run's own word: not proof
    (d / "eval.log").write_text("done\n")
    answer = tmp_path / "answer"
    answer.write_text("0")
    p = subprocess.Popen([sys.executable, "-m", "remote_payload", "stream", "--run-dir", str(d),
                          "--alive-cmd", f"exit $(cat {answer})", "--alive-every-s", "0.05"],
                         stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
    parser, frames = FrameParser(), []
    try:
        def read_until(pred, timeout_s: float = 20):
            deadline = time.monotonic() + timeout_s
            while not pred():
                assert time.monotonic() < deadline, f"not in the stream within {timeout_s} s: {frames}"
                ready, _, _ = select.select([p.stdout], [], [], 60)
                assert ready, "the stream went silent (no heartbeat)"
                chunk = os.read(p.stdout.fileno(), 65536)
                assert chunk, f"the stream ended early: {frames}"
                frames.extend((f.tag, f.data) for f in parser.feed(chunk))
        read_until(lambda: ("L", b"done\n") in frames)
        answer.write_text("2")
        read_until(lambda: any(t == "N" for t, _ in frames))
        notes = [x.decode() for t, x in frames if t == "N"]
        said = ("the scheduler cannot answer now (its job probe: exit 2): still following; the run's end is known "
                "once it answers")
        assert notes == [said], frames
        time.sleep(0.3)
        read_until(lambda: frames[-1][0] == "H")
        assert not any(t == "D" for t, _ in frames) and p.poll() is None  # no answer is no end
        answer.write_text("1")
        read_until(lambda: frames[-1][0] == "D")
        assert [x.decode() for t, x in frames if t == "N"][1:] == ["the scheduler answers again"], frames
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# --- on the real Slurm -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hpc(tmp_path_factory):
    from tests import slurm as slurm_mod
    with slurm_mod.cluster_here(tmp_path_factory.mktemp("noanswer")) as c:
        yield c


def _wait(what: str, ready, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _clis(c, *argvs: list[str]) -> list[subprocess.CompletedProcess]:
    """`reval -i INV ARGV` for each argv, all at once, each in its own process: while slurmctld is gone every
    question to Slurm takes its seconds of retries, so they share that wait instead of adding theirs up."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("REVAL_HOSTS", None)
    env.pop("REVAL_RUNS_DIR", None)
    procs = [subprocess.Popen([sys.executable, "-m", "reval", "-i", c.inv, *argv], cwd=c.here, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in argvs]
    done = []
    for argv, p in zip(argvs, procs):
        out, err = p.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(argv, p.returncode, out, err))
    return done


@pytest.mark.slurm
@pytest.mark.ssh
def test_slurmctld_gone_is_no_answer_everywhere_and_a_follow_waits_for_it(hpc, capsys):
    """slurmctld stops while `finish` follows a run (which then ends under slurmd): status (exit 4), --json,
    ls (exit 2), kill and rm (exit 4: nothing cancelled or removed) say no-answer; the follow says the scheduler
    cannot answer and waits (its heartbeats go on: it used to take the silence for a dropped connection and
    fail); once slurmctld is back it ends `succeeded` with Slurm's COMPLETED recorded."""
    import reval
    rc = cli.main(["-i", hpc.inv, "run", "hpc", "--payload", "dummy", "--name", "na", "--detach",
                   "--", "--lines", "15", "--interval-s", "0.2"])
    assert rc == 101, capsys.readouterr()
    status_json = hpc.run_dir("na") / "status.json"

    def own_state() -> str | None:
        try:
            return protocol.read_json(status_json).get("state")
        except (OSError, ValueError):
            return None
    events: list = []
    got: list = []
    follow = threading.Thread(target=lambda: got.append(reval.find("hpc/na", inventory=hpc.inv).finish(
        on_event=events.append)))
    follow.start()
    try:
        _wait("the follow to stream", lambda: any(isinstance(e, reval.LogLine) for e in events))
        hpc.slurm.stop_controller()
        try:
            status, as_json, ls, kill, rm = _clis(hpc, ["status", "hpc/na"], ["status", "hpc/na", "--json"],
                                                  ["ls", "hpc"], ["kill", "hpc/na", "--grace-s", "0"],
                                                  ["rm", "hpc/na", "--yes"])
            assert status.returncode == 4, status
            assert status.stdout.startswith("na on hpc: no-answer (Slurm cannot answer: "), status
            st = json.loads(as_json.stdout)
            assert as_json.returncode == 4 and st["state"] == "no-answer", as_json
            assert st["reason"].startswith("Slurm cannot answer: "), as_json
            row = next(ln for ln in ls.stdout.splitlines() if " na " in ln)
            assert ls.returncode == 2 and row.split()[2] == "no-answer" and "Slurm cannot answer" in row, ls
            assert kill.returncode == 4 and "nothing was cancelled" in kill.stderr, kill
            assert "cancelled na" not in kill.stdout, kill
            assert rm.returncode == 4 and "not removed" in rm.stderr and status_json.exists(), rm
            _wait("the run to end under slurmd", lambda: own_state() == "succeeded")
            _wait("the follow to say Slurm cannot answer", lambda: any(
                isinstance(e, reval.Note) and "the scheduler cannot answer now" in e.text for e in events))
            # (the default 120 s: each of the follow's polls waits out Slurm's own timeouts against the absent
            # slurmctld, and on two busy cores 60 s was once not enough)
            assert follow.is_alive() and not got  # the run's own record says it ended: not Slurm's answer
            assert not any(isinstance(e, reval.Note) and "dropped" in e.text for e in events), events
        finally:
            hpc.slurm.start_controller()
        follow.join(timeout=180)
        assert not follow.is_alive()
    finally:
        follow.join(timeout=180)
    fin = got[0]
    assert (fin.state, fin.exit_code) == ("succeeded", 0), fin
    notes = [e.text for e in events if isinstance(e, reval.Note)]
    assert any("the scheduler answers again" in n for n in notes), notes
    assert protocol.read_json(status_json)["slurm_state"] == "COMPLETED"
    assert (Path(fin.path) / "results.json").exists()
