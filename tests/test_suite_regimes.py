"""Several decoding regimes in one eval process (issue 29): `--cache g=greedy_cache --cache hot=sampled_cache` on the
trained tiny fixtures (CPU, fp32). Each suite's numbers equal a one-cache run of its cache in its regime; each suite
records its regime and comparability; the top level is `mixed`; compare ranks nothing across regimes and puts
them side by side (`--by suite`: one column per suite and regime)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.render import suites as suite_render
from orchestrator.results import compare
from orchestrator.results import suites as suite_match
from remote_payload.__main__ import main as payload_main
from remote_payload.contract import results as R
from remote_payload.eval.regime import Regime
from remote_payload.extract.command import extract
from tests.runtools import reval

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = [("fizz", "fizzbuzz n01 n02"), ("skip", "skip n03 n06 n09")]
HOT = Regime(temperature=1.0, top_k=0, top_p=1.0, seed=3, samples=2)


def _eval(fx, run_dir: Path, *caches: str, draft: str = "sampled") -> int:
    argv = ["eval", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]), "--device", "cpu",
            "--max-blocks", "4", "--ddtree-budgets", "16", "--run-dir", str(run_dir), "--draft", draft]
    for c in caches:
        argv += ["--cache", c]
    return payload_main(argv)


@pytest.fixture(scope="module")
def runs(fx, tmp_path_factory) -> Path:
    """runs/h/{mixed (greedy cut of the fixture cache + a T=1 cache, --draft sampled), g (greedy alone),
    hot (the T=1 cache alone, --draft sampled), hotg (the T=1 cache alone, --draft greedy), twohot (the T=1
    cache cut in two suites, --draft greedy)}."""
    root = tmp_path_factory.mktemp("regimes")
    src = fx["cache"]
    index = json.loads((src / "cache.json").read_text())
    greedy = root / "greedy"
    greedy.mkdir()
    (greedy / "cache.json").write_text(json.dumps({**index, "prompts": index["prompts"][:3]}))
    for p in index["prompts"][:3]:
        (greedy / p["file"]).symlink_to(src / p["file"])
    (root / "p.jsonl").write_text("".join(json.dumps({"name": n, "prompt": t}) + "\n" for n, t in TEXTS))
    extract(fx["target"], root / "p.jsonl", root / "hot", max_new_tokens=24, layer_ids=[1, 2, 3, 4],
            device="cpu", regime=HOT, log=lambda line: None)
    hot = json.loads((root / "hot" / "cache.json").read_text())
    for half, entries in (("hot_a", hot["prompts"][:HOT.samples]), ("hot_b", hot["prompts"][HOT.samples:])):
        (root / half).mkdir()  # the T=1 cache cut in two suites of the one regime, each prompt's samples together
        (root / half / "cache.json").write_text(json.dumps({**hot, "prompts": entries}))
        for p in entries:
            (root / half / p["file"]).symlink_to(root / "hot" / p["file"])
    out = root / "runs" / "h"
    assert _eval(fx, out / "mixed", f"g={greedy}", f"hot={root / 'hot'}") == 0
    assert _eval(fx, out / "g", str(greedy), draft="greedy") == 0
    assert _eval(fx, out / "hot", str(root / "hot")) == 0
    assert _eval(fx, out / "hotg", str(root / "hot"), draft="greedy") == 0
    assert _eval(fx, out / "twohot", f"a={root / 'hot_a'}", f"b={root / 'hot_b'}", draft="greedy") == 0
    return out


def _load(runs: Path, name: str) -> R.Result:
    return R.Result.load(runs / name / "results.json")


def test_each_suite_equals_a_separate_run_in_its_own_regime(runs):
    mixed, g, hot = (_load(runs, n) for n in ("mixed", "g", "hot"))
    sg, sh = mixed.suites
    assert sg.metrics.to_dict() == g.metrics.to_dict() and sh.metrics.to_dict() == hot.metrics.to_dict()
    assert sg.comparability.key() == g.comparability.key() and sh.comparability.key() == hot.comparability.key()
    lo, hi = sh.prompt_range
    assert [p.to_dict() for p in mixed.per_prompt[lo:hi]] == [{**p.to_dict(), "name": f"hot/{p.name}"}
                                                             for p in hot.per_prompt]
    # each suite its regime: --draft sampled applies to the sampled suite; the greedy one is draft greedy (T = 0)
    assert sh.regime.to_dict() == hot.regime.to_dict() and sh.comparability.regime.endswith("draft=sampled")
    assert (sg.regime.temperature, sg.regime.draft, sg.comparability.regime) == (0.0, "greedy", None)
    assert "draft rule is irrelevant" in sg.regime.notes[-1]
    # the top level says mixed, ranks only against the same suites in the same regimes, has no mean over regimes
    assert mixed.regime.mixed and mixed.regime.temperature is None and mixed.regime.draft == "sampled"
    assert mixed.comparability.regime == f"mixed:g=greedy;hot={sh.comparability.regime}"
    assert mixed.suite_mean is None and any("different decoding regimes" in n for n in mixed.notes)
    assert mixed.metrics.num_prompts == 3 + len(TEXTS) and mixed.cache.num_prompts_total == 3 + len(TEXTS)
    assert mixed.metrics.tau == pytest.approx((3 * g.metrics.tau + len(TEXTS) * hot.metrics.tau) / (3 + len(TEXTS)))
    rounds = g.metrics.num_rounds + hot.metrics.num_rounds
    assert mixed.metrics.num_rounds == pytest.approx(rounds)
    assert mixed.metrics.tau_pooled == pytest.approx(
        (g.metrics.tau_pooled * g.metrics.num_rounds + hot.metrics.tau_pooled * hot.metrics.num_rounds) / rounds)
    assert mixed.metrics.ddtree_tau == {}  # sampled drafts have no trees: no pooled tree figure over both


def test_suites_of_one_sampled_regime_keep_that_regime_at_the_top(runs):
    """Two suites of the one T=1 regime (a sampled cache cut in two): the top level is that regime, its key that
    signature, suite_mean kept, and every figure the one-cache run's over the same samples."""
    two, hotg = _load(runs, "twohot"), _load(runs, "hotg")
    assert not two.regime.mixed and two.regime.to_dict() == hotg.regime.to_dict()
    assert two.comparability.regime == hotg.comparability.regime and two.comparability.regime.endswith("greedy")
    assert [s.regime.to_dict() for s in two.suites] == [hotg.regime.to_dict()] * 2
    assert two.suite_mean is not None and two.cache.num_prompts_total == len(TEXTS)
    assert two.metrics.tau == pytest.approx(hotg.metrics.tau) and two.metrics.num_samples == hotg.metrics.num_samples
    assert two.metrics.tau_pooled == pytest.approx(hotg.metrics.tau_pooled)


def test_draft_sampled_over_greedy_suites_only_is_refused(fx, runs, capsys):
    g = runs / "g"
    rc = _eval(fx, runs.parent / "bad", f"a={_load(runs, 'g').cache.path}", draft="sampled")
    err = capsys.readouterr().err
    assert rc == 3 and err.startswith("error: --draft sampled needs a sampled cache") and len(err.splitlines()) == 1
    assert g.is_dir()


def test_compare_never_ranks_across_regimes_and_sets_them_side_by_side(runs, capsys, monkeypatch):
    monkeypatch.chdir(runs.parent.parent)
    rc, _, err = reval(capsys, "compare", "h/mixed", "h/g")
    assert rc == 3 and "decoding regime" in err
    rc, _, err = reval(capsys, "compare", "h/hot", "h/hotg")
    assert rc == 3 and "decoding regime" in err
    cmp = compare.compare([compare.load_run(runs / n) for n in ("mixed", "g", "hot", "hotg")],
                          allow_incomparable=True)
    sc = suite_match.match(cmp)
    hot_s = "hot T=1 draft=sampled"
    assert sc.columns == ["g T=0", hot_s, "hot T=1"] and not sc.differences
    t = suite_render.suite_table(cmp)
    assert [c.label for c in t.columns][1:4] == ["g\nT=0", "hot\nT=1 draft=sampled", "hot\nT=1"]
    mixed_row, g_row, hot_row, hotg_row = t.rows
    assert mixed_row.cells["suite:g T=0"].value == g_row.cells["suite:g T=0"].value  # landed by content + regime
    assert mixed_row.cells[f"suite:{hot_s}"].value == hot_row.cells[f"suite:{hot_s}"].value
    assert hotg_row.cells[f"suite:{hot_s}"].value is None  # another regime: another column, never ranked
    assert hotg_row.cells["suite:hot T=1"].value == _load(runs, "hotg").metrics.tau
    rc, out, err = reval(capsys, "compare", "h/mixed", "h/g", "h/hot", "h/hotg", "--by", "suite", "--format",
                         "json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["regimes"][hot_s].endswith("draft=sampled") and data["regimes"]["g T=0"] is None
    assert data["runs"][0]["suites"][hot_s]["regime"] == data["regimes"][hot_s] and data["comparable"]
    rc, out, err = reval(capsys, "compare", "h/mixed", "h/g", "h/hot", "h/hotg", "--by", "suite")
    flat = " ".join(out.split())
    assert rc == 0 and "T=0" in flat and "draft=sampled" in flat and "never ranked" in flat, err
    assert "mixed: suites of several decoding regimes: no mean over suites" in flat
    rc, out, _ = reval(capsys, "compare", "h/mixed", "h/hot", "h/hotg", "--by", "suite", "--format", "csv")
    header = out.splitlines()[0].split(",")
    assert rc == 0 and {"suite:g T=0", f"suite:{hot_s}", "suite:hot T=1"} <= set(header)
    page = runs.parent.parent / "r.html"
    rc, _, err = reval(capsys, "compare", "h/mixed", "h/hot", "h/hotg", "--by", "suite", "--html", str(page))
    by_suite = page.read_text().split('id="suites"')[1].split("</section>")[0]
    assert rc == 0 and "T=1 draft=sampled" in by_suite and "never ranked" in by_suite, err


def test_regime_tags_are_short_and_tell_every_regime_apart():
    a, b = "T=1/top_k=0/top_p=1/seed=0/samples=4/draft=greedy", "T=1/top_k=0/top_p=1/seed=1/samples=4/draft=greedy"
    c = "T=0.6/top_k=20/top_p=0.95/seed=0/samples=1/draft=sampled"
    want = {None: "T=0", a: "T=1", c: "T=0.6 top_k=20 top_p=0.95 draft=sampled"}
    assert suite_match.regime_tags([None, a, c]) == want
    tags = suite_match.regime_tags([a, b, None])  # alike but for the seed: both say theirs
    assert tags == {a: "T=1 seed=0 samples=4", b: "T=1 seed=1 samples=4", None: "T=0"}
