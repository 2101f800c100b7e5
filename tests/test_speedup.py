"""`eval --speedup`: the target's latencies measured once per host (the latency table in the workdir, reused by
later runs, re-measured when damaged), the projection tau x t(decode) / (t(draft) + t(verify)) per method and per
suite, the best method by speedup; on the CPU fixtures (numbers: the tiny model's, only their arithmetic counts)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from remote_payload.__main__ import main as payload_main
from remote_payload.eval.latency import projected_speedup
from tests.runtools import cut_cache


@pytest.fixture(scope="module")
def fx(trained_fixtures) -> dict[str, Path]:
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    return {k: trained_fixtures / v for k, v in meta["paths"].items() if isinstance(v, str)}


def _eval(work: Path, name: str, fx, *caches: str) -> dict:
    argv = ["eval", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]), "--device", "cpu",
            "--num-prompts", "2", "--max-blocks", "4", "--ddtree-budgets", "16,64", "--speedup",
            "--run-dir", str(work / "runs" / name)]
    for c in caches or (str(fx["cache"]),):
        argv += ["--cache", c]
    assert payload_main(argv) == 0
    return json.loads((work / "runs" / name / "results.json").read_text())


@pytest.fixture(scope="module")
def halves(fx, tmp_path_factory) -> tuple[Path, Path]:
    """Two suites: the fixture cache's first five prompts and its last five."""
    root = tmp_path_factory.mktemp("halves")
    return cut_cache(fx["cache"], root / "x", 0, 5), cut_cache(fx["cache"], root / "y", 5, 10)


def test_projection_per_method_and_suite_and_the_table_reused(fx, halves, tmp_path, capsys):
    x, y = halves
    first = _eval(tmp_path, "a", fx, f"x={x}", f"y={y}")
    sp = first["speedup"]
    assert not sp["reused"] and sp["measure_s"] > 0 and (tmp_path / "latency.json").is_file()
    assert set(sp["verify_s"]) == {"16", "17", "65"}  # the block, DDTree-16 (17 tokens), DDTree-64 (65 tokens)
    m = first["metrics"]
    want_block = projected_speedup(m["tau"], sp["decode_s"], sp["draft_s"], sp["verify_s"]["16"])
    want_64 = projected_speedup(m["ddtree_tau"]["64"], sp["decode_s"], sp["draft_s"], sp["verify_s"]["65"])
    assert sp["projected"]["block"] == pytest.approx(want_block, rel=1e-3)
    assert sp["projected"]["ddtree_64"] == pytest.approx(want_64, rel=1e-3)
    assert sp["best_speedup"] == max(v for v in sp["projected"].values() if v is not None)
    assert sp["projected"][sp["best_method"]] == sp["best_speedup"]
    assert [s["name"] for s in sp["by_suite"]] == ["x", "y"]
    for suite, by in zip(first["suites"], sp["by_suite"]):  # each suite projected from its own tau
        want = projected_speedup(suite["metrics"]["tau"], sp["decode_s"], sp["draft_s"], sp["verify_s"]["16"])
        assert by["projected"]["block"] == pytest.approx(want, rel=1e-3)
    out = capsys.readouterr().out
    assert "projected speedup" in out and "best by speedup" in out
    from orchestrator.render import suites, tables
    from orchestrator.results import compare
    cmp = compare.compare([compare.load_run(tmp_path / "runs" / "a")])
    best = sp["by_suite"][0]["best_method"]
    cell = suites.suite_table(cmp).rows[0].cells["suite:x"]
    assert cell.text.endswith(f"{sp['by_suite'][0]['projected'][best]:.2f}x "
                              f"{best.replace('ddtree_', '@').replace('block', 'blk')}")
    main = tables.main_table(cmp)
    assert main.rows[0].cells["speedup_best"].value == sp["best_speedup"]
    assert tables.comparison_json(cmp)["runs"][0]["speedup"]["projected"] == sp["projected"]
    again = _eval(tmp_path, "b", fx, f"x={x}", f"y={y}")
    assert again["speedup"]["reused"] and again["speedup"]["measure_s"] == 0
    assert again["speedup"]["decode_s"] == sp["decode_s"]
    assert "reused from" in capsys.readouterr().out
    # the target's hash comes from the table while its files are unchanged (a stat each, no re-read of the weights)
    from remote_payload.eval.latency import LatencyTable, target_content_hash, target_signature
    table, sig = LatencyTable(tmp_path / "latency.json"), target_signature(fx["target"])
    assert table.known_hash(sig) == target_content_hash(fx["target"]) == sp["target_hash"]
    assert table.known_hash(sig.replace("stat-sha256:", "stat-sha256:0")) is None


def test_a_damaged_latency_table_is_measured_again_not_a_traceback(fx, tmp_path, capsys):
    (tmp_path / "latency.json").write_text('{"schema": "reval.latency-table/1", "entries": [{"key": 1}')
    res = _eval(tmp_path, "c", fx)
    assert res["speedup"]["reused"] is False and res["speedup"]["by_suite"] is None
    assert json.loads((tmp_path / "latency.json").read_text())["entries"]  # replaced by a good table
    assert "Traceback" not in capsys.readouterr().err


def test_the_same_cache_as_two_suites_is_refused_even_as_a_copy(fx, tmp_path, capsys):
    """Its prompts would count twice in every pooled figure: refused by the spec for the same path, and by the
    payload when a copy holds the same data under another path (exit 3, no results.json)."""
    copy = tmp_path / "copy"
    shutil.copytree(fx["cache"], copy)
    for caches, says in (([f"x={fx['cache']}", f"y={fx['cache']}"], "given as two suites"),
                         ([f"x={fx['cache']}", f"y={copy}"], "holds the same data as suite x's")):
        argv = ["eval", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]), "--device", "cpu",
                "--num-prompts", "1", "--run-dir", str(tmp_path / "runs" / "dup")]
        for c in caches:
            argv += ["--cache", c]
        assert payload_main(argv) == 3
        assert says in capsys.readouterr().err
        assert not (tmp_path / "runs" / "dup" / "results.json").exists()


def test_reval_run_passes_speedup_and_online_to_the_host(fx, halves, here, capsys):
    """The issue's command shape: `reval run HOST ... --speedup --online N`; the pulled results hold both, and the
    latency table lives in the host's workdir."""
    from tests.runtools import reval
    rc, _out, err = reval(capsys, "run", "local", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]),
                         "--cache", f"s1={halves[0]}", "--cache", f"s2={halves[1]}", "--num-prompts", "2",
                         "--max-blocks", "4", "--speedup", "--online", "2", "--name", "sp", "--",
                         "--ddtree-budgets", "16")
    assert rc == 0, err
    res = json.loads((here / "runs" / "local" / "sp" / "results.json").read_text())
    assert res["speedup"]["projected"]["block"] > 0 and [s["name"] for s in res["speedup"]["by_suite"]] == ["s1", "s2"]
    assert res["online"]["prompts"] == 2 and res["online"]["rounds_agreeing"] == res["online"]["rounds"]
    assert res["online"]["projected_speedup"] == res["speedup"]["projected"]["block"]
    assert list((here / ".reval").rglob("latency.json"))  # <workdir>/latency.json on the host
