"""The sweep report on real local sweeps (dummy payload): checkpoints with and without a step number in one
glob, a host down while every checkpoint was still evaluated elsewhere, and failure messages kept whole in
report.json (shortened only on screen)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from orchestrator import sweep
from orchestrator.runs.lifecycle import EvalSpec
from orchestrator.sweep.report import LoadedRuns, checkpoint_order
from tests.sweeptools import DUMMY, local_inventory, make_checkpoints, opts


def test_checkpoints_with_and_without_a_step_make_one_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100, 200])
    final = ck / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(os.urandom(2048))
    log: list[str] = []
    rep = sweep.Sweep(opts(f"{ck}/*", ["locs"], tmp_path), local_inventory(tmp_path, 1), log=log.append).run()
    sweep.write_report_files(rep)  # the report used to crash here: None < 100
    assert rep.exit_code == 0, log
    by = {o.checkpoint: o for o in rep.outcomes}
    assert set(by) == {"step-100", "step-200", "final"} and by["final"].step is None
    assert by["step-200"].prev_checkpoint == "step-100"
    assert by["final"].prev_checkpoint == "step-200"  # no step: after every numbered checkpoint
    assert json.loads((rep.sweep_dir / "report.json").read_text())["exit_code"] == 0
    assert "final" in (rep.sweep_dir / "report.md").read_text()


def test_a_host_down_is_not_partial_when_every_checkpoint_was_evaluated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100, 200])
    inv = local_inventory(tmp_path, 2)
    inv.hosts["loc2"].python = str(tmp_path / "no-such-python")  # loc2 cannot run anything
    log: list[str] = []
    rep = sweep.Sweep(opts(f"{ck}/step-*", ["locs"], tmp_path), inv, log=log.append).run()
    assert "loc2" in rep.hosts_down
    assert [o.state for o in rep.outcomes] == ["succeeded", "succeeded"] and {o.host for o in rep.outcomes} == {"loc1"}
    assert rep.exit_code == 0, log  # not "partial: not every checkpoint was evaluated"
    notes = sweep.report_table(rep).notes
    assert any(n.startswith("host loc2 left out") for n in notes)  # still said, not hidden


def test_failure_messages_are_whole_in_report_json_and_short_on_screen():
    long = ("cache /eval/cached_hs/prompt-0007.safetensors is truncated: header says 123456789 bytes, the file has "
            "1234 bytes; re-extract it: python -m remote_payload extract --target /models/T --out /eval/cache "
            "--layers 1,16,31,46,61 (the extraction was interrupted)")
    o = sweep.Outcome("step-5", 5, "failed", "gpu1", "step-5-abc", error=long)
    rep = sweep.SweepReport("s1", Path("/tmp/s1"), [o], None, {}, 0.1)
    assert sweep.report_json(rep)["checkpoints"][0]["error"] == long
    text = sweep.outcome_text(o)
    assert len(text) < len(long) and text.endswith("…)") and "truncated" in text


def test_failure_line_keeps_the_whole_error(tmp_path):
    long = "x" * 100 + " then the fix: re-extract the cache with --layers 1,16,31,46,61 " + "y" * 100
    (tmp_path / "eval.log").write_text(f"loading\nerror: {long}\n[reval] failed · exit 3\n")
    assert sweep.failure_line({"exit_code": 3}, tmp_path) == f"exit 3: error: {long}"
    assert sweep.failure_line({"exit_code": 1, "error": long}, tmp_path) == f"exit 1: {long}"


def test_a_suspect_checkpoint_is_marked_in_the_sweep_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100])
    o = sweep.SweepOptions(checkpoints=[f"{ck}/step-*"], hosts=["locs"],
                           spec=EvalSpec(payload="dummy", extra=[*DUMMY, "--suspect"]),
                           sweep_dir=str(tmp_path / "sweeps"), poll_s=0.2, backoff_s=0.2)
    rep = sweep.Sweep(o, local_inventory(tmp_path, 1), log=lambda line: None).run()
    sweep.write_report_files(rep)
    assert [(x.suspect, x.verdict) for x in rep.outcomes] == [(True, "suspect")]
    assert "suspect" in sweep.outcome_text(rep.outcomes[0]).lower()
    assert "suspect" in (rep.sweep_dir / "report.md").read_text()


def test_the_statistics_are_computed_as_runs_are_pulled_and_are_the_reports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100, 200, 300])
    rep = sweep.Sweep(opts(f"{ck}/step-*", ["locs"], tmp_path), local_inventory(tmp_path, 1)).run()
    paths = {o.checkpoint: o.local_path for o in rep.outcomes}
    fresh = LoadedRuns()
    for name in ("step-300", "step-100", "step-200"):  # pulled in any order
        fresh.put(paths[name], rep.loaded.get(paths[name]))
        fresh.prepare(paths[name], checkpoint_order(int(name[5:]), name))
    pairs = {k[:2] for k in fresh._pairs}
    assert pairs == {(paths["step-300"], paths["step-100"]), (paths["step-200"], paths["step-100"]),
                     (paths["step-300"], paths["step-200"])}  # each with its neighbours as they arrived
    by = {o.checkpoint: o for o in rep.outcomes}
    assert fresh.paired_tau(paths["step-300"], paths["step-200"])[0] == by["step-300"].vs_prev
    assert [fresh.tau(paths[n]).lo for n in ("step-100", "step-200")] == [by[n].tau_ci[0] for n in ("step-100",
                                                                                                      "step-200")]
    fresh.prepare(str(tmp_path / "gone"), (False, 400, "step-400"))  # no result there: nothing to compute
    assert str(tmp_path / "gone") not in fresh.order
