"""Trustworthy comparisons on real evals (the trained fixtures, the seeds' scenario): the good drafter against an
early checkpoint is a clear paired win, a drafter against itself is exactly 0, two checkpoints closer than
the noise are `no clear change` with the CI printed; the demo's comparison fits 100 columns; CSV/JSON carry
what the table shows; the HTML report opens in a real headless Chromium with no console error, no request
and every section and plot, and passes an HTML5 validity check."""
from __future__ import annotations

import csv
import io
import json
import re

import pytest

from orchestrator import sweep
from orchestrator.render import formats, tables
from orchestrator.results import compare, stats
from orchestrator.sweep.ledger import LedgerEntry
from remote_payload.__main__ import main as payload_main
from reval import cli
from tests import browser
from tests.resultsgen import render_text

# drafter-good is the final checkpoint (step 400) of the same training run as drafters/step-*
DRAFTERS = {"good": "drafter-good", "good2": "drafter-good", "step-0080": "drafters/step-0080",
            "step-0320": "drafters/step-0320"}


@pytest.fixture(scope="module")
def evals(trained_fixtures, tmp_path_factory):
    """runs/local/<name>/ for four real evals: 10 prompts, 30 blocks (the demo's settings), as pulled runs."""
    root = tmp_path_factory.mktemp("evals") / "runs"
    for name, drafter in DRAFTERS.items():
        rc = payload_main(["eval", "--drafter", str(trained_fixtures / drafter),
                           "--target", str(trained_fixtures / "target"), "--cache", str(trained_fixtures / "cache"),
                           "--run-dir", str(root / "local" / name), "--device", "cpu", "--max-blocks", "30",
                           "--ddtree-budgets", "16,64"])
        assert rc == 0, name
    return root


def _cmp(root, names, baseline):
    return compare.compare([root / "local" / n for n in names], root / "local" / baseline)


def test_good_drafter_vs_early_checkpoint_is_a_clear_paired_win(evals):
    cmp = _cmp(evals, ["step-0080"], "good")
    early = next(r for r in cmp.runs if r.name == "step-0080")
    tau = cmp.paired(early)["tau"]
    assert tau.n == 10 and tau.delta < 0 and tau.delta_hi < 0 and tau.excludes_zero  # the good one wins
    assert tau.p_value < 0.01 and stats.classify_change(tau, 0.1) == "regressed"
    est = cmp.estimates(early)["tau"]
    assert est.lo < early.result.metrics.tau < est.hi and est.n == 10 and est.sd > 0
    text = render_text([tables.paired_table(cmp)], width=100)
    shown = tables.fmt_delta(tau, 2)
    assert re.search(r"-\d+\.\d\d \[-\d+\.\d\d, -\d+\.\d\d\] \*", shown) and shown in text


def test_a_drafter_against_itself_is_exactly_zero(evals):
    cmp = _cmp(evals, ["good2"], "good")
    p = cmp.paired(next(r for r in cmp.runs if r.name == "good2"))
    for key in ("tau", "tau_pooled", "ddtree_best", "pos1_acc"):
        assert (p[key].delta, p[key].delta_lo, p[key].delta_hi) == (0.0, 0.0, 0.0), key
        assert p[key].p_value == 1.0 and not p[key].excludes_zero
    assert "+0.00 [+0.00, +0.00]" in render_text([tables.paired_table(cmp)], width=100)


def test_checkpoints_closer_than_the_noise_are_no_clear_change_with_the_ci(evals):
    """Through the sweep report's own path: the ledger's series, the pulled runs, the verdict, the line."""
    runs = {320: evals / "local" / "step-0320", 400: evals / "local" / "good"}  # step 400 = the good drafter
    series = [LedgerEntry(f"k{s}", f"step-0{s}", "x", f"h{s}", s, "local", f"step-0{s}", "succeeded", "s1",
                          tau=compare.load_run(d).result.metrics.tau, local_path=str(d)) for s, d in runs.items()]
    o = sweep.Outcome("step-0400", 400, "succeeded", "local", "step-0400", series[1].tau,
                      local_path=series[1].local_path)
    sweep.attach_comparisons([o], series, None, 0.1)
    assert o.prev_checkpoint == "step-0320" and o.vs_prev is not None
    assert not o.vs_prev.significant  # the one rule: the CI excludes 0 AND p < 0.05 (here p 0.0625)
    assert o.verdict == "no clear change"
    line = sweep.outcome_text(o)
    assert f"Δ {tables.fmt_ci(o.vs_prev.delta_lo, o.vs_prev.delta_hi, 2, sign=True)}" in line.replace(
        f"{o.vs_prev.delta:+.2f} ", "") and "no clear change" in line
    assert (f"(p {tables.fmt_p(o.vs_prev.p_value)})" in line) == o.vs_prev.disagree  # why a CI off 0 has no star


def test_demo_comparison_fits_100_columns(evals):
    """The demo compares the early checkpoint with the final drafter as the baseline."""
    cmp = _cmp(evals, ["step-0080"], "good")
    ts = [tables.main_table(cmp), tables.paired_table(cmp)]
    text = render_text(ts, width=100)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    for run in cmp.runs:  # numbers never cut: every value and interval the cells hold is there whole
        for col in ("tau", "ddtree_best", "pos1_acc"):
            cell = ts[0].rows[cmp.runs.index(run)].cells[col]
            assert cell.text in text and formats.ci_text(cell, next(c for c in ts[0].columns if c.key == col)) in text
    assert "good (base)" in text and "tok/round" in text and "teacher-" in text
    flat = " ".join(text.split())  # the legend wraps at 100 columns
    assert "[a, b] = 95% bootstrap CI over prompts" in flat
    assert "* = a difference the data supports: the CI excludes 0 and p < 0.05" in flat
    assert tables.fmt_ratio(cmp.paired(cmp.runs[1])["tau"]) in text
    wide = render_text(ts, width=400, wide=True)
    assert "DDT" in wide and "streak" in wide and max(len(line) for line in wide.splitlines()) > 100


def test_cli_table_csv_and_json_carry_every_value(evals, capsys, monkeypatch):
    monkeypatch.setenv("REVAL_RUNS_DIR", str(evals))
    rc = cli.main(["compare", "step-0080", "--baseline", "good", "--format", "csv"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(out))}
    early, good = rows["step-0080"], rows["good"]
    assert early["size"] == "10x30" and good["best_ddtree_budget"] in ("16", "64")
    assert float(early["tau_lo"]) < float(early["tau"]) < float(early["tau_hi"]) and early["tau_n"] == "10"
    assert float(early["tau_delta_hi"]) < 0 and float(early["tau_p"]) < 0.01 and early["tau_mde"]
    rc = cli.main(["compare", "step-0080", "--baseline", "good", "--format", "json"])
    js = json.loads(capsys.readouterr().out)
    e = js["runs"][1]
    assert e["intervals"]["tau"]["n"] == 10 and e["vs_baseline"]["tau"]["paired"]["ci_excludes_0"] is True
    assert e["intervals"]["tau"]["resamples"] == stats.RESAMPLES and e["size"] == "10x30"
    rc = cli.main(["compare", "step-0080", "--baseline", "good"])  # a pipe: the natural width, not 80
    out = capsys.readouterr().out
    assert rc == 0 and max(len(line) for line in out.splitlines()) > 80 and "Δ tau" in out


def test_html_report_in_headless_chromium(evals, tmp_path, capsys, monkeypatch):
    html5lib = pytest.importorskip("html5lib", reason="html5lib is a dev dependency (pyproject [dev])")
    if browser.chromium_path() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    monkeypatch.setenv("REVAL_RUNS_DIR", str(evals))
    page = tmp_path / "report.html"
    rc = cli.main(["compare", "step-0080", "step-0320", "--baseline", "good", "--html", str(page)])
    assert rc == 0 and f"html    {page}" in capsys.readouterr().err
    text = page.read_text()
    html5lib.HTMLParser(strict=True).parse(text)  # raises on any HTML5 parse error
    assert not re.search(r"""(src|href)=["'](?!#)""", text) and "<script" not in text and "@import" not in text
    probe = ("JSON.stringify({sections: [...document.querySelectorAll('section[id]')].map(s => [s.id, "
             "s.querySelectorAll('svg').length, s.querySelectorAll('table').length]), "
             "h1: document.querySelector('h1').textContent, cells: document.querySelectorAll('td').length})")
    rep = browser.open_page(page.as_uri(), probe)
    assert rep.console_errors == [] and rep.exceptions == []
    assert rep.requests == [page.as_uri()]  # the page itself, nothing else
    got = {sid: (svgs, tabs) for sid, svgs, tabs in json.loads(rep.probe)["sections"]}
    assert list(got) == ["comparison", "per-position", "histogram", "ddtree", "per-prompt", "definitions",
                         "provenance"]
    assert got["comparison"][1] == 2 and got["per-position"][0] == 2 and got["histogram"][0] == 1
    assert got["ddtree"][0] == 1 and got["per-prompt"][1] == 1 and got["provenance"][1] == 1
    for needle in ("sha256-64MiB-tree:", "teacher-forced", "paired by prompt vs good", " * <span class=\"word\">"):
        assert needle in text
    _assert_not_blank(rep.screenshot_png)


def _assert_not_blank(png: bytes) -> None:
    import matplotlib.image
    import numpy as np
    img = matplotlib.image.imread(io.BytesIO(png))[..., :3]
    assert img.shape[0] > 800 and img.shape[1] >= 1000
    dark = (img.mean(axis=2) < 0.5).mean()
    assert 0.005 < dark < 0.5 and float(np.std(img)) > 0.05, f"screenshot looks blank ({dark:.4f} dark pixels)"
