"""reval compare: run resolution, comparability refusals, suspect marking, tables at a fixed width,
markdown/csv/json exports, the PNG plot, and the one-line summary."""
from __future__ import annotations

import csv
import io
import json
import re
import sys

import pytest
from rich.console import Console

from orchestrator.errors import ConfigError, RunNotFound
from orchestrator.render import formats, tables
from orchestrator.results import compare
from reval import cli
from tests.resultsgen import make_results, render_text, write_run


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    write_run(root, "ct129", "zlab_full", quality=0.88)
    write_run(root, "ct129", "step4000", quality=0.70, step=4000)
    write_run(root, "pro6000", "step5000", quality=0.75, step=5000)
    return root


def _cli(capsys, *argv):
    rc = cli.main(["compare", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _cmp(root, names, baseline=None):
    runs = [compare.load_run(compare.pulled_run_dir(n, root)) for n in names]
    base = compare.load_run(compare.pulled_run_dir(baseline, root)) if baseline else None
    return compare.build_comparison(runs, base)


# ---- resolution -----------------------------------------------------------------------------------------

def test_resolve_by_name_host_name_and_path(runs_dir):
    assert compare.pulled_run_dir("zlab_full", runs_dir) == runs_dir / "ct129" / "zlab_full"
    assert compare.pulled_run_dir("pro6000/step5000", runs_dir) == runs_dir / "pro6000" / "step5000"
    assert compare.pulled_run_dir(str(runs_dir / "ct129" / "step4000"), runs_dir) == runs_dir / "ct129" / "step4000"


def test_resolve_errors_name_the_fix(runs_dir):
    write_run(runs_dir, "pro6000", "zlab_full", quality=0.88)
    with pytest.raises(ConfigError, match=r"on several hosts: ct129/zlab_full, pro6000/zlab_full"):
        compare.pulled_run_dir("zlab_full", runs_dir)
    with pytest.raises(RunNotFound) as e:
        compare.pulled_run_dir("ct129/nope", runs_dir)
    assert e.value.exit_code == 102 and "reval pull ct129/nope" in e.value.hint
    with pytest.raises(RunNotFound):
        compare.pulled_run_dir("nope", runs_dir)


def test_cli_missing_run_exits_102(runs_dir, capsys):
    rc, out, err = _cli(capsys, "zlab_full", "ghost")
    assert rc == 102 and "run 'ghost' not found" in err and out == ""


# ---- the main table -------------------------------------------------------------------------------------

def test_main_table_values_and_baseline_ratios(runs_dir):
    cmp = _cmp(runs_dir, ["step4000", "pro6000/step5000"], baseline="zlab_full")
    t = tables.main_table(cmp)
    assert [r.cells["run"].value for r in t.rows] == ["zlab_full", "step4000", "step5000"]  # baseline first
    assert t.rows[0].marks == ["base"]
    base = cmp.runs[0].results["metrics"]
    s4k = cmp.runs[1].results["metrics"]
    cell = t.rows[1].cells["streak"]
    assert cell.value == pytest.approx(s4k["streak"])
    assert cell.ratio == pytest.approx(s4k["streak"] / base["streak"])
    assert cell.delta == pytest.approx(s4k["streak"] - base["streak"])
    assert t.rows[0].cells["streak"].delta is None  # the baseline is not compared with itself
    assert t.rows[1].cells["step"].text == "4000" and t.rows[1].cells["size"].text == "4x12"
    assert t.rows[1].cells["ddtree_best"].text.endswith("@512")
    assert t.rows[0].cells["duration"].text == "2m41s"  # status.json's, as `reval status` says (not total_s)
    # every DDTree budget and both widths get a column
    keys = [c.key for c in t.columns]
    assert [k for k in keys if k.startswith("ddtree_") and k != "ddtree_best"] == \
        [f"ddtree_{b}" for b in (16, 32, 64, 128, 256, 512)]
    assert "width_4" in keys and "width_8" in keys
    # the best tau is the strongest drafter's, and only there
    assert [r.cells["tau"].best for r in t.rows] == [True, False, False]


def test_rendered_table_at_fixed_width(runs_dir):
    cmp = _cmp(runs_dir, ["step4000"], baseline="zlab_full")
    main, paired = tables.main_table(cmp), tables.paired_table(cmp)
    text = render_text([main, paired], width=100)
    base, s4k = (r.results["metrics"] for r in cmp.runs)
    assert "zlab_full (base)" in text and "step4000" in text
    assert f"{s4k['tau']:.2f}" in text and f"{base['tau']:.2f}" in text
    # under each value: its 95% bootstrap interval, right-aligned in the same column
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.lstrip().startswith("step4000"))
    value, est = f"{s4k['tau']:.2f}", cmp.estimates(cmp.runs[1])["tau"]
    ci = f"[{est.lo:.2f}, {est.hi:.2f}]"
    end = lines[i].index(f" {value} ") + 1 + len(value)
    assert lines[i + 1][end - len(ci): end] == ci and est.lo <= s4k["tau"] <= est.hi
    # the paired table: Δ [CI] (* when significant: it excludes 0 and p < 0.05), ratio [CI], p against the baseline
    p = cmp.paired(cmp.runs[1])["tau"]
    row = next(line for line in lines[i + 2:] if line.lstrip().startswith("step4000"))
    assert f"{p.delta:+.2f} [{p.delta_lo:+.2f}, {p.delta_hi:+.2f}]" in row and f"{p.ratio:.2f}x" in row
    assert p.delta == pytest.approx(s4k["tau"] - base["tau"]) and (" *" in row) == p.significant
    assert "comparable: same cache, prompts, max-blocks, metrics, drafter attention" in text
    assert max(len(line) for line in text.splitlines()) <= 100
    # best values are bold in a terminal
    con = Console(width=220, file=io.StringIO(), force_terminal=True, color_system="standard")
    formats.print_tables([tables.main_table(cmp)], con)
    ansi = con.file.getvalue()
    assert re.search(rf"\x1b\[1m *{base['tau']:.2f}", ansi)
    assert not re.search(rf"\x1b\[1m *{s4k['tau']:.2f}", ansi)


def test_markdown_bold_best_per_column(runs_dir):
    cmp = _cmp(runs_dir, ["zlab_full", "step4000", "step5000"])
    md = formats.render_markdown([tables.main_table(cmp)])
    lines = md.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| run |"))
    assert lines[header + 1].startswith("|---|---|")
    rows = {line.split("|")[1].strip(): line for line in lines[header + 2: header + 5]}
    zl = cmp.runs[0].results["metrics"]
    assert f"**{zl['tau']:.2f}**" in rows["zlab_full"]
    assert "**" not in rows["step4000"].split("|", 6)[6]  # no bold metric in a weaker row
    assert lines[-1].startswith("_comparable: same cache")


def test_cli_table_end_to_end(runs_dir, capsys):
    rc, out, err = _cli(capsys, "ct129/step4000", "ct129/zlab_full", "--baseline", "zlab_full")
    assert rc == 0, err
    assert "zlab_full (base)" in out and "step4000" in out and "comparable" in out


# ---- comparability and suspects -------------------------------------------------------------------------

def test_incomparable_runs_are_refused_naming_the_field(runs_dir, capsys):
    write_run(runs_dir, "ct129", "short", quality=0.9, max_blocks=20)
    write_run(runs_dir, "ct129", "othercache", quality=0.9, cache_fingerprint="sha256:beef")
    rc, out, err = _cli(capsys, "step4000", "short", "othercache", "--baseline", "zlab_full")
    assert rc == 3 and out == ""
    assert "short: max_blocks 20 differs from 12 (zlab_full)" in err
    assert "othercache: cache sha256:beef differs from sha256:cafe (zlab_full)" in err
    assert "step4000" not in err  # the comparable one is not blamed
    assert "--allow-incomparable" in err


def test_metric_definitions_and_prompt_set_differences(runs_dir):
    write_run(runs_dir, "ct129", "newdefs", metrics_version="dflash-metrics/2")
    write_run(runs_dir, "ct129", "otherprompts", prompt_set="sha256:p2")
    cmp = _cmp(runs_dir, ["zlab_full", "newdefs", "otherprompts"])
    assert {(d.run, d.field) for d in cmp.differences} == {("newdefs", "metrics_version"),
                                                           ("otherprompts", "prompt_set")}
    with pytest.raises(ConfigError, match="newdefs: metric definitions dflash-metrics/2 differs"):
        compare.require_comparable(cmp)


def test_allow_incomparable_marks_and_does_not_rank(runs_dir, capsys):
    write_run(runs_dir, "ct129", "short", quality=0.99, max_blocks=20)  # the highest tau, but incomparable
    cmp = _cmp(runs_dir, ["zlab_full", "step4000", "short"])
    t = tables.main_table(cmp)
    short = t.rows[2]
    assert "INCOMPARABLE" in short.marks and not short.rankable
    assert not any(c.best for c in short.cells.values())
    assert t.rows[0].cells["tau"].best
    rc, out, _err = _cli(capsys, "zlab_full", "step4000", "short", "--allow-incomparable", "--format", "md")
    assert rc == 0 and "short (INCOMPARABLE)" in out and "NOT comparable (max_blocks differ for short)" in out


def test_suspect_runs_marked_never_ranked(runs_dir):
    write_run(runs_dir, "ct129", "gibberish", make_results("gibberish", quality=0.99, suspect=True))
    cmp = _cmp(runs_dir, ["zlab_full", "gibberish"])
    assert not cmp.differences
    t = tables.main_table(cmp)
    assert t.rows[1].marks == ["SUSPECT"]
    assert t.rows[1].cells["tau"].value > t.rows[0].cells["tau"].value
    assert not t.rows[1].cells["tau"].best
    text = render_text([t], width=220)
    assert "gibberish (SUSPECT)" in text
    js = tables.comparison_json(cmp)
    assert js["runs"][1]["rankable"] is False and js["runs"][1]["suspect_reasons"] == ["position-1 accuracy 0.000"]


def test_failed_run_is_shown_without_metrics(runs_dir):
    write_run(runs_dir, "ct129", "oom", state="failed")
    cmp = _cmp(runs_dir, ["zlab_full", "oom"])
    t = tables.main_table(cmp)
    assert t.rows[1].marks == ["FAILED"] and t.rows[1].cells["tau"].value is None
    assert t.rows[1].cells["duration"].text == "2m41s"  # from status.json
    assert "oom (FAILED)" in render_text([t], width=220)


# ---- views and exports ----------------------------------------------------------------------------------

def test_per_position_and_per_prompt_views(runs_dir):
    write_run(runs_dir, "ct129", "gibberish", make_results("gibberish", quality=0.99, suspect=True))
    cmp = _cmp(runs_dir, ["step4000", "gibberish"], baseline="zlab_full")
    tabs = tables.per_position_tables(cmp)
    assert [t.title.split()[0] for t in tabs] == ["per-position", "per-position", "teacher-forced"]
    unc = tabs[0]
    assert len(unc.rows) == 15 and [c.label for c in unc.columns] == ["k", "zlab_full (base)", "step4000",
                                                                      "gibberish (SUSPECT)"]
    exp = cmp.runs[1].results["metrics"]["per_position_acceptance_unconditional"]
    assert [r.cells["step4000"].value for r in unc.rows] == exp
    # best per position among the ranked runs: the suspect run never wins
    assert all(not r.cells["gibberish"].best for r in unc.rows)
    assert unc.rows[0].cells["zlab_full"].best
    pp = tables.per_prompt_table(cmp)
    assert [r.cells["prompt"].value for r in pp.rows] == [f"prompt-{i}" for i in range(4)]
    assert pp.rows[2].cells["step4000"].value == cmp.runs[1].results["per_prompt"][2]["tau"]
    text = render_text([unc, pp], width=160)
    assert "per-prompt tau" in text and "prompt-3" in text


def test_csv_export_has_raw_values_ratios_and_marks(runs_dir, capsys):
    rc, out, err = _cli(capsys, "step4000", "--baseline", "zlab_full", "--format", "csv")
    assert rc == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["run"] for r in rows] == ["zlab_full", "step4000"]
    assert rows[0]["marks"] == "base" and rows[0]["tau_ratio"] == ""
    cmp = _cmp(runs_dir, ["step4000"], baseline="zlab_full")
    b, s = (r.results["metrics"] for r in cmp.runs)
    assert float(rows[1]["tau"]) == pytest.approx(s["tau"])
    assert float(rows[1]["tau_ratio"]) == pytest.approx(s["tau"] / b["tau"], abs=1e-6)
    assert float(rows[1]["pos1_acc_delta"]) == pytest.approx(s["position_1_accuracy"] - b["position_1_accuracy"],
                                                             abs=1e-6)


def test_json_export(runs_dir, capsys):
    rc, out, err = _cli(capsys, "step4000", "step5000", "--baseline", "zlab_full", "--format", "json",
                        "--per-position", "--per-prompt")
    assert rc == 0, err
    js = json.loads(out)
    assert js["baseline"] == "zlab_full" and js["comparable"] is True and js["differences"] == []
    s4k = js["runs"][1]
    assert s4k["label"] == "step4000" and s4k["step"] == 4000 and s4k["host"] == "ct129"
    assert s4k["vs_baseline"]["tau"]["ratio"] == pytest.approx(s4k["metrics"]["tau"] / js["runs"][0]["metrics"]["tau"])
    assert len(s4k["per_position"]["position_accuracy"]) == 15 and len(s4k["per_prompt"]) == 4
    assert "vs_baseline" not in js["runs"][0]


def test_plot_is_a_png_with_one_curve_per_run(runs_dir, tmp_path, capsys):
    from matplotlib import image

    from orchestrator.render import plots
    out_png = tmp_path / "cmp.png"
    rc, _out, err = _cli(capsys, "zlab_full", "step4000", "step5000", "--plot", str(out_png))
    assert rc == 0, err
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = image.imread(out_png)
    assert img.shape[0] > 300 and img.shape[1] > 1000
    fig = plots.comparison_figure(_cmp(runs_dir, ["zlab_full", "step4000", "step5000"]))
    assert len(fig.axes) == 4  # per-position (both conventions), histogram, DDTree
    for ax in fig.axes:
        assert len(ax.get_lines()) == 3
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["zlab_full", "step4000", "step5000"]
    for ext, magic in ((".svg", b"<?xml"), (".pdf", b"%PDF")):  # --plot writes png, svg or pdf
        rc, _out, err = _cli(capsys, "zlab_full", "step4000", "--plot", str(tmp_path / f"x{ext}"))
        assert rc == 0, err
        assert (tmp_path / f"x{ext}").read_bytes()[:len(magic)] == magic
    rc, _out, err = _cli(capsys, "zlab_full", "--plot", str(tmp_path / "x.gif"))
    assert rc == 3 and "unknown format '.gif'" in err and not (tmp_path / "x.gif").exists()
    # the sweep's figure gains the tau-vs-step curve with its CI band and the baseline line
    pts = [plots.StepPoint(100 * i, 5.0 + i, 4.5 + i, 5.5 + i, f"step-{i}", i == 3) for i in range(4)]
    fig = plots.comparison_figure(_cmp(runs_dir, ["step4000"]), pts, ("zlab_full", 8.0, 7.5, 8.5))
    ax = fig.axes[0]
    assert ax.get_title() == "tau vs training step" and list(ax.get_lines()[0].get_xdata()) == [0, 100, 200, 300]
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"this sweep", "earlier sweeps",
                                                                     "baseline zlab_full"}


def test_summary_line():
    r = make_results("x", quality=0.8, num_prompts=1)  # one prompt: no interval to show
    m = r["metrics"]
    m.update(tau=8.37, streak=7.37, ddtree_best={"budget": 512, "tau": 12.38}, tree_width_tau={"4": 10.0, "8": 11.9},
             position_1_accuracy=0.92, num_rounds=300, num_prompts=10)
    assert formats.summary_line(r) == ("tau 8.37 · streak 7.37 · DDTree-512 12.38 · width-8 11.90 · "
                                      "position-1 accuracy 0.920 · 300 blocks, 10 prompts")
    r["health"] = {"suspect": True, "reasons": ["drafts repeat one token"]}
    assert formats.summary_line(r).endswith(" · SUSPECT (drafts repeat one token)")


def test_summary_line_carries_the_bootstrap_intervals_of_the_numbers_it_shows():
    import re

    from orchestrator.results import intervals
    from remote_payload.contract.results import Result
    r = make_results("x", quality=0.8, num_prompts=10)
    line = formats.summary_line(r)
    est = intervals.estimates(Result.from_dict(r))
    m = r["metrics"]
    for label, key, value, digits in (("tau", "tau", m["tau"], 2),
                                      (f"DDTree-{m['ddtree_best']['budget']}", "ddtree_best",
                                       m["ddtree_best"]["tau"], 2),
                                      ("width-8", "width_8", m["tree_width_tau"]["8"], 2),
                                      ("position-1 accuracy", "pos1_acc", m["position_1_accuracy"], 3)):
        got = re.search(re.escape(label) + r" ([0-9.]+) \[([0-9.]+), ([0-9.]+)\]", line)
        assert got, (label, line)
        lo, hi = float(got.group(2)), float(got.group(3))
        assert float(got.group(1)) == round(value, digits), label
        assert lo <= float(got.group(1)) <= hi and lo < hi, label  # the estimate lies inside its interval
        assert (round(est[key].lo, digits), round(est[key].hi, digits)) == (lo, hi), label
    assert re.search(r"· streak [0-9.]+ · ", line)  # streak shown without one: it is tau's, shifted by 1


def test_summary_line_shows_no_interval_a_damaged_file_cannot_back():
    r = make_results("x", quality=0.8, num_prompts=6)
    r["per_prompt"][1]["tau"] = float("nan")  # json.loads takes NaN
    r["per_prompt"][2]["position_hits"] = [h + 5 for h in r["per_prompt"][2]["position_hits"]]  # no longer the metric
    line = formats.summary_line(r)
    assert "nan" not in line and line.startswith(f"tau {r['metrics']['tau']:.2f} · streak")
    assert f"position-1 accuracy {r['metrics']['position_1_accuracy']:.3f} · " in line
    assert " [" in line  # DDTree and width-k are intact: their intervals stay


def test_tables_show_tau_pooled_and_no_interval_a_damaged_file_cannot_back():
    from orchestrator.render import tables
    from remote_payload.contract.results import Result
    good = Result.from_dict(make_results("a", num_prompts=6))
    bad = make_results("c", num_prompts=6)
    bad["per_prompt"][1]["tau"] = float("nan")
    cmp = compare.compare([good, Result.from_dict(bad)], baseline=good, allow_incomparable=True)
    rows = [r.cells for r in tables.main_table(cmp).rows]
    assert [r["tau_pooled"].value for r in rows] == [good.metrics.tau_pooled, bad["metrics"]["tau_pooled"]]
    assert rows[0]["tau"].est is not None and rows[0]["tau_pooled"].est is not None
    assert rows[1]["tau"].est is None and rows[1]["tau"].pair is None  # its per-prompt taus no longer give it
    assert rows[1]["tau_pooled"].est is not None  # the acceptance lengths are intact


def test_pull_then_compare(tmp_path, monkeypatch, capsys):
    """--pull brings runs from their host (here a local-folder host, through the real pull) before comparing."""
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "hostwork"
    write_run(work, "runs", "step4000", quality=0.7, step=4000)   # the host's <workdir>/runs/<run>/
    write_run(work, "runs", "zlab_full", quality=0.88)
    inv = tmp_path / "hosts.yaml"
    inv.write_text(f"hosts:\n  box:\n    local: true\n    workdir: {work}\n    python: {sys.executable}\n"
                   "    venv: {mode: python}\n")
    rc = cli.main(["-i", str(inv), "compare", "--pull", "box/step4000", "--baseline", "box/zlab_full",
                   "--format", "csv"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert (tmp_path / "runs" / "box" / "step4000" / "results.json").exists()
    assert f"pulled  box/zlab_full -> {tmp_path}/runs/box/zlab_full/" in err
    assert [r["run"] for r in csv.DictReader(io.StringIO(out))] == ["zlab_full", "step4000"]


def test_pull_honours_runs_dir(tmp_path, monkeypatch, capsys):
    """--runs-dir is where --pull puts runs and where compare then finds them (one place, not two)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REVAL_RUNS_DIR", "runs")  # --runs-dir wins over it (and sets nothing)
    work = tmp_path / "hostwork"
    write_run(work, "runs", "step4000", quality=0.7, step=4000)
    inv = tmp_path / "hosts.yaml"
    inv.write_text(f"hosts:\n  box:\n    local: true\n    workdir: {work}\n    python: {sys.executable}\n"
                   "    venv: {mode: python}\n")
    rc = cli.main(["-i", str(inv), "compare", "--pull", "box/step4000", "--runs-dir", str(tmp_path / "elsewhere"),
                   "--format", "csv"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert (tmp_path / "elsewhere" / "box" / "step4000" / "results.json").exists()
    assert not (tmp_path / "runs").exists() and "step4000" in out
