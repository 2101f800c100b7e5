"""EAGLE-3 on a sampled cache (remote_payload/eagle3/sampled.py, online_sampled.py; issue 31 item 3 with issue 29's
rules), on the trained tiny EAGLE-3 fixture (remote_payload/tools/eagle3_fixtures.py), CPU, fp32, one thread.

- --draft sampled is the exact E[tau | y] over the teacher-forced chain's q (it was the greedy walk, recorded as
  the sampled rule's expectation); q along y equals the plain per-step chain fed y's tokens;
- coupled: the online chain decode whose target samples are a cached completion's tokens equals the offline walk
  over it round by round (greedy drafts), every sample of a T = 1 cache;
- in law: per prompt the online decodes' mean tau over K seeds and the offline tau over the cache's S samples
  (greedy drafts: the walk; sampled drafts: E[tau | y]) agree within 4 standard errors (as tests/test_online_sampled
  for DFlash); a decode at a misread temperature (1.5 for 1) is caught by the same check;
- T -> 1e-4: the offline figures under both rules are the greedy cache's exactly, and so is the online decode;
- --eagle-tree with --draft sampled is refused in one line (exit 3); the tree with --draft greedy walks every sample
  (the one-child tree K+1,K-1,1 equals the chain of K sample by sample).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from remote_payload.__main__ import main as payload_main
from remote_payload.contract import results as R
from remote_payload.eval.regime import Regime
from remote_payload.extract.command import extract

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("fizzbuzz", "count-07", "countdown-15")
NEW, MAX_BLOCKS, K = 40, 6, 5
SAMPLES, SEEDS = 16, 16
HOT = Regime(temperature=1.0, top_k=0, top_p=1.0, seed=7, samples=SAMPLES)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def e3():
    from remote_payload.tools import eagle3_fixtures
    root = ROOT / ".cache" / "eagle3-fixtures"
    return root, eagle3_fixtures.build(root, log=lambda line: None)


def _prompts(root: Path, out: Path, names=NAMES) -> Path:
    rows = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows if r["name"] in names))
    return out


def _extract(root: Path, prompts: Path, out: Path, regime: Regime | None = None, new: int = NEW):
    return extract(root / "target", prompts, out, max_new_tokens=new, layer_ids=[1, 3, 4], device="cpu",
                   batch_size=16, regime=regime, log=lambda line: None)


def _eval(root: Path, cache, run_dir: Path, *args: str, capsys=None) -> tuple[int, R.Result | None]:
    rc = payload_main(["eval", "--drafter", str(root / "eagle3"), "--target", str(root / "target"), "--cache",
                       str(cache), "--run-dir", str(run_dir), "--device", "cpu", "--max-blocks", str(MAX_BLOCKS),
                       *args])
    return rc, (R.Result.load(run_dir / "results.json") if rc == 0 else None)


@pytest.fixture(scope="module")
def hot(e3, tmp_path_factory):
    """A T = 1 cache of S samples a prompt of the EAGLE-3 fixture's target, its evals under both rules, the models."""
    from transformers import AutoModelForCausalLM

    from remote_payload.eagle3.loader import load_eagle3
    root, meta = e3
    d = tmp_path_factory.mktemp("e3hot")
    cache = _extract(root, _prompts(root, d / "p.jsonl"), d / "cache", HOT)
    runs = {draft: _eval(root, d / "cache", d / "runs" / draft, "--draft", draft)[1] for draft in ("greedy", "sampled")}
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), local_files_only=True).eval()
    head, _ = load_eagle3(root / "eagle3", embed=target.model.embed_tokens.weight.detach())
    return {"root": root, "taps": meta["taps"], "cache": cache, "runs": runs, "target": target, "head": head}


def _samples(res: R.Result) -> list:
    return [s for p in res.per_prompt for s in p.samples]


def _forced_chain_logq(head, feats, ids, a: int, index) -> list[float]:
    """The plain per-step chain (online.draft_chain) at anchor a, fed y's tokens instead of its own drafts ->
    log q(y[a+k]) at each step k = 1..K (-inf where y's token is outside the draft vocabulary)."""
    from remote_payload.eagle3.online import draft_chain
    from remote_payload.eval.sampling import transform_logprobs
    got: list[float] = []

    def forced(logits):
        y = ids[min(a + 1 + len(got), len(ids) - 1)]
        lp = transform_logprobs(logits, *HOT.transform)[0]
        got.append(float(lp[index[y]]) if index[y] >= 0 else float("-inf"))
        return index[y].clamp(min=0).view(1)
    draft_chain(head, feats[:a], ids[1:a + 1], K, choose=forced)
    return got


def test_draft_sampled_is_the_exact_program_over_the_teacher_forced_chain(hot):
    from remote_payload.eagle3.sampled import chain_logq, draft_index
    from remote_payload.eval.expect import expected_walk
    cache, head, res, greedy = hot["cache"], hot["head"], hot["runs"]["sampled"], hot["runs"]["greedy"]
    assert res.regime.draft == "sampled" and res.comparability.regime.endswith("/draft=sampled")
    assert [p.name for p in res.per_prompt] == list(NAMES) and res.metrics.num_samples == len(cache)
    assert res.options.num_prompts == len(NAMES) and res.drafter.family == "eagle3"
    index = draft_index(head)
    for i, s in enumerate(_samples(res)):
        ids, feats = cache.load(i, layer_ids=[1, 3, 4])
        p = cache.prompts[i]
        n = len(ids) - 1 - p.prompt_len
        _, logq = chain_logq(head, feats, ids, torch.arange(p.prompt_len, p.prompt_len + n), K, HOT.transform,
                             chunk=5)
        w = expected_walk(logq.double(), cache.load_logp(i), p.prompt_len, p.seq_len, MAX_BLOCKS, K + 1)
        assert s.acceptance_lengths is None and s.tau == pytest.approx(w.tau, rel=1e-6), p.name
        assert s.expected.rounds == pytest.approx(w.rounds, rel=1e-6)
        if i % SAMPLES == 0:  # q along y = the plain per-step chain fed y's tokens (TTT form = the chain)
            for j in range(0, n, 7):
                a = p.prompt_len + j
                got = _forced_chain_logq(head, feats, ids, a, index)
                for k in range(min(K, len(ids) - 1 - a)):
                    assert float(logq[j, k]) == pytest.approx(got[k], abs=1e-4), (p.name, a, k)
                    if got[k] == float("-inf"):  # y left the draft vocabulary: later steps are never reached
                        break
    # two rules, two numbers (the sampled rule was the greedy walk, recorded as the sampled rule's expectation)
    assert res.metrics.tau != pytest.approx(greedy.metrics.tau, abs=1e-3)
    assert res.per_prompt[0].tau == pytest.approx(np.mean([s.tau for s in res.per_prompt[0].samples]), rel=1e-12)
    assert greedy.per_prompt[0].acceptance_lengths == [x for s in greedy.per_prompt[0].samples
                                                      for x in s.acceptance_lengths]


def test_the_coupled_decode_is_the_offline_walk_round_by_round(hot):
    from remote_payload.eagle3 import online_sampled
    cache, res = hot["cache"], hot["runs"]["greedy"]
    samples, partial = _samples(res), 0
    assert len(samples) == len(cache) == len(NAMES) * SAMPLES
    for i, s in enumerate(samples):
        ids = cache.load(i, layer_ids=[1])[0].tolist()
        P = cache.prompts[i].prompt_len
        d = online_sampled.decode(hot["target"], hot["head"], ids[:P], hot["taps"], K, transform=HOT.transform,
                                  draft="greedy", max_rounds=MAX_BLOCKS, end=0, coupled=ids)
        assert d.lengths == s.acceptance_lengths, (s.name, d.lengths, s.acceptance_lengths)
        assert d.tokens == ids[P:P + len(d.tokens)]
        partial += sum(1 < x < K + 1 for x in d.lengths)
    assert partial >= 5  # rounds that accepted some drafts and then missed: the cut and the features exercised
    with pytest.raises(ValueError, match="greedy drafts only"):
        online_sampled.decode(hot["target"], hot["head"], ids[:P], hot["taps"], K, transform=HOT.transform,
                              draft="sampled", max_rounds=MAX_BLOCKS, end=0, coupled=ids)


def _online(hot, transform, draft: str) -> dict[str, list[float | None]]:
    from remote_payload.eagle3 import online_sampled
    from remote_payload.eval.online_sampled import online_generator
    from remote_payload.target.load import eos_ids_of
    cache, eos, out = hot["cache"], eos_ids_of(hot["root"] / "target"), {}
    for i in range(0, len(cache), SAMPLES):
        name = cache.sample_of(i)[0]
        prompt = cache.load(i, layer_ids=[1])[0][:cache.prompts[i].prompt_len].tolist()
        out[name] = [online_sampled.decode(hot["target"], hot["head"], prompt, hot["taps"], K, transform=transform,
                                           draft=draft, max_rounds=MAX_BLOCKS, end=len(prompt) + NEW, eos=eos,
                                           generator=online_generator(HOT.seed, name, k)).tau for k in range(SEEDS)]
    return out


def _within(online: dict, offline: dict) -> tuple[float, float]:
    """Per prompt the online taus (one a seed) and offline taus (one a sample) -> (mean difference, its se)."""
    diffs, var = [], 0.0
    for name, cached in offline.items():
        on, off = (np.array([np.nan if x is None else x for x in v], dtype=float) for v in (online[name], cached))
        diffs.append(np.nanmean(on) - np.nanmean(off))
        var += np.nanvar(on, ddof=1) / np.isfinite(on).sum() + np.nanvar(off, ddof=1) / np.isfinite(off).sum()
    return float(np.mean(diffs)), math.sqrt(var) / len(offline)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["greedy", "sampled"])
def test_the_offline_tau_at_t_lies_within_the_online_decodes_interval(hot, draft):
    res = hot["runs"][draft]
    offline = {p.name: [s.tau for s in p.samples] for p in res.per_prompt}
    online = _online(hot, HOT.transform, draft)
    assert all(len(v) == SEEDS and None not in v for v in online.values())
    assert all(len(set(v)) > 2 for v in online.values() if max(v) > 1.2)  # the seeds decode different sequences
    diff, se = _within(online, offline)
    assert abs(diff) <= 4 * se, f"{draft}: online - offline tau at T {diff:+.3f} beyond 4 se {4 * se:.3f}"
    wrong, wrong_se = _within(_online(hot, (1.5, 0, 1.0), draft), offline)  # the power: a misread temperature
    assert abs(wrong) > 4 * wrong_se, (draft, wrong, wrong_se)


def test_t_to_zero_is_the_greedy_eval_and_the_greedy_online_decode(e3, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from remote_payload.eagle3 import online, online_sampled
    from remote_payload.eagle3.loader import load_eagle3
    from remote_payload.eval.online_sampled import online_generator
    root, meta = e3
    prompts = _prompts(root, tmp_path / "p.jsonl", NAMES[:2])
    greedy = _extract(root, prompts, tmp_path / "greedy", new=24)
    cold = _extract(root, prompts, tmp_path / "cold", Regime(temperature=1e-4, top_k=0, top_p=1.0, seed=3,
                                                             samples=1), new=24)
    for i in range(2):  # at T -> 0 every non-argmax probability underflows: the greedy tokens
        assert torch.equal(cold.load(i)[0], greedy.load(i)[0])
    _, rg = _eval(root, tmp_path / "greedy", tmp_path / "runs" / "g")
    for draft in ("greedy", "sampled"):
        _, rc = _eval(root, tmp_path / "cold", tmp_path / "runs" / draft, "--draft", draft)
        assert (rc.metrics.tau, rc.metrics.tau_pooled) == (rg.metrics.tau, rg.metrics.tau_pooled), draft
        assert rc.metrics.acceptance_histogram == rg.metrics.acceptance_histogram
        assert [p.tau for p in rc.per_prompt] == [p.tau for p in rg.per_prompt]
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), local_files_only=True).eval()
    head, _ = load_eagle3(root / "eagle3", embed=target.model.embed_tokens.weight.detach())
    for i, p in enumerate(greedy.prompts):
        ids = greedy.load(i, layer_ids=[1])[0].tolist()
        want, _ = online.decode(target, head, ids[:p.prompt_len], meta["taps"], K, p.seq_len, MAX_BLOCKS)
        for draft in ("greedy", "sampled"):
            got = online_sampled.decode(target, head, ids[:p.prompt_len], meta["taps"], K,
                                        transform=(1e-4, 0, 1.0), draft=draft, max_rounds=MAX_BLOCKS,
                                        end=p.seq_len, generator=online_generator(3, p.name, 0))
            assert got.lengths == want, (p.name, draft)
    capsys.readouterr()


def test_the_tree_with_sampled_drafts_is_refused_and_with_greedy_drafts_walks_every_sample(hot, tmp_path, capsys):
    root, cache = hot["root"], hot["cache"]
    capsys.readouterr()
    rc, _ = _eval(root, cache.path, tmp_path / "bad", "--eagle-tree", "20,3,4", "--draft", "sampled")
    err = capsys.readouterr().err
    assert rc == 3 and err.startswith("error: --eagle-tree with --draft sampled") and len(err.splitlines()) == 1
    assert "--draft greedy" in err and "--chain K" in err and not (tmp_path / "bad" / "results.json").exists()
    rc, res = _eval(root, cache.path, tmp_path / "tree", "--eagle-tree", f"{K + 1},{K - 1},1", "--num-prompts", "1")
    assert rc == 0 and res.regime.draft == "greedy" and res.drafter.eagle3["decoding"] == "tree"
    assert len(res.per_prompt) == 1 and len(res.per_prompt[0].samples) == SAMPLES
    chain = hot["runs"]["greedy"].per_prompt[0]  # the one-child tree K+1,K-1,1 is the chain of K, sample by sample
    assert [s.acceptance_lengths for s in res.per_prompt[0].samples] == [s.acceptance_lengths for s in chain.samples]
    assert res.per_prompt[0].tau == chain.tau
    capsys.readouterr()
