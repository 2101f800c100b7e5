"""The `reval` Python API on its own (no `reval` subprocess, no CLI): an eval of the trained fixtures on the
local host through reval.submit -> Run.events()/wait() -> Result, compared with another run; the better
drafter wins. Also: nothing in the library prints, and help(reval) documents the verbs."""
from __future__ import annotations

import json
import pydoc
import sys
from pathlib import Path

import pytest

import reval
from remote_payload.contract import protocol

CPU = ["--device", "cpu", "--dtype", "fp32"]


@pytest.fixture
def inv(tmp_path, monkeypatch):
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
    assert not (tmp_path / "work" / "runs" / "api-bad").exists() and not (tmp_path / "runs" / "box" / "api-bad").exists()
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
