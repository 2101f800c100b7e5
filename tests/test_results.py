"""The results.json schema (remote_payload/contract/results.py): what the payload writes is what the orchestrator reads;
old files load; a broken file is one line naming the file and the field; the docs are generated from it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.results import compare
from remote_payload.__main__ import main as payload_main
from remote_payload.contract import results as R
from remote_payload.tools import results_docs
from reval import cli
from tests.conftest import check_results_roundtrip
from tests.resultsgen import load_result, make_results, write_run

ROOT = Path(__file__).resolve().parents[1]
OLD = ROOT / "tests" / "data" / "results-v1.json"  # written by the payload before this schema (reval.results/1)


def test_docs_are_generated_from_the_schema():
    assert (ROOT / "docs" / "results.md").read_text() == results_docs.markdown(), \
        "docs/results.md is stale: python -m remote_payload.tools.results_docs > docs/results.md"
    text = results_docs.markdown()
    for name in ("target.tied", "config_matches_cache", "position_accuracy_anchors", "hints", "top_draft_token",
                 "causal_in_block", "content_hash"):
        assert f"`{name.split('.')[-1]}`" in text


def test_old_format_file_loads_and_keeps_every_value():
    data = json.loads(OLD.read_text())
    assert data["schema"] == "reval.results/1" and "attention" not in data["drafter"]
    res = R.Result.load(OLD)
    assert res.metrics.tau == data["metrics"]["tau"] and res.drafter.attention is None
    assert res.per_prompt[1].acceptance_lengths == data["per_prompt"][1]["acceptance_lengths"]
    assert res.comparability.key()["attention"] is None
    assert check_results_roundtrip(OLD) is None


def test_old_and_new_runs_stay_comparable_unless_the_attention_differs(tmp_path):
    old = json.loads(OLD.read_text())
    new = json.loads(OLD.read_text())
    new.update(schema=R.SCHEMA, run="new")
    layer = R.LayerAttention(layer=0, type="sliding_attention", window=4, causal_in_block=True)
    new["drafter"]["attention"] = [layer.to_dict()]
    new["comparability"]["attention"] = R.attention_signature([layer])
    write_run(tmp_path, "h", "old", old)
    new = R.Result.from_dict(new).to_dict()  # every field of the current schema, as the eval writes it
    write_run(tmp_path, "h", "new", new)
    runs = [compare.load_run(tmp_path / "h" / n) for n in ("old", "new")]
    assert not compare.build_comparison(runs).differences  # not recorded = unknown, not different
    flipped = json.loads(json.dumps(new))
    flipped["run"] = "bidir"
    flipped["comparability"]["attention"] = R.attention_signature([R.LayerAttention(
        layer=0, type="sliding_attention", window=4, causal_in_block=False)])
    flipped = R.Result.from_dict(flipped).to_dict()
    write_run(tmp_path, "h", "bidir", flipped)
    cmp = compare.build_comparison(runs[1:] + [compare.load_run(tmp_path / "h" / "bidir")])
    assert [(d.run, d.field) for d in cmp.differences] == [("bidir", "attention")]
    assert "drafter attention (window / causal inside the block) sliding_attention/4/b" in str(cmp.differences[0])


def test_runs_of_two_drafter_families_are_matched_on_their_prompts_and_completions(tmp_path):
    """A DFlash block and an EAGLE-3 chain read different target layers (different caches) with blocks of their
    own: ranked together when their prompts and completions (prompt_set), rounds, metrics and regime agree, not
    otherwise; a file from before the family was recorded (null) is DFlash's: matched on everything with one."""
    base = json.loads(OLD.read_text())
    base.update(schema=R.SCHEMA)
    for name, family, change in (("old", None, {}), ("dflash", "dflash", {}),
                                 ("eagle3", "eagle3", {"cache_fingerprint": "sha256:" + "e" * 64, "block_size": 6}),
                                 ("eagle3-other", "eagle3", {"prompt_set": "sha256:" + "f" * 64}),
                                 ("dflash-6", "dflash", {"block_size": 6})):
        d = json.loads(json.dumps(base))
        d["run"] = name
        if family:
            d["drafter"]["family"] = d["comparability"]["family"] = family
        d["comparability"].update(change)
        write_run(tmp_path, "h", name, R.Result.from_dict(d).to_dict())
    runs = {n: compare.load_run(tmp_path / "h" / n) for n in ("old", "dflash", "eagle3", "eagle3-other", "dflash-6")}
    assert runs["eagle3"].result.drafter.family == "eagle3" and runs["old"].result.comparability.key()["family"] is None
    assert not compare.build_comparison([runs["old"], runs["dflash"]]).differences
    assert not compare.build_comparison([runs["dflash"], runs["eagle3"]]).differences
    assert not compare.build_comparison([runs["old"], runs["eagle3"]]).differences
    other = compare.build_comparison([runs["dflash"], runs["eagle3-other"]])
    assert [(d.run, d.field) for d in other.differences] == [("eagle3-other", "prompt_set")]
    same = compare.build_comparison([runs["dflash"], runs["dflash-6"]])  # one family: every field still counts
    assert [(d.run, d.field) for d in same.differences] == [("dflash-6", "block_size")]


def test_missing_field_or_wrong_type_is_one_line_naming_file_and_field(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = make_results("good")
    write_run(tmp_path / "runs", "h", "good", good)
    broken = json.loads(json.dumps(good))
    del broken["metrics"]["tau"]
    d = write_run(tmp_path / "runs", "h", "broken", broken)
    rc = cli.main(["compare", "good", "broken"])
    out, err = capsys.readouterr()
    (d / "results.json").unlink()  # broken on purpose: not one of the files the suite's round-trip check reads
    assert rc == 3 and out == ""
    assert err.splitlines()[0] == "error: runs/h/broken/results.json: missing required field metrics.tau"
    assert "Traceback" not in err
    broken["metrics"]["tau"] = "8.1"
    broken["per_prompt"][2]["acceptance_lengths"][0] = 2.5
    with pytest.raises(R.ResultsError, match=r"^x\.json: field metrics\.tau: expected number or null, got '8\.1'$"):
        R.Result.from_dict(broken, source="x.json")
    broken["metrics"]["tau"] = 8.1
    with pytest.raises(R.ResultsError, match=r"field per_prompt\[2\]\.acceptance_lengths\[0\]: expected integer"):
        R.Result.from_dict(broken)
    for schema, why in (("reval.results/3", "newer than this reval reads"), ("other/1", "not a reval results")):
        with pytest.raises(R.ResultsError, match=why):
            R.Result.from_dict({**good, "schema": schema})


def test_a_pulled_run_reads_as_its_typed_result(tmp_path):
    d = write_run(tmp_path, "h", "r", make_results("r", quality=0.8))
    run = compare.load_run(d)
    assert run.metrics.tau == run.result.metrics.tau and run.health.suspect is False
    assert run.per_prompt[0].acceptance_lengths == run.results["per_prompt"][0]["acceptance_lengths"]
    assert load_result(d) == run.result and load_result(d / "results.json") == run.result
    failed = compare.load_run(write_run(tmp_path, "h", "oom", state="failed"))
    with pytest.raises(AttributeError, match=r"oom: no results.json \(state failed\): no 'metrics'"):
        _ = failed.metrics


def test_unknown_future_fields_are_kept():
    data = make_results("x")
    data["future_section"] = {"a": 1}
    data["metrics"]["tau_geometric"] = 7.5
    data["per_prompt"][0]["entropy"] = [0.1]
    res = R.Result.from_dict(data)
    assert res.metrics.extra == {"tau_geometric": 7.5} and res.extra == {"future_section": {"a": 1}}
    assert res.to_dict() == data


def test_the_eval_writes_the_schema_with_per_layer_attention(trained_fixtures, tmp_path):
    """A real eval (trained fixtures): results.json is the current schema, round-trips exactly, and records
    the attention each drafter layer used, which is part of the comparability key."""
    from remote_payload.eval.checkpoint import peek_config  # the drafter's own config.json

    drafter = trained_fixtures / "drafter-good"
    run_dir = tmp_path / "runs" / "good"
    rc = payload_main(["eval", "--drafter", str(drafter), "--target", str(trained_fixtures / "target"),
                       "--cache", str(trained_fixtures / "cache"), "--run-dir", str(run_dir), "--device", "cpu",
                       "--num-prompts", "2", "--max-blocks", "2", "--ddtree-budgets", "16"])
    assert rc == 0
    data = json.loads((run_dir / "results.json").read_text())
    assert data["schema"] == R.SCHEMA
    assert check_results_roundtrip(run_dir / "results.json") is None
    cfg = peek_config(drafter)
    res = R.Result.load(run_dir / "results.json")
    assert [(a.layer, a.type, a.window, a.causal_in_block) for a in res.drafter.attention] == \
        [(i, cfg.layer_types[i], cfg.layer_window(i), cfg.layer_is_causal(i)) for i in range(cfg.num_hidden_layers)]
    assert res.comparability.attention == R.attention_signature(res.drafter.attention)
    assert res.drafter.content_hash.startswith("sha256-64MiB-tree:")


def test_dummy_and_synthetic_results_are_the_current_schema(tmp_path):
    d = tmp_path / "runs" / "dummy"
    d.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "remote_payload", "dummy", "--run-dir", str(d), "--lines", "2",
                    "--interval-s", "0"], check=True, capture_output=True, cwd=ROOT)
    assert json.loads((d / "results.json").read_text())["schema"] == R.SCHEMA
    assert check_results_roundtrip(d / "results.json") is None
    p = write_run(tmp_path / "runs", "h", "syn") / "results.json"
    assert check_results_roundtrip(p) is None
