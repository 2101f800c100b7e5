"""remote_payload.eval.metrics: walks, aggregates and DDTree on scripted drafts with hand-computed numbers,
and "two implementations agree" checks (brute force == heap == vectorised torch)."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from remote_payload.eval import metrics as m
from tests.samples import random_targets, sorted_logprobs


def correct_rows(g, prompt_len, n, width):
    """[n, width] drafts equal to g[a+1 .. a+width]; 0 past the end (never matches)."""
    t = m.target_tokens(np.asarray(g), prompt_len, n, width)
    return np.where(t >= 0, t, 0)


def ranks_of(drafts, g, prompt_len):
    """target_rank for argmax drafts with no ties: 0 where the draft is g, 1 where it is not, -1 past the end."""
    t = m.target_tokens(np.asarray(g), prompt_len, *np.asarray(drafts).shape)
    return np.where(t < 0, -1, np.where(drafts == t, 0, 1))


# ------------------------------------------------------------------------------------- scripted drafters

def test_perfect_drafter_gives_tau_block_size():
    bs, prompt_len, max_blocks = 16, 5, 100
    seq_len = prompt_len + 1 + 16 * 7  # the completion is exactly 7 full blocks after the bonus
    g = np.random.default_rng(0).integers(10, 1000, seq_len)
    n = m.num_anchors(prompt_len, seq_len, max_blocks, bs)
    assert n == seq_len - 2 - prompt_len + 1
    acc = m.accept_lengths_vanilla(correct_rows(g, prompt_len, n, bs - 1), g, prompt_len)
    lengths = m.walk(acc, prompt_len, seq_len, max_blocks, bs)
    assert lengths == [16] * 7
    s = m.summarize([lengths], bs)
    assert s["tau"] == 16.0 and s["tau_pooled"] == 16.0 and s["streak"] == 15.0
    assert s["acceptance_histogram"] == [0] * 16 + [7]
    assert s["per_position_acceptance_unconditional"] == [1.0] * 15
    assert s["per_position_acceptance_conditional"] == [1.0] * 15


def test_always_wrong_drafter_gives_tau_one():
    bs, prompt_len, seq_len, max_blocks = 16, 3, 40, 30
    g = np.arange(seq_len) + 100
    n = m.num_anchors(prompt_len, seq_len, max_blocks, bs)
    drafts = correct_rows(g, prompt_len, n, bs - 1) + 1
    lengths = m.walk(m.accept_lengths_vanilla(drafts, g, prompt_len), prompt_len, seq_len, max_blocks, bs)
    assert lengths == [1] * 30  # max_blocks stops it before the sequence end (36 more tokens)
    s = m.summarize([lengths], bs)
    assert s["tau"] == 1.0 and s["streak"] == 0.0
    assert s["acceptance_histogram"] == [0, 30] + [0] * 15
    assert s["per_position_acceptance_unconditional"] == [0.0] * 15
    assert s["per_position_acceptance_conditional"] == [0.0] + [None] * 14
    acc = m.position_accuracy([m.position_hits(drafts, g, prompt_len)])
    assert acc["position_accuracy"] == [0.0] * 15 and acc["position_1_accuracy"] == 0.0


# A hand-built prompt, bs=4 (3 drafts per anchor), prompt_len 2, seq_len 10: anchors a = 2..8.
G = [100, 101, 10, 11, 12, 13, 14, 15, 16, 17]
X = 999  # a wrong draft


def hand_drafts():
    c = correct_rows(G, 2, 7, 3)
    rows = [  # a: drafts (C = correct, X = wrong), LCP
        [c[0, 0], c[0, 1], X],        # a=2: LCP 2
        [c[1, 0], X, c[1, 2]],        # a=3: LCP 1 (a later match does not count)
        [c[2, 0], c[2, 1], c[2, 2]],  # a=4: LCP 3
        [X, c[3, 1], c[3, 2]],        # a=5: LCP 0
        [c[4, 0], c[4, 1], c[4, 2]],  # a=6: LCP 3
        [c[5, 0], c[5, 1], X],        # a=7: LCP 2 (position 10 lies past the end)
        [c[6, 0], X, X],              # a=8: LCP 1 (only position 9 exists)
    ]
    return np.array(rows)


def test_hand_built_lcps_walk_and_position_accuracy():
    d = hand_drafts()
    acc = m.accept_lengths_vanilla(d, G, 2)
    assert acc.tolist() == [2, 1, 3, 0, 3, 2, 1]
    assert m.walk(acc, 2, 10, 10, 4) == [3, 1, 4]  # a = 2 -> 5 -> 6 -> 10
    assert m.walk(acc, 2, 10, 2, 4) == [3, 1]  # max_blocks
    hits, totals = m.position_hits(d, G, 2)
    assert hits.tolist() == [6, 5, 4] and totals.tolist() == [7, 6, 5]
    pa = m.position_accuracy([(hits, totals), (np.array([0, 0, 0]), np.array([1, 1, 0]))])
    assert pa["position_accuracy"] == pytest.approx([6 / 8, 5 / 7, 4 / 5])
    assert pa["position_accuracy_macro"] == pytest.approx([(6 / 7) / 2, (5 / 6) / 2, 4 / 5])
    assert pa["position_1_accuracy"] == pytest.approx(0.75) and pa["num_anchors"] == 8


def test_walk_stops_at_sequence_end_with_a_short_last_round():
    bs, prompt_len = 16, 4
    seq_len = prompt_len + 1 + 16 * 2 + 5
    g = np.arange(seq_len)
    n = m.num_anchors(prompt_len, seq_len, 30, bs)
    acc = m.accept_lengths_vanilla(correct_rows(g, prompt_len, n, bs - 1), g, prompt_len)
    assert m.walk(acc, prompt_len, seq_len, 30, bs) == [16, 16, 6]
    with pytest.raises(ValueError, match="needs acc at"):
        m.walk(acc[:-1], prompt_len, seq_len, 30, bs)


def test_num_anchors_bounds():
    assert m.num_anchors(10, 11, 30, 16) == 0  # no completion token to predict
    assert m.num_anchors(10, 12, 30, 16) == 1
    assert m.num_anchors(10, 10_000, 2, 16) == 32  # max_blocks * bs covers every reachable anchor


def test_summarize_hand_computed_macro_vs_pooled():
    s = m.summarize([[3, 1, 4], [2], []], 4)
    assert s["tau"] == pytest.approx((8 / 3 + 2) / 2)  # the empty prompt is left out of the macro mean
    assert s["tau_pooled"] == pytest.approx(2.5)
    assert s["streak"] == pytest.approx((8 / 3 + 2) / 2 - 1) and s["streak_pooled"] == pytest.approx(1.5)
    assert s["num_prompts"] == 3 and s["num_rounds"] == 4
    assert s["acceptance_histogram"] == [0, 1, 1, 1, 1]
    assert s["per_position_acceptance_unconditional"] == [0.75, 0.5, 0.25]
    assert s["per_position_acceptance_conditional"] == pytest.approx([0.75, 2 / 3, 0.5])
    with pytest.raises(ValueError, match="1..4"):
        m.summarize([[5]], 4)


def test_width_one_equals_vanilla_and_wider_trees_accept_more():
    d = hand_drafts()
    ranks = ranks_of(d, G, 2)
    assert m.accept_lengths_width(ranks, 1).tolist() == m.accept_lengths_vanilla(d, G, 2).tolist()
    # every wrong draft had the target at rank 1: width 2 accepts every row that exists
    assert m.accept_lengths_width(ranks, 2).tolist() == [3, 3, 3, 3, 3, 2, 1]


def test_degenerate_drafts_flags_one_repeated_token():
    assert m.degenerate_drafts(np.array([[7, 7, 7], [7, 1, 7]])) == (True, 7, pytest.approx(5 / 6))
    suspect, _, share = m.degenerate_drafts(np.arange(30).reshape(10, 3))
    assert not suspect and share == pytest.approx(1 / 30)


def test_every_reported_metric_is_defined():
    keys = set(m.summarize([[2, 3]], 4)) | set(m.position_accuracy([m.position_hits(hand_drafts(), G, 2)]))
    keys |= {"ddtree_tau", "ddtree_best", "tree_width_tau", "acceptance_lengths"}
    assert keys <= set(m.DEFINITIONS), keys - set(m.DEFINITIONS)


def test_walks_and_aggregates_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from remote_payload.eval import metrics as m\n"
            "import numpy as np\n"
            "acc = m.accept_lengths_vanilla(np.array([[5, 6], [6, 0]]), [4, 5, 6], 0)\n"
            "print(m.summarize([m.walk(acc, 0, 3, 5, 3)], 3)['tau'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3.0"


# ------------------------------------------------------------------------------------------- DDTree

def brute_force_tree(lp, budget):
    """All prefixes of ranks < K up to depth D, ordered by (-score, ranks); the first `budget`."""
    depth, k = lp.shape
    prefixes = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            score = 0.0
            for i, r in enumerate(ranks):
                score = score + float(lp[i, r])
            prefixes.append((-score, ranks))
    return [r for _, r in sorted(prefixes)[:budget]]


def test_ddtree_hand_example():
    lp = np.log(np.array([[0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]))
    # prefix probabilities: (0) .6, (0,0) .42, (1) .3, (1,0) .21, (0,1) .12, (2) .1, ...
    assert m.ddtree_build(lp, 5) == [(0,), (0, 0), (1,), (1, 0), (0, 1)]
    assert m.ddtree_accept_heap(lp, np.array([1, 0]), 3) == 1
    assert m.ddtree_accept_heap(lp, np.array([1, 0]), 4) == 2
    assert m.ddtree_accept_heap(lp, np.array([0, -1]), 5) == 1  # -1: past the sequence end
    assert m.ddtree_accept_heap(lp, np.array([2, 0]), 5) == 0
    assert m.ddtree_build(lp, 100) == brute_force_tree(lp, 100)  # budget larger than the 12 prefixes


@pytest.mark.parametrize("ties", [False, True])
def test_ddtree_heap_equals_brute_force_on_tiny_vocab(ties):
    rng = np.random.default_rng(1 + ties)
    for _ in range(4):
        lp = sorted_logprobs(rng, (4, 5), ties)
        full = brute_force_tree(lp, 30)
        for b in range(1, 31):
            assert m.ddtree_build(lp, b) == full[:b]
            ranks = rng.integers(-1, 5, 4) if b % 3 else np.array([0, 0, 1, 0])
            tree = set(full[:b])
            want = 0
            while want < 4 and ranks[want] >= 0 and tuple(ranks[: want + 1].tolist()) in tree:
                want += 1
            assert m.ddtree_accept_heap(lp, ranks, b) == want


def test_ddtree_vectorised_equals_heap_continuous():
    pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    n, depth, k = 40, 6, 64
    lp = sorted_logprobs(rng, (n, depth, k)).astype(np.float32)
    ranks = random_targets(rng, n, depth, k)
    budgets = [1, 2, 3, 16, 64]
    got = m.ddtree_accept_lengths(lp, ranks, budgets, max_elements=5000)  # several anchor chunks
    for b in budgets:
        want = [m.ddtree_accept_heap(lp[j], ranks[j], b) for j in range(n)]
        assert got[b].tolist() == want, b
    # a larger tree holds every smaller one
    assert all((got[64] >= got[b]).all() for b in budgets)
    assert (got[64] > 0).any() and (got[1] <= 1).all()


def test_ddtree_vectorised_equals_heap_with_ties_and_budget_above_k():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    n, depth, k = 30, 4, 5
    lp = sorted_logprobs(rng, (n, depth, k), ties=True)
    ranks = random_targets(rng, n, depth, k)
    budgets = list(range(1, 31))
    got = m.ddtree_accept_lengths(torch.tensor(lp), torch.tensor(ranks), budgets)
    for b in budgets:
        assert got[b].tolist() == [m.ddtree_accept_heap(lp[j], ranks[j], b) for j in range(n)], b


def test_ddtree_confident_drafter_spends_the_budget_on_the_chain():
    pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    lp = sorted_logprobs(rng, (8, 15, 32)) - 6.0
    lp[:, :, 0] = -0.01  # top-1 far above the rest: the 15-deep greedy chain outscores every branch
    ranks = np.zeros((8, 15), dtype=np.int64)  # the target always equals the argmax draft
    got = m.ddtree_accept_lengths(lp, ranks, [1, 14, 15, 32])
    assert got[1].tolist() == [1] * 8 and got[14].tolist() == [14] * 8
    assert got[15].tolist() == [15] * 8 and got[32].tolist() == [15] * 8
    lp[:, 3, 1] = -1.0  # the best runner-up of all, at depth 4: it is node 16, its child node 17
    ranks[:, 3] = 1
    got = m.ddtree_accept_lengths(lp, ranks, [15, 16, 17])
    assert got[15].tolist() == [3] * 8 and got[16].tolist() == [4] * 8 and got[17].tolist() == [5] * 8


def test_prompt_metrics_and_aggregate_hand_computed():
    pytest.importorskip("torch")
    t = m.target_tokens(G, 2, 7, 3)
    good = ranks_of(hand_drafts(), G, 2)  # rank 0 where the draft is right, 1 where wrong
    bad = np.where(t < 0, -1, 5)  # a second prompt: every target outside the top-2
    # K=2 and a confident top-1: budget 3 is the greedy chain; budget 14 is all 2+4+8 prefixes
    topk = np.tile(np.array([-0.01, -6.0]), (7, 3, 1))
    recs = [m.prompt_metrics(hand_drafts(), good, topk, G, 2, 10, 4, budgets=[3, 14], widths=[2]),
            m.prompt_metrics(np.full((7, 3), X), bad, topk, G, 2, 10, 4, budgets=[3, 14], widths=[2])]
    assert recs[0]["acceptance_lengths"] == [3, 1, 4] and recs[1]["acceptance_lengths"] == [1] * 7
    assert recs[0]["ddtree_acceptance_lengths"] == {"3": [3, 1, 4], "14": [4, 4]}
    assert recs[0]["tree_width_acceptance_lengths"] == {"2": [4, 4]}
    assert recs[0]["position_accuracy"] == pytest.approx([6 / 7, 5 / 6, 4 / 5])
    agg = m.aggregate(recs, 4)
    json.dumps({"metrics": agg, "per_prompt": recs}, allow_nan=False)
    assert agg["tau"] == pytest.approx((8 / 3 + 1) / 2) and agg["tau_pooled"] == pytest.approx(15 / 10)
    assert agg["ddtree_tau"] == pytest.approx({"3": (8 / 3 + 1) / 2, "14": 2.5})
    assert agg["tree_width_tau"] == {"2": 2.5}
    assert agg["ddtree_best"] == {"budget": 14, "tau": 2.5}
    assert agg["position_accuracy"] == pytest.approx([6 / 14, 5 / 12, 4 / 10])
    assert agg["num_anchors"] == 14 and agg["num_rounds"] == 10
    assert set(agg) | set(recs[0]) <= set(m.DEFINITIONS) | {"prompt_len", "seq_len"}
