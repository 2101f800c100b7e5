"""reval sweep: discovery (two hash implementations agree), the ledger, scheduling over hosts, a host going
away mid-sweep, a killed controller, ledger skips and --force, the report and its exit codes.

The payload here is `python -m remote_payload dummy` (torch-free, seconds) unless a test says otherwise: the
sweep machinery is what is under test; the eval itself has its own tests."""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from orchestrator import sweep
from orchestrator.errors import ConfigError, RunNotFound
from orchestrator.hosts import gpuspec
from orchestrator.hosts.inventory import load_inventory
from orchestrator.results import compare, stats
from orchestrator.runs.lifecycle import EvalSpec
from orchestrator.sweep import ledger
from orchestrator.sweep.discover import _local_matches
from remote_payload.contract import protocol
from reval import cli
from tests.resultsgen import write_run
from tests.runtools import synced_local
from tests.sweeptools import DUMMY, entry_from, local_inventory, make_checkpoints, opts


def remote_run_dirs(workdirs: list[Path]) -> dict[str, Path]:
    """run name -> the host workdir holding it, over every host; fails on a run name seen twice."""
    seen: dict[str, Path] = {}
    for w in workdirs:
        for d in (w / "runs").glob("*") if (w / "runs").is_dir() else []:
            assert d.name not in seen, f"run {d.name} on two hosts"
            seen[d.name] = w
    return seen


# ---- pure parts -----------------------------------------------------------------------------------------

def test_parse_checkpoint_spec(tmp_path):
    inv = local_inventory(tmp_path, 1)
    assert sweep.parse_checkpoint_spec("loc1:/root/ckpt/step-*", inv) == ("loc1", "/root/ckpt", "step-*")
    assert sweep.parse_checkpoint_spec("./ckpts/step-*", inv) == (None, "./ckpts", "step-*")
    with pytest.raises(ConfigError, match="unknown host 'ct129'"):
        sweep.parse_checkpoint_spec("ct129:/x/step-*", inv)
    with pytest.raises(ConfigError, match="glob may only be in the last part"):
        sweep.parse_checkpoint_spec("/x/*/step-1", inv)
    with pytest.raises(ConfigError, match="glob may only be in the last part"):
        sweep.parse_checkpoint_spec("/x/step-$(reboot)", inv)


def test_select_latest_and_since():
    cks = [sweep.Checkpoint(f"step-{s}", f"/c/step-{s}", None, 1, 1000 + s, step=s) for s in (300, 100, 200, 1000)]
    cks.append(sweep.Checkpoint("final", "/c/final", None, 1, 5000))
    assert [c.name for c in sweep.select(cks)] == ["step-100", "step-200", "step-300", "step-1000", "final"]
    assert [c.name for c in sweep.select(cks, latest=2)] == ["step-1000", "final"]
    assert [c.name for c in sweep.select(cks, since=1250)] == ["step-300", "step-1000", "final"]
    assert sweep.parse_since("36h", now=200000.0) == 200000.0 - 36 * 3600
    assert sweep.parse_since("2026-11-30") == datetime(2026, 11, 30, tzinfo=timezone.utc).timestamp()
    with pytest.raises(ConfigError, match="--since 'yesterday'"):
        sweep.parse_since("yesterday")


def test_verdicts_and_exit_codes():
    O = sweep.Outcome

    def paired(delta, lo, hi):
        return stats.Paired(delta, lo, hi, None, None, None, 0.01, 0.3, 10)
    # improved / regressed only when the paired CI excludes 0 and the change is at least the threshold
    assert sweep.verdict(O("b", 2, "succeeded", tau=5.02, prev_tau=4.33, vs_prev=paired(0.69, 0.4, 0.9)), 0.1) \
        == "improved"
    assert sweep.verdict(O("b", 2, "succeeded", tau=4.0, prev_tau=5.02, vs_prev=paired(-1.02, -1.3, -0.7)), 0.1) \
        == "regressed"
    assert sweep.verdict(O("b", 2, "succeeded", tau=4.95, prev_tau=5.02, vs_prev=paired(-0.07, -0.3, 0.2)), 0.1) \
        == "no clear change"  # the CI includes 0
    assert sweep.verdict(O("b", 2, "succeeded", tau=5.07, prev_tau=5.02, vs_prev=paired(0.05, 0.02, 0.08)), 0.1) \
        == "no clear change"  # real, but below --threshold
    assert sweep.verdict(O("b", 2, "succeeded", tau=6.0, prev_tau=5.0), 0.1) == "no clear change"  # not paired
    assert sweep.verdict(O("b", 2, "succeeded", tau=9.0, prev_tau=5.0, suspect=True), 0.1) == "suspect"
    assert sweep.verdict(O("b", 2, "failed"), 0.1) == "failed"
    assert sweep.verdict(O("a", 1, "succeeded", tau=4.0), 0.1) == "new"
    ok, failed, gone = O("a", 1, "succeeded", tau=4.0), O("b", 2, "failed"), O("c", 3, "unreachable")
    assert sweep.sweep_exit_code([ok], {}) == 0
    assert sweep.sweep_exit_code([ok, gone], {}) == 2
    assert sweep.sweep_exit_code([ok, gone, failed], {}) == 1
    assert sweep.sweep_exit_code([ok], {"h3": "unreachable"}) == 0  # every checkpoint evaluated: not partial
    earlier_failure = O("d", 4, "failed", earlier=True)
    assert sweep.sweep_exit_code([ok, earlier_failure], {}) == 0  # reported, but not this sweep's failure


def test_ledger_key_and_run_names():
    k1 = ledger.ledger_key("sha256:a", "sha256:c", "v1", {"max_blocks": 30, "num_prompts": 10})
    assert k1 == ledger.ledger_key("sha256:a", "sha256:c", "v1", {"num_prompts": 10, "max_blocks": 30})
    for changed in (("sha256:b", "sha256:c", "v1", {"max_blocks": 30, "num_prompts": 10}),
                    ("sha256:a", "sha256:d", "v1", {"max_blocks": 30, "num_prompts": 10}),
                    ("sha256:a", "sha256:c", "v2", {"max_blocks": 30, "num_prompts": 10}),
                    ("sha256:a", "sha256:c", "v1", {"max_blocks": 20, "num_prompts": 10})):
        assert ledger.ledger_key(*changed) != k1
    ck = sweep.Checkpoint("step 4000 (final)", "/x", None, 1, 1)
    name = sweep.run_name_for(ck, k1)
    assert name == f"step_4000_final_-{k1[7:15]}" and protocol.validate_run_name(name)
    smi = "0, NVIDIA H200, 143771, 5, 0\n1, NVIDIA H200, 143771, 90000, 95\n2, NVIDIA H200, 143771, 100, 3\n"
    assert gpuspec.gpu_slots(smi, "auto") == ["auto"] * 3  # busy ones too: the wrapper picks, a refusal requeues
    assert gpuspec.gpu_slots(smi, "0,2") == ["0", "2"]
    assert gpuspec.gpu_slots("", "auto") == ["none"] and gpuspec.gpu_slots(smi, "none") == ["none"]


def test_content_hash_and_listing_agree_with_the_remote_scripts(tmp_path):
    d = make_checkpoints(tmp_path, [10, 20, 300])
    (d / "step-20" / "sub" / "B.bin").write_bytes(b"upper case sorts first in C order")
    single = d / "ckpt-7.pt"
    single.write_bytes(b"a team .pt checkpoint")
    _, t, wd = synced_local(tmp_path / "work")  # the payload's `hash` runs where the checkpoints live
    paths = [str(p) for p in sorted(d.iterdir())]
    remote = sweep.parse_hashes(t.run(sweep.hash_command(f"{wd}/payload", sys.executable, paths)).stdout)
    assert remote == {p: sweep.local_content_hash(p) for p in paths}
    assert len(set(remote.values())) == 4 and all(h.startswith("sha256-64MiB-tree:") for h in remote.values())
    before = sweep.local_content_hash(d / "step-10")
    (d / "step-10" / "sub" / "extra.bin").write_bytes(b"not a weight file: the drafter's identity is its weights")
    assert sweep.local_content_hash(d / "step-10") == before
    (d / "step-10" / "model.safetensors").write_bytes(b"changed")
    assert sweep.local_content_hash(d / "step-10") != before
    listed = {}
    for line in t.run(sweep.list_script(str(d), "step-*")).stdout.splitlines():
        p, size, mtime = line.split("\t")
        listed[os.path.basename(p)] = (int(size), int(mtime))
    assert listed == {c.name: (c.size, c.mtime) for c in _local_matches(str(d), "step-*")}


def test_ledger_persists_and_refuses_a_second_controller(tmp_path):
    lg = ledger.Ledger(tmp_path / "ledger.json")
    lg.lock()
    e = ledger.LedgerEntry("sha256:k", "step-1", "/c/step-1", "sha256:h", 1, "h1", "step-1-abc", "succeeded",
                           "s1", tau=4.2, config="sha256:cfg")
    lg.put(e)
    lg.remember_hash("/c/step-1", 10, 99, "sha256:h")
    other = ledger.Ledger(tmp_path / "ledger.json")
    assert other.get("sha256:k").tau == 4.2 and other.cached_hash("/c/step-1", 10, 99) == "sha256:h"
    assert other.cached_hash("/c/step-1", 11, 99) is None  # size changed: hash again
    with pytest.raises(ConfigError, match="another reval sweep is using"):
        other.lock()
    lg.unlock()
    other.lock()
    other.unlock()
    (tmp_path / "ledger.json").write_text("{broken")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ledger.Ledger(tmp_path / "ledger.json")


# ---- sweeps on local hosts (no SSH): scheduling, ledger skip, --force, report -------------------------------

def test_local_sweep_ledger_skip_force_and_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100, 200, 300, 400])
    inv = local_inventory(tmp_path, 2)
    write_run(tmp_path / "runs", "ref", "zlab_full", quality=0.9)
    log: list[str] = []
    parsed: list[str] = []
    real_load = compare.load_run
    monkeypatch.setattr(compare, "load_run", lambda path: parsed.append(str(path)) or real_load(path))
    rep = sweep.Sweep(opts(f"{ck}/step-*", ["locs"], tmp_path, baseline="zlab_full"), inv, log=log.append).run()
    sweep.write_report_files(rep)
    monkeypatch.setattr(compare, "load_run", real_load)
    assert rep.exit_code == 0, log
    # each pulled run's results.json is parsed once: for the ledger, the comparisons and the report files
    assert sorted(p for p in parsed if "zlab_full" not in p) == sorted(o.local_path for o in rep.outcomes)
    assert [o.checkpoint for o in rep.outcomes] == ["step-100", "step-200", "step-300", "step-400"]
    assert all(o.state == "succeeded" and o.tau is not None for o in rep.outcomes)
    assert {o.host for o in rep.outcomes} == {"loc1", "loc2"}  # both hosts got work
    assert rep.outcomes[0].verdict == "new" and rep.outcomes[1].prev_checkpoint == "step-100"
    assert rep.outcomes[1].verdict == "no clear change"  # the dummy gives every checkpoint the same tau
    assert rep.outcomes[1].vs_prev.delta == 0 and rep.outcomes[1].tau_ci is not None
    # the dummy's results differ from the baseline's cache: ratio shown, marked not comparable
    assert rep.outcomes[0].base_ratio is not None and "not comparable" in rep.outcomes[0].base_note
    runs1 = remote_run_dirs([tmp_path / "loc1", tmp_path / "loc2"])
    assert len(runs1) == 4
    md = (rep.sweep_dir / "report.md").read_text()
    assert "| step-300 |" in md and "no clear change" in md
    assert (rep.sweep_dir / "plots.png").read_bytes()[:4] == b"\x89PNG"
    page = (rep.sweep_dir / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="tau-vs-step"' in page and "step-400" in page
    js = json.loads((rep.sweep_dir / "report.json").read_text())
    assert js["exit_code"] == 0 and len(js["checkpoints"]) == 4
    assert "4 checkpoints · 0 already evaluated (skipped) · 4 to run on 2 host(s), 2 slot(s)" in log

    # the same sweep again: nothing new
    log.clear()
    rep2 = sweep.Sweep(opts(f"{ck}/step-*", ["locs"], tmp_path), inv, log=log.append).run()
    assert rep2.exit_code == 0 and [o.state for o in rep2.outcomes] == ["skipped"] * 4
    assert all(o.earlier for o in rep2.outcomes)
    assert remote_run_dirs([tmp_path / "loc1", tmp_path / "loc2"]) == runs1
    assert not any(line.startswith("launch") for line in log)

    # one checkpoint changes: only that one runs
    (ck / "step-300" / "config.json").write_text('{"step": 300, "retrained": true}')
    os.utime(ck / "step-300" / "config.json", (time.time() + 5, time.time() + 5))
    rep3 = sweep.Sweep(opts(f"{ck}/step-*", ["locs"], tmp_path), inv, log=log.append).run()
    assert [o.state for o in rep3.outcomes] == ["skipped", "skipped", "succeeded", "skipped"]
    assert len(remote_run_dirs([tmp_path / "loc1", tmp_path / "loc2"])) == 5
    # tau vs step covers every checkpoint the ledger holds for this configuration (earlier sweeps too, the old
    # step-300 as well), with its CI; only tonight's re-run step-300 is marked as this sweep's
    assert sorted((p.step, p.tonight) for p in rep3.history) == \
        [(100, False), (200, False), (300, False), (300, True), (400, False)]
    assert all(p.lo is not None and p.lo <= p.tau <= p.hi for p in rep3.history)
    sweep.write_report_files(rep3)
    _open_sweep_report(rep3.sweep_dir / "report.html")

    # --force re-runs everything, under new run names
    rep4 = sweep.Sweep(opts(f"{ck}/step-*", ["locs"], tmp_path, force=True, latest=2), inv, log=log.append).run()
    assert [(o.checkpoint, o.state) for o in rep4.outcomes] == [("step-300", "succeeded"), ("step-400", "succeeded")]
    assert len(remote_run_dirs([tmp_path / "loc1", tmp_path / "loc2"])) == 7


def _open_sweep_report(page: Path) -> None:
    """The sweep's report.html in headless Chromium (make test installs it; without it this fails, unless skips
    are allowed: tests/whole.py): no console error, no request but the page, the sweep's sections with their plot."""
    from tests import browser, whole
    if browser.chromium_path() is None:  # the HTML itself was checked above
        whole.missing("chromium is not installed (Debian: apt-get install chromium; scripts/install-system-deps)")
        return
    probe = ("JSON.stringify([...document.querySelectorAll('section[id]')]"
             ".map(s => [s.id, s.querySelectorAll('svg').length]))")
    rep = browser.open_page(page.as_uri(), probe)
    assert rep.console_errors == [] and rep.exceptions == [] and rep.requests == [page.as_uri()]
    got = dict(json.loads(rep.probe))
    assert list(got)[:3] == ["sweep", "tau-vs-step", "comparison"] and got["tau-vs-step"] == 1
    assert {"per-position", "histogram", "ddtree", "per-prompt", "definitions", "provenance"} <= set(got)


def test_resumed_sweep_keeps_its_runs_when_the_payload_changed(tmp_path, monkeypatch):
    """The root cause of a flaky kill/resume: the ledger key holds the payload version (a hash of the local
    remote_payload/ tree), so an edit between the kill and the re-run gave every checkpoint a new key and run
    name, and the resumed sweep launched all of them again. Its own runs are now found by checkpoint."""
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [1, 2, 3])
    inv = local_inventory(tmp_path, 1)
    o = opts(f"{ck}/step-*", ["loc1"], tmp_path)
    rep = sweep.Sweep(o, inv).run()
    assert rep.exit_code == 0 and [x.state for x in rep.outcomes] == ["succeeded"] * 3
    # make it look killed: unfinished sweep, step-2 launched (its run is there), step-3 not launched yet
    protocol.atomic_write_json(rep.sweep_dir / "sweep.json",
                               {**protocol.read_json(rep.sweep_dir / "sweep.json"), "complete": False})
    lg = ledger.Ledger(tmp_path / "sweeps" / "ledger.json")
    by = {e.checkpoint: e for e in lg.entries.values()}
    lg.put(entry_from(by["step-2"], state=ledger.LAUNCHED, tau=None, local_path=None))
    del lg.entries[by["step-3"].key]
    lg.put(by["step-1"])
    (tmp_path / "loc1" / "runs" / by["step-3"].run).rename(tmp_path / "gone")
    before = set(remote_run_dirs([tmp_path / "loc1"]))

    monkeypatch.setattr(sweep.schedule, "local_manifest_hash", lambda: "someone-edited-remote_payload")
    log: list[str] = []
    rep2 = sweep.Sweep(o, inv, log=log.append).run()
    assert rep2.sweep_id == rep.sweep_id and rep2.exit_code == 0, log
    assert [(x.checkpoint, x.state, x.earlier) for x in rep2.outcomes] == \
        [("step-1", "succeeded", False), ("step-2", "succeeded", False), ("step-3", "succeeded", False)]
    assert [x.run for x in rep2.outcomes[:2]] == [by["step-1"].run, by["step-2"].run]
    assert [line.split(" · ")[0] for line in log if line.startswith(("launch", "attach"))] == \
        ["attach  step-2: run " + by["step-2"].run + " on loc1", "launch  step-3 on loc1"]
    after = set(remote_run_dirs([tmp_path / "loc1"]))
    assert len(after) == 3 and before < after  # step-3 ran once (under the new payload's key), nothing else
    assert rep2.outcomes[2].run != by["step-3"].run
    assert "resume  2 run(s) kept from before a payload/cache change (not run again)" in log


def test_failed_eval_is_reported_not_retried(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [1, 2])
    inv_path = tmp_path / "hosts.yaml"
    inv_path.write_text(f"hosts:\n  loc1:\n    local: true\n    workdir: {tmp_path / 'loc1'}\n"
                        f"    python: {sys.executable}\n    venv: {{mode: python}}\n    gpus: none\n")
    argv = ["-i", str(inv_path), "sweep", "--checkpoints", f"{ck}/step-*", "--hosts", "loc1", "--payload", "dummy",
            "--sweep-dir", str(tmp_path / "sweeps"), "--poll-s", "0.2", "--json",
            "--", "--lines", "2", "--interval-s", "0.05", "--exit-code", "1"]
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 1, err
    js = json.loads(out)
    assert [c["state"] for c in js["checkpoints"]] == ["failed", "failed"]
    assert js["checkpoints"][0]["error"].startswith("exit 1")
    assert "exit 1 (an eval failed)" in err
    assert len(list((tmp_path / "loc1" / "runs").iterdir())) == 2
    # run again: failed evals are reported from the ledger, not launched again (and not this sweep's failure)
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 0 and [c["state"] for c in json.loads(out)["checkpoints"]] == ["failed", "failed"]
    assert len(list((tmp_path / "loc1" / "runs").iterdir())) == 2


def test_sweep_needs_target_and_cache_for_a_real_eval(tmp_path, capsys):
    rc = cli.main(["sweep", "--checkpoints", f"{tmp_path}/step-*", "--hosts", "local"])
    assert rc == 3 and "needs --target and --cache" in capsys.readouterr().err


def fake_gpus(bin_dir: Path, rows: str) -> Path:
    """A fake `nvidia-smi` (a seam: no GPU here) answering both queries (hostcheck's 5 columns, the wrapper's
    4) from `gpus.csv` (`index, memory.used, memory.total, utilization.gpu` rows), so tests can change it."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    csv = bin_dir / "gpus.csv"
    csv.write_text(rows)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncase \"$1\" in *name*) awk -F', ' '{{print $1\", Fake GPU, \"$3\", \"$2\", \"$4}}' "
                   f"{csv};;\n*) cat {csv};;\nesac\n")
    smi.chmod(0o755)
    return csv


def test_no_free_gpu_requeues_never_fails(tmp_path, monkeypatch):
    """The wrapper on the host picks and locks GPUs; a launch it refuses ("no free GPU") goes back in the
    queue: nothing in the ledger, no run dir. All busy all along: not-run (exit 2), run by the next sweep."""
    monkeypatch.chdir(tmp_path)
    csv = fake_gpus(tmp_path / "bin", "0, 50000, 97871, 99\n1, 60000, 97871, 97\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    ck = make_checkpoints(tmp_path, [1, 2, 3])
    inv = local_inventory(tmp_path, 1)
    inv.hosts["loc1"].gpus = "auto"
    o = opts(f"{ck}/step-*", ["loc1"], tmp_path, retries=2)
    log: list[str] = []
    rep = sweep.Sweep(o, inv, log=log.append).run()
    assert rep.exit_code == 2, log
    assert [x.state for x in rep.outcomes] == ["not-run"] * 3 and "no free GPU" in rep.outcomes[0].error
    assert "host    loc1: ready · 2 GPU slot(s)" in log
    assert any(line.startswith("busy    step-") and "requeued" in line for line in log)
    assert ledger.Ledger(tmp_path / "sweeps" / "ledger.json").entries == {}  # no failure recorded
    assert not list((tmp_path / "loc1" / "runs").iterdir())

    # GPUs idle now, but GPU 1 locked by someone else's run: everything runs on GPU 0, one after another
    csv.write_text("0, 5, 97871, 0\n1, 5, 97871, 0\n")
    (tmp_path / "loc1" / "locks").mkdir(exist_ok=True)
    fd = os.open(tmp_path / "loc1" / "locks" / "gpu1.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        rep2 = sweep.Sweep(o, inv, log=log.append).run()
    finally:
        os.close(fd)
    assert rep2.exit_code == 0 and rep2.sweep_id == rep.sweep_id, log
    assert [x.state for x in rep2.outcomes] == ["succeeded"] * 3
    for x in rep2.outcomes:
        assert protocol.read_json(tmp_path / "loc1" / "runs" / x.run / "status.json")["gpus"] == [0]
    assert len(list((tmp_path / "loc1" / "runs").iterdir())) == 3
    assert {e.state for e in ledger.Ledger(tmp_path / "sweeps" / "ledger.json").entries.values()} == {"succeeded"}


def test_bad_baseline_fails_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [1])
    inv_path = tmp_path / "hosts.yaml"
    inv_path.write_text(f"hosts:\n  loc1:\n    local: true\n    workdir: {tmp_path / 'loc1'}\n"
                        f"    python: {sys.executable}\n    venv: {{mode: python}}\n    gpus: none\n")

    def sweep_with(baseline: str) -> int:
        return cli.main(["-i", str(inv_path), "sweep", "--checkpoints", f"{ck}/step-*", "--hosts", "loc1",
                         "--payload", "dummy", "--sweep-dir", str(tmp_path / "sweeps"), "--baseline", baseline,
                         "--", *DUMMY])
    assert sweep_with("nope") == 102
    err = capsys.readouterr().err
    assert "--baseline: run 'nope' not found" in err and "reval compare --pull" in err
    run_dir = tmp_path / "runs" / "ref" / "unfinished"
    run_dir.mkdir(parents=True)
    protocol.atomic_write_json(run_dir / "status.json", {"state": "failed", "exit_code": 1})
    assert sweep_with("unfinished") == 3
    err = capsys.readouterr().err
    assert "--baseline 'unfinished': " in err and "has no results.json" in err
    assert not (tmp_path / "sweeps").exists() and not (tmp_path / "loc1").exists()  # nothing ran, nothing written
    with pytest.raises(RunNotFound):  # the library path checks as early: before the ledger is even read
        sweep.Sweep(opts(f"{ck}/step-*", ["loc1"], tmp_path, baseline="nope"), local_inventory(tmp_path, 1))


# ---- real sshd hosts --------------------------------------------------------------------------------------

@pytest.mark.ssh
@pytest.mark.slow
def test_sweep_over_three_hosts_one_goes_away_then_resumes(ssh_hosts, tmp_path, monkeypatch):
    cluster = ssh_hosts(3)
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [1000, 2000, 3000, 4000, 5000, 6000, 7000])
    inv = load_inventory(cluster.inventory_path)
    o = opts(f"{ck}/step-*", ["cluster"], tmp_path, retries=2)
    o.spec = dataclasses.replace(o.spec, extra=["--lines", "10", "--interval-s", "0.3"])  # ~3 s per run
    log: list[str] = []
    sw = sweep.Sweep(o, inv, log=log.append)
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(rep=sw.run()))
    th.start()
    # take ssh3 away once it has a run going: launched (the launch command returned: its `launch` line is
    # logged) and running there; cutting the launch command itself is another test's business
    deadline = time.monotonic() + 120
    while not (list((cluster.hosts[2].workdir / "runs").glob("*/status.json"))
               and any(line.startswith("launch") and " on ssh3 " in line for line in log)):
        assert time.monotonic() < deadline and th.is_alive(), log
        time.sleep(0.05)
    cluster.stop(2)
    th.join(timeout=240)
    assert not th.is_alive()
    rep = result["rep"]
    first = {o.checkpoint: o for o in rep.outcomes}
    states = {c: o.state for c, o in first.items()}
    assert rep.exit_code == 2, log
    gone = [c for c, s in states.items() if s == "unreachable"]
    # the run going on ssh3; and, when that slot's long poll was also to start its next (staged) run once the
    # first ended, that job too (whether it started is unknown after the cut): both stay ssh3's
    assert 1 <= len(gone) <= 2 and all(s in ("succeeded", "unreachable") for s in states.values()), states
    assert all(first[c].host == "ssh3" for c in gone), [first[c] for c in gone]
    assert sum(s == "succeeded" for s in states.values()) == 7 - len(gone)
    assert "ssh3" in rep.hosts_down and any("ssh3: gone" in line for line in log)
    workdirs = [h.workdir for h in cluster.hosts]
    ssh3 = cluster.hosts[2].workdir
    before = remote_run_dirs(workdirs)
    # the one on ssh3 kept running there (the host was only cut off); a second one may have started
    assert 7 - len(gone) + 1 <= len(before) <= 7
    assert sum(w == ssh3 for w in before.values()) >= 1

    # the host comes back: the same command re-attaches to what it started there and pulls it; a job whose
    # start the cut left unknown is re-attached or, never started, launched there; nothing runs twice
    cluster.start(2)
    log.clear()
    rep2 = sweep.Sweep(o, load_inventory(cluster.inventory_path), log=log.append).run()
    assert rep2.exit_code == 0, log
    by = {o.checkpoint: o for o in rep2.outcomes}
    assert [o.state for o in rep2.outcomes] == ["succeeded"] * 7  # the resumed sweep reports all of them
    for c in gone:
        assert by[c].state == "succeeded" and by[c].host == "ssh3" and not by[c].earlier
    launched = [line for line in log if line.startswith("launch")]
    again = [c for c in gone if any(line.startswith(f"launch  {c} on ssh3 ") for line in launched)]
    assert len(again) == len(launched) <= len(gone) - 1, log  # at most the one whose start was unknown
    after = remote_run_dirs(workdirs)  # (fails on a run folder on two hosts)
    assert {k: v for k, v in after.items() if k in before} == before
    assert len(after) == 7 == len(before) + len(launched) and all(after[k] == ssh3 for k in set(after) - set(before))
    assert rep2.sweep_id == rep.sweep_id  # the unfinished sweep was resumed, not a new one


@pytest.mark.ssh
def test_long_poll_brings_the_ended_runs_files(ssh_hosts, tmp_path, monkeypatch):
    """Over real sshd: the long poll that sees a run end (and starts the slot's next run, or has none to start)
    also brings the ended run's files (one SSH session a run fewer): no run is pulled on its own; every pulled
    copy is the host's, byte for byte, its follow state finished. A run too large to ride is pulled on its own,
    the same."""
    from orchestrator.backends import base, ssh
    from orchestrator.rundir.registry import load_follow_state
    cluster = ssh_hosts(2)
    monkeypatch.chdir(tmp_path)
    streamed: list[str] = []
    real_pull = base.pull_run
    monkeypatch.setattr(base, "pull_run", lambda t, name, **kw: streamed.append(name) or real_pull(t, name, **kw))
    ck = make_checkpoints(tmp_path, [1, 2, 3, 4, 5, 6])
    o = opts(f"{ck}/step-*", ["cluster"], tmp_path)
    o.poll_s = 5.0  # the call that sees a run end is the one that brings its files
    log: list[str] = []
    rep = sweep.Sweep(o, load_inventory(cluster.inventory_path), log=log.append).run()
    assert rep.exit_code == 0 and [x.state for x in rep.outcomes] == ["succeeded"] * 6, log
    assert streamed == [], (streamed, log)
    where = remote_run_dirs([h.workdir for h in cluster.hosts])
    for x in rep.outcomes:
        remote = where[x.run] / "runs" / x.run
        for f in protocol.RUN_FILES:  # an eval has no caches.json (an extract run's): each one it has
            if (remote / f).exists():
                assert (Path(x.local_path) / f).read_bytes() == (remote / f).read_bytes(), (x.run, f)
            else:
                assert not (Path(x.local_path) / f).exists(), (x.run, f)
        assert load_follow_state(x.host, x.run).get("finished") is True, x.run
    # too large to ride: every run pulled on its own (none lost, none twice)
    streamed.clear()
    monkeypatch.setattr(ssh, "PULL_MAX_BYTES", 100)
    ck2 = make_checkpoints(tmp_path / "b", [7, 8, 9, 10])
    o2 = opts(f"{ck2}/step-*", ["cluster"], tmp_path / "b")
    rep2 = sweep.Sweep(o2, load_inventory(cluster.inventory_path), log=log.append).run()
    assert rep2.exit_code == 0 and [x.state for x in rep2.outcomes] == ["succeeded"] * 4, log
    assert sorted(streamed) == sorted(x.run for x in rep2.outcomes)
    assert all((Path(x.local_path) / "results.json").exists() for x in rep2.outcomes)


@pytest.mark.ssh
@pytest.mark.slow
def test_killed_controller_resumes_without_repeating_runs(ssh_hosts, tmp_path):
    cluster = ssh_hosts(2)
    ck = make_checkpoints(tmp_path, [10, 20, 30, 40, 50, 60])
    argv = [sys.executable, "-m", "reval", "-i", str(cluster.inventory_path), "sweep",
            "--checkpoints", f"{ck}/step-*", "--hosts", "cluster", "--payload", "dummy", "--poll-s", "0.2",
            "--sweep-dir", str(tmp_path / "sweeps"), "--json", "--", "--lines", "8", "--interval-s", "0.25"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ledger_path = tmp_path / "sweeps" / "ledger.json"
    deadline = time.monotonic() + 120
    try:
        while True:  # kill it while some runs are finished and others still going
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()
            try:
                entries = json.loads(ledger_path.read_text())["entries"].values()
            except (OSError, ValueError):
                entries = []
            if any(e["state"] == "succeeded" for e in entries) and any(e["state"] == "launched" for e in entries):
                break
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
        p.stdout.close()
        p.stderr.close()
    workdirs = [h.workdir for h in cluster.hosts]
    finished_before = {e["run"]: e for e in json.loads(ledger_path.read_text())["entries"].values()
                       if e["state"] == "succeeded"}
    started = {n: protocol.read_json(w / "runs" / n / "status.json")["started_at"]
               for n, w in remote_run_dirs(workdirs).items() if (w / "runs" / n / "status.json").exists()}

    r = subprocess.run(argv, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    js = json.loads(r.stdout)
    assert [c["state"] for c in js["checkpoints"]] == ["succeeded"] * 6
    assert not any(c["earlier"] for c in js["checkpoints"])  # one sweep, resumed
    after = remote_run_dirs(workdirs)
    entries = [(e["checkpoint"], e["run"], e["state"], e["sweep"], e["config"][7:15])
               for e in json.loads(ledger_path.read_text())["entries"].values()]
    assert len(after) == 6, (sorted(after), entries, r.stderr)  # every checkpoint ran exactly once
    for n, t0 in started.items():  # nothing that had started was started again
        assert protocol.read_json(after[n] / "runs" / n / "status.json")["started_at"] == t0
    final_runs = {c["run"] for c in js["checkpoints"]}
    assert set(finished_before) <= final_runs  # finished before the kill: pulled and reported, not re-run
    assert "resume  sweep" in r.stderr


class _CutTransport:
    """A real SSH transport whose folded "run over -> launch the next" script (the slot's long poll) has the
    connection cut once: the sshd session serving it killed (`kill -9 $PPID`: the client sees the connection
    drop, exit 255) either before the launch part (nothing started) or after it (started, the answer lost). Both
    cuts sit where only a call that saw the run end gets: a long poll that ran out first is not the one cut."""

    def __init__(self, inner, flag: Path, where: str):
        self.inner, self.flag, self.where = inner, flag, where

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def workdir(self):
        return self.inner.workdir

    @workdir.setter
    def workdir(self, value):
        self.inner.workdir = value

    def run(self, cmd, **kw):
        from orchestrator.backends.ssh import OVER
        if f"echo {OVER}" in cmd:
            cut = f"if mkdir {self.flag} 2>/dev/null; then kill -9 $PPID; exit 0; fi"
            cmd = cmd.replace(f"echo {OVER}", f"{cut}\necho {OVER}", 1) if self.where == "before" \
                else cmd.replace('echo "@@STATUS"', f'{cut}\necho "@@STATUS"', 1)  # the run started, no answer
        return self.inner.run(cmd, **kw)


def _cut_sweep(cluster, tmp_path, where: str, retries: int, log: list[str]):
    from orchestrator.backends.ssh import SSHBackend
    from orchestrator.sweep.stage import HostPool
    ck = make_checkpoints(tmp_path, [1, 2, 3])
    inv = load_inventory(cluster.inventory_path)
    o = opts(f"{ck}/step-*", ["ssh1"], tmp_path, retries=retries)
    flag = tmp_path / f"cut-{where}"
    pool = HostPool(o, inv, log=log.append, backend_for=lambda h, t: SSHBackend(h, _CutTransport(t, flag, where)))
    rep = sweep.Sweep(o, inv, log=log.append, hosts=pool).run()
    assert flag.is_dir(), log  # the cut happened, in a folded call
    return o, rep


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.parametrize("where", ["before", "after"])
def test_folded_long_poll_and_launch_survive_a_cut_connection(ssh_hosts, tmp_path, monkeypatch, where):
    """The slot's long poll starts the next run in the same SSH command once the run ended. The connection cut
    between the end and the launch (nothing started) or after the launch (started, its answer lost): the call is
    retried, and every checkpoint runs exactly once (a started run is found by its name and re-attached)."""
    cluster = ssh_hosts(1)
    monkeypatch.chdir(tmp_path)
    log: list[str] = []
    _, rep = _cut_sweep(cluster, tmp_path, where, 3, log)
    assert rep.exit_code == 0, log
    assert [x.state for x in rep.outcomes] == ["succeeded"] * 3, log
    assert any("retry 1/2" in line for line in log), log
    runs = remote_run_dirs([cluster.hosts[0].workdir])
    assert sorted(runs) == sorted(x.run for x in rep.outcomes)  # each one run, once
    attached = [line for line in log if line.startswith("attach")]
    assert len(attached) == (1 if where == "after" else 0), log  # the started one, found by its name
    assert [line.split()[1].rstrip(":") for line in log if line.startswith(("launch", "attach"))] == \
        ["step-1", "step-2", "step-3"], log
    entries = ledger.Ledger(tmp_path / "sweeps" / "ledger.json").entries.values()
    assert sorted(e.state for e in entries) == ["succeeded"] * 3


@pytest.mark.ssh
@pytest.mark.slow
def test_folded_call_cut_for_good_leaves_both_runs_to_the_next_sweep(ssh_hosts, tmp_path, monkeypatch):
    """No retry left when the folded call loses its connection after the launch: the host leaves the sweep (exit
    2), the run that ended and the one that may have started are both `unreachable` with the ledger saying
    `launched`; the next sweep re-attaches to both, pulls them and runs the last one: each ran once."""
    cluster = ssh_hosts(1)
    monkeypatch.chdir(tmp_path)
    log: list[str] = []
    o, rep = _cut_sweep(cluster, tmp_path, "after", 1, log)
    assert rep.exit_code == 2, log
    assert [x.state for x in rep.outcomes] == ["unreachable", "unreachable", "not-run"], log
    entries = {e.checkpoint: e.state for e in ledger.Ledger(tmp_path / "sweeps" / "ledger.json").entries.values()}
    assert entries == {"step-1": "launched", "step-2": "launched"}, entries
    log.clear()
    rep2 = sweep.Sweep(o, load_inventory(cluster.inventory_path), log=log.append).run()
    assert rep2.exit_code == 0, log
    assert [x.state for x in rep2.outcomes] == ["succeeded"] * 3, log
    assert sorted(line.split()[1].rstrip(":") for line in log if line.startswith("attach")) == ["step-1", "step-2"], log
    assert [line.split()[1] for line in log if line.startswith("launch")] == ["step-3"], log
    assert sorted(remote_run_dirs([cluster.hosts[0].workdir])) == sorted(x.run for x in rep2.outcomes)


@pytest.mark.ssh
@pytest.mark.slow
def test_real_eval_sweep_of_trained_checkpoints(ssh_hosts, tmp_path, monkeypatch, trained_fixtures):
    """The tiny trained drafters (checkpoints along training) evaluated for real over 3 sshd hosts."""
    root = Path(trained_fixtures)
    steps = sorted((root / "drafters").glob("step-*"))
    assert len(steps) >= 2, steps
    cluster = ssh_hosts(3)
    monkeypatch.chdir(tmp_path)
    o = sweep.SweepOptions(checkpoints=[f"{root}/drafters/step-*"], hosts=["cluster"], 
                           spec=EvalSpec(target=str(root / "target"), cache=str(root / "cache"), num_prompts=3,
                                         max_blocks=30, extra=["--device", "cpu", "--dtype", "fp32"]),
                           sweep_dir=str(tmp_path / "sweeps"), poll_s=2.0, backoff_s=0.2)
    log: list[str] = []
    rep = sweep.Sweep(o, load_inventory(cluster.inventory_path), log=log.append).run()
    assert rep.exit_code == 0, log
    assert [x.state for x in rep.outcomes] == ["succeeded"] * len(steps)
    assert [x.checkpoint for x in rep.outcomes] == [s.name for s in steps]
    assert rep.outcomes[-1].tau > rep.outcomes[0].tau  # trained beats untrained (step-0000)
    # one checkpoint hash: the ledger's entry and the run's results.json name the same content
    entries = {e.run: e for e in ledger.Ledger(tmp_path / "sweeps" / "ledger.json").entries.values()}
    for x in rep.outcomes:
        res = compare.load_run(x.local_path).results
        assert entries[x.run].content_hash == res["drafter"]["content_hash"]
        assert res["drafter"]["content_hash"].startswith("sha256-64MiB-tree:")
    first = compare.load_run(rep.outcomes[0].local_path)
    cmp = compare.build_comparison([compare.load_run(x.local_path) for x in rep.outcomes[1:]], first)
    assert not cmp.differences  # one cache, one prompt set, one set of options: comparable


@pytest.mark.ssh
@pytest.mark.slow
def test_checkpoints_on_another_host_relayed_then_that_host_goes_away(ssh_hosts, tmp_path, monkeypatch):
    """Checkpoints on ssh2, the sweep on ssh1: relayed through here (the relay copy deleted once staged).
    ssh2 stopped before its checkpoints are copied: they are not-run (exit 2), ssh1 stays in, the sweep ends."""
    cluster = ssh_hosts(2)
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [1, 2, 3])
    inv = load_inventory(cluster.inventory_path)
    log: list[str] = []
    rep = sweep.Sweep(opts(f"ssh2:{ck}/step-*", ["ssh1"], tmp_path, latest=1), inv, log=log.append).run()
    assert rep.exit_code == 0 and [(x.checkpoint, x.state, x.host) for x in rep.outcomes] == \
        [("step-3", "succeeded", "ssh1")], log
    h16 = sweep.local_content_hash(ck / "step-3").split(":")[-1][:16]
    staged = cluster.hosts[0].workdir / "checkpoints" / h16
    assert (staged / "step-3.complete").exists() and (staged / "step-3" / "sub" / "extra.bin").read_bytes() == b"x" * 3
    assert not list((tmp_path / "sweeps" / "relay").iterdir())  # the laptop's relay copy is gone

    def stop_ssh2_once_planned(line: str) -> None:
        log.append(line)
        if " to run on " in line:
            cluster.stop(1)
    o = opts(f"ssh2:{ck}/step-*", ["ssh1"], tmp_path, retries=2)
    rep2 = sweep.Sweep(o, load_inventory(cluster.inventory_path), log=stop_ssh2_once_planned).run()
    assert rep2.exit_code == 2, log
    assert [(x.checkpoint, x.state) for x in rep2.outcomes] == \
        [("step-1", "not-run"), ("step-2", "not-run"), ("step-3", "skipped")], log
    assert all("ssh2" in x.error and "unreachable" in x.error for x in rep2.outcomes[:2])
    assert "ssh2" in rep2.hosts_down and "ssh1" not in rep2.hosts_down
    assert len(list((cluster.hosts[0].workdir / "runs").iterdir())) == 1  # nothing more launched
    assert not list((tmp_path / "sweeps" / "relay").iterdir())
    assert {e.state for e in ledger.Ledger(tmp_path / "sweeps" / "ledger.json").entries.values()} == {"succeeded"}


def _sweep_one_named_cache(here: Path, inv: list[str], hosts: str) -> dict:
    """`reval sweep ... --cache gsm8k=/eval/x` (exactly one named cache) through the CLI; sweep.json's options."""
    ck = make_checkpoints(here, [100])
    rc = cli.main([*inv, "sweep", "--checkpoints", f"{ck}/step-*", "--hosts", hosts, "--target", "/eval/t",
                   "--cache", "gsm8k=/eval/x", "--payload", "dummy", "--poll-s", "0.2", "--", *DUMMY])
    assert rc == 0
    [saved] = list((here / "sweeps").glob("*/sweep.json"))
    return json.loads(saved.read_text())["options"]


def test_one_named_cache_is_one_suite_on_the_local_host(tmp_path, monkeypatch):
    """The bug the one spec fixed: exactly one NAME=PATH became the path '<cwd>/gsm8k=/eval/x' on local."""
    monkeypatch.chdir(tmp_path)
    saved = _sweep_one_named_cache(tmp_path, [], "local")
    assert saved["cache"] == ["gsm8k=/eval/x"] and saved["spec"]["cache"] == [{"path": "/eval/x", "name": "gsm8k"}]


@pytest.mark.ssh
def test_one_named_cache_is_one_suite_on_a_remote_host(ssh_hosts, tmp_path, monkeypatch):
    """... and on a remote host it was refused as a relative path; now it is the suite gsm8k at /eval/x."""
    cluster = ssh_hosts(1)
    monkeypatch.chdir(tmp_path)
    saved = _sweep_one_named_cache(tmp_path, ["-i", str(cluster.inventory_path)], "cluster")
    assert saved["cache"] == ["gsm8k=/eval/x"] and saved["spec"]["cache"] == [{"path": "/eval/x", "name": "gsm8k"}]
