"""Sweeps over benchmark suites (--cache NAME=PATH repeated), the sweep's path rule (relative --target/--cache as
`reval run` takes them), an incomparable --baseline refused before anything runs, a suspect checkpoint marked on
the tau-vs-step plot, and the sweep's terminal table at narrow widths."""
from __future__ import annotations

import dataclasses
import json

import pytest

import reval
from orchestrator import sweep
from orchestrator.hosts.inventory import Host
from tests.resultsgen import write_run
from tests.sweeptools import local_inventory, make_checkpoints, opts


def test_relative_target_and_cache_mean_the_current_directory_on_a_local_host(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100])
    o = opts(f"{ck}/step-*", ["locs"], tmp_path, target="models/T", cache=["gsm=eval/gsm", "eval/mt"])
    rep = reval.sweep(o, inventory=local_inventory(tmp_path, 1))
    assert rep.exit_code == 0
    saved = json.loads((rep.sweep_dir / "sweep.json").read_text())["options"]
    assert saved["target"] == str(tmp_path / "models/T")
    assert saved["cache"] == [f"gsm={tmp_path}/eval/gsm", str(tmp_path / "eval/mt")]


def test_relative_cache_with_a_remote_host_is_refused_in_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100])
    inv = local_inventory(tmp_path, 1)
    inv.hosts["far"] = Host(name="far", address="192.0.2.1", workdir="/w")
    inv.groups["mixed"] = ["loc1", "far"]
    with pytest.raises(reval.Error) as e:
        reval.sweep(opts(f"{ck}/step-*", ["mixed"], tmp_path, target="/m/T", cache="eval/cache"), inventory=inv)
    msg = str(e.value)
    assert e.value.exit_code == 3 and "--cache 'eval/cache' is relative" in msg and "far" in msg
    assert "local: local:" not in msg and "Error" not in msg.split(":")[0]
    assert not (tmp_path / "sweeps").exists()  # nothing launched, nothing kept


def test_an_incomparable_baseline_is_refused_before_anything_is_launched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100])
    write_run(tmp_path / "runs", "ref", "zlab_full", max_blocks=12)
    with pytest.raises(reval.Error) as e:
        reval.sweep(opts(f"{ck}/step-*", ["locs"], tmp_path, baseline="zlab_full", max_blocks=20),
                    inventory=local_inventory(tmp_path, 1))
    assert e.value.exit_code == 3
    assert "not comparable" in str(e.value) and "max_blocks 12 there, 20 here" in str(e.value)
    assert not (tmp_path / "sweeps").exists() and not list((tmp_path / "loc1").glob("runs/*"))


def test_a_suspect_checkpoint_and_an_incomparable_baseline_are_marked_on_the_plot_not_hidden(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100, 200])
    write_run(tmp_path / "runs", "ref", "zlab_full")  # another cache than the dummy's: known only after
    o = opts(f"{ck}/step-*", ["locs"], tmp_path, baseline="zlab_full")
    o.spec = dataclasses.replace(o.spec, extra=[*o.spec.extra, "--suspect"])
    rep = sweep.Sweep(o, local_inventory(tmp_path, 1), log=lambda line: None).run()
    sweep.write_report_files(rep)
    assert [(p.name, p.suspect) for p in rep.history] == [("step-100", True), ("step-200", True)]
    page = (rep.sweep_dir / "report.html").read_text()
    assert "suspect (not in the curve): step-100, step-200" in page
    assert "NOT COMPARABLE" in page


def test_a_sweep_over_suites_reports_tau_per_suite_per_checkpoint_and_draws_a_curve_each(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100, 200])
    o = opts(f"{ck}/step-*", ["locs"], tmp_path, cache=["gsm=/e/gsm", "mt=/e/mt"])
    # the dummy's stand-in for the suites' caches
    o.spec = dataclasses.replace(o.spec, extra=[*o.spec.extra, "--suite", "gsm", "--suite", "mt"])
    rep = reval.sweep(o, inventory=local_inventory(tmp_path, 1))
    assert rep.exit_code == 0
    for out in rep.outcomes:
        assert list(out.suites) == ["gsm", "mt", "mean"]
        assert all(v["ci"] and v["ci"][0] <= v["tau"] <= v["ci"][1] for v in out.suites.values())
        assert "gsm " in sweep.outcome_text(out) and "mt " in sweep.outcome_text(out)
    table = sweep.report_table(rep)
    assert {"suite:gsm", "suite:mt", "suite:mean"} <= {c.key for c in table.columns}
    js = json.loads((rep.sweep_dir / "report.json").read_text())
    assert set(js["checkpoints"][0]["suites"]) == {"gsm", "mt", "mean"}
    assert "tau · gsm" in (rep.sweep_dir / "report.md").read_text()
    assert {p.suite for p in rep.history} == {"", "gsm", "mt", "mean"}
    page = (rep.sweep_dir / "report.html").read_text()
    assert "gsm (95% CI band)" in page and "mt (95% CI band)" in page and "mean over suites (95% CI band)" in page


def test_the_ledger_key_covers_every_suites_cache_as_results_json_does():
    from remote_payload.contract.spec import EvalSpec, joined_fingerprint
    assert EvalSpec(cache="/e/one").suites() is None and EvalSpec(cache=["/e/one"]).suites() is None
    s = EvalSpec(cache=["gsm=/e/gsm", "/e/mtbench/"]).suites()
    assert s == [("gsm", "/e/gsm"), ("mtbench", "/e/mtbench/")]
    a = joined_fingerprint([("gsm", "sha256:1"), ("mtbench", "sha256:2")])
    assert a != joined_fingerprint([("gsm", "sha256:1"), ("mtbench", "sha256:3")])  # any suite's cache moves it
    import hashlib
    assert a == "sha256:" + hashlib.sha256(b"gsm\0sha256:1\nmtbench\0sha256:2\n").hexdigest()  # run.py's formula
