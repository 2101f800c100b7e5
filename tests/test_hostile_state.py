"""Every local and remote state file is untrusted input: damaged status.json / run.json / .follow.json /
events.jsonl / ledger, a `runs` that is a file, a reader that goes away (`| head -2`), a SIGKILLed
controller's socket folder. Each gives one clear line and a documented exit code: never a traceback, never
a hang. Real runs on the local host (the dummy payload stands in for the eval), real processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.hosts import transport
from remote_payload.contract import protocol
from tests.runtools import reval

REPO = Path(__file__).resolve().parents[1]
FAST = ["--", "--lines", "3", "--interval-s", "0"]
DOCUMENTED = {0, 1, 2, 3, 4, 101, 102, 103}


def reval_proc(cwd: Path, *argv, timeout: float = 120, shell_tail: str = "") -> subprocess.CompletedProcess:
    """`reval ARGV` as the user runs it: its own process (a hang is a timeout here, not a stuck test)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("REVAL_HOSTS", None)
    env.pop("REVAL_RUNS_DIR", None)
    cmd = [sys.executable, "-m", "reval", *argv]
    if shell_tail:
        import shlex
        return subprocess.run(["bash", "-o", "pipefail", "-c", shlex.join(cmd) + " " + shell_tail], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def assert_one_line_error(rc, err: str, out: str = "", *, allowed=DOCUMENTED) -> None:
    """A documented exit code, no traceback (no exception name), and a non-zero exit says why."""
    assert rc in allowed, (rc, err)
    assert "Traceback" not in err and "Error:" not in err.replace("error:", ""), err
    if rc != 0:
        assert err.strip() or out.strip(), rc


# --- damaged status.json: every command ------------------------------------------------------------------
STATUS_DAMAGE = {
    "garbage": b"{not json",
    "empty": b"",
    "list": b"[1, 2, 3]",
    "number": b"7",
    "not utf-8": b'{"state": "succ\xe9eded"}',
    "no state": b'{"pid": 1, "pgid": 1}',
    "bad types": json.dumps({"state": "succeeded", "pgid": "x", "exit_code": [1], "gpus": 5,
                             "started_at": {"a": 1}, "finished_at": 3}).encode(),
    "unknown state": b'{"state": "exploded"}',
    "one line": json.dumps({"state": "succeeded", "exit_code": 0, "started_at": "2026-01-01T00:00:00Z",
                            "finished_at": "2026-01-01T00:00:09Z"}).encode(),
}


@pytest.fixture
def finished(here, capsys):
    """A finished run `fin` on the local host (payload synced), and its remote and local folders."""
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "fin", *FAST)
    assert rc == 0, err
    return here / ".reval/local/runs/fin", here / "runs/local/fin"


@pytest.mark.parametrize("damage", list(STATUS_DAMAGE))
def test_every_command_with_a_damaged_status_json_is_one_line(finished, capsys, damage):
    remote, _ = finished
    (remote / "status.json").write_bytes(STATUS_DAMAGE[damage])
    for argv in (["status", "fin"], ["status"], ["ls"], ["ls", "local"], ["logs", "fin"], ["pull", "fin"],
                 ["pull", "--all"], ["kill", "fin", "--grace-s", "0"], ["compare", "local/fin"],
                 ["ls", "--json"], ["status", "fin", "--json"], ["status", "--json"], ["logs", "fin", "--json"],
                 ["logs", "fin", "--tail", "2"], ["prune", "--older-than", "9999d", "--yes"],
                 ["rm", "fin", "--local-only", "--yes"]):
        rc, out, err = reval(capsys, *argv)
        assert_one_line_error(rc, err, out)
    (remote / "status.json").write_bytes(STATUS_DAMAGE[damage])  # pull copied it; kill may not rewrite it
    rc, out, err = reval(capsys, "status", "fin")
    if damage in ("one line", "bad types"):  # a valid state; the fields of the wrong type are left out
        assert rc == 0 and out.startswith("fin on local: succeeded") and "None" not in out
    else:
        assert rc == 1 and "unknown" in out, (out, err)


@pytest.mark.parametrize("damage", ["garbage", "list", "no state", "unknown state"])
def test_logs_f_on_a_finished_run_with_a_damaged_status_json_ends_with_one_line(finished, damage):
    remote, local = finished
    (remote / "status.json").write_bytes(STATUS_DAMAGE[damage])
    (local / ".follow.json").unlink()
    p = reval_proc(remote.parents[3], "logs", "fin", "-f", timeout=120)  # it used to wait forever
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "status.json is damaged" in p.stderr and "Traceback" not in p.stderr
    assert "[3/3] prompt3" in p.stdout  # the log was shown before it said so


# --- damaged local state -----------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"[1, 2]", b"garbage", b'{"log_offset": "abc"}', b'{"log_offset": -5}',
                                     b'{"python": 7, "log_offset": 1e99}'])
def test_a_damaged_follow_json_is_no_follow_state(finished, capsys, content):
    _, local = finished
    (local / ".follow.json").write_bytes(content)
    rc, out, err = reval(capsys, "logs", "fin", "-f")
    assert rc == 0 and "done    fin succeeded" in out, err
    assert "[1/3] prompt1" in out  # no usable offset: the log from its start (twice rather than lost)
    rc, out, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "fin2", *FAST)
    assert rc == 0, err


@pytest.mark.parametrize("damage", [b"garbage", b"[]", b'{"argv": 5}'])
def test_a_damaged_local_copy_is_one_line_in_compare_and_status(finished, capsys, damage):
    _, local = finished
    for f in ("status.json", "run.json", "results.json", "events.jsonl"):
        (local / f).write_bytes(damage)
        rc, out, err = reval(capsys, "compare", "local/fin")
        assert_one_line_error(rc, err, out)
        rc, out, err = reval(capsys, "status")
        assert_one_line_error(rc, err, out)
    for f in ("status.json", "run.json", "results.json", "events.jsonl"):
        (local / f).unlink()  # damaged on purpose; the session's results.json check is for real outputs


def test_runs_that_is_a_file_is_refused_before_launching(here, capsys):
    (here / "runs").write_text("not a folder\n")
    rc, out, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "r1", *FAST)
    assert rc == 3 and "cannot keep local run copies in runs/: it is not a folder" in err, err
    assert "launch" not in out and not (here / ".reval/local/runs/r1").exists()  # nothing started, nothing left
    (here / "runs").unlink()
    (here / "runs").mkdir()
    (here / "runs/local").write_text("")
    rc, out, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "r1", *FAST)
    assert rc == 3 and "runs/local/: it is not a folder" in err


# --- a reader that goes away ---------------------------------------------------------------------------
def test_run_piped_into_head_is_still_followed_and_pulled(here):
    p = reval_proc(here, "run", "local", "--payload", "dummy", "--name", "piped", "--", "--lines", "30",
                   "--interval-s", "0.01", shell_tail="| head -2", timeout=180)
    assert p.returncode == 0, p.stderr  # head's status (pipefail: reval's too)
    assert len(p.stdout.splitlines()) == 2 and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr
    pulled = here / "runs/local/piped"
    assert json.loads((pulled / "results.json").read_text())["run"] == "piped"
    assert protocol.read_json(pulled / "status.json")["state"] == "succeeded"
    p = reval_proc(here, "ls", shell_tail="| head -1")
    assert p.returncode == 0 and "Traceback" not in p.stderr


# --- a SIGKILLed controller's socket folder ----------------------------------------------------------------
def test_empty_control_folders_of_dead_controllers_are_removed(tmp_path, monkeypatch):
    root = tmp_path / "cm"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "REVAL_CONTROL_ROOT": str(root)}
    code = ("import os, signal; from orchestrator.hosts import transport; transport._control_dir(); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60, check=False)
    assert p.returncode == -signal.SIGKILL
    left = os.listdir(root)
    assert len(left) == 1 and left[0].startswith("reval-cm-") and not os.listdir(root / left[0])  # SIGKILL's
    gone = subprocess.Popen(["true"])
    gone.wait()
    busy = root / f"reval-cm-{gone.pid}-busy"
    busy.mkdir()
    (busy / "0123456789abcdef").write_text("")                   # a master may still use it: kept
    alive = subprocess.Popen(["sleep", "60"])
    try:
        (root / f"reval-cm-{alive.pid}-keep").mkdir()          # its controller still runs: kept
        monkeypatch.setattr(transport, "_CONTROL_DIR", None)
        monkeypatch.setenv("REVAL_CONTROL_ROOT", str(root))
        mine = transport._control_dir()
        after = sorted(os.listdir(root))
        assert after == sorted([busy.name, f"reval-cm-{alive.pid}-keep", os.path.basename(mine)])
        assert os.path.basename(mine).startswith(f"reval-cm-{os.getpid()}-")
    finally:
        alive.kill()
        alive.wait()
        transport.close_all()
        monkeypatch.setattr(transport, "_CONTROL_DIR", None)


@pytest.mark.parametrize("damage", [b"{broken", b"[1]", b'{"entries": [1]}', b'{"entries": {"k": 5}}',
                                    b'{"entries": {"k": {"name": "x"}}}', b'{"entries": {}, "hashes": 3}'])
def test_a_damaged_sweep_ledger_is_one_line(here, capsys, damage):
    (here / "ck" / "step-1").mkdir(parents=True)
    (here / "ck" / "step-1" / "model.safetensors").write_bytes(b"weights")
    (here / "sweeps").mkdir()
    (here / "sweeps" / "ledger.json").write_bytes(damage)
    rc, out, err = reval(capsys, "sweep", "--checkpoints", str(here / "ck" / "step-*"), "--hosts", "local",
                         "--payload", "dummy", "--", "--lines", "1", "--interval-s", "0")
    assert_one_line_error(rc, err, out)
    if damage != b'{"entries": {}, "hashes": 3}':  # a damaged hash cache is only a cache: hashed again
        assert rc == 3 and "ledger" in err and "move it away" in err, err
        assert (here / "sweeps" / "ledger.json").read_bytes() == damage  # refused: never overwritten
