"""reval compare in daily use: run globs over the pulled runs (a sweep's checkpoints in step order), the HTML
report telling better from worse (not by colour alone), one decision rule for the star, the verdict and the p,
and report files that follow the umask."""
from __future__ import annotations

import json

import pytest

import reval
from orchestrator import cli
from tests.resultsgen import write_run


@pytest.fixture
def sweep_runs(tmp_path, monkeypatch):
    """runs/<host>/<name>: a sweep's checkpoints (names whose lexical order is not their step order), a
    baseline, a checkpoint without a step, and a run on another host."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REVAL_RUNS_DIR", raising=False)
    root = tmp_path / "runs"
    write_run(root, "ct129", "zlab_full", quality=0.88)
    for step, q in ((500, 0.70), (4000, 0.75), (10000, 0.80)):
        write_run(root, "ct129", f"step-{step}", quality=q, step=step)
    write_run(root, "ct129", "step-final", quality=0.82)
    write_run(root, "pro6000", "step-2000", quality=0.72, step=2000)
    (root / "ct129" / "step-notarun").mkdir()  # a folder without any run file: no run
    return root


def _cli(capsys, *argv):
    rc = cli.main(["compare", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---- 13: globs over the local registry ------------------------------------------------------------------

def test_a_glob_compares_every_matching_pulled_run_in_step_order(sweep_runs, capsys):
    rc, out, err = _cli(capsys, "step-*", "--baseline", "zlab_*", "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["baseline"] == "zlab_full"
    assert [r["label"] for r in data["runs"]] == ["zlab_full", "step-500", "step-2000", "step-4000", "step-10000",
                                                 "step-final"]
    assert [r["host"] for r in data["runs"]][2] == "pro6000"
    rc, out, err = _cli(capsys, "ct129/step-*0", "--format", "json")  # a host part narrows it
    assert rc == 0, err
    assert [r["label"] for r in json.loads(out)["runs"]] == ["step-500", "step-4000", "step-10000"]


def test_a_glob_in_the_api_and_a_run_named_twice_is_compared_once(sweep_runs):
    cmp = reval.compare(["step-?000", "step-4000"], baseline="zlab_full", runs_dir=sweep_runs)
    assert [r["label"] for r in cmp.rows] == ["zlab_full", "step-2000", "step-4000"]
    assert cmp.best == "zlab_full"


def test_a_glob_matching_nothing_is_run_not_found(sweep_runs, capsys):
    rc, out, err = _cli(capsys, "ckpt-*")
    assert rc == 102 and out == "" and "Traceback" not in err
    assert "no pulled run matches 'ckpt-*'" in err.splitlines()[0] and "reval ls" in err
    rc, out, err = _cli(capsys, "step-4000", "--baseline", "nothing*")
    assert rc == 102 and "no pulled run matches 'nothing*'" in err


def test_a_baseline_glob_must_match_exactly_one_run(sweep_runs, capsys):
    rc, out, err = _cli(capsys, "step-500", "--baseline", "step-*")
    assert rc == 3 and out == "" and "Traceback" not in err
    assert "baseline 'step-*' matches 5 runs: ct129/step-500, pro6000/step-2000" in err.splitlines()[0]
    rc, out, err = _cli(capsys, "step-500", "--baseline", "*/zlab*", "--format", "json")
    assert rc == 0 and json.loads(out)["baseline"] == "zlab_full"


def test_a_glob_that_leaves_the_registry_is_refused(sweep_runs, capsys):
    for bad in ("../*", "a/b/c*", "step-*;rm"):
        rc, out, err = _cli(capsys, bad)
        assert rc == 3 and out == "" and "Traceback" not in err, bad
        assert "a run glob is NAME or HOST/NAME" in err, bad
