"""`no-answer`: a Slurm run whose scheduler cannot answer now (slurmctld unreachable) has its own state word,
apart from `unknown` (the run's own status.json missing or damaged), at the seams (no Slurm): the Slurm
backend's state when scontrol cannot answer; `reval status RUN` exits 4 for it (ask again) and 1 for
`unknown`; `ls` puts Slurm's why in the cause column (exit 2); a wait asks again and says so instead of ending
on it; `unknown` is an end as far as waiting goes (`reval rm` takes it).
The sweep's side (said once, nothing in the ledger until Slurm answers) is test_slurm_trust.py's outage test.
"""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from orchestrator import cli
from orchestrator.runs import NO_ANSWER, UNKNOWN, RunState

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
    return {"STATUS": status, "JOB": {"job_id": job}, "EVENT": {}, "SUM": "", "NOW": None}


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
    from orchestrator import lifecycle
    from orchestrator.events import EventSink, Note
    from orchestrator.follow import FollowResult
    from orchestrator.pull import PullResult
    answers = [RunState("hpc", "r", NO_ANSWER, {"job_id": "5"}, reason=f"Slurm cannot answer: {WHY}")] * 3 + [
        RunState("hpc", "r", "succeeded", {"state": "succeeded", "exit_code": 0, "slurm_state": "COMPLETED"})]
    asked: list[float] = []

    def state(name, wait_s=0.0):
        asked.append(time.monotonic())
        return answers[min(len(asked), len(answers)) - 1]
    be = SimpleNamespace(host=SimpleNamespace(name="hpc", python="python3"), queues=True, state=state)
    monkeypatch.setattr(lifecycle, "NO_ANSWER_POLL_S", 0.01, raising=False)
    run = lifecycle.Run(be, "r")
    monkeypatch.setattr(run, "follow", lambda sink, **kw: FollowResult("succeeded", {"state": "succeeded"}))
    monkeypatch.setattr(run, "pull", lambda finished=False: PullResult(here / "runs/hpc/r"))
    notes: list[str] = []
    fin = run.wait(EventSink(lambda ev: notes.append(ev.text) if isinstance(ev, Note) else None))
    assert (fin.state, fin.status.get("slurm_state")) == ("succeeded", "COMPLETED") and len(asked) == 4
    said = f"waiting r on hpc: Slurm cannot answer: {WHY}; its end is known once it answers (asked every 0.01 s)"
    assert notes == [said, "answer  r on hpc is succeeded"], notes
