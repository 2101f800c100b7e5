"""Issue 19 item 15: tables fit the width they are printed at. A sweep's table that does not fit folds to one
line per checkpoint (a pipe counts as 100 columns); `reval ls` keeps the timestamp whole at 100 columns;
`compare` in a pipe shows run names whole."""
from __future__ import annotations

import io
import re
import sys
from pathlib import Path

from rich.console import Console

from orchestrator import sweep
from orchestrator.render import formats
from orchestrator.results.stats import Paired
from orchestrator.rundir.registry import RunState
from reval import cli
from reval.cli.commands.runs import states_table
from tests.resultsgen import write_run


def terminal(width: int = 100) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None, highlight=False)


def pipe() -> Console:
    return formats.listing_console(file=io.StringIO(), highlight=False)  # sys.stdout is no tty under pytest


def text_of(con: Console) -> str:
    return con.file.getvalue()


def _sweep_report() -> sweep.SweepReport:
    outs = []
    for i, step in enumerate((1000, 2000, 3000)):
        o = sweep.Outcome(f"step-{step}", step, "succeeded", "gpu-node-07", f"step-{step}-3f9c02ab", tau=4.1 + i / 3)
        o.tau_ci = [o.tau - 0.21, o.tau + 0.19]
        if i:
            o.prev_checkpoint, o.prev_tau = f"step-{step - 1000}", o.tau - 1 / 3
            o.vs_prev = Paired(1 / 3, 0.2, 0.45, 1.08, 1.04, 1.11, 0.001, 0.2, 40)
        o.base_ratio = o.tau / 4.0
        o.vs_base = Paired(o.tau - 4.0, o.tau - 4.2, o.tau - 3.8, o.base_ratio, 0.95, 1.1, 0.01, 0.3, 40)
        o.verdict, o.base_verdict = ("improved" if i else ""), "improved"
        outs.append(o)
    return sweep.SweepReport("20261130-0102", Path("/tmp/s"), outs, "zlab_full", {"gpu9": "ssh: timed out"}, 0.1)


def test_sweep_table_that_does_not_fit_100_columns_folds_to_one_line_per_checkpoint():
    rep = _sweep_report()
    assert formats.natural_width([sweep.report_table(rep)]) > 100  # the table this is about
    con = terminal(100)
    sweep.print_report(rep, con)
    out = text_of(con)
    assert "…" not in out and "impro\n" not in out and "s    1." not in out
    lines = out.splitlines()
    assert all(len(line) <= 100 for line in lines)
    for o in rep.outcomes:  # each checkpoint on its own line, starting with its name, tau whole
        assert any(line.startswith(f"{o.checkpoint}  tau {o.tau:.2f}") for line in lines), out
    assert "host gpu9 left out: ssh: timed out" in out  # the table's notes still said
    assert "improved" in out


def test_sweep_table_in_a_pipe_is_not_185_columns_wide():
    rep = _sweep_report()
    con = pipe()
    sweep.print_report(rep, con)
    out = text_of(con)
    table_lines = [line for line in out.splitlines() if "─" in line or "verdict" in line]
    assert not table_lines  # folded: no 185-column table in a log or a cron mail
    assert "…" not in out
    for o in rep.outcomes:
        assert any(line.startswith(f"{o.checkpoint}  tau {o.tau:.2f} [") for line in out.splitlines())


def test_sweep_table_that_fits_is_still_a_table():
    rep = _sweep_report()
    for o in rep.outcomes:
        o.vs_prev = o.vs_base = None
        o.tau_ci, o.prev_tau, o.base_ratio, o.host = None, None, None, "g1"
    assert formats.natural_width([sweep.report_table(rep)]) <= 100
    con = terminal(100)
    sweep.print_report(rep, con)
    out = text_of(con)
    assert "checkpoint" in out and "─" in out  # the table's header
    assert any(line.startswith("step-1000  tau") for line in out.splitlines())  # and the lines under it


def _states() -> list[RunState]:
    out = []
    for i in range(3):
        st = {"started_at": f"2026-11-30T10:0{i}:00Z", "finished_at": f"2026-11-30T10:1{i}:41Z", "exit_code": 1,
              "gpus": [0, 1, 2, 3], "error": "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB "
                                               "(GPU 0; 79.15 GiB total capacity)"}
        out.append(RunState("gpu-node-07.cluster.example", f"step-00{i}80-20261130-100{i}00-3f9c02ab", "failed", st))
    return out


def test_reval_ls_at_100_columns_keeps_the_timestamp_whole():
    con = terminal(100)
    con.print(states_table(_states(), {"gpu9": "ssh: connect to host gpu9 port 22: Connection timed out"}))
    out = text_of(con)
    assert all(len(line) <= 100 for line in out.splitlines())
    for i in range(3):
        assert f"2026-11-30T10:0{i}:00Z" in out, out  # on one line, whole: the part that differs between runs


def test_reval_ls_in_a_pipe_keeps_everything_whole():
    con = pipe()
    con.print(states_table(_states(), {}))
    out = text_of(con)
    for s in _states():
        assert s.name in out and s.status["started_at"] in out and s.status["error"] in out


LONG = "step-0080-lr3e-4-warmup2000-bs512-seed1234-final"


def test_compare_in_a_pipe_shows_run_names_whole(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_run(tmp_path / "runs", "ct129", LONG, quality=0.8, step=80)
    write_run(tmp_path / "runs", "ct129", "zlab_full", quality=0.88)
    assert not sys.stdout.isatty()
    rc = cli.main(["compare", LONG, "zlab_full", "--baseline", "zlab_full"])
    out = capsys.readouterr().out
    assert rc == 0
    assert LONG in out and "…" not in out, out


def test_compare_in_a_terminal_still_shortens_long_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_run(tmp_path / "runs", "ct129", LONG, quality=0.8, step=80)
    write_run(tmp_path / "runs", "ct129", "zlab_full", quality=0.88)
    from orchestrator.render import tables
    from orchestrator.results import compare
    runs = [compare.load_run(compare.pulled_run_dir(n, tmp_path / "runs")) for n in (LONG, "zlab_full")]
    cmp = compare.build_comparison(runs, None)
    con = terminal(100)
    formats.print_tables([tables.main_table(cmp)], con)
    out = text_of(con)
    assert re.search(r"step-0080-l\S*…\S*final", out) and all(len(x) <= 100 for x in out.splitlines())
