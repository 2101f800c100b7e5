"""A DFlash run and an EAGLE-3 run of one target over the same prompts: their caches hold different layers (so the
cache fingerprints differ), their blocks and attention differ, yet `reval compare` ranks them in one table on tau,
matched on the prompts' and completions' token fingerprint (comparability.prompt_set); other prompts are refused."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remote_payload.contract import results as results_json
from tests import browser
from tests.tiny_models import random_drafter, tiny_drafter_config, write_zlab_drafter

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def _eval(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "remote_payload", "eval", *args], cwd=cwd, check=False,
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """{dflash, eagle3 (the chain of 5), eagle3-tree (EAGLE's tree 20,3,4), dflash-5 (fewer prompts)}: run dirs on
    the EAGLE-3 fixture's target."""
    from remote_payload.extract.command import extract
    from remote_payload.tools import eagle3_fixtures
    root = ROOT / ".cache" / "eagle3-fixtures"
    meta = eagle3_fixtures.build(root, log=lambda line: None)
    tmp = tmp_path_factory.mktemp("families")
    target = json.loads((root / "target" / "config.json").read_text())
    # a cache of DFlash-style layers from the same target and prompts (greedy: the same completions)
    extract(root / "target", root / "prompts.jsonl", tmp / "cache-dflash", max_new_tokens=meta["recipe"]
            ["max_new_tokens"], layer_ids=[0, 2, 6], device="cpu", dtype="fp32", log=lambda line: None)
    cfg = tiny_drafter_config(hidden_size=target["hidden_size"], intermediate_size=96, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, num_target_layers=target["num_hidden_layers"],
                              vocab_size=target["vocab_size"], block_size=8, sliding_window=None,
                              layer_types=["full_attention", "full_attention"], target_layer_ids=[0, 2, 6],
                              mask_token_id=target["pad_token_id"])
    dflash = write_zlab_drafter(tmp / "dflash", cfg, random_drafter(cfg).state_dict())
    common = ["--target", str(root / "target"), "--max-blocks", "32", "--device", "cpu"]
    runs = {}
    for name, extra in (("dflash", ["--drafter", str(dflash), "--cache", str(tmp / "cache-dflash")]),
                        ("eagle3", ["--drafter", str(root / "eagle3"), "--cache", str(root / "cache")]),
                        ("eagle3-tree", ["--drafter", str(root / "eagle3"), "--cache", str(root / "cache"),
                                         "--eagle-tree", "20,3,4"]),
                        ("dflash-5", ["--drafter", str(dflash), "--cache", str(tmp / "cache-dflash"),
                                      "--num-prompts", "5"])):
        p = _eval([*common, *extra, "--run-dir", str(tmp / "runs" / name)], tmp)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        runs[name] = tmp / "runs" / name
    return runs


def test_a_dflash_and_an_eagle3_run_over_the_same_prompts_are_compared(two_runs, capsys):
    from orchestrator.results import compare
    from reval import cli
    d, e = (results_json.Result.load(two_runs[n] / "results.json") for n in ("dflash", "eagle3"))
    cd, ce = d.comparability, e.comparability
    assert (cd.family, ce.family) == ("dflash", "eagle3")
    assert cd.cache_fingerprint != ce.cache_fingerprint and cd.block_size != ce.block_size
    assert cd.prompt_set == ce.prompt_set  # the same prompts and completions, ids only
    assert results_json.fields_to_match(cd.key(), ce.key()) == results_json.Comparability.CROSS_FAMILY_FIELDS
    cmp = compare.compare([two_runs["dflash"], two_runs["eagle3"]])
    assert cmp.differences == []
    assert "comparable across drafter families (dflash, eagle3)" in compare.comparability_note(cmp)
    rc = cli.main(["compare", str(two_runs["eagle3"]), str(two_runs["dflash"])])
    out = capsys.readouterr().out
    assert rc == 0 and "eagle3" in out and "dflash" in out and "NOT comparable" not in out
    assert "EAGLE-3 chain 5" in out and "DFlash block 8" in out  # each row's family and decoding, by default
    assert e.metrics.tau > d.metrics.tau  # the trained head ranks above the random DFlash drafter


def test_other_prompts_are_refused_across_families_too(two_runs):
    from orchestrator.errors import ConfigError
    from orchestrator.results import compare
    with pytest.raises(ConfigError, match="prompt_set|num_prompts"):
        compare.compare([two_runs["eagle3"], two_runs["dflash-5"]])
    same_family = compare.build_comparison([compare.load_run(two_runs["dflash"]),
                                            compare.load_run(two_runs["dflash-5"])])
    assert {d.field for d in same_family.differences} == {"prompt_set", "num_prompts"}


def test_the_html_report_puts_a_dflash_and_an_eagle3_tree_run_in_one_table(two_runs, tmp_path, capsys):
    """`reval compare --html` with a DFlash run and an EAGLE-3 tree run, rendered by a real headless Chromium: both
    rows in the one comparison table, each naming its family and decoding, ranked against each other."""
    from reval import cli
    html5lib = pytest.importorskip("html5lib", reason="html5lib is a dev dependency (pyproject [dev])")
    if browser.chromium_path() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    page = tmp_path / "families.html"
    rc = cli.main(["compare", str(two_runs["dflash"]), str(two_runs["eagle3-tree"]), "--html", str(page)])
    assert rc == 0, capsys.readouterr().err
    html5lib.HTMLParser(strict=True).parse(page.read_text())
    probe = ("JSON.stringify([...document.querySelectorAll('#comparison table')].map(t => ({"
             "head: [...t.querySelectorAll('th')].map(h => h.innerText.replace(/\\s+/g, ' ')), "
             "rows: [...t.querySelectorAll('tbody tr')].map(r => [...r.cells].map(c => c.innerText.trim()))})))")
    rep = browser.open_page(page.as_uri(), probe)
    assert rep.console_errors == [] and rep.exceptions == [] and rep.requests == [page.as_uri()]
    first, *_ = json.loads(rep.probe)  # the runs table: the first of the comparison section
    col = first["head"].index("family decoding")
    rows = {r[0].split()[0]: r for r in first["rows"]}  # the run's name, its marks aside (the random one: SUSPECT)
    assert set(rows) == {"dflash", "eagle3-tree"}, rows
    assert rows["dflash"][col] == "DFlash block 8" and rows["eagle3-tree"][col] == "EAGLE-3 tree 20,3,4"
    tau = first["head"].index("tau tok/round")
    best = [r for r in first["rows"] if r[tau]]
    assert len(best) == 2  # both ranked: a tau in each row
    assert "comparable across drafter families (dflash, eagle3)" in page.read_text()
