"""EAGLE's dynamic draft tree for EAGLE-3 heads: the offline tree walk over the cache equals online tree decoding
with the real target (tree-mask verify) round by round; the one-child tree is the chain; the eval's --eagle-tree.
The trained fixture is tests/test_eagle3.py's (remote_payload/tools/eagle3_fixtures.py, built once)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remote_payload.contract.errors import PayloadError
from remote_payload.eagle3.loader import load_eagle3
from remote_payload.eagle3.tree import NO_NODE, Trees, TreeShape, accept_lengths, draft_trees, parse_tree
from remote_payload.eval import metrics
from remote_payload.eval.cache import open_cache

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def e3():
    from transformers import AutoModelForCausalLM

    from remote_payload.tools import eagle3_fixtures
    root = ROOT / ".cache" / "eagle3-fixtures"
    meta = eagle3_fixtures.build(root, log=lambda line: None)
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), local_files_only=True).eval()
    head, _ = load_eagle3(root / "eagle3", embed=target.model.embed_tokens.weight.detach())
    return root, meta, target, head


def _offline(head, cache, i: int, taps, shape: TreeShape, rounds: int):
    p = cache.prompts[i]
    ids, feats = cache.load(i, layer_ids=[k - 1 for k in taps])
    n = metrics.num_anchors(p.prompt_len, p.seq_len, rounds, shape.max_accept + 1)
    anchors = torch.arange(p.prompt_len, p.prompt_len + n)
    trees = draft_trees(head, feats, ids, anchors, shape, chunk=16)
    acc, path = accept_lengths(trees, ids, anchors, width=shape.max_accept)
    walk = metrics.walk(acc.numpy(), p.prompt_len, p.seq_len, rounds, shape.max_accept + 1)
    return ids, feats, anchors, trees, acc, path, walk


def test_parse_tree_and_its_refusals():
    assert parse_tree("default") == TreeShape(60, 7, 10) and parse_tree("6,4,1").max_accept == 5
    for bad, named in (("60,7", "TOTAL_TOKEN,DEPTH,TOP_K"), ("1,3,2", "total_token >= 2"),
                       ("30,1,2", "score only 6 candidates")):
        with pytest.raises(PayloadError, match=named):
            parse_tree(bad)


@pytest.mark.parametrize("shape", [TreeShape(60, 7, 10), TreeShape(20, 3, 4)], ids=["default", "20-3-4"])
def test_offline_tree_walk_equals_online_tree_decoding(e3, shape):
    """Per prompt and round: the tree drafted from the cache at the walk's anchors accepts what online decoding
    accepts when the real target verifies the tree (one forward, tree attention mask) and features come from it."""
    from remote_payload.eagle3.online_tree import decode_tree
    root, meta, target, head = e3
    cache = open_cache(root / "cache")
    online_all, offline_all = [], []
    for i, p in enumerate(cache.prompts[:4]):
        ids, *_, offline = _offline(head, cache, i, meta["taps"], shape, 64)
        online, tokens = decode_tree(target, head, ids[:p.prompt_len].tolist(), meta["taps"], shape, p.seq_len, 64)
        assert tokens == ids.tolist(), f"{p.name}: the target's greedy tokens are the cache's"
        assert offline == online, p.name
        online_all.append(online)
        offline_all.append(offline)
    tau = metrics.summarize(offline_all, shape.max_accept + 1)["tau"]
    if shape.max_accept > 5:
        assert max(max(w) for w in offline_all) > 6  # rounds deeper than the K=5 chain reaches
    print(f"\nEAGLE-3 tree {shape.as_list()}: tau offline {tau:.4f} = online over {sum(map(len, online_all))} rounds")


def test_a_one_child_tree_is_the_chain(e3):
    """total_token=K+1, depth=K-1, top_k=1 keeps every candidate: the tree is one path, each level at the next
    position: per anchor the free-running chain (online.draft_chain) and the batched chain's acceptance."""
    from remote_payload.eagle3.online import draft_chain
    from remote_payload.eagle3.walk import chain_drafts
    root, meta, _, head = e3
    cache = open_cache(root / "cache")
    K = 5
    for i in range(3):
        one_child = TreeShape(K + 1, K - 1, 1)
        ids, feats, anchors, trees, acc, path, _ = _offline(head, cache, i, meta["taps"], one_child, 64)
        assert trees.parent.tolist() == [list(range(K))] * len(anchors)  # node j's parent is node j-1
        for j, a in enumerate(anchors.tolist()[:12]):
            assert trees.tokens[j].tolist() == draft_chain(head, feats[:a], ids[1:a + 1], K), f"anchor {a}"
        chain, _ = chain_drafts(head, feats, ids, anchors, K)
        p = cache.prompts[i]
        assert acc.tolist() == metrics.accept_lengths_vanilla(chain.numpy(), ids.numpy(), p.prompt_len).tolist()
        assert acc.tolist() == metrics.accept_lengths_vanilla(path.numpy(), ids.numpy(), p.prompt_len).tolist()


def _accept_lengths_loop(trees: Trees, g, anchors, width: int | None = None):
    """The reference: tree.accept_lengths as it was, a Python walk per anchor and level (the matching child, else
    the best-scoring one, the first on a tie)."""
    n, M = trees.tokens.shape
    D = int(trees.level.max()) if M else 0
    g = g.cpu().long()
    want_pos = anchors.cpu()[:, None] + trees.level
    want = torch.where(want_pos < g.numel(), g[want_pos.clamp(max=g.numel() - 1)], -1)
    hit = trees.tokens == want
    ok = torch.zeros((n, M + 1), dtype=torch.bool)
    ok[:, 0] = True
    for _ in range(D):
        ok[:, 1:] = hit & ok.gather(1, trees.parent)
    acc = torch.where(ok[:, 1:], trees.level, 0).amax(1)
    path = torch.full((n, max(D, width or 0)), NO_NODE, dtype=torch.long)
    for j in range(n):
        node = 0
        for lvl in range(D):
            kids = (trees.parent[j] == node).nonzero()[:, 0]
            if kids.numel() == 0:
                break
            match = kids[ok[j, kids + 1]]
            nxt = int(match[0]) if match.numel() else int(kids[trees.scores[j, kids].argmax()])
            path[j, lvl] = int(trees.tokens[j, nxt])
            node = nxt + 1
    return acc, path


@torch.no_grad()
def test_accept_lengths_equals_the_per_anchor_loop(e3):
    """The vectorised accept_lengths (all anchors and nodes at once) equals the per-anchor loop it replaced, on the
    fixture's trees at every anchor of three prompts (default, 20,3,4, the one-child 6,4,1; width past the depth),
    and on the same trees with ties and -inf among the scores and tokens forced to match deep paths (siblings that
    both match: the first)."""
    root, meta, _, head = e3
    cache = open_cache(root / "cache")
    gen = torch.Generator().manual_seed(0)
    for shape in (TreeShape(60, 7, 10), TreeShape(20, 3, 4), TreeShape(6, 4, 1)):
        for i in range(3):
            ids, feats = cache.load(i, layer_ids=[t - 1 for t in meta["taps"]], device="cpu", dtype=torch.float32)
            p = cache.prompts[i]
            anchors = torch.arange(p.prompt_len, p.seq_len - 1)
            trees = draft_trees(head, feats, ids, anchors, shape, chunk=32)
            for width in (shape.max_accept, shape.max_accept + 2):
                got, want = accept_lengths(trees, ids, anchors, width), _accept_lengths_loop(trees, ids, anchors,
                                                                                            width)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (shape, i, width)
            tied = Trees(trees.tokens.clone(), trees.parent, trees.level,
                         (trees.scores * 2).round() / 2)  # coarse scores: many ties among siblings
            tied.scores[torch.rand(tied.scores.shape, generator=gen) < 0.1] = -torch.inf
            deep = torch.rand(tied.tokens.shape, generator=gen) < 0.5  # a node made to match g where it may
            pos = (anchors[:, None] + tied.level).clamp(max=ids.numel() - 1)
            tied.tokens[deep] = ids[pos][deep]
            got, want = accept_lengths(tied, ids, anchors, 9), _accept_lengths_loop(tied, ids, anchors, 9)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (shape, i, "tied")


def _path_logprob(head, feats, tokens, path: list[int]) -> float:
    """The plain sequential reference for one tree node: the draft run along the node's path (the prefix causal,
    then each path token fed with the previous step's pre-norm hidden at the next position, attending to the
    prefix and the path so far) -> the sum of the path tokens' log-probs (the node's cumulative score)."""
    from remote_payload.eagle3.model import attend
    group = head.cfg.num_attention_heads // head.cfg.num_key_value_heads
    p = tokens.shape[0]
    u = head.project(feats)
    q, k, v = head.qkv(head.slot_inputs(u, tokens), torch.arange(p))
    h = head.finish(u[-1:], attend(q[-1:], [(k, None)], [v], group))
    to_draft = {int(t): i for i, t in enumerate(head.to_target(torch.arange(head.cfg.draft_vocab_size)))}
    keys, values, total = [k], [v], 0.0
    for s, tok in enumerate(path):
        total += float(head.logits(h).log_softmax(-1)[0, to_draft[tok]])
        qs, ks, vs = head.qkv(head.slot_inputs(h, torch.tensor([tok])), torch.tensor([p + s]))
        keys.append(ks)
        values.append(vs)
        h = head.finish(h, attend(qs, [(torch.cat(keys), None)], [torch.cat(values)], group))
    return total


@torch.no_grad()
def test_every_tree_node_scores_its_paths_log_prob(e3):
    """Each node of the default tree (batched over anchors) scores what the plain per-path draft gives its path:
    the tree's positions (one per level), its attention (prefix + ancestors) and the fed-back hiddens; a node's
    parent scores at least as high, and the tree keeps the best total_token-1 candidates, level 1 first."""
    root, meta, _, head = e3
    cache = open_cache(root / "cache")
    ids, feats, anchors, trees, *_ = _offline(head, cache, 1, meta["taps"], TreeShape(60, 7, 10), 64)
    for j in (0, len(anchors) // 2, len(anchors) - 1):
        a, par, toks = int(anchors[j]), trees.parent[j].tolist(), trees.tokens[j].tolist()
        assert trees.level[j].max() > 3  # a deep tree: positions and fed-back hiddens matter
        for node in range(len(toks)):
            path, at = [], node + 1
            while at:
                path.insert(0, toks[at - 1])
                at = par[at - 1]
            assert len(path) == int(trees.level[j, node])
            ref = _path_logprob(head, feats[:a], ids[1:a + 1], path)
            assert float(trees.scores[j, node]) == pytest.approx(ref, abs=1e-4), (a, node, path)
            assert par[node] == 0 or trees.scores[j, par[node] - 1] >= trees.scores[j, node]


def _eval(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "remote_payload", "eval", *args], cwd=cwd, check=False,
                          capture_output=True, text=True, env=env, timeout=600)


def test_eval_command_evaluates_the_eagle_tree(e3, tmp_path):
    from remote_payload.contract.results import Result
    root, meta, _, head = e3
    base = ["--drafter", str(root / "eagle3"), "--target", str(root / "target"), "--cache", str(root / "cache"),
            "--max-blocks", "64", "--device", "cpu"]
    p = _eval([*base, "--eagle-tree", "20,3,4", "--run-dir", str(tmp_path / "run")], tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = Result.load(tmp_path / "run" / "results.json")
    assert res.options.block_size == res.comparability.block_size == 5  # bonus + levels 1..4
    assert res.drafter.eagle3["decoding"] == "tree"
    assert res.drafter.eagle3["tree"] == {"total_token": 20, "depth": 3, "top_k": 4}
    cache = open_cache(root / "cache")
    walks = [_offline(head, cache, i, meta["taps"], TreeShape(20, 3, 4), 64)[-1] for i in range(len(cache.prompts))]
    assert res.metrics.tau == pytest.approx(metrics.summarize(walks, 5)["tau"], abs=1e-4)
    assert res.metrics.tau > meta["quality"]["chain_5"]["tau"]  # the tree accepts more than the K=5 chain
    assert len(res.metrics.position_accuracy) == 4 and not res.health.suspect
    both = _eval([*base, "--eagle-tree", "default", "--chain", "3", "--run-dir", str(tmp_path / "r2")], tmp_path)
    assert both.returncode == 3 and "--chain 3 and --eagle-tree default" in both.stderr
    bad = _eval([*base, "--eagle-tree", "60,1,2", "--run-dir", str(tmp_path / "r3")], tmp_path)
    assert bad.returncode == 3 and "--eagle-tree 60,1,2" in bad.stderr and "Traceback" not in bad.stderr


def test_eagle_tree_is_refused_for_a_dflash_drafter(tmp_path):
    d = tmp_path / "dflash"
    d.mkdir()
    (d / "config.json").write_text('{"dflash_config": {"mask_token_id": 2}, "hidden_size": 8}')
    p = _eval(["--drafter", str(d), "--target", str(tmp_path), "--cache", str(tmp_path), "--eagle-tree", "default"],
              tmp_path)
    assert p.returncode == 3 and "--eagle-tree default" in p.stderr and "DFlash" in p.stderr


def test_a_drafter_that_does_not_exist_is_said_so_not_called_dflash(tmp_path):
    """--eagle-tree / --chain with a drafter path that is not there: the eval's own one line, not a family it
    cannot have (it used to say '/x is a DFlash drafter')."""
    for opt in (["--eagle-tree", "default"], ["--chain", "3"]):
        p = _eval(["--drafter", str(tmp_path / "nope"), "--target", str(tmp_path), "--cache", str(tmp_path),
                   "--run-dir", str(tmp_path / opt[0].strip("-")), *opt], tmp_path)
        assert p.returncode == 3 and p.stderr.startswith("error: ") and "DFlash drafter" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1  # the eval's own first refusal (here: the empty cache)
