"""Online speculative decoding at temperature T (remote_payload/eval/online_sampled.py; issue 29 items 4 and 5), on
the trained tiny fixtures, CPU, fp32, one thread.

- coupled: the online decode whose target samples are a cached completion y's tokens equals the offline walk over y
  (results.json's per-sample acceptance lengths) round by round, greedy drafts, for every sample of a T = 1 cache;
  the block only here: the online DDTree decode's coupled check is tests/test_online_tree.py;
- in law: the online decode's mean tau over K seeds and the offline tau at T over the cache's S samples (greedy
  drafts: the walk; sampled drafts: E[tau | y]) estimate the same number; per prompt the difference of the two
  means, averaged over the prompts, lies within 4 standard errors (online seeds and cache samples independent:
  se^2 = sum over prompts of (var_online / K + var_offline / S), over the prompts squared). The same interval
  excludes the greedy (T = 0) tau of those prompts: the check can fail;
- T -> tiny (1e-4): the online decode at T, both draft rules, is the greedy online decode exactly (eval --online);
- eval --online on a sampled cache records the regime, the seeds and the intervals; hostile combinations exit 3.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from remote_payload.__main__ import main as payload_main
from remote_payload.contract import results as R
from remote_payload.eval import online_sampled
from remote_payload.eval.regime import Regime
from remote_payload.extract.command import extract
from remote_payload.target.load import eos_ids_of, load_target

TEXTS = [("fizz", "fizzbuzz n01 n02"), ("count-long", "count n07 n08 n09 n10 n11 n12 n13"),
         ("skip", "skip n03 n06 n09")]
NEW, MAX_BLOCKS = 40, 6
SAMPLES, SEEDS = 16, 16  # the statistical check: S cached samples and K online seeds a prompt
HOT = Regime(temperature=1.0, top_k=0, top_p=1.0, seed=7, samples=SAMPLES)

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(path, texts=TEXTS):
    path.write_text("".join(json.dumps({"name": n, "prompt": t}) + "\n" for n, t in texts))
    return path


def _extract(fx, prompts, out, **kw):
    return extract(fx["target"], prompts, out, max_new_tokens=NEW, layer_ids=[1, 2, 3, 4], log=lambda line: None,
                   device="cpu", batch_size=16, **kw)


def _eval(fx, cache, run_dir, *args):
    rc = payload_main(["eval", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]), "--cache",
                       str(cache), "--run-dir", str(run_dir), "--device", "cpu", "--max-blocks", str(MAX_BLOCKS),
                       "--ddtree-budgets", "16", *args])
    return rc, (json.loads((run_dir / "results.json").read_text()) if rc == 0 else None)


@pytest.fixture(scope="module")
def hot(fx, tmp_path_factory):
    """A T = 1 cache of S samples a prompt and its offline evals under both draft rules; the model pieces."""
    from remote_payload.eval.checkpoint import load_drafter, load_target_head
    d = tmp_path_factory.mktemp("hot")
    cache = _extract(fx, _prompts(d / "p.jsonl"), d / "cache", regime=HOT)
    runs = {draft: _eval(fx, d / "cache", d / "runs" / draft, "--draft", draft)[1] for draft in ("greedy", "sampled")}
    drafter, _ = load_drafter(fx["drafter_good"])
    head, _ = load_target_head(fx["target"], vocab_size=drafter.cfg.vocab_size, hidden_size=drafter.cfg.hidden_size)
    target = load_target(fx["target"], torch.device("cpu"), torch.float32)
    return {"dir": d, "cache": cache, "runs": runs, "drafter": drafter, "head": head, "target": target}


def _prompt_ids(cache):
    """(prompt name, its token ids) of each prompt, from its first sample."""
    out = {}
    for i in range(len(cache)):
        name = cache.sample_of(i)[0]
        if name not in out:
            out[name] = cache.load(i, layer_ids=cache.layer_ids[:1])[0][:cache.prompts[i].prompt_len].tolist()
    return list(out.items())


@pytest.mark.slow
def test_the_coupled_decode_is_the_offline_walk_round_by_round(hot):
    cache, res, h = hot["cache"], hot["runs"]["greedy"], hot
    fc = list(h["drafter"].cfg.fc_layer_ids)
    samples = [s for p in res["per_prompt"] for s in p["samples"]]
    assert len(samples) == len(cache) == len(TEXTS) * SAMPLES
    partial = 0
    for i, s in enumerate(samples):
        ids = cache.load(i, layer_ids=cache.layer_ids[:1])[0].tolist()
        P = cache.prompts[i].prompt_len
        assert s["name"] == cache.prompts[i].name
        d = online_sampled.decode(h["target"], h["drafter"], h["head"], fc, ids[:P], transform=HOT.transform,
                                  draft="greedy", max_blocks=MAX_BLOCKS, end=0, eos=set(), coupled=ids)
        assert d.lengths == s["acceptance_lengths"], (s["name"], d.lengths, s["acceptance_lengths"])
        assert d.tokens == ids[P:P + len(d.tokens)] and len(d.tokens) == min(sum(d.lengths) + 1, len(ids) - P)
        partial += sum(1 < x < h["drafter"].cfg.block_size for x in d.lengths)
    assert partial >= 5  # rounds that accepted some drafts and rejected one: the crop and the bonus are exercised
    with pytest.raises(ValueError, match="greedy drafts only"):
        online_sampled.decode(h["target"], h["drafter"], h["head"], fc, ids[:P], transform=HOT.transform,
                              draft="sampled", max_blocks=MAX_BLOCKS, end=0, eos=set(), coupled=ids)


def _within(online: dict, offline: dict) -> tuple[float, float]:
    """Per prompt lists of online taus (one a seed) and offline taus (one a sample) -> (mean difference, its se)."""
    diffs, var = [], 0.0
    for name, cached in offline.items():  # a decode or a sample without a round (a stop token first): left out
        on, off = (np.array([np.nan if x is None else x for x in v], dtype=float) for v in (online[name], cached))
        diffs.append(np.nanmean(on) - np.nanmean(off))
        var += np.nanvar(on, ddof=1) / np.isfinite(on).sum() + np.nanvar(off, ddof=1) / np.isfinite(off).sum()
    return float(np.mean(diffs)), math.sqrt(var) / len(offline)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["greedy", "sampled"])
def test_the_offline_tau_at_t_lies_within_the_online_decodes_interval(fx, hot, draft):
    h, res = hot, hot["runs"][draft]
    got = online_sampled.online_at_t(h["target"], h["drafter"], h["head"], None, _prompt_ids(h["cache"]), MAX_BLOCKS,
                                     transform=HOT.transform, seed=HOT.seed, draft=draft, seeds=SEEDS,
                                     max_new_tokens=NEW, eos=eos_ids_of(fx["target"]), timed=False)
    online = {r.name: r.seed_taus for r in got}
    offline = {p["name"]: [s["tau"] for s in p["samples"]] for p in res["per_prompt"]}
    assert all(len(v) == SEEDS and None not in v for v in online.values())
    assert all(len(set(v)) > 2 for v in online.values() if max(v) > 1.2)  # the seeds decode different sequences
    diff, se = _within(online, offline)
    assert abs(diff) <= 4 * se, (f"{draft}: online - offline tau at T {diff:+.3f} beyond 4 se {4 * se:.3f} "
                                 f"({SEEDS} seeds, {SAMPLES} samples a prompt)")
    # the power: an online decode at a misread temperature (1.5 for 1) is caught by the same check
    g = online_sampled.online_at_t(h["target"], h["drafter"], h["head"], None, _prompt_ids(h["cache"]), MAX_BLOCKS,
                                   transform=(1.5, 0, 1.0), seed=HOT.seed, draft=draft, seeds=SEEDS,
                                   max_new_tokens=NEW, eos=eos_ids_of(fx["target"]), timed=False)
    wrong, wrong_se = _within({r.name: r.seed_taus for r in g}, offline)
    assert abs(wrong) > 4 * wrong_se, (draft, wrong, wrong_se)


def test_t_to_zero_online_is_the_greedy_online_decode_and_the_section_records_the_regime(fx, tmp_path, capsys):
    """A T = 1e-4 cache (the greedy tokens: test_sampled_cache) decoded online at its T with either rule gives the
    greedy online decode's acceptance lengths exactly; results.json's online section says how it was made."""
    prompts = _prompts(tmp_path / "p.jsonl", TEXTS[:2])
    _extract(fx, prompts, tmp_path / "greedy")
    _extract(fx, prompts, tmp_path / "cold", regime=Regime(temperature=1e-4, top_k=0, top_p=1.0, seed=3, samples=1))
    on = ["--online", "2", "--online-repeats", "1"]
    _, g = _eval(fx, tmp_path / "greedy", tmp_path / "runs" / "g", *on)
    want = [p["acceptance_lengths"] for p in g["online"]["per_prompt"]]
    assert g["online"]["regime"] is None and g["online"]["rounds_agreeing"] == g["online"]["rounds"]
    for draft in ("greedy", "sampled"):
        rc, res = _eval(fx, tmp_path / "cold", tmp_path / "runs" / draft, *on, "--online-seeds", "2", "--draft", draft)
        o = res["online"]
        assert rc == 0 and [p["acceptance_lengths"] for p in o["per_prompt"]] == [w + w for w in want], draft
        assert o["regime"] == {"temperature": 1e-4, "top_k": 0, "top_p": 1.0, "seed": 3, "samples": 1, "seeds": 2,
                               "draft": draft}
        assert o["prompts_agreeing"] is None and o["rounds"] == 2 * g["online"]["rounds"]
        taus = [p["tau"] for p in res["per_prompt"]]
        assert o["tau_online"] == pytest.approx(np.mean([np.mean(w) for w in want]))
        assert o["tau_offline"] == pytest.approx(np.mean(taus)) and o["tau_difference"] == pytest.approx(0, abs=1e-12)
        assert [p["seed_taus"] for p in o["per_prompt"]] == [[np.mean(w)] * 2 for w in want]
        assert o["tau_difference_ci"] == [pytest.approx(0, abs=1e-12)] * 2 and "paired" in o["ci_note"]
        assert o["spec_s"] > 0 and o["target_only_s"] > 0 and len(o["measured_speedup_runs"]) == 1
        assert R.Result.from_dict(res).online.regime.draft == draft
        out = capsys.readouterr().out
        assert "online at T (2 prompts x 2 seeds" in out and "(2 seeds) vs" in out


@pytest.fixture(scope="module")
def small(fx, tmp_path_factory):
    """A one-prompt sampled cache (T = 1, 8 new tokens)."""
    d = tmp_path_factory.mktemp("small")
    extract(fx["target"], _prompts(d / "p.jsonl", TEXTS[:1]), d / "cache", max_new_tokens=8, layer_ids=[1, 2, 3, 4],
            log=lambda line: None, device="cpu", regime=Regime(1.0, 0, 1.0, 1, 1))
    return d / "cache"


@pytest.mark.parametrize("case", ["hybrid", "greedy-cache-seeds", "seeds-without-online"])
def test_hostile_online_at_t_is_one_line_exit_3(fx, small, tmp_path, capsys, case):
    cache, target, args = small, fx["target"], ["--online", "1", "--draft", "sampled"]
    want = "--online: "
    if case == "hybrid":  # a target with linear-attention layers: refused before anything is evaluated
        target = tmp_path / "hybrid"
        target.mkdir()
        cfg = json.loads((fx["target"] / "config.json").read_text())
        cfg["layer_types"] = ["linear_attention"] * (cfg["num_hidden_layers"] - 1) + ["full_attention"]
        (target / "config.json").write_text(json.dumps(cfg))
    elif case == "greedy-cache-seeds":
        cache, args, want = fx["cache"], ["--online", "1", "--online-seeds", "3"], "--online-seeds needs a sampled"
    else:
        args, want = ["--online-seeds", "3"], "--online-seeds tunes --online N"
    rc = payload_main(["eval", "--drafter", str(fx["drafter_good"]), "--target", str(target), "--cache", str(cache),
                       "--run-dir", str(tmp_path / "run"), "--device", "cpu", "--num-prompts", "1", *args])
    err = capsys.readouterr().err
    assert rc == 3 and err.startswith(f"error: {want}") and err.count("\n") == 1, err
    assert not (tmp_path / "run" / "results.json").exists()
