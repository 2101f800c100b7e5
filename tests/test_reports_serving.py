"""Issue 32 items 4, 6, 9 and 13 (the laptop's reports): the serving figures (--speedup's projected speedup,
--online's measured speedup and agreement) in compare's default text table, its HTML and the sweep's table,
lines and files; a sweep verdict that says why a checkpoint after a suspect one is "new"; the HTML page as
wide as the window (a sweep's verdict column on screen in a real Chromium); --allow-unknown-config keys
shown by compare as what two runs differ by; a results file holding one cache as two suites counted once in
every interval and paired test (the sweep's verdicts too)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator import sweep
from orchestrator.render import html, tables
from orchestrator.results import compare
from orchestrator.sweep.ledger import LedgerEntry
from tests import browser
from tests.conftest import check_results_roundtrip
from tests.resultsgen import make_results, write_run
from tests.runtools import reval


def serving(run: str, *, measured: float, best: float, agree: int = 4, step: int | None = None,
            quality: float = 0.8, num_prompts: int = 8) -> dict:
    """A results.json with both serving sections, every field filled as the payload writes them."""
    d = make_results(run, quality=quality, step=step, num_prompts=num_prompts)
    d["speedup"] = {"regime": "eager", "device": "cpu", "gpu": None, "dtype": "float32", "context_len": 200,
                    "decode_s": 0.01, "draft_s": 0.004, "verify_s": {"16": 0.012, "65": 0.02},
                    "target_hash": "sha256:t", "reused": False, "measure_s": 1.5, "note": "",
                    "projected": {"block": best * 0.8, "ddtree_64": best}, "best_method": "ddtree_64",
                    "best_speedup": best, "by_suite": None, "tau": "pooled", "tied": None, "batches": None,
                    "repeats": None, "latencies": None, "by_batch": None, "stops_paying": None,
                    "measured_at": None, "table": None, "table_note": None}
    names = [p["name"] for p in d["per_prompt"][:4]]
    d["online"] = {"method": "block", "device": "cpu", "dtype": "float32", "prompts": 4,
                   "prompts_agreeing": agree, "rounds": 12, "rounds_agreeing": 12 - (4 - agree),
                   "tau_pooled_online": 3.1, "tau_pooled_offline": 3.1, "tokens": 37, "spec_s": 2.0,
                   "target_only_s": 2.0 * measured, "measured_speedup": measured,
                   "projected_speedup": best * 0.8,
                   "prompts_with_cache_mismatch": 0, "projected_tau": None, "measured_speedup_runs": None,
                   "repeats": None, "regime": None, "tau_online": None, "tau_online_ci": None,
                   "tau_online_seed_ci": None, "tau_offline": None, "tau_offline_ci": None, "tau_difference": None,
                   "tau_difference_ci": None, "ci_note": None,  # the fields of a sampled cache's online decode
                   "per_prompt": [{"name": n, "acceptance_lengths": [3, 3, 4], "agree": i < agree,
                                   "spec_s": 0.5, "target_only_s": 0.5 * measured, "seed_taus": None,
                                   "seed_rounds": None, "tau_online": None, "tau_offline": None}
                                  for i, n in enumerate(names)]}
    return d


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REVAL_RUNS_DIR", raising=False)
    root = tmp_path / "runs"
    write_run(root, "h", "a", serving("a", measured=1.85, best=2.31))
    write_run(root, "h", "b", serving("b", measured=1.42, best=1.97, agree=3, quality=0.7))
    write_run(root, "h", "plain", num_prompts=8)  # measured neither: empty cells
    for run in ("a", "b"):
        assert check_results_roundtrip(root / "h" / run / "results.json") is None
    return root


def test_compare_shows_projected_and_online_speedup_in_the_default_table(served, capsys, tmp_path):
    rc, out, err = reval(capsys, "compare", "h/a", "h/b", "h/plain")
    assert rc == 0, err
    lines = {}
    for line in out.splitlines():  # each run's first line (its name first, then its numbers)
        if line.split() and line.split()[0] in ("a", "b", "plain") and "x12" in line:
            lines.setdefault(line.split()[0], line)
    assert "2.31x @64" in lines["a"] and "1.85x · 4/4" in lines["a"], out  # the old table showed neither
    assert "1.97x @64" in lines["b"] and "1.42x · 3/4" in lines["b"]
    assert "@64" not in lines["plain"] and "·" not in lines["plain"]  # no figure where none was measured
    assert "online = the measured wall-clock speedup" in out and "speedup (proj.) = the best projected" in out
    rc, _, err = reval(capsys, "compare", "h/a", "h/b", "--html", str(tmp_path / "r.html"))
    page = (tmp_path / "r.html").read_text()
    comparison = page[page.index('id="comparison"'):page.index('id="per-position"')]
    assert rc == 0 and "2.31x @64" in comparison and "1.85x · 4/4" in comparison, err


def _series(root: Path, states: dict[int, str]) -> tuple[list[LedgerEntry], list]:
    """The ledger's series and this sweep's outcomes for runs/h/step-N (state 'suspect': a suspect run)."""
    series, outs = [], []
    for s, state in states.items():
        write_run(root, "h", f"step-{s}", serving(f"step-{s}", measured=1.5 + s / 1000, best=2.0 + s / 1000,
                                                  step=s, quality=0.6 + s / 2000))
        tau = compare.load_run(root / "h" / f"step-{s}").result.metrics.tau
        e = LedgerEntry(f"k{s}", f"step-{s}", "x", f"h{s}", s, "h", f"step-{s}", "succeeded", "s1", tau=tau,
                        suspect=state == "suspect", local_path=str(root / "h" / f"step-{s}"))
        series.append(e)
        outs.append(sweep.Outcome(e.checkpoint, e.step, "succeeded", "h", e.run, e.tau, suspect=e.suspect,
                                  local_path=e.local_path))
    sweep.attach_comparisons(outs, series, None, 0.1)
    return series, outs


def test_a_checkpoint_after_a_suspect_one_says_why_it_is_new(tmp_path):
    _, outs = _series(tmp_path / "runs", {100: "suspect", 200: "ok", 300: "suspect", 400: "ok"})
    first, after = outs[1], outs[3]
    assert first.verdict == "new" and first.verdict_note == \
        "nothing earlier to compare with: step-100 suspect, not compared"  # was a bare "new"
    assert after.prev_checkpoint == "step-200" and after.verdict_note == \
        "vs step-200, the last earlier one that can be compared (step-300 suspect between)"
    assert outs[0].verdict == "suspect" and outs[0].verdict_note is None
    rep = sweep.SweepReport("s1", tmp_path / "s1", outs, None, {}, 0.1)
    text = sweep.outcome_text(first)
    assert text.endswith("new (nothing earlier to compare with: step-100 suspect, not compared)"), text
    verdicts = [r.cells["verdict"].text for r in sweep.report_table(rep).rows]
    assert verdicts[1] == "new (nothing earlier to compare with: step-100 suspect, not compared)"


def test_the_sweep_report_shows_the_serving_figures(tmp_path):
    _, outs = _series(tmp_path / "runs", {100: "ok", 200: "ok"})
    assert outs[1].speedup == {"projected": 2.2, "method": "ddtree_64", "block": pytest.approx(2.2 * 0.8)}
    assert outs[1].online["measured_speedup"] == 1.7 and outs[1].online["prompts_agreeing"] == 4
    assert "2.20x @64 proj. · online 1.70x (4/4 agree)" in sweep.outcome_text(outs[1])
    rep = sweep.SweepReport("s1", tmp_path / "s1", outs, None, {}, 0.1)
    t = sweep.report_table(rep)
    row = t.rows[1].cells
    assert row["speedup"].text == "2.20x @64" and row["online"].text == "1.70x (4/4 agree)"
    assert row["speedup"].best and not t.rows[0].cells["speedup"].best  # ranked like tau
    assert any(n.startswith("online = the measured wall-clock speedup") for n in t.notes)
    data = sweep.report_json(rep)
    assert data["checkpoints"][1]["online"]["measured_speedup"] == 1.7  # report.json keeps them


def _wide_sweep_page(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    series, outs = _series(root, {s: "ok" for s in (1000, 2000, 3000)})
    base = compare.load_run(write_run(root, "h", "zlab-reference-drafter-full-attention",
                                      serving("base", measured=2.0, best=2.5, quality=0.9)))
    for o in outs:
        o.checkpoint = f"run-2026-11-30-very-long-experiment-name/{o.checkpoint}"
    sweep.attach_comparisons(outs, series, base, 0.1)
    rep = sweep.SweepReport("s1", tmp_path / "s1", outs, "zlab-reference-drafter-full-attention", {}, 0.1,
                            baseline_run=base)
    cmp = compare.build_comparison([compare.load_run(e.local_path) for e in series], base)
    page = tmp_path / "report.html"
    page.write_text(html.render_report("sweep s1", cmp, sweep_table=sweep.report_table(rep), steps=[]))
    return page


def test_the_html_page_uses_the_window_s_width(tmp_path):
    """The page was capped at 1200 px: the sweep table scrolled inside it and its verdict column was off
    screen even in a 2400 px window. Now a table as wide as the window shows whole, checked in Chromium."""
    if browser.chromium_path() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    page = _wide_sweep_page(tmp_path)
    probe = ("JSON.stringify((() => { const t = document.querySelector('#sweep table'); "
             "const s = t.closest('.scroll'); const v = [...t.querySelectorAll('th')].find(th => "
             "th.textContent.startsWith('verdict')).getBoundingClientRect(); return {table: t.offsetWidth, "
             "hidden: s.scrollWidth - s.clientWidth, verdict_right: v.right, "
             "window: window.innerWidth}; })())")
    rep = browser.open_page(page.as_uri(), probe, window=(2400, 1200))
    got = json.loads(rep.probe)
    assert rep.console_errors == [] and rep.exceptions == []
    assert got["table"] > 1200, got  # a table the old cap could not show whole
    assert got["hidden"] == 0 and got["verdict_right"] <= got["window"], got


def test_compare_names_the_unknown_config_keys_runs_differ_by(tmp_path, capsys, monkeypatch):
    """Two runs whose only difference is a drafter config key reval does not read (allowed with
    --allow-unknown-config): compare said nothing; now the key and each run's value, in every format."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REVAL_RUNS_DIR", raising=False)
    root = tmp_path / "runs"
    a = make_results("a")
    b = {**a, "run": "b", "drafter": {**a["drafter"], "allowed_unknown_config": {"rope_variant": '"yarn"'}}}
    write_run(root, "h", "a", a)
    write_run(root, "h", "b", b)
    rc, out, err = reval(capsys, "compare", "h/a", "h/b")
    assert rc == 0, err
    assert ('drafter config keys reval does not read, allowed with --allow-unknown-config (results may '
            'differ by them): rope_variant DIFFERS: a not set, b "yarn"') in " ".join(out.split())
    rc, out, _ = reval(capsys, "compare", "h/a", "h/b", "--json")
    runs = json.loads(out)["runs"]
    assert [r["allowed_unknown_config"] for r in runs] == [None, {"rope_variant": '"yarn"'}]
    rc, out, _ = reval(capsys, "compare", "h/a", "h/b", "--format", "csv")
    assert 'rope_variant=""yarn""' in out  # the column (csv quoting doubles the quotes)
    cmp = compare.compare([compare.load_run(root / "h" / "a"), compare.load_run(root / "h" / "b")])
    assert tables.unknown_config_note(cmp).endswith('rope_variant DIFFERS: a not set, b "yarn"')


def _better(d: dict, run: str) -> dict:
    """`d`'s run one token better on every round of every prompt (its tau and per-prompt tau restated)."""
    pp = [{**p, "name": p["name"], "acceptance_lengths": [x + 1 for x in p["acceptance_lengths"]],
           "tau": p["tau"] + 1} for p in d["per_prompt"]]
    tau = sum(p["tau"] for p in pp) / len(pp)
    return {**d, "run": run, "per_prompt": pp, "metrics": {**d["metrics"], "tau": tau, "streak": tau - 1}}


def _twice(d: dict) -> dict:
    """`d` as a file written before the spec refused the same cache given as two suites (x=C y=C): every
    prompt twice, as `x/<prompt>` and `y/<prompt>`."""
    from remote_payload.contract.results import Result
    n = len(d["per_prompt"])
    pp = [{**p, "name": f"{s}/{p['name']}"} for s in "xy" for p in d["per_prompt"]]
    suites = [{"name": s, "cache": d["cache"], "comparability": d["comparability"], "metrics": d["metrics"],
               "prompt_range": [i * n, (i + 1) * n]} for i, s in enumerate("xy")]
    tau = d["metrics"]["tau"]
    return Result.from_dict({**d, "per_prompt": pp, "suites": suites, "suite_mean": {
        "num_suites": 2, "tau": tau, "streak": tau - 1, "position_1_accuracy": None,
        "ddtree_tau": {}}}).to_dict()


def test_a_cache_given_as_two_suites_counts_each_prompt_once(tmp_path):
    """Item 9: an old file holding one cache as two suites paired 2n prompts: 5 prompts all better (exact
    sign-flip p 0.0625, no clear change) became p 0.002, "improved". Each prompt now counts once: the same
    Δ, CI and p as the one-cache runs, in compare and in the sweep's verdict."""
    from orchestrator.results import intervals
    root = tmp_path / "runs"
    one_a = make_results("a", num_prompts=5)
    one_b = _better(one_a, "b")
    for name, d in (("a", _twice(one_a)), ("b", _twice(one_b)), ("a1", one_a), ("b1", one_b)):
        write_run(root, "h", name, d)
    a, b, a1, b1 = (compare.load_run(root / "h" / n) for n in ("a", "b", "a1", "b1"))
    assert len(b.result.per_prompt) == 10 and len(intervals.distinct_prompts(b.result)) == 5
    twice, once = (intervals.compare_paired(x.result, y.result, keys={"tau"})["tau"]
                   for x, y in ((b, a), (b1, a1)))
    assert twice.n == 5 and twice.p_value == once.p_value == pytest.approx(0.0625)
    assert (twice.delta, twice.delta_lo, twice.delta_hi) == (once.delta, once.delta_lo, once.delta_hi)
    assert intervals.estimates(b.result)["tau"].n == 5
    series = [LedgerEntry(f"k{s}", f"step-{s}", "x", f"h{s}", s, "h", n, "succeeded", "s1",
                          tau=r.result.metrics.tau, local_path=str(r.path))
              for s, n, r in ((1, "a", a), (2, "b", b))]
    outs = [sweep.Outcome(e.checkpoint, e.step, "succeeded", "h", e.run, e.tau, local_path=e.local_path)
            for e in series]
    sweep.attach_comparisons(outs, series, None, 0.1)
    assert outs[1].vs_prev.n == 5 and outs[1].verdict == "no clear change"  # was "improved" (p 0.002)
    # a suite run whose suites are different caches keeps every prompt
    from remote_payload.runtime.dummy import fake_results, with_suites
    res = compare.load_run(write_run(root, "h", "s", with_suites(fake_results("s", 6), ["g", "m"])))
    assert len(intervals.distinct_prompts(res.result)) == 6


def test_one_duration_for_one_run(served, capsys, tmp_path):
    """Item 6: compare said 12s (the payload's total_s) where `done` and `reval status` said 2m41s
    (status.json); one figure now, the provenance naming the payload's parts beside it."""
    from orchestrator.render.tables import duration_text
    rc, out, err = reval(capsys, "compare", "h/a", "--json")
    run = compare.load_run(served / "h" / "a")
    assert rc == 0 and json.loads(out)["runs"][0]["duration_s"] == 161.0, err
    assert tables.main_table(compare.compare([run])).rows[0].cells["duration"].text == duration_text(run.status)
    prov = html.provenance_table(compare.compare([run])).rows[0].cells
    assert (prov["wall"].text, prov["payload_s"].text) == ("2m41s", "12s")  # the wall, and the payload's part


def test_an_online_check_at_t_shows_its_taus_not_a_none_agreement(tmp_path, monkeypatch, capsys):
    """At T > 0 the online rounds are not compared with the walk's (the draws are its own): prompts_agreeing is
    null, and the tables say 'tau X online vs Y offline' instead of 'None/4'."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REVAL_RUNS_DIR", raising=False)
    d = serving("t1", measured=1.5, best=2.0)
    d["online"].update({"prompts_agreeing": None, "rounds_agreeing": None, "prompts_with_cache_mismatch": None,
                        "tau_online": 3.823, "tau_offline": 3.847, "tau_difference": -0.024})
    for p in d["online"]["per_prompt"]:
        p["agree"] = None
    write_run(tmp_path / "runs", "h", "t1", d)
    rc, out, err = reval(capsys, "compare", "h/t1")
    assert rc == 0, err
    assert "None" not in out and "1.50x · tau 3.82 online vs 3.85 offline" in out
    from orchestrator.words import online_agreement
    assert online_agreement(d["online"]) == "tau 3.82 online vs 3.85 offline"
    assert online_agreement({"prompts_agreeing": 3, "prompts": 4}) == "3/4 agree"
    assert online_agreement({"prompts_agreeing": None, "prompts": 4}) == ""


def test_a_method_name_with_control_characters_is_escaped_in_the_speedup_plot(tmp_path, monkeypatch, capsys):
    """speedup.by_batch's method names come from a results.json (untrusted): the per-batch table and the HTML's
    speedup-vs-batch plot (its title and legend) show them escaped, never a raw ESC (matplotlib used to draw the
    raw name and warn about the missing glyph)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REVAL_RUNS_DIR", raising=False)
    d = serving("w", measured=1.5, best=2.0)
    m = "=cmd|'/c calc'!A1\x1b[31m"
    d["speedup"]["projected"] = {m: 2.0, "block": 1.5}
    d["speedup"]["by_batch"] = [{"batch": b, "projected": {m: 2.0 / b, "block": 1.5}, "low": {m: 1.8 / b,
                                 "block": 1.4}, "high": {m: 2.2 / b, "block": 1.6}, "best_method": None,
                                 "best_speedup": 2.0 / b, "tied": [m, "block"]} for b in (1, 4)]
    d["speedup"]["stops_paying"] = {m: 4, "block": None}
    write_run(tmp_path / "runs", "h", "w", d)
    rc, out, err = reval(capsys, "compare", "h/w", "--wide")
    assert rc == 0 and "\x1b" not in out and "\\x1b[31m" in out, err
    rc, out, err = reval(capsys, "compare", "h/w", "--html", str(tmp_path / "r.html"))
    page = (tmp_path / "r.html").read_text()
    assert rc == 0 and "\x1b" not in page and "Glyph" not in err and "\\x1b[31m" in page, err
