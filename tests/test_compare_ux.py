"""reval compare in daily use: run globs over the pulled runs (a sweep's checkpoints in step order), the HTML
report telling better from worse (not by colour alone), one decision rule for the star, the verdict and the p,
and report files that follow the umask."""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
from html.parser import HTMLParser
from pathlib import Path

import pytest

import reval
from orchestrator import sweep
from orchestrator.render import html, tables
from orchestrator.results import compare, stats
from orchestrator.sweep.ledger import LedgerEntry
from orchestrator.sweep.report import detection_note
from reval import cli
from tests import browser
from tests.resultsgen import write_run
from tests.sweeptools import local_inventory, make_checkpoints, opts


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


# ---- 14: the HTML report tells better from worse, not by colour alone ---------------------------------------

@pytest.fixture
def checkpoints(tmp_path, monkeypatch):
    """12-prompt runs: step-100 < step-200 < the baseline, each clearly apart (paired p < 0.01)."""
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    for name, q in (("step-100", 0.65), ("step-200", 0.80), ("base", 0.95)):
        write_run(root, "h", name, quality=q, num_prompts=12, step=int(name[5:]) if name != "base" else None)
    return root


def _sweep(root: Path, steps=(100, 200)):
    """The sweep's own path: the ledger's series of runs/h/step-N, the pulled runs, verdicts vs the previous
    checkpoint and vs runs/h/base -> (outcomes, report, comparison)."""
    series = [LedgerEntry(f"k{s}", f"step-{s}", "x", f"h{s}", s, "h", f"step-{s}", "succeeded", "s1",
                          tau=compare.load_run(root / "h" / f"step-{s}").result.metrics.tau,
                          local_path=str(root / "h" / f"step-{s}")) for s in steps]
    outs = [sweep.Outcome(e.checkpoint, e.step, "succeeded", "h", e.run, e.tau, local_path=e.local_path)
            for e in series]
    base = compare.load_run(root / "h" / "base")
    sweep.attach_comparisons(outs, series, base, 0.1)
    rep = sweep.SweepReport("s1", root.parent / "s1", outs, "base", {}, 0.1, baseline_run=base)
    return outs, rep, compare.build_comparison([compare.load_run(e.local_path) for e in series], base)


def _sweep_html(root: Path, steps=(100, 200)) -> tuple[str, list]:
    outs, rep, cmp = _sweep(root, steps)
    return html.render_report("sweep s1", cmp, sweep_table=sweep.report_table(rep), steps=[]), outs


class _Classes(HTMLParser):
    """The whole text (textContent) of every element, by each of its classes, in document order."""

    def __init__(self, text: str):
        super().__init__()
        self.open: list[tuple[str, list[list[str]]]] = []  # (tag, its text buffers) of the elements open now
        self.text: dict[str, list[str]] = {}
        self._bufs: dict[str, list[list[str]]] = {}
        self.feed(text)
        for c, bufs in self._bufs.items():
            self.text[c] = ["".join(b) for b in bufs]

    def handle_starttag(self, tag, attrs):
        if tag in ("meta", "br", "link", "img", "input", "hr"):
            return
        mine = []
        for c in (dict(attrs).get("class") or "").split():
            buf: list[str] = []
            self._bufs.setdefault(c, []).append(buf)
            mine.append(buf)
        self.open.append((tag, mine))

    def handle_endtag(self, tag):
        while self.open and self.open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        for _, bufs in self.open:
            for buf in bufs:
                buf.append(data)


def _spans(text: str, cls: str) -> list[str]:
    return _Classes(text).text.get(cls, [])


def test_html_marks_a_regression_worse_and_an_improvement_better_with_a_symbol_and_a_word(checkpoints):
    text, outs = _sweep_html(checkpoints)
    assert [o.verdict for o in outs] == ["new", "improved"]
    assert [o.base_verdict for o in outs] == ["regressed", "regressed"]
    # the paired table vs the baseline: both checkpoints clearly worse; the sweep row vs step-100 clearly better
    starred = _spans(text, "sig")
    signs = [re.search(r"(?:^▲ |^▼ |Δ )([+-])\d+\.\d+ \[", t).group(1) for t in starred]
    for t, sign in zip(starred, signs):  # the sign of Δ decides: arrow, word, style
        assert (t[0], t.rsplit(" ", 1)[1]) == (("▲", "better") if sign == "+" else ("▼", "worse")), t
    assert "+" in signs and "-" in signs
    assert any(t.startswith("▲ Δ +") and " vs step-100" in t for t in starred)  # the sweep row vs step-100
    assert any(t.startswith("▼ 0.") and "x · Δ -" in t for t in starred)  # the sweep row vs the baseline
    assert re.search(r'<span class="verdict-regressed worse">▼ regressed</span>', text)  # vs the baseline
    assert re.search(r'<span class="verdict-improved better">▲ improved</span>', text)
    assert '<span class="sig">' not in text  # no sign-blind style left


def test_better_and_worse_look_different_in_a_real_browser(checkpoints, tmp_path):
    if browser.chromium_path() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    text, _ = _sweep_html(checkpoints)
    page = tmp_path / "report.html"
    page.write_text(text)
    probe = ("JSON.stringify(Object.fromEntries(['.sig.better', '.sig.worse', '.verdict-improved', "
             "'.verdict-regressed'].map(q => { const el = document.querySelector(q); const cs = getComputedStyle(el); "
             "return [q, [cs.color, cs.textDecorationLine, el.textContent]]; })))")
    rep = browser.open_page(page.as_uri(), probe)
    assert rep.console_errors == [] and rep.exceptions == []
    got = json.loads(rep.probe)
    assert got[".sig.better"][0] != got[".sig.worse"][0]  # colour differs ...
    assert got[".verdict-improved"][0] == got[".sig.better"][0] and got[".verdict-regressed"][0] == got[".sig.worse"][0]
    assert got[".verdict-regressed"][0] not in ("rgb(29, 35, 48)", "")  # regressed has its colour, not the text's
    # ... and so do the symbol and the word (read without colour)
    assert got[".sig.better"][2].startswith("▲") and got[".sig.better"][2].endswith("better")
    assert got[".sig.worse"][2].startswith("▼") and got[".sig.worse"][2].endswith("worse")
    assert got[".verdict-regressed"][2] == "▼ regressed" and got[".verdict-improved"][2] == "▲ improved"
    assert got[".sig.worse"][1] == "underline" and got[".sig.better"][1] == "none"


# ---- 18: one decision rule for the star, the verdict and the p ----------------------------------------------

@pytest.fixture
def few_prompts(tmp_path, monkeypatch):
    """5 prompts: step-2 is above step-1 on most prompts, so the paired bootstrap CI excludes 0, while the exact
    sign-flip test cannot go below p 0.0625 with 5 prompts: the interval and the test disagree."""
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    for name, q in (("step-1", 0.75), ("step-2", 0.80), ("base", 0.75)):
        write_run(root, "h", name, quality=q, num_prompts=5)
    return root


def test_an_interval_off_zero_with_p_above_005_is_no_clear_change_everywhere(few_prompts, capsys):
    pair = compare.compare([few_prompts / "h" / "step-2"], few_prompts / "h" / "step-1").paired(
        compare.load_run(few_prompts / "h" / "step-2"))["tau"]
    assert pair.excludes_zero and pair.p_value >= 0.05 and abs(pair.delta) >= 0.1  # the disagreement, set up
    assert not pair.significant and stats.classify_change(pair, 0.1) == "no clear change"
    # compare: no star; the note says why (the CI and the test disagree), p beside it
    rc, out, err = _cli(capsys, "h/step-2", "--baseline", "h/step-1", "--format", "md")
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.startswith("| step-2 ") and "[+" in line)
    assert tables.fmt_delta(pair, 2) in row and " *" not in row
    assert f"the CI excludes 0 but p {tables.fmt_p(pair.p_value)} >= 0.05: not called" in out
    assert "5 prompts cannot give p < 0.05, the least is 0.0625" in out
    rc, out, err = _cli(capsys, "h/step-2", "--baseline", "h/step-1", "--format", "json")
    got = json.loads(out)["runs"][1]["vs_baseline"]["tau"]["paired"]
    assert got["ci_excludes_0"] is True and got["significant"] is False
    # the sweep: the same rule for the verdict, the p beside the Δ on its line, nothing green in its HTML
    outs, rep, cmp = _sweep(few_prompts, (1, 2))
    assert outs[1].verdict == "no clear change" and outs[1].vs_prev.excludes_zero
    line = sweep.outcome_text(outs[1])
    assert f"Δ {tables.fmt_delta(outs[1].vs_prev, 2)} (p {tables.fmt_p(outs[1].vs_prev.p_value)}) vs step-1" in line
    assert " *" not in line and line.endswith("no clear change")
    text = html.render_report("sweep s1", cmp, sweep_table=sweep.report_table(rep), steps=[])
    assert _spans(text, "better") == [] and "verdict-improved" not in text


def test_identical_runs_say_no_spread_not_a_prompt_count(sweep_runs, capsys):
    shutil.copytree(sweep_runs / "ct129" / "step-500", sweep_runs / "ct129" / "step-500-again")
    rc, out, err = _cli(capsys, "step-500-again", "--baseline", "step-500")
    assert rc == 0, err
    flat = " ".join(out.split())
    assert "no spread" in flat and "any change would show" in flat and "any change shows" in flat
    assert "needs 2 prompts" not in flat and "±0.00" not in flat
    assert stats.prompts_needed(0.0, 0.1) is None
    root = sweep_runs
    for s in (1, 2):
        shutil.copytree(root / "ct129" / "step-500", root / "h" / f"step-{s}")
    shutil.copytree(root / "ct129" / "step-500", root / "h" / "base")
    outs, rep, _ = _sweep(root, (1, 2))
    note = detection_note(outs, 0.1)
    assert note.startswith("no spread") and "needs" not in note
    assert note in sweep.report_table(rep).notes


# ---- 24: report files follow the umask, as the plots do -----------------------------------------------------

@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(d: Path, names) -> dict[str, int]:
    return {n: stat.S_IMODE((d / n).stat().st_mode) for n in names}


def test_compare_report_files_follow_the_umask(sweep_runs, tmp_path, capsys, umask_022):
    rc, _, err = _cli(capsys, "step-500", "--baseline", "zlab_full", "--html", str(tmp_path / "report.html"),
                      "--plot", str(tmp_path / "curves.png"))
    assert rc == 0, err
    assert _modes(tmp_path, ["report.html", "curves.png"]) == {"report.html": 0o644, "curves.png": 0o644}
    os.umask(0o027)  # a stricter umask is followed too, not widened
    rc, _, err = _cli(capsys, "step-500", "--html", str(tmp_path / "private.html"))
    assert rc == 0, err
    assert _modes(tmp_path, ["private.html"]) == {"private.html": 0o640}


def test_sweep_report_files_follow_the_umask(tmp_path, monkeypatch, umask_022):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100, 200])
    rep = sweep.Sweep(opts(f"{ck}/step-*", ["locs"], tmp_path), local_inventory(tmp_path, 1), log=print).run()
    sweep.write_report_files(rep)
    names = ["report.md", "report.json", "report.html", "plots.png", "sweep.json"]
    assert _modes(rep.sweep_dir, names) == dict.fromkeys(names, 0o644)
    assert not list(rep.sweep_dir.glob(".*.tmp"))  # no temp file left behind
