"""remote_payload/eval/online_tree.py: the online DDTree decode (the real target verifies the drafter's tree under a
tree attention mask over its KV cache) equals the offline eval's DDTree walk round by round (issue 29 item 5), on
the trained tiny fixtures, CPU, fp32, one thread:

- a greedy cache, budgets 16 and 64: the online lengths (the target's argmax after each node) equal results.json's
  ddtree_acceptance_lengths, and the committed tokens are the cached greedy completion;
- a T = 1 sampled cache, coupled mode (the target's token after each node is y's): equal, for every sample, to the
  offline DDTree walk over that sample (the eval's own functions: anchors.drafted_prompts, metrics.walk).
"""
from __future__ import annotations

import json

import pytest
import torch

from remote_payload.__main__ import main as payload_main
from remote_payload.eval import metrics
from remote_payload.eval.online_tree import _accept, build_tree, decode_tree
from remote_payload.eval.regime import Regime

BUDGETS = (16, 64)
MAX_BLOCKS, NUM_PROMPTS = 6, 3

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(fx):
    from remote_payload.eval.checkpoint import load_drafter, load_target_head
    from remote_payload.target.load import load_target
    drafter, _ = load_drafter(fx["drafter_good"])
    head, _ = load_target_head(fx["target"], vocab_size=drafter.cfg.vocab_size, hidden_size=drafter.cfg.hidden_size)
    return drafter, head, load_target(fx["target"], torch.device("cpu"), torch.float32)


def _offline_walks(drafter, head, cache, count: int) -> list[tuple[list[int], int, dict[int, list[int]]]]:
    """(ids, prompt_len, {B: the DDTree walk's lengths}) of cache entries 0..count-1, by the eval's functions."""
    from remote_payload.eval.anchors import drafted_prompts
    bs = drafter.cfg.block_size

    def anchors_of(i):
        return metrics.num_anchors(cache.prompts[i].prompt_len, cache.prompts[i].seq_len, MAX_BLOCKS, bs)
    out = []
    for i, ids, res in drafted_prompts(drafter, head, cache, count, anchors_of, device=torch.device("cpu"),
                                       dtype=torch.float32, batch_size=16, budgets=list(BUDGETS), widths=[]):
        P = cache.prompts[i].prompt_len
        walks = {b: metrics.walk(a, P, len(ids), MAX_BLOCKS, bs) for b, a in res.tree_acc.items()}
        out.append((ids.tolist(), P, walks))
    return out


def test_the_accept_walk_follows_the_targets_tokens_through_the_tree():
    # root 0 (token 9) -> 1 (token 5), 2 (token 6); 1 -> 3 (token 7); target after 0: 6, after 2: 4
    tokens, parents = [9, 5, 6, 7], [-1, 0, 0, 1]
    assert _accept(tokens, parents, [6, 7, 4, 0]) == ([2], 4)
    assert _accept(tokens, parents, [5, 7, 4, 3]) == ([1, 3], 3)
    assert _accept(tokens, parents, [8, 7, 4, 3]) == ([], 8)
    ids = torch.tensor([[3, 4], [5, 6]])
    lp = torch.log(torch.tensor([[0.9, 0.1], [0.8, 0.2]]))
    assert build_tree(ids, lp, 3, 2) == ([-1, 3, 5, 6], [-1, 0, 1, 1])  # (0,), (0, 0), (0, 1): .9, .72, .18
    assert build_tree(ids, lp, 4, 2) == ([-1, 3, 5, 6, 4], [-1, 0, 1, 1, 0])  # then (1,): .1
    assert build_tree(ids, lp, 4, 1) == ([-1, 3, 4], [-1, 0, 0])  # depth 2 past the end: dropped


@pytest.mark.slow
def test_online_ddtree_on_a_greedy_cache_is_the_offline_walk_round_by_round(fx, model, tmp_path):
    from remote_payload.eval.cache import open_cache
    drafter, head, target = model
    run = tmp_path / "run"
    rc = payload_main(["eval", "--drafter", str(fx["drafter_good"]), "--target", str(fx["target"]), "--cache",
                       str(fx["cache"]), "--run-dir", str(run), "--device", "cpu", "--max-blocks", str(MAX_BLOCKS),
                       "--num-prompts", str(NUM_PROMPTS), "--ddtree-budgets", ",".join(map(str, BUDGETS))])
    assert rc == 0
    records = json.loads((run / "results.json").read_text())["per_prompt"]
    cache = open_cache(fx["cache"])
    beyond_block = 0
    for i, rec in enumerate(records):
        ids = cache.load(i, layer_ids=cache.layer_ids[:1])[0].tolist()
        P = rec["prompt_len"]
        for b in BUDGETS:
            want = rec["ddtree_acceptance_lengths"][str(b)]
            d = decode_tree(target, drafter, head, ids[:P], budget=b, max_blocks=MAX_BLOCKS, end=len(ids),
                            topk=max(BUDGETS))
            assert d.lengths == want, (rec["name"], b, d.lengths, want)
            assert d.tokens == ids[P:P + len(d.tokens)]  # the target's argmax is the cached greedy completion
            assert all(1 < n <= b + 1 for n in d.tree_sizes)
        beyond_block += rec["ddtree_acceptance_lengths"]["64"] != rec["acceptance_lengths"]
    assert beyond_block >= 1  # the tree accepted what the block did not: the walk is not the block's in disguise


@pytest.mark.slow
def test_coupled_online_ddtree_on_a_sampled_cache_is_the_offline_walk_over_each_sample(fx, model, tmp_path):
    from remote_payload.eval.cache import open_cache
    from remote_payload.extract.command import extract
    drafter, head, target = model
    texts = [("fizz", "fizzbuzz n01 n02"), ("count-long", "count n07 n08 n09 n10 n11 n12 n13")]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"name": n, "prompt": t}) + "\n" for n, t in texts))
    extract(fx["target"], prompts, tmp_path / "cache", max_new_tokens=40, layer_ids=[1, 2, 3, 4],
            log=lambda line: None, device="cpu", batch_size=16, regime=Regime(1.0, 0, 1.0, 7, 3))
    cache = open_cache(tmp_path / "cache")
    walks = _offline_walks(drafter, head, cache, len(cache))
    assert len(walks) == len(texts) * 3
    partial = differ = 0
    for ids, P, offline in walks:
        for b in BUDGETS:
            d = decode_tree(target, drafter, head, ids[:P], budget=b, max_blocks=MAX_BLOCKS, end=0,
                            topk=max(BUDGETS), coupled=ids)
            assert d.lengths == offline[b], (b, d.lengths, offline[b])
            assert d.tokens == ids[P:P + len(d.tokens)]
            partial += sum(1 < x < drafter.cfg.block_size for x in d.lengths)
        greedy = decode_tree(target, drafter, head, ids[:P], budget=64, max_blocks=MAX_BLOCKS, end=len(ids))
        differ += greedy.lengths != offline[64]
    assert differ >= 1  # the target's argmax walks another path: the coupling is what makes the rounds equal
    assert partial >= 5  # rounds that accepted part of a path: the crop and the re-run chain are exercised
