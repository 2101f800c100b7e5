"""Several suites in one EAGLE-3 eval (remote_payload/eagle3/suites.py): `--cache g=GREEDY --cache hot=SAMPLED` on the
trained tiny EAGLE-3 fixture (CPU, fp32). The head is loaded once; each suite's numbers, regime and comparability
equal a one-cache run of its cache; the top level is `mixed`; a later suite's cache without the head's taps is
refused naming that suite (exit 3)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from remote_payload.contract import results as R
from remote_payload.eval.regime import Regime
from tests.test_eagle3_sampled import ROOT, _eval, _extract, _prompts

pytestmark = pytest.mark.usefixtures("one_thread")

HOT = Regime(temperature=1.0, top_k=0, top_p=1.0, seed=3, samples=2)


@pytest.fixture(scope="module")
def e3():
    from remote_payload.tools import eagle3_fixtures
    root = ROOT / ".cache" / "eagle3-fixtures"
    return root, eagle3_fixtures.build(root, log=lambda line: None)


def _cut(src: Path, out: Path, keep: int, layer_ids=None) -> Path:
    """The first `keep` entries of a cache (links to its files; cache.json's layer_ids rewritten if asked)."""
    index = json.loads((src / "cache.json").read_text())
    out.mkdir()
    (out / "cache.json").write_text(json.dumps({**index, "prompts": index["prompts"][:keep],
                                                **({"layer_ids": layer_ids} if layer_ids else {})}))
    for p in index["prompts"][:keep]:
        (out / p["file"]).symlink_to(src / p["file"])
    return out


@pytest.fixture(scope="module")
def runs(e3, tmp_path_factory) -> Path:
    root, _ = e3
    d = tmp_path_factory.mktemp("e3suites")
    greedy = _cut(root / "cache", d / "greedy", 3)
    _extract(root, _prompts(root, d / "p.jsonl", ("fizzbuzz", "countdown-15")), d / "hot", HOT, new=24)
    out = d / "runs"
    for name, caches, draft in (("mixed", [f"g={greedy}", f"hot={d / 'hot'}"], "sampled"),
                                ("g", [str(greedy)], "greedy"), ("hot", [str(d / "hot")], "sampled")):
        args = [x for c in caches for x in ("--cache", c)][1:]  # _eval gives the first --cache
        assert _eval(root, args[0], out / name, *args[1:], "--draft", draft)[0] == 0, name
    return out


def _load(runs: Path, name: str) -> R.Result:
    return R.Result.load(runs / name / "results.json")


def test_each_suite_equals_its_own_one_cache_run_with_the_head_loaded_once(runs):
    mixed, g, hot = (_load(runs, n) for n in ("mixed", "g", "hot"))
    sg, sh = mixed.suites
    assert (sg.name, sh.name) == ("g", "hot")
    assert sg.metrics.to_dict() == g.metrics.to_dict() and sh.metrics.to_dict() == hot.metrics.to_dict()
    assert sg.comparability.key() == g.comparability.key() and sh.comparability.key() == hot.comparability.key()
    assert sg.comparability.family == sh.comparability.family == mixed.comparability.family == "eagle3"
    lo, hi = sh.prompt_range
    assert [p.to_dict() for p in mixed.per_prompt[lo:hi]] == [{**p.to_dict(), "name": f"hot/{p.name}"}
                                                             for p in hot.per_prompt]
    assert [p.name for p in hot.per_prompt] == ["fizzbuzz", "countdown-15"] and hot.metrics.num_samples == 4
    assert sh.regime.to_dict() == hot.regime.to_dict() and sh.comparability.regime.endswith("draft=sampled")
    assert (sg.regime.temperature, sg.regime.draft, sg.comparability.regime) == (0.0, "greedy", None)
    assert mixed.regime.mixed and mixed.suite_mean is None
    assert mixed.comparability.regime == f"mixed:g=greedy;hot={sh.comparability.regime}"
    assert mixed.drafter.family == "eagle3" and mixed.drafter.eagle3 == g.drafter.eagle3
    assert mixed.options.block_size == 6 and mixed.metrics.ddtree_tau == {}
    events = [json.loads(line) for line in (runs / "mixed" / "events.jsonl").read_text().splitlines()]
    assert sum(e.get("stage") == "load_drafter" and "message" in e and e["message"].startswith("Loading EAGLE-3")
               for e in events) == 1  # the head loaded once for both suites


def test_a_later_suites_cache_without_the_taps_is_refused_naming_it(e3, runs, tmp_path, capsys):
    root, _ = e3
    bad = _cut(root / "cache", tmp_path / "dflash-layers", 2, layer_ids=[1, 2, 3])
    capsys.readouterr()
    good = _cut(root / "cache", tmp_path / "g", 2)
    rc, _ = _eval(root, f"g={good}", tmp_path / "run", "--cache", f"d={bad}")
    err = capsys.readouterr().err
    assert rc == 3 and err.startswith(f"error: suite d (--cache d={bad})") and "without [4]" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "run" / "results.json").exists()
