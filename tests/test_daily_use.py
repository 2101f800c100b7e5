"""Everyday commands through the CLI runner on the local host (real runs; the dummy payload stands in for
the eval): rm and prune, --json listings, logs --tail, suspect results visible everywhere, ls oldest first."""
from __future__ import annotations

import json

from orchestrator.rundir.registry import RunState
from orchestrator.runs.remove import select_for_prune
from remote_payload.contract import protocol
from tests.runtools import reval, wait_lines

FAST = ["--", "--lines", "3", "--interval-s", "0"]


def test_rm_removes_both_sides_asks_first_and_frees_the_name(here, capsys):
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "bad", "--", "--lines", "2",
                       "--interval-s", "0", "--crash")
    assert rc == 1
    remote, local = here / ".reval/local/runs/bad", here / "runs/local/bad"
    assert remote.is_dir() and local.is_dir()
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "bad", *FAST)
    assert rc == 3 and "already used" in err
    rc, out, err = reval(capsys, "rm", "bad")  # no terminal to ask on (the test's stdin): refused
    assert rc == 3 and "add --yes" in err and "remove  local/bad (failed): on the host and here" in out
    assert remote.is_dir() and local.is_dir()
    rc, out, err = reval(capsys, "rm", "bad", "--yes")
    assert rc == 0 and "removed 1 run(s)" in out, err
    assert not remote.exists() and not local.exists()
    rc, _, err = reval(capsys, "rm", "local/bad", "--yes")
    assert rc == 102 and "no run 'bad'" in err
    rc, out, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "bad", *FAST)  # the name is free
    assert rc == 0 and "done    bad succeeded" in out, err


def test_rm_refuses_a_running_run_and_removes_nothing(here, capsys):
    assert reval(capsys, "run", "local", "--payload", "dummy", "--name", "ok1", *FAST)[0] == 0
    rc, _, _ = reval(capsys, "run", "local", "--payload", "dummy", "--name", "busy", "--detach", "--",
                     "--lines", "1000", "--interval-s", "0.05")
    assert rc == 101
    wait_lines(here / ".reval/local/runs/busy/eval.log", 3)
    try:
        rc, out, err = reval(capsys, "rm", "ok1", "busy", "--yes")
        assert rc == 3 and "local/busy is still running: not removed" in err and "reval kill local/busy" in err
        assert (here / ".reval/local/runs/ok1").is_dir() and (here / "runs/local/ok1").is_dir()  # all or nothing
    finally:
        assert reval(capsys, "kill", "busy", "--grace-s", "2")[0] == 0
    rc, out, _ = reval(capsys, "rm", "busy", "--local-only", "--yes")
    assert rc == 0 and "local/busy (cancelled): here" in out
    assert (here / ".reval/local/runs/busy").is_dir() and not (here / "runs/local/busy").exists()


def test_prune_by_state_and_age(here, capsys):
    for name, extra in (("good", []), ("crash", ["--crash"]), ("bad2", ["--exit-code", "2"])):
        reval(capsys, "run", "local", "--payload", "dummy", "--name", name, "--", "--lines", "2",
              "--interval-s", "0", *extra)
    rc, _, err = reval(capsys, "prune")
    assert rc == 3 and "--failed and/or --older-than" in err
    rc, out, _ = reval(capsys, "prune", "local", "--failed", "--yes")
    assert rc == 0 and "removed 2 run(s)" in out
    assert sorted(p.name for p in (here / ".reval/local/runs").iterdir()) == ["good"]
    rc, out, _ = reval(capsys, "prune", "--older-than", "1d", "--yes")
    assert rc == 0 and "nothing to remove" in out
    rc, _, err = reval(capsys, "prune", "--older-than", "soon")
    assert rc == 3 and "not an age" in err


def test_select_for_prune_is_state_and_age(here):
    now = 1_800_000_000.0  # 2027-01-15T08:00:00Z by the hosts' clock, as their listing said

    def st(name, state, finished, host_now=now):
        return RunState("h", name, state, {"state": state, "finished_at": finished}, host_now=host_now)
    old, new = "2026-01-01T00:00:00Z", "2027-01-15T07:00:00Z"
    runs = [st("a", "succeeded", old), st("b", "failed", new), st("c", "lost", old), st("d", "running", old),
            st("e", "cancelled", None), st("f", "unknown", new), st("g", "queued", old),
            RunState("h", "i", "lost", {"state": "running", "finished_at": old}, alive=True, host_now=now)]
    # never a queued or live run; not one whose status.json is unreadable (it may be starting): reval rm takes it
    assert [s.name for s in select_for_prune(runs, failed=True)[0]] == ["b", "c", "e"]
    assert select_for_prune(runs, older_than_s=86400) == ([runs[0], runs[2]], [])
    assert [s.name for s in select_for_prune(runs, failed=True, older_than_s=86400)[0]] == ["c"]
    # ages by the host's own clock; a time its clock could not have written now is no age at all
    skewed = [st("behind", "succeeded", "2001-12-01T00:00:00Z", host_now=1_007_164_900.0),  # 25y behind: fresh
              st("went-back", "failed", "2027-01-15T07:00:00Z", host_now=now - 30 * 86400),
              st("unsaid", "failed", old, host_now=None),
              st("slack", "failed", "2027-01-15T08:00:30Z")]  # 30 s ahead: just ended, not a clock that went back
    picked, skipped = select_for_prune(skewed, older_than_s=86400)
    assert picked == [] and [(s.name, why.split(":")[0]) for s, why in skipped] == [
        ("behind", "it ended at 2001-12-01T00"), ("went-back", "it ended at 2027-01-15T07"),
        ("unsaid", "its host did not say what time it is")]
    assert "written by a wrong clock" in skipped[0][1] and "the host's clock went back" in skipped[1][1]
    assert select_for_prune(skewed, failed=True) == (skewed[1:], [])  # --failed alone needs no clock


def test_json_listings_and_logs_with_offsets(here, capsys):
    assert reval(capsys, "run", "local", "--payload", "dummy", "--name", "j1", *FAST)[0] == 0
    assert reval(capsys, "run", "local", "--payload", "dummy", "--name", "j0", *FAST)[0] == 0
    st = here / ".reval/local/runs/j1/status.json"  # j1 started first, whatever the clock's resolution
    protocol.atomic_write_json(st, {**protocol.read_json(st), "started_at": "2020-01-01T00:00:00Z"})
    rc, out, _ = reval(capsys, "ls", "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["name"] for r in rows] == ["j1", "j0"]  # by start time, not by name
    assert rows[0]["state"] == "succeeded" and rows[0]["suspect"] is False and rows[0]["exit_code"] == 0
    rc, out, _ = reval(capsys, "status", "j0", "--json")
    assert rc == 0 and json.loads(out)["name"] == "j0"
    rc, out, _ = reval(capsys, "status", "--json")
    assert rc == 0 and {r["name"] for r in json.loads(out)} == {"j0", "j1"}
    log = (here / ".reval/local/runs/j1/eval.log").read_bytes()
    rc, out, _ = reval(capsys, "logs", "j1", "--json")
    lines = [json.loads(x) for x in out.splitlines()]
    assert rc == 0 and len(lines) == len(log.splitlines())
    for x in lines:  # every offset points at its line in the file
        assert log[x["offset"]:].split(b"\n", 1)[0].decode() == x["line"]
    rc, out, _ = reval(capsys, "logs", "j1", "--tail", "2")
    assert rc == 0 and out.splitlines() == log.decode().splitlines()[-2:]
    rc, out, err = reval(capsys, "logs", "j1", "-f", "--tail", "2", "--json")
    followed = [json.loads(x) for x in out.splitlines()]  # stdout is JSON lines only (| jq); the end on stderr
    assert [x["line"] for x in followed] == log.decode().splitlines()[-2:] and "done    j1 succeeded" in err


def test_a_suspect_result_is_visible_everywhere(here, capsys):
    rc, out, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "sus", "--", "--lines", "2",
                         "--interval-s", "0", "--suspect")
    assert rc == 0 and "done    sus succeeded (SUSPECT result)" in out and "SUSPECT RESULT" in err
    st = protocol.read_json(here / ".reval/local/runs/sus/status.json")
    assert st["suspect"] is True and "position-1 accuracy 0.000" in st["suspect_reasons"][0]
    rc, out, _ = reval(capsys, "ls")
    assert "succeeded (SUSPECT)" in out
    rc, out, _ = reval(capsys, "status", "sus")
    assert rc == 0 and "sus on local: succeeded (SUSPECT)" in out and "position-1 accuracy 0.000" in out
    rc, out, _ = reval(capsys, "status")
    assert "succeeded (SUSPECT)" in out
    rc, out, _ = reval(capsys, "ls", "--json")
    assert json.loads(out)[0]["suspect"] is True


def test_progress_rate_and_eta_by_the_events_clock():
    import io

    from rich.console import Console

    from reval.cli.display import RichSink, rate_eta, rate_text
    assert rate_eta([(100.0, 2)], 10) == (None, None)
    assert rate_eta([(100.0, 2), (104.0, 4)], 10) == (0.5, 12.0)  # 2 items in 4 s; 6 left
    assert rate_text(0.5, 12.0) == "0.5/s · ETA 0:00:12" and rate_text(0.01, 4000) == "0.6/min · ETA 1:06:40"
    con = Console(file=io.StringIO(), width=120, force_terminal=True, color_system=None)
    sink = RichSink(con)
    try:
        for i in range(1, 5):  # replayed all at once: the rate is the run's (1 prompt / 2 s), not the replay's
            sink.event({"t": 1000.0 + 2 * i, "stage": "eval", "i": i, "n": 10})
        task = sink.progress.tasks[0]
        assert task.completed == 4 and task.fields["rate"] == "0.5/s · ETA 0:00:12"
    finally:
        sink.close()


def test_replayed_log_and_events_interleave(tmp_path):
    from remote_payload.runtime import stream
    lines = [f"[{i}/400] prompt{i}: " + "x" * 1000 + "\n" for i in range(1, 401)]  # ~400 KB of log
    (tmp_path / "eval.log").write_text("".join(lines))
    (tmp_path / "events.jsonl").write_text("".join(json.dumps({"i": i, "n": 400}) + "\n" for i in range(1, 401)))
    frames, log_off, ev_off = stream.new_frames(tmp_path, 0, 0, final=True)
    tags = [f.split(b" ", 1)[0] for f in frames]
    assert log_off == (tmp_path / "eval.log").stat().st_size and ev_off == (tmp_path / "events.jsonl").stat().st_size
    assert tags[:2] == [b"L", b"E"] and tags.count(b"L") > 5  # events go out beside the first chunk of lines
    body = b"".join(f.split(b"\n", 1)[1] for f in frames if f.startswith(b"L"))
    assert body == (tmp_path / "eval.log").read_bytes()  # every byte once, in order
    (tmp_path / "eval.log").write_bytes(b"y" * (3 << 16) + b"\n")  # one line longer than a chunk: sent whole
    frames, log_off, _ = stream.new_frames(tmp_path, 0, ev_off, final=False)
    assert log_off == (3 << 16) + 1 and len(frames) == 1


def test_gpus_on_a_host_without_gpus_suggests_none_or_auto(here, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi: this host has no GPU
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "g0", "--gpus", "0", *FAST)
    assert rc == 3 and "this host has no GPU" in err and "--gpus none" in err and "--gpus auto" in err, err
    assert not (here / ".reval/local/runs/g0").exists()  # nothing left behind
