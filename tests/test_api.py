"""The `reval` Python API on its own (no `reval` subprocess, no CLI): an eval of the trained fixtures on the
local host through reval.submit -> Run.events()/wait() -> Result, compared with another run; the better
drafter wins. Also: nothing in the library prints, and help(reval) documents the verbs."""
from __future__ import annotations

import json
import pydoc
import shutil
import sys
from pathlib import Path

import pytest

import reval
from remote_payload.contract import protocol
from tests.runtools import wait_lines

CPU = ["--device", "cpu", "--dtype", "fp32"]


@pytest.fixture
def inv(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the built-in `local` host (.reval/local) is this test's too
    monkeypatch.setenv("REVAL_RUNS_DIR", str(tmp_path / "runs"))
    path = tmp_path / "hosts.yaml"
    path.write_text(f"hosts:\n  box:\n    local: true\n    workdir: {tmp_path / 'work'}\n    python: {sys.executable}\n"
                    "    venv: {mode: python}\n    gpus: none\n")
    return reval.Inventory.load(path)


def test_api_eval_on_trained_fixtures_and_the_better_drafter_wins(inv, tmp_path, trained_fixtures, capsys):
    root = Path(trained_fixtures)
    paths = json.loads((root / "fixtures.json").read_text())["paths"]

    def spec(drafter: str) -> reval.EvalSpec:
        return reval.EvalSpec(drafter=str(root / drafter), target=str(root / paths["target"]),
                              cache=str(root / paths["cache"]), num_prompts=3, max_blocks=20, extra=CPU)

    early = reval.submit(inv["box"], spec(paths["drafters"][0]), name="api-early")
    assert early.ref == "box/api-early" and early.state in ("running", "succeeded")
    events = list(early.events())
    assert any(isinstance(e, reval.LogLine) and "Loading drafter" in e.text for e in events)
    steps = [e.step for e in events if isinstance(e, reval.Progress) and e.step is not None]
    assert steps and max(steps) == 5
    prompts = [e for e in events if isinstance(e, reval.Progress) and e.stage == "eval_prompt"]
    assert [(e.i, e.n) for e in prompts] == [(1, 3), (2, 3), (3, 3)] and "tau" in prompts[0].metrics
    res_early = early.wait()
    assert isinstance(res_early, reval.Result) and res_early.state == protocol.SUCCEEDED
    assert res_early.path == tmp_path / "runs" / "box" / "api-early"

    seen = []
    res_good = reval.submit(inv["box"], spec(paths["drafter_good"]), name="api-good").wait(on_event=seen.append)
    assert any(isinstance(e, reval.Progress) and e.stage == "done" for e in seen)
    assert res_good.per_prompt[0].acceptance_lengths and res_good.health.suspect is False  # the typed result
    assert res_good.metrics.tau == res_good.results["metrics"]["tau"] > res_early.metrics.tau

    cmp = reval.compare([res_early, reval.load(tmp_path / "runs" / "box" / "api-good")], baseline=res_early)
    assert cmp.comparable and not cmp.differences
    assert cmp.best == "api-good"
    rows = {r["label"]: r for r in cmp.rows}
    assert rows["api-good"]["metrics"]["tau"] > rows["api-early"]["metrics"]["tau"]
    assert rows["api-good"]["vs_baseline"]["tau"]["ratio"] > 1
    out, err = capsys.readouterr()
    assert out == "" and err == ""  # the library prints nothing


def test_api_errors_are_one_line_and_leave_nothing(inv, tmp_path):
    bad = reval.EvalSpec(drafter=str(tmp_path / "no-such-drafter"), target=str(tmp_path), cache=str(tmp_path))
    with pytest.raises(reval.Error, match="no-such-drafter does not exist") as e:
        reval.submit(inv["box"], bad, name="api-bad")
    assert e.value.exit_code == 3
    assert not (tmp_path / "work" / "runs" / "api-bad").exists()
    assert not (tmp_path / "runs" / "box" / "api-bad").exists()
    with pytest.raises(reval.Error, match="unknown host 'nope'"):
        inv["nope"]
    with pytest.raises(reval.Error, match="missing --target, --cache"):
        reval.submit(inv["box"], reval.EvalSpec(drafter="/d"))


def test_api_submit_refuses_a_runs_folder_that_is_a_file_before_anything_starts(inv, tmp_path):
    """The follow state goes into runs/ the moment a run exists: a `runs` that is a file refuses the submit
    before the host has a run (the CLI checks it too, before syncing)."""
    d = tmp_path / "d"
    d.mkdir()
    (tmp_path / "runs").write_text("not a folder\n")
    with pytest.raises(reval.Error, match="it is not a folder") as e:
        reval.submit(inv["box"], reval.EvalSpec(drafter=str(d), target=str(d), cache=str(d)), name="api-rf")
    assert e.value.exit_code == 3 and not (tmp_path / "work" / "runs" / "api-rf").exists()


def test_help_documents_the_api():
    text = pydoc.render_doc(reval, renderer=pydoc.plaintext)
    for verb in ("Inventory.load", "reval.submit", "run.events()", "run.wait()", "reval.load", "reval.compare"):
        assert verb in text, verb
    for name in ("submit", "attach", "load", "compare", "Run", "EvalSpec", "Result", "Progress"):
        assert name in reval.__all__ and getattr(reval, name).__doc__


def test_attach_with_a_bad_run_name_raises_the_api_error():
    import reval
    for bad in ("a/b", "-rf", ".."):
        with pytest.raises(reval.Error, match="run name"):
            reval.attach("local", bad)


# -- the CLI's verbs as API calls: the same components the CLI tests use (a local host, a real sshd) ----------
DUMMY = ["--lines", "3", "--interval-s", "0"]


def dummy(*extra: str) -> reval.EvalSpec:
    return reval.EvalSpec(payload="dummy", extra=[*DUMMY, *extra])


def test_api_run_verbs_mirror_the_cli(inv, tmp_path, capsys):
    """submit -> finish, status, ls (a host, or the runs known here), logs with offsets, pull, pull_all, kill
    (of a run that ended, and of a running one), and the typed objects they return."""
    run = reval.submit(inv["box"], dummy(), name="v1")
    assert run.launch is not None and run.launch.name == "v1" and not run.reattached
    fin = run.finish()
    assert isinstance(fin, reval.Finished) and fin.ok and fin.exit_code == 0 and not fin.discarded
    assert fin.result.metrics.tau > 0 and fin.path == tmp_path / "runs/box/v1" and fin.last_lines == []
    assert repr(fin) == f"reval.Finished(box/v1: succeeded, exit 0 · {fin.path})"

    s = reval.status("v1", inventory=inv)  # a bare name, found in runs/ here
    assert isinstance(s, reval.RunState) and (s.host, s.name, s.state) == ("box", "v1", "succeeded")
    listing = reval.ls("box", inventory=inv)
    assert [r.name for r in listing.runs] == ["v1"] and listing.unreachable == {}
    assert listing.to_json()[0]["state"] == "succeeded"
    assert [r.name for r in reval.ls("box", here=True, inventory=inv).runs] == ["v1"]

    log = reval.logs("box/v1", inventory=inv)
    data = (tmp_path / "work/runs/v1/eval.log").read_bytes()
    assert log.data == data and log.start == 0
    for line in log.lines():  # every offset points at its line in eval.log
        assert data[line.offset:].split(b"\n", 1)[0].decode() == line.text
    tail = reval.logs("v1", tail=2, inventory=inv)
    assert [x.text for x in tail.lines()] == data.decode().splitlines()[-2:] and tail.start > 0

    (fin.path / "eval.log").write_text("damaged\n")
    p = reval.pull("v1", inventory=inv)
    assert (p.host, p.name, p.state) == ("box", "v1", "succeeded") and "results.json" in p.files
    assert (fin.path / "eval.log").read_bytes() == data
    every = reval.pull_all("box", inventory=inv)
    assert [(x.name, x.state) for x in every.runs] == [("v1", "succeeded")] and every.unreachable == {}

    k = reval.kill("v1", inventory=inv)
    assert k.already_ended and k.state.state == "succeeded"
    busy = reval.submit(inv["box"], reval.EvalSpec(payload="dummy", extra=["--lines", "1000", "--interval-s",
                                                                           "0.05"]), name="v2")
    wait_lines(tmp_path / "work/runs/v2/eval.log", 3)
    assert busy.state == "running" and busy.status().alive
    k = busy.kill(grace_s=2)
    assert not k.already_ended and k.state.state == "cancelled" and busy.state == "cancelled"
    with pytest.raises(reval.Error) as e:
        reval.status("box/nope", inventory=inv)
    assert e.value.exit_code == 102
    out, err = capsys.readouterr()
    assert out == "" and err == ""  # the library prints nothing


def test_api_removal_is_planned_then_applied(inv, tmp_path):
    for name, extra in (("good", []), ("crash", ["--crash"])):
        reval.submit(inv["box"], dummy(*extra), name=name).finish()
    plan = reval.plan_prune("box", failed=True, inventory=inv)
    assert [(r.name, r.state, r.remote, r.local) for r in plan.runs] == [("crash", "failed", True, True)]
    assert (tmp_path / "work/runs/crash").is_dir()  # nothing removed by planning
    assert [r.name for r in plan.apply()] == ["crash"]
    assert not (tmp_path / "work/runs/crash").exists() and not (tmp_path / "runs/box/crash").exists()
    # every host: box and the built-in local; just ended, by the host's own clock
    assert reval.prune(older_than_s=86400, inventory=inv).runs == []
    with pytest.raises(reval.Error, match="--failed and/or --older-than"):
        reval.plan_prune(inventory=inv)
    busy = reval.submit(inv["box"], reval.EvalSpec(payload="dummy", extra=["--lines", "1000", "--interval-s",
                                                                           "0.05"]), name="busy")
    try:
        with pytest.raises(reval.Error, match="box/busy is still running") as e:
            reval.plan_rm(["good", "busy"], inventory=inv)  # all or nothing
        assert e.value.exit_code == 3
    finally:
        busy.kill(grace_s=2)
    gone = reval.rm("box/good", local_only=True, inventory=inv)
    assert [(r.name, r.remote, r.local) for r in gone.runs] == [("good", False, True)]
    assert (tmp_path / "work/runs/good").is_dir() and not (tmp_path / "runs/box/good").exists()


def test_api_bad_input_is_cleaned_up_once_and_the_name_is_free(inv, tmp_path):
    """The payload's exit 3 after launch: finish() says so (exit_code 3, the log's tail) and has removed the run
    on both sides; wait() raises the same; the name is free again."""
    fin = reval.submit(inv["box"], dummy("--exit-code", "3"), name="bad").finish()
    assert (fin.state, fin.exit_code, fin.discarded) == ("failed", 3, True) and fin.last_lines
    assert not (tmp_path / "work/runs/bad").exists() and not (tmp_path / "runs/box/bad").exists()
    with pytest.raises(reval.Error) as e:
        reval.submit(inv["box"], dummy("--exit-code", "3"), name="bad").wait()
    assert e.value.exit_code == 3 and e.value.finished.discarded and "bad: failed (exit 3)" in str(e.value)
    assert reval.submit(inv["box"], dummy(), name="bad").wait().state == "succeeded"


def test_api_prepares_once_and_reattaches(inv, tmp_path):
    prep = reval.prepare(inv["box"])
    assert prep.host == "box" and prep.python and prep.workdir == str(tmp_path / "work")
    spec = dummy()
    first = reval.submit("box", spec, name="once", prepared=prep, inventory=inv)
    again = reval.submit("box", spec, name="once", prepared=prep, inventory=inv, reattach=True)
    assert again.reattached and again.ref == first.ref and again.launch is None  # not a second run
    assert again.finish().ok
    with pytest.raises(reval.Error, match="already used"):  # seen to its end: the same command is a new run
        reval.submit("box", spec, name="once", prepared=prep, inventory=inv, reattach=True)
    with pytest.raises(reval.Error, match="prepared for box"):
        reval.submit(reval.Host(name="other", local=True), spec, prepared=prep)


def test_api_load_and_compare_take_names_and_read_short(inv, tmp_path):
    for name in ("c1", "c2"):
        reval.submit(inv["box"], dummy(), name=name).finish()
    res = reval.load("c1")  # NAME, HOST/NAME or a folder, as the CLI takes them
    assert res.path == tmp_path / "runs/box/c1" and reval.load("box/c1").path == res.path
    text = repr(res)
    assert text == f"reval.Result(box/c1: succeeded · tau {res.metrics.tau:.2f} · {res.path})"
    assert "per_prompt" not in text and len(text) < 200
    cmp = reval.compare(["c1", "box/c2"], baseline="c1")
    assert cmp.comparable and cmp.best in ("c1", "c2") and repr(cmp).startswith("reval.Comparison(2 runs vs c1")
    (tmp_path / "runs/box/c2/results.json").unlink()  # a copy pulled part way: succeeded, no results.json
    for call in (lambda: reval.load("c2"), lambda: reval.compare(["c1"], baseline="c2"),
                 lambda: reval.compare(["c1", "c2"])):
        with pytest.raises(reval.Error, match=r"run box/c2: it succeeded but .*c2/results\.json is missing"
                           ) as e:
            call()  # was an AttributeError at the first res.metrics
        assert e.value.exit_code == 3 and "reval pull box/c2" in e.value.hint
    html = cmp.write_html(tmp_path / "r.html")
    assert html.read_text().startswith("<!DOCTYPE html>")


def test_api_sweep_and_sync_and_hosts_check(inv, tmp_path):
    from tests.sweeptools import make_checkpoints
    ckpts = make_checkpoints(tmp_path, [100, 200])
    opts = reval.SweepOptions(checkpoints=[f"{ckpts}/step-*"], hosts=["box"],
                              spec=reval.EvalSpec(payload="dummy", extra=DUMMY),
                              sweep_dir=str(tmp_path / "sweeps"), poll_s=0.2, backoff_s=0.2)
    lines = []
    rep = reval.sweep(opts, inventory=inv, on_line=lines.append)
    assert isinstance(rep, reval.SweepReport) and rep.exit_code == 0 and lines
    assert sorted(o.state for o in rep.outcomes) == ["succeeded", "succeeded"]
    assert Path(rep.files["html"]).is_file() and Path(rep.files["markdown"]).is_file()
    with pytest.raises(reval.Error, match="needs --target and --cache"):
        reval.sweep(reval.SweepOptions(checkpoints=["x"], hosts=["box"]), inventory=inv)
    [synced] = reval.sync("box", inventory=inv)
    assert isinstance(synced, reval.HostSync) and synced.ok and synced.sync.method == "none"
    [check] = reval.check_hosts("box", inventory=inv)
    assert isinstance(check, reval.HostCheck) and check.ok and check.payload == "current"


@pytest.mark.ssh
def test_api_over_a_real_sshd(ssh_hosts, here):
    """The same calls over OpenSSH: hosts check, sync, submit/wait, find by a bare name (searching the hosts),
    kill, and a host that went down named in ls (exit 2 in the CLI) and raising exit 4 for one run."""
    c = ssh_hosts(2)
    inv = reval.Inventory.load(c.inventory_path)
    assert [r.ok for r in reval.check_hosts("cluster", inventory=inv)] == [True, True]
    assert all(s.ok for s in reval.sync("cluster", inventory=inv))
    res = reval.submit(inv["ssh1"], dummy(), name="r1").wait()
    assert res.state == "succeeded" and res.path == here / "runs/ssh1/r1"
    assert (res.path / "eval.log").read_bytes() == (c.hosts[0].workdir / "runs/r1/eval.log").read_bytes()
    reval.submit(inv["ssh2"], reval.EvalSpec(payload="dummy", extra=["--lines", "1000", "--interval-s", "0.05"]),
                 name="r2")
    wait_lines(c.hosts[1].workdir / "runs/r2/eval.log", 3)
    shutil.rmtree(here / "runs/ssh2/r2")  # not known here: found by asking every host
    assert reval.find("r2", inventory=inv).ref == "ssh2/r2"
    assert reval.kill("r2", inventory=inv).state.state == "cancelled"
    c.stop(0)
    listing = reval.ls(inventory=inv)
    assert [r.name for r in listing.runs] == ["r2"] and list(listing.unreachable) == ["ssh1"]
    with pytest.raises(reval.Error) as e:
        reval.status("ssh1/r1", inventory=inv)
    assert e.value.exit_code == 4


def test_help_reads_well_and_results_repr_short():
    text = pydoc.render_doc(reval, renderer=pydoc.plaintext)
    assert "class Result(" in text and "Result = class" not in text
    for verb in ("status(", "ls(", "logs(", "pull(", "pull_all(", "kill(", "plan_rm(", "plan_prune(", "rm(",
                 "prune(", "sweep(", "sync(", "check_hosts(", "prepare(", "build_fixtures(", "find(", "check_spec("):
        assert verb in text, verb
    for name in reval.__all__:
        assert getattr(reval, name).__doc__, name


def test_extract_spec_names_what_a_prompt_file_is_when_it_is_not_one(tmp_path):
    """A prompt file is read here and copied to the host: a folder, a FIFO (reading it would block) or a missing
    path is refused when the spec is made, each named for what it is (the FIFO used to be called missing)."""
    import os
    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)
    for path, says in ((fifo, "not a regular file"), (tmp_path, "a folder, not a file"),
                       (tmp_path / "none.jsonl", "no such file here")):
        with pytest.raises(reval.Error, match=says) as e:
            reval.ExtractSpec(target="/models/T", prompts=[f"a={path}"], layers="1")
        assert e.value.exit_code == 3
        with pytest.raises(reval.Error, match=says):  # run/sweep --prompts: refused when the spec is made (a
            reval.EvalSpec(drafter="/d", target="/t", prompts=[f"a={path}"])  # sweep hashed the FIFO: it hung)
