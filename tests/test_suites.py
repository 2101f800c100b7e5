"""Benchmark suites: one eval process over several caches (weights loaded once), per-suite metrics equal to
one-cache runs of the same caches, their mean, and `reval compare --by suite` (text, CSV, JSON, HTML)."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest

import reval as reval_api
from orchestrator.render import formats, suites
from orchestrator.results import compare, intervals, stats
from remote_payload.__main__ import main as payload_main
from remote_payload.contract.results import Result, ResultsError
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


@pytest.fixture(scope="module")
def more_evals(evals, caches, fx, trained_fixtures) -> Path:
    """evals' folder, and: reordered (three's suites given in another --cache order), two (gsm and mt only),
    renamed (gsm's and mt's caches named gsm8k and mtbench), early (three's suites, an early checkpoint)."""
    runs = evals
    _eval(runs / "reordered", fx, *(f"{n}={caches[n]}" for n in ("he", "gsm", "mt")))
    _eval(runs / "two", fx, f"gsm={caches['gsm']}", f"mt={caches['mt']}")
    _eval(runs / "renamed", fx, f"gsm8k={caches['gsm']}", f"mtbench={caches['mt']}")
    _eval(runs / "early", {**fx, "drafter_good": trained_fixtures / "drafters" / "step-0080"},
          *(f"{n}={p}" for n, p in caches.items()))
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
    assert swapped.text.endswith(suites.MISMATCH) and not swapped.ranked and not swapped.best
    assert swapped.value == other["suites"][0]["metrics"]["tau"]  # shown (and in the CSV), never ranked
    assert any("not comparable" in n for n in t.notes)
    assert t.rows[0].cells["suite:he"].value == t.rows[1].cells["suite:he"].value
    # its mean is over two suites that are not comparable: shown with ≠, never ranked, nothing bolded
    # (the old table bolded both: the swapped run's mean equals three's)
    means = [r.cells["suite_mean"] for r in t.rows]
    assert means[1].text.endswith(suites.MISMATCH) and not means[1].ranked
    assert not means[0].best and not means[1].best


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


# ---- compare --by suite: matched by name and content, suspects marked, Δ against a baseline -------------

def _json(path: Path) -> dict:
    return json.loads((path / "results.json").read_text())


def _suite_taus(results: dict) -> dict:
    return {s["name"]: s["metrics"]["tau"] for s in results["suites"]}


def test_suites_are_matched_by_name_whatever_the_cache_order(more_evals, capsys, monkeypatch):
    """The same suites given in another --cache order: compared suite by suite, the mean ranked (the old
    compare refused them, 'cache differs': the pooled key's fingerprint follows the order)."""
    evals = more_evals
    monkeypatch.chdir(evals.parent.parent)
    rc, out, err = reval(capsys, "compare", "h/three", "h/reordered", "--by", "suite", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["suites"] == list(SPLITS) and data["comparable"] and data["mean_over"] == list(SPLITS)
    for run, name in zip(data["runs"], ("three", "reordered")):
        assert {n: c["tau"] for n, c in run["suites"].items()} == _suite_taus(_json(evals / name))
        assert all(c["comparable"] for c in run["suites"].values()) and run["suite_mean"]["ranked"]
    assert data["runs"][0]["suites"]["he"]["interval"]["n"] == 4  # over that suite's prompts
    api = reval_api.compare(["h/three", "h/reordered"], by="suite")  # ./runs, as the CLI read them
    assert json.loads(formats.render_json(api.by_suite)) == data  # the API's view is the CLI's
    t = suites.suite_table(api.model)
    assert [c.label for c in t.columns] == ["run", "gsm", "mt", "he", "mean\nover suites"]
    for n in SPLITS:  # the same drafter on the same cache: equal, both the best
        a, b = t.rows[0].cells[f"suite:{n}"], t.rows[1].cells[f"suite:{n}"]
        assert a.value == b.value and a.best and b.best
    with pytest.raises(reval_api.Error, match="not comparable"):  # the pooled view keeps its own rule
        reval_api.compare(["h/three", "h/reordered"], runs_dir=evals.parent)


def test_runs_sharing_some_suites_leave_the_others_empty_and_their_mean_unranked(more_evals, capsys,
                                                                                  monkeypatch):
    evals = more_evals
    monkeypatch.chdir(evals.parent.parent)
    rc, out, err = reval(capsys, "compare", "h/three", "h/two", "--by", "suite", "--json")
    assert rc == 0, err  # the old compare refused them
    two = json.loads(out)["runs"][1]
    assert set(two["suites"]) == {"gsm", "mt"} and all(c["comparable"] for c in two["suites"].values())
    assert two["suite_mean"]["comparable"] is False and two["suite_mean"]["ranked"] is False
    t = suites.suite_table(reval_api.compare(["h/three", "h/two"], by="suite", runs_dir=evals.parent).model)
    he = t.rows[1].cells["suite:he"]
    assert he.value is None and he.text == ""  # an empty cell, not a refusal
    assert t.rows[1].cells["suite:gsm"].value == _suite_taus(_json(evals / "two"))["gsm"]
    means = [r.cells["suite_mean"] for r in t.rows]
    assert means[1].text.endswith(suites.MISMATCH) and not means[1].ranked
    assert not means[0].best and not means[1].best  # a mean over 2 suites is not ranked against one over 3
    assert any("over other suites than the reference's (gsm, mt, he)" in n for n in t.notes)


def test_a_one_cache_run_lands_in_the_column_of_its_cache(more_evals, capsys, monkeypatch):
    """h/gsm (one cache: the gsm cache) lands in renamed's gsm8k column (the same cache content); h/he, whose
    cache no suite holds, in a column named by its folder (the old table gave both an empty row)."""
    evals = more_evals
    monkeypatch.chdir(evals.parent.parent)
    rc, out, err = reval(capsys, "compare", "h/renamed", "h/gsm", "h/he", "--by", "suite", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["suites"] == ["gsm8k", "mtbench", "he"]
    gsm, he = data["runs"][1], data["runs"][2]
    renamed = _suite_taus(_json(evals / "renamed"))
    assert gsm["suites"] == {"gsm8k": {**gsm["suites"]["gsm8k"], "suite": "gsm", "comparable": True}}
    assert gsm["suites"]["gsm8k"]["tau"] == _json(evals / "gsm")["metrics"]["tau"] == renamed["gsm8k"]
    assert list(he["suites"]) == ["he"] and gsm["suite_mean"] is None
    rc, out, err = reval(capsys, "compare", "h/renamed", "h/gsm", "h/he", "--by", "suite")
    assert rc == 0 and "gsm: one cache, the same content as suite gsm8k's: in that column" in out
    assert "one cache, named by its folder: he" in out


def test_a_suspect_run_is_marked_in_every_format(evals, tmp_path, capsys, monkeypatch):
    root = tmp_path / "runs" / "h"
    for name in ("three", "sus"):
        (root / name).mkdir(parents=True)
    (root / "three" / "results.json").write_text((evals / "three" / "results.json").read_text())
    sus = {**_json(evals / "three2"), "run": "sus"}
    sus["health"] |= {"suspect": True, "reasons": ["position-1 accuracy 0.000"]}
    (root / "sus" / "results.json").write_text(json.dumps(sus))
    monkeypatch.chdir(tmp_path)
    argv = ("compare", "h/three", "h/sus", "--by", "suite")
    rc, out, err = reval(capsys, *argv)
    assert rc == 0 and "sus (SUSPECT)" in out, err
    rc, out, _ = reval(capsys, *argv, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out.split("\n\n")[0])))
    assert [r["marks"] for r in rows] == ["", "SUSPECT"] and rows[1]["run"] == "sus"
    rc, out, _ = reval(capsys, *argv, "--format", "md")
    assert "sus (SUSPECT)" in out
    rc, out, _ = reval(capsys, *argv, "--json")
    run = json.loads(out)["runs"][1]
    assert run["marks"] == ["SUSPECT"] and run["rankable"] is False and run["suspect_reasons"]
    rc, _, err = reval(capsys, *argv, "--html", str(tmp_path / "r.html"))
    page = (tmp_path / "r.html").read_text()
    assert rc == 0 and "sus (SUSPECT)" in page[page.index('id="suites"'):], err
    t = suites.suite_table(reval_api.compare(["h/three", "h/sus"], by="suite").model)
    assert not any(c.best for c in t.rows[1].cells.values())  # equal to three's, but never ranked


def test_per_suite_delta_against_the_baseline_is_paired_by_prompt(more_evals, capsys, monkeypatch):
    """--baseline: each suite's Δ tau with its paired 95% CI and p over that suite's prompts (stats.paired of
    the two runs' per-prompt tau), the mean over suites' Δ over every prompt weighted 1/n of its suite."""
    evals = more_evals
    monkeypatch.chdir(evals.parent.parent)
    rc, out, err = reval(capsys, "compare", "h/early", "--baseline", "h/three", "--by", "suite", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["baseline"] == "three" and data["runs"][0]["suites"]["gsm"]["vs_baseline"] is None
    early, three = _json(evals / "early"), _json(evals / "three")
    for name, (a, b) in SPLITS.items():
        pp_e, pp_t = early["per_prompt"][a:b], three["per_prompt"][a:b]
        want = stats.paired(*(stats.Sample([p["name"] for p in pp], np.array([p["tau"] for p in pp]),
                                           np.ones(b - a)) for pp in (pp_e, pp_t)))
        got = data["runs"][1]["suites"][name]["vs_baseline"]["paired"]
        assert got["n"] == b - a and got["delta"] == pytest.approx(want.delta)
        assert got["delta_ci"] == pytest.approx([want.delta_lo, want.delta_hi])
        assert got["p_value"] == want.p_value
    mean = data["runs"][1]["suite_mean"]["vs_baseline"]
    assert mean["delta"] == pytest.approx(early["suite_mean"]["tau"] - three["suite_mean"]["tau"])
    lo, hi = mean["paired"]["delta_ci"]
    assert mean["paired"]["n"] == 10 and lo <= mean["delta"] <= hi
    rc, out, err = reval(capsys, "compare", "h/early", "--baseline", "h/three", "--by", "suite")
    assert rc == 0 and "Δ tau by suite vs three, paired by prompt" in out and "Δ gsm" in out, err
    gsm = data["runs"][1]["suites"]["gsm"]["vs_baseline"]["paired"]
    assert f"{gsm['delta']:+.2f} [{gsm['delta_ci'][0]:+.2f}, {gsm['delta_ci'][1]:+.2f}]" in out
    rc, out, _ = reval(capsys, "compare", "h/early", "--baseline", "h/three", "--by", "suite",
                       "--format", "csv")
    header = out.splitlines()[0].split(",")
    assert {"suite:gsm_delta", "suite:gsm_delta_lo", "suite:gsm_p", "suite_mean_delta_hi"} <= set(header)


def test_a_one_cache_baseline_pairs_with_the_suite_over_its_cache(evals, capsys, monkeypatch):
    """Prompt names differ (`gsm/<prompt>` in a suite run): paired by the suite's own prompts all the same."""
    monkeypatch.chdir(evals.parent.parent)
    rc, out, err = reval(capsys, "compare", "h/three", "--baseline", "h/gsm", "--by", "suite", "--json")
    assert rc == 0, err
    three = json.loads(out)["runs"][1]
    assert three["suites"]["gsm"]["vs_baseline"]["paired"]["n"] == 3
    assert three["suites"]["gsm"]["vs_baseline"]["delta"] == 0.0  # the same drafter on the same cache
    assert three["suites"]["mt"]["vs_baseline"] is None  # the baseline has no mt


def test_by_suite_refuses_a_suite_over_another_cache_and_wide(evals, caches, fx, tmp_path, capsys,
                                                              monkeypatch):
    _eval(tmp_path / "runs" / "h" / "swapped", fx, f"gsm={caches['mt']}", f"mt={caches['gsm']}",
          f"he={caches['he']}")
    capsys.readouterr()  # the eval's own lines
    monkeypatch.chdir(tmp_path)
    argv = ("compare", str(evals / "three"), "h/swapped", "--by", "suite")
    rc, out, err = reval(capsys, *argv)
    assert rc == 3 and out == "" and "swapped: suite gsm: cache" in err and "swapped: suite mt: cache" in err
    assert "suite he" not in err
    rc, out, err = reval(capsys, *argv, "--allow-incomparable")
    assert rc == 0 and suites.MISMATCH in out, err
    rc, out, err = reval(capsys, *argv, "--allow-incomparable", "--wide")
    assert rc == 3 and out == "" and err.startswith("error: --wide widens the per-run table") and \
        err.count("\n") == 2  # the line and its hint


def test_a_suite_name_given_twice_in_a_results_file_is_refused(evals, tmp_path, capsys, monkeypatch):
    """Suites are matched by name: a second one of a name was dropped without a word; now one line."""
    data = _json(evals / "three")
    data["suites"][2]["name"] = "gsm"
    with pytest.raises(ResultsError, match=r"suites\[2\]\.name: suite 'gsm' is given twice "
                                           r"\(suites\[0\] too\)"):
        Result.from_dict(data)
    run = tmp_path / "runs" / "h" / "twice"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    rc, out, err = reval(capsys, "compare", "h/twice", "--by", "suite")
    (run / "results.json").unlink()  # broken on purpose: not one of the session's round-trip checks
    assert rc == 3 and out == "" and "suites[2].name" in err and "Traceback" not in err
    assert err.count("\n") <= 2  # the line and its hint
