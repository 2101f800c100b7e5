"""`reval run / logs / status / ls / pull / kill` through the CLI runner (reval.cli.main): the local
host end to end with the dummy payload (a seam standing in for the eval), a real eval when the fixture
builder is there, and the same commands over a real sshd."""
from __future__ import annotations

import json
import subprocess

import pytest

from remote_payload.contract import protocol
from reval import cli
from reval.cli.commands import run as run_cmd
from reval.cli.commands import runs as runs_cmd
from tests.runtools import group_members, reval, wait_lines

FAST = ["--", "--lines", "5", "--interval-s", "0"]


def test_run_local_end_to_end(here, capsys):
    rc, out, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "e2e", *FAST)
    assert rc == 0, err
    assert "sync    payload:" in out and "launch  e2e on local · CPU (no GPU on this host)" in out
    assert sum("[5/5] prompt5" in line for line in out.splitlines()) == 1  # the log, streamed once
    assert "done    e2e succeeded" in out and "position-1 accuracy" in out
    assert "tau 4.00 [2.80, 5.20] · streak 3.00" in out  # the interval: a seeded bootstrap over the 5 prompts
    pulled = here / "runs" / "local" / "e2e"
    assert protocol.read_json(pulled / "status.json")["state"] == "succeeded"
    assert (pulled / "eval.log").read_bytes() == (here / ".reval/local/runs/e2e/eval.log").read_bytes()
    assert json.loads((pulled / "results.json").read_text())["run"] == "e2e"
    rc, out, _ = reval(capsys, "status", "e2e")
    assert rc == 0 and "e2e on local: succeeded" in out
    rc, out, _ = reval(capsys, "ls")
    assert rc == 0 and "e2e" in out and "succeeded" in out
    rc, out, _ = reval(capsys, "logs", "local/e2e")
    assert rc == 0 and out.splitlines()[-1].startswith("[reval] succeeded")
    rc, out, _ = reval(capsys, "status")  # every run known here, refreshed from its host
    assert rc == 0 and "local" in out and "e2e" in out and "succeeded" in out
    (pulled / "eval.log").write_text("damaged\n")
    rc, out, _ = reval(capsys, "pull", "e2e")
    assert rc == 0 and "pulled  local/e2e (succeeded)" in out
    assert (pulled / "eval.log").read_bytes() == (here / ".reval/local/runs/e2e/eval.log").read_bytes()
    assert (pulled / ".follow.json").exists()  # the follow offset survives a re-pull


def test_crashing_payload_fails_with_log_tail_and_nothing_marked_success(here, capsys):
    rc, out, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "boom", "--", "--lines", "6",
                         "--interval-s", "0", "--crash")
    assert rc == 1
    assert "failed  boom on local (exit 1: RuntimeError: dummy crash at prompt 4 of 6)" in err
    assert "last lines of eval.log" in err
    assert "RuntimeError: dummy crash at prompt 4 of 6" in err
    pulled = here / "runs" / "local" / "boom"
    st = protocol.read_json(pulled / "status.json")
    assert (st["state"], st["exit_code"]) == ("failed", 1)
    assert not (pulled / "results.json").exists() and "done" not in out
    rc, out, _ = reval(capsys, "status", "local/boom")
    assert rc == 1 and "failed" in out and "exit 1" in out
    # the payload's "bad input" (exit 3: a missing key, a wrong path) is reval's bad input too
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "badin", "--", "--lines", "1",
                       "--interval-s", "0", "--exit-code", "3")
    assert rc == 3 and "failed  badin on local (exit 3)" in err


def test_detach_kill_group_gone_then_logs_f_cancelled(here, capsys):
    rc, out, _ = reval(capsys, "run", "local", "--payload", "dummy", "--name", "k1", "--detach", "--",
                       "--lines", "1000", "--interval-s", "0.05")
    assert rc == 101
    assert "detached: k1 keeps running on local. Re-attach: reval logs k1 -f" in out
    run_dir = here / ".reval/local/runs/k1"
    wait_lines(run_dir / "eval.log", 6)
    pgid = protocol.read_json(run_dir / "status.json")["pgid"]
    assert len(group_members(pgid)) == 2  # the wrapper and the payload
    rc, out, _ = reval(capsys, "status", "k1")
    # with the latest progress, e.g. "eval 7/1000"
    assert rc == 101 and "k1 on local: running" in out and "eval " in out
    rc, out, _ = reval(capsys, "kill", "k1")
    assert rc == 0 and "cancelled k1" in out
    assert group_members(pgid) == []
    assert protocol.read_json(run_dir / "status.json")["state"] == "cancelled"
    rc, out, _ = reval(capsys, "status", "k1")
    assert rc == 103 and "k1 on local: cancelled" in out
    rc, out, _ = reval(capsys, "logs", "k1", "-f")
    assert rc == 103 and "cancelled k1" in out
    rc, out, _ = reval(capsys, "kill", "k1")
    assert rc == 0 and "already ended: cancelled" in out


def test_kill_with_a_damaged_status_signals_nothing_and_says_so(here, capsys):
    rc, _, _ = reval(capsys, "run", "local", "--payload", "dummy", "--name", "dmgk", "--detach", "--",
                     "--lines", "100000", "--interval-s", "0.05")
    assert rc == 101
    run_dir = here / ".reval/local/runs/dmgk"
    wait_lines(run_dir / "eval.log", 3)
    good = (run_dir / "status.json").read_text()
    pgid = json.loads(good)["pgid"]
    (run_dir / "status.json").write_text('{"state": "running", "pgid": ')  # cut off mid-write
    try:
        rc, out, err = reval(capsys, "kill", "dmgk")
        assert rc == 3 and "already ended" not in out
        assert err.splitlines()[0] == "error: local: run 'dmgk' has no readable status.json; nothing was signalled"
        assert "Traceback" not in err and len(group_members(pgid)) == 2  # still running: nothing was signalled
    finally:  # the run is this test's: restored, then killed through reval
        (run_dir / "status.json").write_text(good)
        rc, out, _ = reval(capsys, "kill", "dmgk")
    assert rc == 0 and group_members(pgid) == []


def test_ctrl_c_detaches_and_logs_f_resumes_exactly(here, capsys, monkeypatch):
    class InterruptAfter(runs_cmd.PlainSink):
        def __init__(self, n):
            super().__init__()
            self.n = n

        def line(self, text):
            super().line(text)
            self.n -= 1
            if self.n == 0:
                raise KeyboardInterrupt

    monkeypatch.setattr(run_cmd, "make_sink", lambda: InterruptAfter(4))
    rc, out1, _ = reval(capsys, "run", "local", "--payload", "dummy", "--name", "cc", "--", "--lines", "40",
                        "--interval-s", "0.02")
    assert rc == 101 and out1.splitlines()[-1] == "detached: cc keeps running on local. Re-attach: reval logs cc -f"
    monkeypatch.setattr(runs_cmd, "make_sink", runs_cmd.PlainSink)
    rc, out2, _ = reval(capsys, "logs", "cc", "-f")
    assert rc == 0
    shown = [line for line in out1.splitlines() if not line.startswith(("sync ", "launch ", "detached:"))]
    shown += out2.splitlines()[:-2]  # minus the done/summary lines
    assert shown == (here / ".reval/local/runs/cc/eval.log").read_text().splitlines()


def test_lost_run_is_reported_lost_never_success(here, capsys):
    assert reval(capsys, "run", "local", "--payload", "dummy", "--name", "first", *FAST)[0] == 0  # payload synced
    d = here / ".reval/local/runs/ghost"
    d.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    protocol.atomic_write_json(d / "status.json", {"state": "running", "pid": dead.pid, "pgid": dead.pid,
                                                   "started_at": protocol.now_iso()})
    (d / "eval.log").write_text("[reval] ghost started\nloading...\n")
    rc, out, _ = reval(capsys, "status", "local/ghost")
    assert rc == 1 and "ghost on local: lost" in out
    rc, out, err = reval(capsys, "logs", "local/ghost", "-f")
    assert rc == 1 and "lost    ghost" in err and "done" not in out
    rc, out, _ = reval(capsys, "ls", "local")
    assert "lost" in out


def test_not_found_hostile_and_ambiguous_names(here, capsys):
    for argv in (["status", "nope"], ["logs", "local/nope"], ["kill", "local/nope"], ["pull", "local/nope"]):
        rc, _, err = reval(capsys, *argv)
        assert rc == 102, (argv, err)
    for bad in ("../x", "a;b", "$(touch PWN)", "a b"):
        rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", bad)
        assert rc == 3 and "invalid run name" in err
        rc, _, err = reval(capsys, "status", f"local/{bad}")
        assert rc == 3
    assert not (here / ".reval").exists() and not list(here.rglob("PWN"))
    rc, _, _ = reval(capsys, "run", "local", "--payload", "dummy", "--name", "fine", *FAST)
    assert rc == 0
    # a directory on the server that reval did not make (a hostile name) is not a run: ls/pull skip it
    (here / ".reval/local/runs/x;$(touch PWN) ..").mkdir()
    rc, out, _ = reval(capsys, "ls", "local")
    assert rc == 0 and "fine" in out and "PWN" not in out
    rc, out, _ = reval(capsys, "pull", "--all")
    assert rc == 0 and "pulled  local/fine" in out and "PWN" not in out
    assert sorted(p.name for p in (here / "runs/local").iterdir()) == ["fine"] and not list(here.rglob("PWN"))
    (here / "hosts.yaml").write_text("hosts:\n  a: {local: true, workdir: wa, python: current, venv: {mode: python}}\n"
                                     "  b: {local: true, workdir: wb, python: current, venv: {mode: python}}\n")
    for h in ("a", "b"):
        rc, _, err = reval(capsys, "run", h, "--payload", "dummy", "--name", "same", *FAST)
        assert rc == 0, err
    rc, _, err = reval(capsys, "status", "same")
    assert rc == 3 and "exists on several hosts: a, b" in err and "a/same" in err
    rc, out, _ = reval(capsys, "status", "b/same")
    assert rc == 0 and "same on b: succeeded" in out


def test_status_help_names_exit_codes_and_what_no_run_lists(capsys):
    with pytest.raises(SystemExit):
        cli.main(["status", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("0 succeeded, 101 running, 1 failed, lost or unknown (no readable status.json), 103 cancelled, "
            "102 no such run, 4 host unreachable or no-answer (its scheduler cannot answer now") in text
    assert "runs no longer on their host are left out" in text


def test_logs_fails_when_eval_log_cannot_be_read(here, capsys):
    d = here / ".reval/local/runs/broken"
    (d / "eval.log").mkdir(parents=True)  # no log, whatever is there: refused before any read (cat failed on it)
    protocol.atomic_write_json(d / "status.json", {"state": "failed", "exit_code": 1})
    rc, out, err = reval(capsys, "logs", "local/broken")
    assert rc == 3 and f"{d / 'eval.log'} is not a regular file: refused" in err and out == ""
    (d / "eval.log").rmdir()  # no log at all yet: nothing to show, not an error
    rc, out, err = reval(capsys, "logs", "local/broken")
    assert rc == 0 and out == ""


def test_unknown_options_and_missing_paths_are_bad_input(here, capsys):
    rc, _, err = reval(capsys, "run", "local", "--drafter", "/d")
    assert rc == 3 and "missing --target, --cache" in err
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--bogus")
    assert rc == 3 and "unrecognized arguments: --bogus" in err
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--gpus", "0;reboot")
    assert rc == 3
    assert not (here / ".reval" / "local" / "runs").exists() or not list((here / ".reval/local/runs").iterdir())


@pytest.mark.slow
def test_real_eval_through_the_same_path(here, capsys, random_eval_inputs):
    """`python -m remote_payload eval` (the real payload) through run -> launch -> follow -> pull."""
    d = random_eval_inputs
    rc, out, err = reval(capsys, "run", "local", "--drafter", str(d / "drafter"), "--target", str(d / "target"),
                         "--cache", str(d / "cache"), "--num-prompts", "2", "--max-blocks", "3", "--name", "real",
                         "--", "--device", "cpu", "--dtype", "fp32")
    assert rc == 0, err + out
    assert "done    real succeeded" in out and "tau " in out and "position-1 accuracy" in out
    assert "[2/2]" in out  # the payload's own progress lines came through the live follow
    pulled = here / "runs/local/real"
    res = json.loads((pulled / "results.json").read_text())
    assert res["schema"] == protocol.RESULTS_SCHEMA and res["run"] == "real"
    assert res["metrics"]["num_prompts"] == 2 and 1.0 <= res["metrics"]["tau"] <= 16.0
    assert any(e.get("stage") == "done" for e in protocol.read_events(pulled / "events.jsonl"))
    assert protocol.read_json(pulled / "status.json")["state"] == "succeeded"
    assert (pulled / "eval.log").read_bytes() == (here / ".reval/local/runs/real/eval.log").read_bytes()


@pytest.mark.ssh
def test_run_kill_ls_pull_over_ssh(ssh_hosts, here, capsys):
    c = ssh_hosts(2)
    inv = str(c.inventory_path)
    rc, out, err = reval(capsys, "-i", inv, "run", "ssh1", "--payload", "dummy", "--name", "r1", *FAST)
    assert rc == 0, err
    assert "done    r1 succeeded" in out
    assert (here / "runs/ssh1/r1/eval.log").read_bytes() == (c.hosts[0].workdir / "runs/r1/eval.log").read_bytes()
    rc, out, _ = reval(capsys, "-i", inv, "run", "ssh2", "--payload", "dummy", "--name", "r2", "--detach", "--",
                       "--lines", "1000", "--interval-s", "0.05")
    assert rc == 101
    wait_lines(c.hosts[1].workdir / "runs/r2/eval.log", 5)
    pgid = protocol.read_json(c.hosts[1].workdir / "runs/r2/status.json")["pgid"]
    rc, out, _ = reval(capsys, "-i", inv, "kill", "r2")  # found by searching the hosts
    assert rc == 0 and group_members(pgid) == []
    c.stop(0)  # ssh1 down: ls reports it and still lists ssh2
    rc, out, _ = reval(capsys, "-i", inv, "ls")
    assert rc == 2 and "unreachable" in out and "r2" in out and "cancelled" in out
    rc, out, err = reval(capsys, "-i", inv, "pull", "--all")
    assert rc == 2 and "pulled  ssh2/r2 (cancelled)" in out and "failed  ssh1" in err
    assert protocol.read_json(here / "runs/ssh2/r2/status.json")["state"] == "cancelled"


@pytest.mark.ssh
def test_host_down_is_exit_4_for_pull_logs_status(ssh_hosts, here, capsys):
    """ssh's own failure (exit 255) on the streamed commands (pull's tar, logs' cat) is `unreachable`,
    not a failed remote command."""
    c = ssh_hosts(1)
    c.stop(0)
    for argv in (["pull", "ssh1/r1"], ["logs", "ssh1/r1"], ["status", "ssh1/r1"]):
        rc, _, err = reval(capsys, "-i", str(c.inventory_path), *argv)
        assert rc == 4 and "ssh1: unreachable" in err, (argv, err)
