"""EAGLE-3 heads with `eval --online N` and `--speedup` (issue 31 items 5 and 6): the online decode over the target's
KV cache equals the offline walk round by round (chain K=5 and EAGLE's default tree), a cache whose layers are not
what it says is caught by it, results.json's online and speedup sections are the DFlash ones (the projection formula
holds on the recorded latencies) and the laptop's compare --wide and HTML report show the EAGLE-3 methods; the
draft step counts the head's sequential forwards (K for the chain, depth+1 for the tree). On the trained tiny
fixture (remote_payload/tools/eagle3_fixtures.py, CPU fp32)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from remote_payload.__main__ import main as payload_main
from remote_payload.eval import metrics
from remote_payload.eval.cache import open_cache
from tests.runtools import reval

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def e3():
    from remote_payload.tools import eagle3_fixtures
    root = ROOT / ".cache" / "eagle3-fixtures"
    return root, eagle3_fixtures.build(root, log=lambda line: None)


@pytest.fixture(scope="module")
def models(e3):
    from transformers import AutoModelForCausalLM

    from remote_payload.eagle3.loader import load_eagle3
    root, _ = e3
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), local_files_only=True).eval()
    head, _ = load_eagle3(root / "eagle3", embed=target.model.embed_tokens.weight.detach())
    return target, head


def _offline(head, cache, i, cache_ids, shape, K, rounds):
    from remote_payload.eagle3.tree import accept_lengths, draft_trees
    from remote_payload.eagle3.walk import chain_drafts
    p = cache.prompts[i]
    ids, feats = cache.load(i, layer_ids=cache_ids)
    bs = K + 1
    n = metrics.num_anchors(p.prompt_len, p.seq_len, rounds, bs)
    anchors = torch.arange(p.prompt_len, p.prompt_len + n)
    if shape is None:
        drafts, _ = chain_drafts(head, feats, ids, anchors, K)
        acc = metrics.accept_lengths_vanilla(drafts.numpy(), ids.numpy(), p.prompt_len)
    else:
        acc = accept_lengths(draft_trees(head, feats, ids, anchors, shape), ids, anchors)[0].numpy()
    return ids.tolist(), metrics.walk(acc, p.prompt_len, p.seq_len, rounds, bs)


@pytest.mark.parametrize("tree", [None, "default"])
def test_the_online_decode_over_the_kv_cache_equals_the_offline_walk(e3, models, tree):
    from remote_payload.eagle3.onlinecheck import chain_shape, speculative
    from remote_payload.eagle3.tree import parse_tree
    root, meta = e3
    target, head = models
    cache = open_cache(root / "cache")
    cache_ids = [k - 1 for k in meta["taps"]]
    shape = parse_tree(tree) if tree else None
    K = shape.max_accept if shape else 5
    deep = 0
    for i in range(4):
        g, offline = _offline(head, cache, i, cache_ids, shape, K, 64)
        P = cache.prompts[i].prompt_len
        online, produced = speculative(target, head, cache_ids, shape or chain_shape(K), g, P, 64)
        assert online == offline, cache.prompts[i].name
        assert produced[:len(g) - P] == g[P:]  # the target's greedy tokens are the cache's
        deep = max(deep, *online)
    assert deep > (6 if shape else 4)  # rounds that accept deep paths were checked (tree: past the chain's K=5)


def test_the_head_runs_k_sequential_steps_a_round(models):
    """The draft step --speedup times: K head forwards a round for the chain, depth+1 for the tree (counted, not
    timed), each batch's anchors drafted at once; the latency key names the method."""
    from remote_payload.eagle3.onlinecheck import chain_shape
    from remote_payload.eagle3.targetside import draft_step, method_name, verify_parents
    from remote_payload.eagle3.tree import TreeShape
    from remote_payload.eval.latency import latency_key
    from remote_payload.eval.treeverify import tree_depths
    target, head = models
    calls = []
    finish = head.finish
    head.finish = lambda *a: calls.append(a[0].shape[:-1]) or finish(*a)
    try:
        for shape, steps in ((chain_shape(1), 1), (chain_shape(8), 8), (TreeShape(60, 7, 10), 8)):
            calls.clear()
            out = draft_step(head, shape, 32, 3, torch.Generator().manual_seed(0), torch.device("cpu"))()
            assert len(calls) == steps and out.shape == (3, shape.total_token - 1)
    finally:
        del head.finish
    tree = verify_parents(TreeShape(60, 7, 10), 8)
    assert len(tree) == 60 and max(tree_depths(tree)) == 8 and verify_parents(None, 5) == [-1, 0, 1, 2, 3, 4]
    assert (method_name(None, 5), method_name(TreeShape(60, 7, 10), 8)) == ("eagle3-chain-5", "eagle3-tree-60,7,10")
    keys = [latency_key(target, head, context_len=64, budgets=[], block_size=6, method=m)
            for m in ("eagle3-chain-5", None)]
    assert keys[0]["method"] == "eagle3-chain-5" and "method" not in keys[1] and keys[0] != keys[1]


@pytest.fixture(scope="module")
def runs(e3, tmp_path_factory):
    root, _ = e3
    tmp = tmp_path_factory.mktemp("e3serving")
    bad = tmp / "cache-mislabelled"  # the mid and high taps' layers swapped in cache.json: the offline walk reads
    shutil.copytree(root / "cache", bad)  # the wrong states; the online decode taps the right ones
    meta = json.loads((bad / "cache.json").read_text())
    meta.update(layer_ids=[1, 4, 3], hf_hidden_states=[2, 5, 4])
    (bad / "cache.json").write_text(json.dumps(meta))
    common = ["eval", "--drafter", str(root / "eagle3"), "--target", str(root / "target"), "--device", "cpu",
              "--max-blocks", "64", "--online", "2", "--online-repeats", "1"]
    for name, extra in (("chain", ["--cache", str(root / "cache"), "--speedup", "--speedup-batches", "1,2",
                                   "--speedup-repeats", "1", "--latency-table", str(tmp / "latency.json")]),
                        ("mislabelled", ["--cache", str(bad), "--num-prompts", "2"])):
        assert payload_main([*common, *extra, "--run-dir", str(tmp / "runs" / "h" / name)]) == 0
    return tmp / "runs" / "h"


def test_results_hold_the_online_and_speedup_sections_and_compare_shows_them(runs, capsys, monkeypatch):
    from orchestrator.render import speedup as batch_view
    from orchestrator.results import compare
    from remote_payload.contract.results import Result
    res = Result.load(runs / "chain" / "results.json")
    on, sp = res.online, res.speedup
    assert on.method == "eagle3-chain-5" and on.prompts == 2 and on.rounds_agreeing == on.rounds > 0
    assert on.prompts_agreeing == 2 and on.prompts_with_cache_mismatch == 0 and on.tokens > on.rounds
    assert [p.acceptance_lengths for p in on.per_prompt] == [p.acceptance_lengths for p in res.per_prompt[:2]]
    assert [r.batch for r in sp.by_batch] == [1, 2] and sp.best_method in (None, "eagle3-chain-5")
    lat = {(x.step, x.tokens, x.batch): x.median for x in sp.latencies}
    assert set(lat) == {(s, n, b) for s, n in (("decode", 1), ("draft", 6), ("verify", 6)) for b in (1, 2)}
    tau = sum(sum(p.acceptance_lengths) for p in res.per_prompt) / sum(len(p.acceptance_lengths)
                                                                      for p in res.per_prompt)
    for r in sp.by_batch:  # the projection from the recorded latencies and the pooled tau
        want = tau * lat["decode", 1, r.batch] / (lat["draft", 6, r.batch] + lat["verify", 6, r.batch])
        assert r.projected == {"eagle3-chain-5": pytest.approx(want, rel=1e-3)}
    table = json.loads(Path(sp.table).read_text())
    assert [e["key"]["method"] for e in table["entries"]] == ["eagle3-chain-5"]
    monkeypatch.chdir(runs.parent.parent)
    cmp = compare.compare([compare.load_run(runs / "chain")])
    t = batch_view.batch_table(cmp)
    assert [r.cells["method"].text for r in t.rows] == ["eagle3-chain-5"]
    rc, out, err = reval(capsys, "compare", "h/chain", "--wide")
    assert rc == 0 and "eagle3-chain-5" in out and "projected speedup by batch size" in out, err
    page = runs.parent / "r.html"
    rc, _, err = reval(capsys, "compare", "h/chain", "--html", str(page))
    text = page.read_text()
    speed = text[text.index('id="speedup"'):]
    assert rc == 0 and "eagle3-chain-5" in speed and "<svg" in speed, err


def test_a_cache_mislabelling_its_layers_is_caught_by_the_online_check(runs):
    from remote_payload.contract.results import Result
    on = Result.load(runs / "mislabelled" / "results.json").online
    assert on.rounds_agreeing < on.rounds and on.prompts_agreeing < on.prompts
    log = (runs / "mislabelled" / "events.jsonl").read_text()
    assert "online rounds differ from the offline walk" in log


def test_the_eagle3_bench_part_produces_its_rows_at_the_tiny_size():
    """benchdoc's `eagle3` part (bench_eagle3.py) on CPU at the tiny size: rounds/s and % of peak for the chain and
    the tree, the DFlash row beside them; a tree round's FLOPs are its forwards' (1 + depth x top_k)."""
    from remote_payload.tools import bench_eagle3
    from remote_payload.tools.benchdoc import PARTS
    from remote_payload.tools.benchrows import T_EAGLE3
    out = bench_eagle3.part_eagle3(torch.device("cpu"), torch.float32, 2, 1.0, lambda: (10, 0.5, 1e9), size="tiny")
    rows = {(s.row, s.col) for s in out}
    assert rows == {(r, c) for r in ("EAGLE-3 chain K=5 (tiny)", "EAGLE-3 tree 60,7,10 (tiny)",
                                     "DFlash block (the payload part's seeds row)") for c in ("rounds/s", "% of peak")}
    assert len(out) == 12 and all(s.table == T_EAGLE3 and s.value > 0 for s in out) and "eagle3" in PARTS
    cfg = bench_eagle3.random_head("tiny", torch.device("cpu"), torch.float32).cfg
    one = bench_eagle3.anchor_flops(cfg, 100, [1])
    assert bench_eagle3.anchor_flops(cfg, 100, [1, 10, 10]) > 20 * one > bench_eagle3.anchor_flops(cfg, 100, [1] * 5)
