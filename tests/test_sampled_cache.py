"""Sampled caches and tau at T (issue 29), on the trained tiny fixtures, CPU, fp32.

- extract --temperature T --seed S --samples N: the draws are the seed's whatever the batch size (and, slow, over
  `--gpus cpu,cpu`): token ids byte for byte, features up to fp32 rounding; greedy (no flag, or T = 0) is today's
  cache byte for byte; T -> 0 gives the greedy cache's tokens and eval numbers exactly; an interrupted sampled
  extract resumes, one made under another regime is refused (one line);
- the tokens' law is the transform's through extract's own generation steps (both decoders): a chi-square test on
  4000 draws of one prompt, first token and second token given the first, p > 1e-3;
- eval --draft greedy on a sampled cache is the walk of each sample (grouped into its prompt);
  --draft sampled is expect.py's program fed by the drafter's own logits, and lies within 4 standard errors of a
  Monte Carlo of the rejection sampler (400 draws a sample) over the same cached completions;
- results.json records the regime, its comparability key differs by regime, bad combinations exit 3.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from scipy.stats import chisquare

from remote_payload.__main__ import main as payload_main
from remote_payload.contract import results as R
from remote_payload.contract.errors import PayloadError
from remote_payload.eval import metrics
from remote_payload.eval.cache import open_cache
from remote_payload.eval.expect import expected_walk
from remote_payload.eval.regime import Regime, regime_of
from remote_payload.eval.sampling import transform_logprobs
from remote_payload.extract.command import extract
from remote_payload.extract.decode import Generator, draws
from remote_payload.target.load import load_target
from tests.runtools import stop_after

LAYERS = [1, 2, 3, 4]
TEXTS = [("fizz", "fizzbuzz n01 n02"), ("count-long", "count n07 n08 n09 n10 n11 n12 n13"),
         ("skip", "skip n03 n06 n09"), ("pattern", "pattern p1 moon")]
NEW = 40
HOT = Regime(temperature=1.0, top_k=0, top_p=1.0, seed=7, samples=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls, one thread


@pytest.fixture(scope="module")
def fx(trained_fixtures):
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    return trained_fixtures, trained_fixtures / meta["paths"]["drafter_good"]


def _prompts(path, texts=TEXTS):
    path.write_text("".join(json.dumps({"name": n, "prompt": t}) + "\n" for n, t in texts))
    return path


def _extract(fx, prompts, out, log=lambda line: None, **kw):
    return extract(fx[0] / "target", prompts, out, **{"max_new_tokens": NEW, "layer_ids": LAYERS, "log": log,
                                                       **({} if "gpus" in kw else {"device": "cpu"}), **kw})


def _tokens_and_features(a, b, *, same_features: bool):
    """Two caches: cache.json equal but its created_at (and generation batch size), ids byte for byte, features
    and log-probs exactly or (batches of other prompts: other padded shapes) up to fp32 rounding."""
    ja, jb = (json.loads((c / "cache.json").read_text()) for c in (a, b))
    for j in (ja, jb):
        j.pop("created_at")
        j["generation"].pop("batch_size")
        j["generation"].pop("earlier", None)
        for p in j["prompts"]:
            if not same_features:
                p.pop("logp_sha256")
    assert ja == jb
    for p in ja["prompts"]:
        ta, tb = load_file(a / p["file"]), load_file(b / p["file"])
        assert torch.equal(ta["ids"], tb["ids"]), p["name"]
        for k in ("features", "logp"):
            if same_features:
                assert torch.equal(ta[k], tb[k]), (p["name"], k)
            else:
                torch.testing.assert_close(ta[k], tb[k], rtol=1e-5, atol=1e-5, msg=f"{p['name']} {k}")


@pytest.fixture(scope="module")
def hot(fx, tmp_path_factory):
    """A sampled cache (T = 1, 2 samples a prompt) in batches of 3 entries, and its evals with both rules."""
    d = tmp_path_factory.mktemp("hot")
    cache = _extract(fx, _prompts(d / "p.jsonl"), d / "cache", regime=HOT, batch_size=3)
    runs = {draft: _eval(fx, d / "cache", d / "runs" / draft, "--draft", draft)[1] for draft in ("greedy", "sampled")}
    return d, cache, runs


def _eval(fx, cache, run_dir, *args):
    rc = payload_main(["eval", "--drafter", str(fx[1]), "--target", str(fx[0] / "target"), "--cache", str(cache),
                       "--run-dir", str(run_dir), "--device", "cpu", "--max-blocks", "6", "--ddtree-budgets",
                       "16,64", *args])
    return rc, (R.Result.load(run_dir / "results.json") if rc == 0 else None)


# ---- extract: the cache a seed makes --------------------------------------------------------------------------------
def test_a_sampled_cache_records_its_regime_and_is_the_seeds_whatever_the_batches(fx, hot, tmp_path):
    d, cache, _ = hot
    assert cache.regime == HOT and cache.meta["sampling"] == HOT.to_json()
    assert [cache.sample_of(i) for i in range(len(cache))] == [(n, s) for n, _ in TEXTS for s in range(2)]
    assert [p.name for p in cache.prompts[:2]] == ["fizz~s0", "fizz~s1"]
    positions = sum(p.seq_len - p.prompt_len for p in cache.prompts)
    assert cache.meta["sampled_agreement"] == {"fraction": 1.0, "matches": positions, "positions": positions}
    assert cache.agreement == 1.0 and cache.argmax_agreement is None and "argmax_agreement" not in cache.meta
    ids = [cache.load(i)[0].tolist() for i in range(len(cache))]
    assert len({tuple(x) for x in ids}) >= 6  # the samples differ
    for i, p in enumerate(cache.prompts):  # log p(y) is the transform's, from a plain forward of the target
        lp = cache.load_logp(i)
        assert lp.shape == (p.seq_len - p.prompt_len,) and bool((lp <= 0).all())
    one = _extract(fx, d / "p.jsonl", tmp_path / "one", regime=HOT, batch_size=1)
    _tokens_and_features(tmp_path / "one", d / "cache", same_features=False)
    assert one.fingerprint != cache.fingerprint  # the generation record says how (batch size)
    other_seed = _extract(fx, d / "p.jsonl", tmp_path / "seed8", regime=Regime(1.0, 0, 1.0, 8, 2), batch_size=3)
    assert [other_seed.load(i)[0].tolist() for i in range(len(cache))] != ids


def test_log_probs_are_the_targets_own_under_the_transform(fx, hot):
    _, cache, _ = hot
    model = load_target(fx[0] / "target", torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for i in (0, 3):
            ids, p = cache.load(i)[0], cache.prompts[i]
            logits = model(ids[None]).logits[0, p.prompt_len - 1:-1]
            want = transform_logprobs(logits, *HOT.transform).gather(1, ids[p.prompt_len:, None])[:, 0]
            torch.testing.assert_close(cache.load_logp(i), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_two_processes_sample_the_one_process_cache(fx, hot, tmp_path):
    d, _, _ = hot
    _extract(fx, d / "p.jsonl", tmp_path / "two", regime=HOT, batch_size=3, gpus="cpu,cpu")
    _tokens_and_features(d / "cache", tmp_path / "two", same_features=True)


def test_greedy_is_todays_cache_and_t_to_zero_gives_its_numbers(fx, tmp_path, capsys):
    prompts = _prompts(tmp_path / "p.jsonl", TEXTS[:2])
    base = ["extract", "--target", str(fx[0] / "target"), "--prompts", str(prompts), "--max-new-tokens", str(NEW),
            "--layers", "1,2,3,4", "--device", "cpu"]
    assert payload_main([*base, "--out", str(tmp_path / "greedy")]) == 0
    assert payload_main([*base, "--out", str(tmp_path / "t0"), "--temperature", "0"]) == 0
    ja, jb = (json.loads((tmp_path / c / "cache.json").read_text()) for c in ("greedy", "t0"))
    assert ja.pop("created_at") and jb.pop("created_at") and ja == jb and "sampling" not in ja
    for p in ja["prompts"]:
        assert (tmp_path / "greedy" / p["file"]).read_bytes() == (tmp_path / "t0" / p["file"]).read_bytes()
        assert set(load_file(tmp_path / "greedy" / p["file"])) == {"ids", "features"}
    cold = Regime(temperature=1e-4, top_k=0, top_p=1.0, seed=3, samples=1)
    c = _extract(fx, prompts, tmp_path / "cold", regime=cold)
    g = open_cache(tmp_path / "greedy")
    for i in range(2):  # at T -> 0 every non-argmax probability underflows: the greedy tokens and features
        assert torch.equal(c.load(i)[0], g.load(i)[0]) and torch.equal(c.load(i)[1], g.load(i)[1])
    rg = _eval(fx, tmp_path / "greedy", tmp_path / "runs" / "g")[1]
    for draft in ("greedy", "sampled"):
        rc = _eval(fx, tmp_path / "cold", tmp_path / "runs" / draft, "--draft", draft)[1]
        assert rc.metrics.tau == rg.metrics.tau and rc.metrics.tau_pooled == rg.metrics.tau_pooled, draft
        assert rc.metrics.acceptance_histogram == rg.metrics.acceptance_histogram
        assert [p.tau for p in rc.per_prompt] == [p.tau for p in rg.per_prompt]
    capsys.readouterr()


def test_an_interrupted_sampled_extract_resumes_and_refuses_another_regime(fx, hot, tmp_path):
    d, _, _ = hot
    with pytest.raises(KeyboardInterrupt):
        _extract(fx, d / "p.jsonl", tmp_path / "c", regime=HOT, batch_size=3, log=stop_after(4, 8))
    # the regime is part of the cache's recipe (issue 30): the resume names the field that differs
    with pytest.raises(PayloadError, match=r"was started with other inputs \(options\.sampling\.seed: 7 -> 9\); "
                                           r"re-run that command"):
        _extract(fx, d / "p.jsonl", tmp_path / "c", regime=Regime(1.0, 0, 1.0, 9, 2))
    with pytest.raises(PayloadError, match=r"was started with other inputs \(options\.sampling: .* -> null\)"):
        _extract(fx, d / "p.jsonl", tmp_path / "c")
    lines = []
    _extract(fx, d / "p.jsonl", tmp_path / "c", regime=HOT, batch_size=3, log=lines.append)
    assert re.match(r"resuming .*: [1-7] of 8 prompts already extracted", lines[0]), lines[0]
    _tokens_and_features(d / "cache", tmp_path / "c", same_features=False)


@pytest.mark.parametrize("args,match", [
    ((None, 5, None, None, None), "--top-k without --temperature > 0"),
    ((1.0, None, None, None, None), "needs --seed S"),
    ((1.0, None, 1.5, 0, None), "--top-p 1.5"),
    ((-1.0, None, None, 0, None), "--temperature -1.0"),
    ((1.0, None, None, 0, 0), "--samples 0")])
def test_sampling_options_are_checked_never_ignored(args, match):
    with pytest.raises(PayloadError, match=match):
        regime_of(*args)
    assert regime_of(0.0, None, None, None, None) is None
    assert regime_of(0.7, 20, 0.9, 1, 3) == Regime(0.7, 20, 0.9, 1, 3)


# ---- the law of the sampled tokens, through extract's generation steps -------------------------------------------
@pytest.mark.parametrize("generator", ["greedy_static", "greedy_complete_batch"])
def test_the_sampled_tokens_follow_the_transform(fx, generator):
    """4000 rows of one prompt, each its own (prompt, sample) generator: the first token's counts against the
    transform of the prompt's last logits, and the second token's, among the rows whose first is the commonest,
    against the transform after it. Chi-square over the tokens expected >= 5 times (the rest lumped), p > 1e-3;
    tokens outside top-k / top-p never drawn."""
    model = load_target(fx[0] / "target", torch.device("cpu"), torch.float32)
    from tokenizers import Tokenizer
    prompt = Tokenizer.from_file(str(fx[0] / "target" / "tokenizer.json")).encode(TEXTS[0][1]).ids
    regime, m = Regime(temperature=1.6, top_k=12, top_p=0.97, seed=1, samples=4000), 4000
    sampler = draws(regime, [("p", s) for s in range(m)], 2)
    with torch.no_grad():
        rows = Generator(generator)(model, [prompt] * m, 2, set(), sampler=sampler)
        first = torch.tensor([r[3] for r in rows])
        lp1 = transform_logprobs(model(torch.tensor([prompt])).logits[0, -1], *regime.transform)
        t0 = int(first.mode().values)
        second = torch.tensor([r[4] for r in rows])[first == t0]
        lp2 = transform_logprobs(model(torch.tensor([[*prompt, t0]])).logits[0, -1], *regime.transform)
    for draws_, lp in ((first, lp1), (second, lp2)):
        law = lp.double().exp().numpy()
        counts = np.bincount(draws_.numpy(), minlength=len(law))
        assert counts[law == 0].sum() == 0
        exp = law * counts.sum()
        big = exp >= 5
        obs = np.append(counts[big], counts[~big].sum())
        want = np.append(exp[big], exp[~big].sum())
        keep = want > 0
        assert keep.sum() >= 3, "the transform keeps a few tokens: the test has power"
        p = chisquare(obs[keep], want[keep] * obs.sum() / want[keep].sum()).pvalue  # float sums: rescaled
        assert p > 1e-3, f"{generator}: chi-square p = {p:.2e} (counts {obs}, expected {want.round(1)})"


# ---- eval at T: the two rules -------------------------------------------------------------------------------------
def _drafter_logits(fx, cache, i):
    """The drafter's full logits at every walk anchor of entry i, and the target's over the sequence (fp32 CPU)."""
    from remote_payload.eval.checkpoint import load_drafter, load_target_head
    drafter, _ = load_drafter(fx[1])
    cfg = drafter.cfg
    head, _ = load_target_head(fx[0] / "target", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size)
    ids, feats = cache.load(i, layer_ids=cfg.fc_layer_ids)
    p = cache.prompts[i]
    n = metrics.num_anchors(p.prompt_len, p.seq_len, 6, cfg.block_size)
    with torch.inference_mode():
        anchors = torch.arange(p.prompt_len, p.prompt_len + n)
        hidden = drafter.draft_hidden(drafter.precompute_context(feats), anchors, ids[anchors], head)
        d_logits = torch.nn.functional.linear(hidden[:, 1:], head.lm_head)
    return ids, p, d_logits, cfg.block_size


def test_draft_greedy_is_the_walk_of_every_sample(fx, hot):
    _, cache, runs = hot
    res = runs["greedy"]
    assert res.regime.to_dict() == {**HOT.to_json(), "draft": "greedy", "notes": res.regime.notes, "mixed": False}
    assert res.comparability.regime == "T=1/top_k=0/top_p=1/seed=7/samples=2/draft=greedy"
    assert [p.name for p in res.per_prompt] == [n for n, _ in TEXTS] and res.metrics.num_samples == 8
    assert res.options.num_prompts == res.comparability.num_prompts == 4 and res.cache.num_prompts_total == 4
    walks = []
    for i in range(len(cache)):
        ids, p, d_logits, bs = _drafter_logits(fx, cache, i)
        lengths = metrics.walk(metrics.accept_lengths_vanilla(d_logits.argmax(-1).numpy(), ids.numpy(),
                                                              p.prompt_len), p.prompt_len, p.seq_len, 6, bs)
        s = res.per_prompt[i // 2].samples[i % 2]
        assert (s.name, s.sample) == (p.name, i % 2) and s.acceptance_lengths == lengths, p.name
        walks.append(lengths)
    for k, p in enumerate(res.per_prompt):
        assert p.tau == pytest.approx(np.mean([np.mean(walks[2 * k]), np.mean(walks[2 * k + 1])]), rel=1e-12)
        assert p.acceptance_lengths == walks[2 * k] + walks[2 * k + 1]
    pooled = [x for w in walks for x in w]
    assert res.metrics.tau_pooled == pytest.approx(np.mean(pooled), rel=1e-12)
    assert res.metrics.tau == pytest.approx(np.mean([p.tau for p in res.per_prompt]), rel=1e-12)
    assert res.metrics.acceptance_histogram == np.bincount(pooled, minlength=bs + 1).tolist()
    assert set(res.metrics.ddtree_tau) == {"16", "64"} and any("cluster bootstrap" in n for n in res.regime.notes)


def _monte_carlo_ci(q_lp, p_lp, y, bs, draws, seed):
    from tests.test_sampling import _monte_carlo
    tau, _, _ = _monte_carlo(q_lp.double().exp(), p_lp.double().exp(), y, 6, bs, draws, seed)
    se = float(tau.std()) / math.sqrt(draws)
    return float(tau.mean()) - 4 * se, float(tau.mean()) + 4 * se


def test_draft_sampled_is_the_exact_program_and_within_a_monte_carlo_of_rejection_sampling(fx, hot):
    _, cache, runs = hot
    res = runs["sampled"]
    assert res.regime.draft == "sampled" and res.comparability.regime.endswith("/draft=sampled")
    assert res.metrics.ddtree_tau == {} and res.metrics.ddtree_best is None and res.metrics.tree_width_tau == {}
    assert any("left out for sampled drafts" in n for n in res.regime.notes)
    model = load_target(fx[0] / "target", torch.device("cpu"), torch.float32)
    exact = []
    for i in range(len(cache)):
        ids, p, d_logits, bs = _drafter_logits(fx, cache, i)
        n = d_logits.shape[0]
        tgt = torch.from_numpy(metrics.target_tokens(ids.numpy(), p.prompt_len, n, bs - 1)).clamp(min=0)
        q_lp = transform_logprobs(d_logits, *HOT.transform)
        w = expected_walk(q_lp.gather(2, tgt[..., None])[..., 0], cache.load_logp(i), p.prompt_len, p.seq_len, 6,
                          bs)
        s = res.per_prompt[i // 2].samples[i % 2]
        assert s.acceptance_lengths is None and s.tau == pytest.approx(w.tau, rel=1e-6), p.name
        assert s.expected.rounds == pytest.approx(w.rounds, rel=1e-6)
        exact.append(w)
        if i in (0, 5):  # the rejection sampler itself, over the target's full distributions along y
            with torch.no_grad():
                p_lp = transform_logprobs(model(ids[None]).logits[0, p.prompt_len - 1:-1], *HOT.transform)
            lo, hi = _monte_carlo_ci(q_lp, p_lp, ids[p.prompt_len:], bs, 400, seed=i)
            assert lo <= w.tau <= hi, f"{p.name}: E[tau | y] {w.tau:.4f} outside [{lo:.4f}, {hi:.4f}] (400 draws)"
    tokens, rounds = sum(w.tokens for w in exact), sum(w.rounds for w in exact)
    assert res.metrics.tau_pooled == pytest.approx(tokens / rounds, rel=1e-6)
    assert res.metrics.num_rounds == pytest.approx(rounds, rel=1e-6)
    assert res.per_prompt[0].tau == pytest.approx((exact[0].tau + exact[1].tau) / 2, rel=1e-6)
    assert res.per_prompt[0].acceptance_lengths == []
    assert runs["greedy"].metrics.tau != res.metrics.tau  # the two rules are two numbers


def test_regimes_are_not_ranked_against_each_other_and_bad_combinations_exit_3(fx, hot, tmp_path, capsys):
    from orchestrator.results import compare
    _, _, runs = hot
    key_g, key_s = runs["greedy"].comparability.key(), runs["sampled"].comparability.key()
    assert {k for k in key_g if key_g[k] != key_s[k]} == {"regime"}
    cmp = compare.build_comparison([compare._record(runs["greedy"]), compare._record(runs["sampled"])])
    assert [x.field for x in cmp.differences] == ["regime"]
    greedy = _extract(fx, _prompts(tmp_path / "p.jsonl", TEXTS[:1]), tmp_path / "greedy", max_new_tokens=12)
    capsys.readouterr()
    for k, (cache, args, want) in enumerate((
            (greedy.path, ["--draft", "sampled"], "--draft sampled needs a sampled cache"),
            (greedy.path, ["--online", "1", "--online-seeds", "2"], "--online-seeds needs a sampled cache"))):
        rc, _ = _eval(fx, cache, tmp_path / "runs" / f"bad{k}", *args)
        err = capsys.readouterr().err
        assert rc == 3 and err.startswith(f"error: {want}") and len(err.splitlines()) == 1, err
