"""The plot worker (orchestrator/render/plotworker.py): a second process that draws plots.png while the sweep's
report draws the HTML report's figures. It must draw exactly what this process would, refuse what is not a
plot, and never cost a report file when it fails or is gone."""
from __future__ import annotations

import os
import signal

import pytest

from orchestrator import sweep
from orchestrator.render import plots, plotworker
from orchestrator.results import compare
from tests.sweeptools import local_inventory, make_checkpoints, opts


@pytest.fixture
def swept(tmp_path, monkeypatch):
    """A finished local sweep of two checkpoints (its report not written yet) and its comparison."""
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100, 200])
    rep = sweep.Sweep(opts(f"{ck}/step-*", ["locs"], tmp_path), local_inventory(tmp_path, 1)).run()
    assert rep.exit_code == 0
    recs = [rep.loaded.get(o.local_path) for o in rep.outcomes]
    return rep, compare.build_comparison(recs, None)


@pytest.fixture
def worker():
    w = plotworker.PlotWorker()
    yield w
    w.close()


def test_the_worker_draws_the_same_png_as_this_process(swept, worker, tmp_path):
    rep, cmp = swept
    pending = worker.start("save_comparison_plot", cmp, tmp_path / "there.png", rep.history, None)
    assert pending is not None
    assert worker.start("panel_svg", cmp, "histogram") is None  # one request at a time: the caller draws
    assert pending.result() == tmp_path / "there.png"
    plots.save_comparison_plot(cmp, tmp_path / "here.png", rep.history, None)
    assert (tmp_path / "there.png").read_bytes() == (tmp_path / "here.png").read_bytes()
    assert worker.start("panel_svg", cmp, "histogram").result() == plots.panel_svg(cmp, "histogram")


def test_what_is_not_a_plot_or_fails_there_is_left_to_the_caller(swept, worker, tmp_path):
    rep, cmp = swept
    assert worker.start("_figure", 1, 1) is None  # only plots.ALLOWED, never sent
    assert worker.start("save_comparison_plot", cmp, tmp_path / "x.bmp", rep.history, None).result() is None
    assert not (tmp_path / "x.bmp").exists()
    assert worker.alive()  # an error there is an answer, not a broken worker
    assert worker.start("tau_vs_step_svg", rep.history, None).result().startswith("<svg")


def test_a_dead_worker_costs_no_report_file(swept, monkeypatch):
    rep, _ = swept
    plotworker.warm()
    w = plotworker.shared()
    assert w is not None
    os.kill(w.proc.pid, signal.SIGKILL)  # our own child
    w.proc.wait()
    sweep.write_report_files(rep)
    assert (rep.sweep_dir / "plots.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rep.files["plot"] == str(rep.sweep_dir / "plots.png")
    assert plotworker.shared() is None  # not asked again


def test_the_report_with_the_worker_is_the_report_without_it(swept, monkeypatch):
    rep, _ = swept
    plotworker.close()
    sweep.write_report_files(rep)
    alone = (rep.sweep_dir / "plots.png").read_bytes()
    plotworker.warm()
    assert plotworker.shared() is not None
    sweep.write_report_files(rep)
    assert (rep.sweep_dir / "plots.png").read_bytes() == alone
    assert plotworker.shared() is not None  # kept for the next report


def test_close_ends_the_worker(worker):
    proc = worker.proc
    worker.close()
    assert proc.returncode == 0 and not worker.alive()
    assert worker.start("panel_svg", None, "histogram") is None
