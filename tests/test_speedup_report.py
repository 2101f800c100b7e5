"""Issue 29 item 3 on the laptop: `reval compare --wide` shows the projected speedup at every batch size measured
(a row per run and method, best or within noise marked, where it stops paying), CSV and JSON carry it, and the
HTML report has a speedup-vs-batch plot per method (checked in a real headless Chromium). The runs are real tiny
evals with --speedup on the CPU fixtures (batches 1 and 4; the second run reuses the first's latency table)."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from orchestrator.render import formats
from orchestrator.render import speedup as batch_view
from orchestrator.results import compare
from remote_payload.__main__ import main as payload_main
from tests import browser
from tests.runtools import reval

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(fx, tmp_path_factory) -> Path:
    """runs/h/{good, early}: the good drafter and an early checkpoint, both with --speedup at batch 1 and 4."""
    root = tmp_path_factory.mktemp("batch")
    for name, drafter in (("good", fx["drafter_good"]), ("early", fx["target"].parent / "drafters" / "step-0080")):
        argv = ["eval", "--drafter", str(drafter), "--target", str(fx["target"]), "--cache", str(fx["cache"]),
                "--device", "cpu", "--num-prompts", "3", "--max-blocks", "4", "--ddtree-budgets", "16",
                "--speedup", "--speedup-batches", "1,4", "--speedup-repeats", "2",
                "--latency-table", str(root / "latency.json"), "--run-dir", str(root / "runs" / "h" / name)]
        assert payload_main(argv) == 0
    return root / "runs" / "h"


def _by_batch(runs: Path, name: str) -> list[dict]:
    return json.loads((runs / name / "results.json").read_text())["speedup"]["by_batch"]


def _text(v: float, row: dict, m: str) -> str:
    return f"{v:.2f}x" + (" best" if row["best_method"] == m else " ≈" if m in row["tied"] else "")


def test_wide_shows_the_projection_per_batch_and_method_within_100_columns(runs, capsys, monkeypatch):
    monkeypatch.chdir(runs.parent.parent)
    cmp = compare.compare([compare.load_run(runs / n) for n in ("good", "early")])
    t = batch_view.batch_table(cmp)
    assert [c.label for c in t.columns] == ["run", "method", "batch\n1", "batch\n4", "stops\npaying"]
    assert [(r.cells["run"].text, r.cells["method"].text) for r in t.rows] == [
        ("good", "block"), ("", "DDT-16"), ("early", "block"), ("", "DDT-16")]
    for name, rows in (("good", t.rows[:2]), ("early", t.rows[2:])):
        stored = _by_batch(runs, name)
        stops = json.loads((runs / name / "results.json").read_text())["speedup"]["stops_paying"]
        for row, m in zip(rows, ("block", "ddtree_16")):
            for b in stored:  # every figure is the stored projection, marked as the payload judged it
                assert row.cells[f"b{b['batch']}"].text == _text(b["projected"][m], b, m)
                assert row.cells[f"b{b['batch']}"].best == (b["best_method"] == m)
            assert row.cells["stops"].text == ("-" if stops[m] is None else f"at {stops[m]}")
    assert formats.natural_width([t]) <= 100
    rc, out, err = reval(capsys, "compare", "h/good", "h/early", "--wide")
    assert rc == 0 and "projected speedup by batch size" in out and "stops paying" in " ".join(out.split()), err
    rc, out, _ = reval(capsys, "compare", "h/good", "h/early")
    assert "projected speedup by batch size" not in out  # the default table stays the headline
    rc, out, _ = reval(capsys, "compare", "h/good", "h/early", "--wide", "--format", "csv")
    rows = list(csv.reader(io.StringIO(out)))
    assert rc == 0 and any(r[:2] == ["good", "block"] for r in rows)
    rc, out, _ = reval(capsys, "compare", "h/good", "h/early", "--json")
    assert json.loads(out)["runs"][0]["speedup"]["by_batch"] == _by_batch(runs, "good")


def test_the_html_report_plots_speedup_against_batch_per_method(runs, tmp_path, capsys, monkeypatch):
    html5lib = pytest.importorskip("html5lib", reason="html5lib is a dev dependency (pyproject [dev])")
    if browser.chromium_path() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    monkeypatch.chdir(runs.parent.parent)
    page = tmp_path / "r.html"
    rc, _, err = reval(capsys, "compare", "h/good", "h/early", "--html", str(page))
    assert rc == 0, err
    text = page.read_text()
    html5lib.HTMLParser(strict=True).parse(text)
    probe = ("JSON.stringify({sections: [...document.querySelectorAll('section[id]')].map(s => [s.id, "
             "s.querySelectorAll('svg').length, s.querySelectorAll('table').length, "
             "[...s.querySelectorAll('figcaption')].map(f => f.textContent.split(':')[0])]), "
             "nav: [...document.querySelectorAll('nav a')].map(a => a.textContent)})")
    rep = browser.open_page(page.as_uri(), probe)
    assert rep.console_errors == [] and rep.exceptions == [] and rep.requests == [page.as_uri()]
    got = json.loads(rep.probe)
    sections = {sid: (svgs, tabs, caps) for sid, svgs, tabs, caps in got["sections"]}
    assert sections["speedup"] == (2, 1, ["block", "DDT-16"])  # one plot per method, the table beside them
    assert got["nav"][:3] == ["comparison", "speedup", "per-position"]
    speed = text[text.index('id="speedup"'):text.index('id="per-position"')]
    first = _by_batch(runs, "good")[0]
    assert _text(first["projected"]["block"], first, "block") in speed
    assert speed.count("<svg") == 2 and "batch size" in speed
