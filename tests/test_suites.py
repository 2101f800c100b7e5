"""Benchmark suites: one eval process over several caches (weights loaded once), per-suite metrics equal to
one-cache runs of the same caches, their mean, and `reval compare --by suite` (text, CSV, JSON, HTML)."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from orchestrator.render import suites
from orchestrator.results import compare, intervals
from remote_payload.__main__ import main as payload_main
from remote_payload.contract.results import Result
from remote_payload.contract.spec import EvalSpec, SpecError, parse_caches
from tests.runtools import reval

SPLITS = {"gsm": (0, 3), "mt": (3, 6), "he": (6, 10)}


@pytest.fixture(scope="module")
def caches(trained_fixtures, tmp_path_factory) -> dict[str, Path]:
    """Three suites cut from the fixture cache (their prompt files linked, their own cache.json)."""
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    src = trained_fixtures / meta["paths"]["cache"]
    index = json.loads((src / "cache.json").read_text())
    root = tmp_path_factory.mktemp("suites")
    out = {}
    for name, (a, b) in SPLITS.items():
        d = root / name
        d.mkdir()
        sub = {**index, "prompts": index["prompts"][a:b]}
        (d / "cache.json").write_text(json.dumps(sub))
        for p in sub["prompts"]:
            (d / p["file"]).symlink_to(src / p["file"])
        out[name] = d
    return out


@pytest.fixture(scope="module")
def fx(trained_fixtures) -> dict[str, Path]:
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    return {k: trained_fixtures / v for k, v in meta["paths"].items() if isinstance(v, str)}


def _eval(run_dir: Path, fx, *caches: str) -> dict:
    argv = ["eval", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]), "--device", "cpu",
            "--max-blocks", "6", "--run-dir", str(run_dir)]
    for c in caches:
        argv += ["--cache", c]
    assert payload_main(argv) == 0
    return json.loads((run_dir / "results.json").read_text())


@pytest.fixture(scope="module")
def evals(caches, fx, tmp_path_factory) -> Path:
    """runs/h/{three, three2 (same suites), gsm, mt, he (one cache each)}."""
    runs = tmp_path_factory.mktemp("suite-runs") / "runs" / "h"
    _eval(runs / "three", fx, *(f"{n}={p}" for n, p in caches.items()))
    _eval(runs / "three2", fx, *(f"{n}={p}" for n, p in caches.items()))
    for n, p in caches.items():
        _eval(runs / n, fx, str(p))
    return runs


def test_each_suite_equals_a_one_cache_run_of_that_cache(evals):
    three = json.loads((evals / "three" / "results.json").read_text())
    assert [s["name"] for s in three["suites"]] == list(SPLITS)
    taus = []
    for s in three["suites"]:
        one = json.loads((evals / s["name"] / "results.json").read_text())
        a, b = s["prompt_range"]
        mine = three["per_prompt"][a:b]
        assert [p["name"] for p in mine] == [f"{s['name']}/{p['name']}" for p in one["per_prompt"]]
        assert [p["acceptance_lengths"] for p in mine] == [p["acceptance_lengths"] for p in one["per_prompt"]]
        assert s["metrics"] == one["metrics"] and s["comparability"] == one["comparability"]
        assert s["cache"]["fingerprint"] == one["cache"]["fingerprint"]
        taus.append(one["metrics"]["tau"])
    assert three["suite_mean"]["tau"] == pytest.approx(sum(taus) / 3)
    assert three["suite_mean"]["num_suites"] == 3
    assert three["metrics"]["num_prompts"] == 10 and len(three["per_prompt"]) == 10  # pooled at the top level
    Result.load(evals / "three" / "results.json")  # the typed schema reads it back


def test_compare_by_suite_table_intervals_equal_the_one_cache_runs(evals, capsys, monkeypatch):
    monkeypatch.chdir(evals.parent.parent)
    cmp = compare.compare([compare.load_run(evals / "three"), compare.load_run(evals / "three2")])
    t = suites.suite_table(cmp)
    assert [c.label for c in t.columns] == ["run", "gsm", "mt", "he", "mean\nover suites"]
    for n in SPLITS:
        cell = t.rows[0].cells[f"suite:{n}"]
        one = compare.load_run(evals / n).result
        est = intervals.estimates(one)["tau"]
        assert (cell.value, cell.est.lo, cell.est.hi) == (one.metrics.tau, est.lo, est.hi)
    rc, out, err = reval(capsys, "compare", "h/three", "h/three2", "--by", "suite")
    assert rc == 0, err
    assert "tau by suite" in out and "gsm" in out and "mean" in out and "over suites" in out
    assert f"[{est.lo:.2f}, {est.hi:.2f}]" in out
    rc, out, _ = reval(capsys, "compare", "h/three", "--by", "suite", "--format", "json")
    data = json.loads(out)
    assert data["suites"] == list(SPLITS) and set(data["runs"][0]["suites"]) == set(SPLITS)
    assert data["runs"][0]["suites"]["he"]["interval"]["n"] == 4
    rc, out, _ = reval(capsys, "compare", "h/three", "h/three2", "--by", "suite", "--format", "csv")
    rows = list(csv.reader(io.StringIO(out)))
    assert rc == 0 and any("gsm" in c for c in rows[0]) and len(rows) >= 3
    html = evals.parent.parent / "r.html"
    rc, _, err = reval(capsys, "compare", "h/three", "h/three2", "--html", str(html))
    assert rc == 0, err
    assert "tau by suite" in html.read_text()


def test_a_suite_over_another_cache_is_marked_not_ranked(evals, caches, fx, tmp_path):
    """The same suite name over a different cache is shown with ≠ and never ranked."""
    other = _eval(tmp_path / "runs" / "h" / "swapped", fx, f"gsm={caches['mt']}", f"mt={caches['gsm']}",
                  f"he={caches['he']}")
    assert other["suites"][0]["cache"]["fingerprint"] != json.loads(
        (evals / "three" / "results.json").read_text())["suites"][0]["cache"]["fingerprint"]
    cmp = compare.compare([compare.load_run(evals / "three"), compare.load_run(tmp_path / "runs/h/swapped")],
                          allow_incomparable=True)
    t = suites.suite_table(cmp)
    swapped = t.rows[1].cells["suite:gsm"]
    assert swapped.text.endswith(suites.MISMATCH) and swapped.value is None and not swapped.best
    assert any("not comparable" in n for n in t.notes)
    assert t.rows[0].cells["suite:he"].value == t.rows[1].cells["suite:he"].value


def test_cache_arguments_name_suites_or_refuse():
    one = EvalSpec(cache=["/x/cache"])
    assert (one.cache_label(), one.suites()) == ("/x/cache", None)
    two = EvalSpec(cache=["gsm=/e/gsm", "/e/mtbench/"])
    assert two.suites() == [("gsm", "/e/gsm"), ("mtbench", "/e/mtbench/")]
    assert two.cache_label() == "gsm=/e/gsm,mtbench=/e/mtbench/"
    for bad, want in ((["a=/x", "a=/y"], "suite name 'a' is given twice"),
                      (["/x/c", "/y/c"], "suite name 'c' is given twice")):
        with pytest.raises(SpecError, match=want):
            parse_caches(bad)


def test_reval_run_evaluates_suites_on_a_host(caches, fx, here, capsys):
    """`reval run HOST --cache NAME=PATH ...`: preflight checks every cache, the pulled run holds the suites."""
    argv = ["run", "local", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]),
            "--max-blocks", "4", "--name", "suites"]
    bad = argv + ["--cache", f"gsm={caches['gsm']}", "--cache", f"mt={here / 'missing'}"]
    rc, _, err = reval(capsys, *bad)
    assert rc == 3 and "missing" in err and not (here / "runs" / "local" / "suites").exists()
    for n, p in caches.items():
        argv += ["--cache", f"{n}={p}"]
    rc, _out, err = reval(capsys, *argv)
    assert rc == 0, err
    res = json.loads((here / "runs" / "local" / "suites" / "results.json").read_text())
    assert [s["name"] for s in res["suites"]] == list(SPLITS) and res["suite_mean"]["num_suites"] == 3


@pytest.mark.parametrize("bad", [[1], [2, 1], [0, 999], [-1, 2]])
def test_a_damaged_suite_range_is_one_line_not_a_traceback(evals, tmp_path, capsys, monkeypatch, bad):
    data = json.loads((evals / "three" / "results.json").read_text())
    data["suites"][0]["prompt_range"] = bad
    run = tmp_path / "runs" / "h" / "damaged"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    rc, _out, err = reval(capsys, "compare", "h/damaged", "--by", "suite")
    assert rc == 3 and "suites[0].prompt_range" in err and "Traceback" not in err
    (run / "results.json").unlink()  # damaged on purpose: not one the suite's round-trip check reads


def test_preflight_names_the_suite_whose_cache_does_not_fit(caches, fx, tmp_path, capsys):
    """A layer mismatch in one of several suites: the one line says which suite's cache is wrong."""
    bad = tmp_path / "mtwrong"
    bad.mkdir()
    index = json.loads((caches["mt"] / "cache.json").read_text())
    (bad / "cache.json").write_text(json.dumps({**index, "layer_ids": [0, 1, 2, 3]}))
    for p in index["prompts"]:
        (bad / p["file"]).symlink_to((caches["mt"] / p["file"]).resolve())
    argv = ["preflight", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"])]
    assert payload_main([*argv, "--cache", f"gsm={caches['gsm']}", "--cache", f"mt={caches['mt']}"]) == 0
    capsys.readouterr()
    assert payload_main([*argv, "--cache", f"gsm={caches['gsm']}", "--cache", f"mt={bad}"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: suite mt: ") and err.count("\n") == 1, err
    # the eval itself (the run the preflight guards, or `eval` by hand) names it too
    run = tmp_path / "runs" / "wrong"
    rc = payload_main(["eval", *argv[1:], "--cache", f"gsm={caches['gsm']}", "--cache", f"mt={bad}", "--device",
                       "cpu", "--max-blocks", "2", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert rc == 3 and err.count("\n") == 1 and not (run / "results.json").exists(), err
    assert err.startswith(f"error: suite mt (--cache mt={bad}): drafter fc expects") and "without layers [4]" in err


def test_num_prompts_per_suite_and_online_above_the_prompts_are_said(caches, fx, tmp_path, capsys):
    """--num-prompts N takes the first N of EACH suite (the log says so, --help too); --online 10 over a first
    suite of 2 prompts decodes 2 and says so in the log and results.json's notes."""
    run = tmp_path / "runs" / "np"
    assert payload_main(["eval", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]), "--device",
                         "cpu", "--cache", f"gsm={caches['gsm']}", "--cache", f"mt={caches['mt']}", "--num-prompts",
                         "2", "--max-blocks", "3", "--online", "10", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    res = json.loads((run / "results.json").read_text())
    assert [s["prompt_range"] for s in res["suites"]] == [[0, 2], [2, 4]]
    assert "suites: gsm, mt (--num-prompts 2 applies per suite: the first 2 prompts of each)" in out
    said = "--online 10: suite gsm (the first) has 2 prompts, so 2 are decoded online"
    assert f"note: {said}" in out and res["notes"] == [said] and res["online"]["prompts"] == 2
    with pytest.raises(SystemExit):
        payload_main(["eval", "--help"])
    assert "with suites, the first N of each suite" in " ".join(capsys.readouterr().out.split())
