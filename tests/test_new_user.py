"""What a new user tripped on (issue 19, items 19-23), through the CLI runner on the local host (real runs; the
dummy payload stands in for the eval) and a fixed-width rich Console for the live display."""
from __future__ import annotations

import io
import json
import sys

from rich.console import Console

from orchestrator.commands import display
from orchestrator.commands import run as run_cmd
from remote_payload.contract import protocol
from tests.runtools import reval, wrap

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
    (here / "other.yaml").write_text("hosts:\n  box: {local: true, workdir: wb, python: current, venv: {mode: python}}\n")
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
