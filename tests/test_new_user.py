"""What a new user tripped on (issue 19, items 19-23), through the CLI runner on the local host (real runs; the
dummy payload stands in for the eval) and a fixed-width rich Console for the live display."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from remote_payload.contract import protocol
from reval.cli import display
from reval.cli.commands import demo as demo_cmd
from reval.cli.commands import run as run_cmd
from tests.runtools import reval, wait_lines, wrap
from tests.sweeptools import make_checkpoints

FAST = ["--", "--lines", "3", "--interval-s", "0"]
CRASH = "RuntimeError: dummy crash at prompt 4 of 6"


def terminal(width: int = 100) -> Console:
    """A terminal of `width` columns whose output is kept (console.export_text())."""
    return Console(file=io.StringIO(), width=width, record=True, force_terminal=True, color_system=None)


# -- 19: the cause of a failure, in one line ------------------------------------------------------------------
def test_a_crash_says_its_cause_in_status_ls_json_and_the_final_line(here, capsys):
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "boom", "--", "--lines", "6",
                       "--interval-s", "0", "--crash")
    assert rc == 1
    assert err.splitlines()[-1].startswith(f"failed  boom on local (exit 1: {CRASH}) after "), err
    assert protocol.read_json(here / "runs/local/boom/status.json")["error"] == CRASH  # recorded, and pulled
    rc, out, _ = reval(capsys, "status", "boom")
    assert rc == 1 and out.startswith("boom on local: failed") and f"exit 1 · {CRASH}" in out
    rc, out, _ = reval(capsys, "status", "boom", "--json")
    assert rc == 1 and json.loads(out)["error"] == CRASH
    rc, out, _ = reval(capsys, "ls")
    assert rc == 0 and CRASH in out
    rc, out, _ = reval(capsys, "ls", "--json")
    assert [r["error"] for r in json.loads(out)] == [CRASH]


def test_the_payloads_error_event_is_the_cause(tmp_path):
    """The eval's own error event (what it writes for every failure it catches) comes before the log's words."""
    d = tmp_path / "runs" / "ev"
    code = ("import json, sys; d = sys.argv[1]\n"
            "open(d + '/events.jsonl', 'a').write(json.dumps({'stage': 'error', 'message': "
            "'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\\nmore detail'}) + '\\n')\n"
            "print('error: something printed on the way out', file=sys.stderr); sys.exit(1)")
    p = wrap(d, sys.executable, "-c", code, str(d))
    assert p.returncode == 1
    st = protocol.read_json(d / "status.json")
    assert st["error"] == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    d2 = tmp_path / "runs" / "said"  # no event, no traceback: the payload's own `error:` line
    p = wrap(d2, sys.executable, "-c", "import sys; print('error: the cache is gone', file=sys.stderr); sys.exit(1)")
    assert p.returncode == 1 and protocol.read_json(d2 / "status.json")["error"] == "the cache is gone"
    d3 = tmp_path / "runs" / "mute"  # nothing said: no cause is made up
    p = wrap(d3, sys.executable, "-c", "import sys; sys.exit(1)")
    assert p.returncode == 1 and "error" not in protocol.read_json(d3 / "status.json")


def test_on_a_terminal_the_traceback_is_shown_once_and_the_last_line_says_why(here, capsys, monkeypatch):
    con = terminal()
    monkeypatch.setattr(run_cmd, "make_sink", lambda: display.RichSink(con))
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "boom", "--", "--lines", "6",
                       "--interval-s", "0", "--crash")
    assert rc == 1
    screen = con.export_text() + err
    assert screen.count("Traceback (most recent call last)") == 1 and screen.count(CRASH) == 2  # the log; the cause
    assert err.splitlines()[-1].startswith(f"failed  boom on local (exit 1: {CRASH})"), err


# -- 20: a run whose host is not in the inventory in use ------------------------------------------------------
def test_a_run_of_a_host_of_another_inventory_says_which_host_and_the_inventory(here, capsys, monkeypatch):
    (here / "other.yaml").write_text(
        "hosts:\n  box: {local: true, workdir: wb, python: current, venv: {mode: python}}\n")
    argv = ["-i", "other.yaml", "run", "box", "--payload", "dummy", "--name", "far", *FAST]
    monkeypatch.setattr(sys, "argv", ["reval", *argv])  # the command line run.json records
    rc, _, err = reval(capsys, *argv)
    assert rc == 0, err
    for ref in ("far", "box/far"):  # the default inventory (the built-in local host) has no `box`
        for cmd in ("status", "logs", "kill"):
            rc, _, err = reval(capsys, cmd, ref)
            assert rc == 3, (cmd, ref, err)
            first, hint = err.splitlines()[:2]
            assert first == ("error: run 'far' is runs/box/far here, but its host 'box' is not in the built-in "
                             "inventory"), err
            assert "-i other.yaml" in hint and "reval -i other.yaml status box/far" in hint, err
    rc, out, _ = reval(capsys, "-i", "other.yaml", "status", "far")
    assert rc == 0 and out.startswith("far on box: succeeded")
    (here / "runs/box/far/run.json").write_text("{}")  # no recorded command line: the hint says FILE
    rc, _, err = reval(capsys, "status", "far")
    assert rc == 3 and "-i FILE" in err and "REVAL_HOSTS=FILE" in err
    rc, _, err = reval(capsys, "status", "nowhere")  # a run that is nowhere is still "not found"
    assert rc == 102 and "no run named 'nowhere'" in err


# -- 21: Ctrl-C says what goes on and how to resume; a used name says what holds it ------------------------------
def test_ctrl_c_in_a_sweep_says_what_keeps_running_and_the_same_command_resumes(tmp_path):
    ck = make_checkpoints(tmp_path, [1, 2])
    (tmp_path / "hosts.yaml").write_text(f"hosts:\n  loc1: {{local: true, workdir: {tmp_path / 'loc1'}, python: "
                                         f"{sys.executable}, venv: {{mode: python}}, gpus: none}}\n")
    argv = [sys.executable, "-m", "reval", "sweep", "--checkpoints", f"{ck}/step-*", "--hosts", "loc1",
            "--payload", "dummy", "--sweep-dir", "sweeps", "--poll-s", "0.2", "--", "--lines", "200",
            "--interval-s", "0.1"]  # 20 s a run: still going when the Ctrl-C lands on a busy machine
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    try:
        while not list((tmp_path / "loc1" / "runs").glob("step-1-*/status.json")):  # launched: a run is going
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    runs = sorted(d.name for d in (tmp_path / "loc1" / "runs").iterdir())
    (run,) = [r for r in runs if r.startswith("step-1-")]
    last = err.strip().splitlines()[-1]
    assert p.returncode == 101, err
    assert last.startswith("interrupted: sweep ")
    assert f"1 run(s) it launched keep running on their hosts (loc1/{run})" in last
    # a run besides it is only one the line names as "may have started" (the slot's long poll was starting it)
    assert all(f"loc1/{r} may have started" in last for r in runs if r != run), (runs, last)
    assert "Resume: run the same command again" in last and "Traceback" not in err
    started = protocol.read_json(tmp_path / "loc1" / "runs" / run / "status.json")["started_at"]
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stderr
    assert "resume  sweep" in r.stderr and f"attach  step-1: run {run} on loc1" in r.stderr
    assert protocol.read_json(tmp_path / "loc1" / "runs" / run / "status.json")["started_at"] == started


def test_ctrl_c_stops_the_sweeps_workers_at_once(tmp_path):
    """Ctrl-C leaves the runs going and the controller stops its slot workers: they take, launch and follow
    nothing more, and a call under way answers before the line is written. Before, the sweep joined its threads
    with Thread.join, which Ctrl-C can leave believing a thread stopped: the process exited under a worker in
    the middle of its long poll, so the slot's next checkpoint stayed `launched` in the ledger and the line said
    it "may have started" although the run before it (60 s) had not ended."""
    ck = make_checkpoints(tmp_path, [1, 2])
    (tmp_path / "hosts.yaml").write_text(f"hosts:\n  loc1: {{local: true, workdir: {tmp_path / 'loc1'}, python: "
                                         f"{sys.executable}, venv: {{mode: python}}, gpus: none}}\n")
    argv = [sys.executable, "-m", "reval", "sweep", "--checkpoints", f"{ck}/step-*", "--hosts", "loc1",
            "--payload", "dummy", "--sweep-dir", "sweeps", "--poll-s", "0.2", "--", "--lines", "600",
            "--interval-s", "0.1"]  # a 60 s run
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs_dir, run = tmp_path / "loc1" / "runs", None
    try:
        deadline = time.monotonic() + 120
        while not (started := list(runs_dir.glob("step-1-*/status.json"))):
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()
            time.sleep(0.05)
        run = started[0].parent.name
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=45)  # the old workers followed the 60 s run first (45 s: a busy machine)
        assert p.returncode == 101 and "Traceback" not in err, err
        assert protocol.read_json(runs_dir / run / "status.json")["state"] == "running"
        last = err.strip().splitlines()[-1]
        assert f"the 1 run(s) it launched keep running on their hosts (loc1/{run})." in last and "may have" not in last
        ledger = protocol.read_json(tmp_path / "sweeps" / "ledger.json")["entries"].values()
        assert sorted((e["checkpoint"], e["state"]) for e in ledger) == [("step-1", "launched")]
        time.sleep(1.0)  # nothing of the controller is left to launch step-2
        assert [d.name for d in runs_dir.iterdir()] == [run]
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        if run is not None:  # the run it started, ended by reval (its own process group, by its recorded pid)
            subprocess.run([sys.executable, "-m", "reval", "-i", "hosts.yaml", "kill", f"loc1/{run}",
                            "--grace-s", "2"], cwd=tmp_path, env=env, capture_output=True, timeout=60, check=False)
    assert protocol.read_json(runs_dir / run / "status.json")["state"] == "cancelled"


def test_sweep_interrupted_before_any_launch_says_nothing_runs():
    import reval
    from reval.cli.commands.sweep import interrupted_text
    text = interrupted_text(reval.SweepInterrupted(None, []))
    assert text.startswith("interrupted: the sweep stopped here; no run of it is running. Resume: run the same command")


def test_sweep_interrupted_during_a_folded_launch_does_not_claim_it_runs():
    """A launch under way at Ctrl-C (the long poll that starts the slot's next run) is 'may have started', never
    counted among the runs that keep running."""
    import reval
    from reval.cli.commands.sweep import interrupted_text
    text = interrupted_text(reval.SweepInterrupted("S1", [("h1", "step-1-a")], [("h1", "step-2-b")]))
    assert "the 1 run(s) it launched keep running on their hosts (h1/step-1-a); h1/step-2-b may have started" in text
    text = interrupted_text(reval.SweepInterrupted("S1", [], [("h1", "step-2-b")]))
    assert "no run of it is running; h1/step-2-b may have started (its launch was under way)" in text


class InterruptAfter(display.PlainSink):
    """A display on which the user presses Ctrl-C after `n` log lines."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def line(self, text: str) -> None:
        super().line(text)
        self.n -= 1
        if self.n == 0:
            raise KeyboardInterrupt


def test_ctrl_c_in_the_demo_says_the_eval_goes_on_and_the_same_command_reattaches(here, capsys, monkeypatch,
                                                                                    trained_fixtures):
    shutil.copytree(trained_fixtures, here / ".reval/local/fixtures")  # built before: the demo reuses them
    monkeypatch.setattr(demo_cmd, "make_sink", lambda: InterruptAfter(3))
    rc, out, err = reval(capsys, "demo", "--max-blocks", "5")
    assert rc == 101, err
    assert "cache   demo: built" in out  # the demo's cache through the host's store (as run --prompts)
    (extract,) = [n for n in os.listdir(here / ".reval/local/runs") if n.startswith("extract-")]
    (early,) = [n for n in os.listdir(here / ".reval/local/runs") if n != extract]
    assert early.startswith("demo-early-")
    assert err.strip().splitlines()[-1] == (f"interrupted: {early} keeps running on local (follow it: reval logs "
                                            f"local/{early} -f). Resume: reval demo (the same command re-attaches "
                                            "to it, then runs what is left)")
    monkeypatch.setattr(demo_cmd, "make_sink", display.PlainSink)
    rc, out, err = reval(capsys, "demo", "--max-blocks", "5")
    assert rc == 0, err
    assert f"{early} from before (its controller stopped)" in out and "following it, not starting another" in out
    assert "cache   demo: in the store" in out  # found again: no second extract
    runs = sorted(n for n in os.listdir(here / ".reval/local/runs") if n != extract)
    assert len(runs) == 2 and runs[0] == early and runs[1].startswith("demo-final-")  # the early eval ran once
    assert f"done    {early} succeeded" in out and "demo    done in" in out


def test_a_used_name_says_what_holds_it_and_how_to_free_it(here, capsys):
    assert reval(capsys, "run", "local", "--payload", "dummy", "--name", "ok", *FAST)[0] == 0
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "ok", *FAST)  # the same command
    first, hint = err.splitlines()[:2]
    assert rc == 3 and first.startswith("error: run name 'ok' is already used on local: that run succeeded at 20"), err
    assert "reval rm local/ok" in hint and "--name ok-2" in hint and "reval compare local/ok" in hint
    reval(capsys, "run", "local", "--payload", "dummy", "--name", "bad", "--", "--lines", "6", "--interval-s", "0",
          "--crash")
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "bad", *FAST)
    assert rc == 3
    assert err.splitlines()[0] == f"error: run name 'bad' is already used on local: that run failed (exit 1: {CRASH})"
    assert "free the name: reval rm local/bad" in err
    rc, _, _ = reval(capsys, "run", "local", "--payload", "dummy", "--name", "busy", "--detach", "--", "--lines",
                     "1000", "--interval-s", "0.05")
    assert rc == 101
    try:
        wait_lines(here / ".reval/local/runs/busy/eval.log", 3)
        rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "busy", *FAST)
        assert rc == 3 and "that run is running" in err and "follow it: reval logs local/busy -f" in err
    finally:
        assert reval(capsys, "kill", "busy", "--grace-s", "2")[0] == 0
    rc, _, _ = reval(capsys, "rm", "local/ok", "--yes")  # what the hint says frees the name
    assert rc == 0 and reval(capsys, "run", "local", "--payload", "dummy", "--name", "ok", *FAST)[0] == 0


# -- 22: the live display in a terminal of 100 columns -------------------------------------------------------------
def bar_text(sink: display.RichSink) -> str:
    """The progress bar as the terminal shows it now."""
    con = terminal()
    con.print(sink.progress.get_renderable())
    return con.export_text()


def test_the_live_display_fits_100_columns_and_counts_what_it_shows(here, capsys, monkeypatch, trained_fixtures):
    con = terminal(100)
    monkeypatch.setattr(run_cmd, "make_sink", lambda: display.RichSink(con))
    paths = json.loads((trained_fixtures / "fixtures.json").read_text())["paths"]
    rc, out, err = reval(capsys, "run", "local", "--drafter", str(trained_fixtures / paths["drafter_good"]),
                         "--target", str(trained_fixtures / paths["target"]), "--cache",
                         str(trained_fixtures / paths["cache"]), "--name", "live", "--max-blocks", "10")
    assert rc == 0, err
    screen = con.export_text().splitlines()
    log = (here / "runs/local/live/eval.log").read_text().splitlines()
    (at,) = [k for k, line in enumerate(screen) if line.startswith("[reval] live started")]
    assert len(log[0]) > 100 and screen[at].endswith("…") and len(screen[at]) <= 100  # one line, not five
    assert screen[at + 1] == log[1]  # the next line on the screen is the log's next line
    summary = out[out.index("done    live succeeded"):].splitlines()[1:]
    assert len(summary) > 1 and all(len(line) <= 100 for line in summary), summary
    assert all(line.count("[") == line.count("]") for line in summary), summary  # no interval cut in two
    assert " · ".join(line.strip() for line in summary).startswith("tau ")
    # the bar, event by event, as the run showed it
    sink = display.RichSink(terminal())
    loading = counting = None
    try:
        for ev in protocol.read_events(here / "runs/local/live/events.jsonl"):
            sink.event(ev)
            if ev.get("stage") == "load_drafter" and "i" not in ev and loading is None:
                loading = bar_text(sink)
            if ev.get("stage") == "eval_prompt" and ev.get("i") == 5:
                counting = bar_text(sink)
    finally:
        sink.close()
    assert "[4/5] Loading drafter" in loading and "/10" not in loading, loading  # not step 3's 10/10
    assert "[5/5] Evaluating" in counting and "5/10" in counting and " · ETA 0:" in counting, counting


# -- 23: the conventions other CLIs taught -----------------------------------------------------------------------
def test_json_flags_and_the_inventory_option_after_the_command(here, capsys):
    for name in ("a", "b"):
        assert reval(capsys, "run", "local", "--payload", "dummy", "--name", name, *FAST)[0] == 0
    rc, out, err = reval(capsys, "compare", "a", "b", "--json")  # as llm / sqlite-utils users type it
    assert rc == 0, err
    rc2, out2, _ = reval(capsys, "compare", "a", "b", "--format", "json")
    assert rc2 == 0 and json.loads(out) == json.loads(out2) and [r["label"] for r in json.loads(out)["runs"]]
    (here / "other.yaml").write_text("hosts:\n  box: {local: true, workdir: wb, python: current, "
                                     "venv: {mode: python}}\n"
                                     "groups:\n  boxes: [box]\n")
    rc, out, err = reval(capsys, "hosts", "--json", "-i", "other.yaml")
    assert rc == 0, err
    inv = json.loads(out)
    box = next(h for h in inv["hosts"] if h["name"] == "box")
    assert inv["inventory"].endswith("other.yaml") and box["workdir"] == "wb" and box["local"] is True
    assert inv["groups"] == {"boxes": ["box"]}
    rc, _, err = reval(capsys, "run", "box", "-i", "other.yaml", "--payload", "dummy", "--name", "far", *FAST)
    assert rc == 0, err  # -i after HOST, among run's options
    rc, out, err = reval(capsys, "ls", "-i", "other.yaml")
    assert rc == 0 and "box" in out and "far" in out, err
    rc, out, _ = reval(capsys, "status", "far", "-i", "other.yaml")
    assert rc == 0 and out.startswith("far on box: succeeded")
    rc, out, _ = reval(capsys, "-i", "other.yaml", "ls", "-i", "hosts-none.yaml")  # the one after the command wins
    assert rc == 3
    rc, out, _ = reval(capsys, "ls")  # and without it, the default inventory as before
    assert rc == 0 and "far" not in out and " a " in f" {out} "


def test_other_tools_words_for_commands_get_a_did_you_mean(here, capsys):
    for word, meant in (("cancel", "kill"), ("stop", "kill"), ("queue", "ls"), ("list", "ls"), ("delete", "rm")):
        rc, _, err = reval(capsys, word, "x")
        assert rc == 3 and f"did you mean {meant!r}?" in err, (word, err)


def test_completion_of_run_names_in_a_real_bash(here, capsys):
    for name in ("step-10", "step-20"):
        assert reval(capsys, "run", "local", "--payload", "dummy", "--name", name, *FAST)[0] == 0
    rc, script, _ = reval(capsys, "completion", "bash")
    assert rc == 0
    (here / "reval.bash").write_text(script)
    repo = Path(__file__).resolve().parents[1]
    driver = f"""
source {here}/reval.bash
reval() {{ PYTHONPATH={repo} {sys.executable} -m reval "$@"; }}
comp() {{ COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _reval; echo "${{COMPREPLY[*]}}"; }}
comp reval logs ""
comp reval logs -f step-1
comp reval status local/
comp reval compare step-10 --baseline st
comp reval rm ""
"""
    p = subprocess.run(["bash", "-c", driver], check=False, capture_output=True, text=True, timeout=120, cwd=here)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["step-10 step-20 local/step-10 local/step-20", "step-10",
                                     "local/step-10 local/step-20", "step-10 step-20",
                                     "step-10 step-20 local/step-10 local/step-20"]
