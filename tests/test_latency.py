"""The latency model (remote_payload/eval/latency.py): the projection, the tree mask (checked against feeding each
node's root-to-node path causally), measure() on the trained CPU fixtures, and the latency table."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from remote_payload.contract.contenthash import content_hash
from remote_payload.eval import latency as L
from remote_payload.eval import latencytable as LT
from remote_payload.eval import metrics
from remote_payload.eval import projection as P
from remote_payload.eval import treeverify as TV


# test-only (was eval/treeverify.py's): the tree verify as `measure` times it, checked against plain forwards
@torch.inference_mode()
def verify_logits(model, context_ids: torch.Tensor, node_ids: torch.Tensor, parents: list[int], *,
                  attention: str | None = None) -> torch.Tensor:
    """The tree verify forward, as `measure` times it: the context prefilled into a slot cache, then the tree's
    nodes fed at once under `tree_mask` at positions len(context) + depth -> logits [n, V] (row i predicts the
    token after node i's root-to-node path). attention: an HF attention implementation to run instead of the
    one `measure` picks (`_attention`)."""
    impl = attention or TV._attention(model)
    with TV._attention_of(model, impl):
        groups = TV._groups(model, impl)
        cache = TV._slot_cache(model, len(context_ids) + len(parents))
        TV._prefill(model, cache, context_ids, groups)
        return TV._Step(model, cache, node_ids, parents, len(context_ids), groups)()


@pytest.fixture(scope="module")
def models(trained_fixtures):
    """(target fp32 on CPU, its folder, drafter-good, its TargetHead) from the trained fixtures."""
    from remote_payload.eval.checkpoint import load_drafter, load_target_head
    from remote_payload.target.load import load_target
    root = Path(trained_fixtures)
    target = load_target(root / "target", torch.device("cpu"), torch.float32)
    drafter, _ = load_drafter(root / "drafter-good")
    head, _ = load_target_head(root / "target", vocab_size=drafter.cfg.vocab_size, hidden_size=drafter.cfg.hidden_size)
    return target, root / "target", drafter, head


# ---------------------------------------------------------------- the projection

def test_projected_speedup_on_known_latencies():
    assert L.projected_speedup(4.0, 0.010, 0.002, 0.008) == pytest.approx(4.0)
    assert L.projected_speedup(6.5, 0.020, 0.003, 0.012) == pytest.approx(6.5 * 20 / 15)
    assert L.projected_speedup(1.0, 0.010, 0.0, 0.010) == pytest.approx(1.0)  # verify = decode, no drafting: 1x
    for bad in ((4.0, 0.01, 0.0, 0.0), (-1.0, 0.01, 0.001, 0.001), (4.0, math.nan, 0.001, 0.001),
                (4.0, 0.01, math.inf, 0.001)):
        with pytest.raises(ValueError):
            L.projected_speedup(*bad)


def test_latencies_speedup_picks_the_verify_size_and_the_batch():
    lat = _lat(decode_s=0.010, draft_s=0.002, verify_s={16: 0.008, 33: 0.018})
    assert lat.speedup(4.0) == pytest.approx(4.0)  # n = the key's block_size, the first batch
    assert lat.speedup(5.0, budget=32) == pytest.approx(5.0 * 0.010 / 0.020)
    assert lat.speedup(4.0, batch=4) == pytest.approx(4.0 * 0.040 / (0.008 + 0.032))  # _lat: times x batch
    with pytest.raises(KeyError):
        lat.speedup(4.0, budget=64)
    with pytest.raises(KeyError):
        lat.speedup(4.0, batch=16)


# ---------------------------------------------------------------- trees

def test_tree_mask_against_a_hand_written_tree():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    parents = [-1, 0, 0, 1, 1, 2, 3]
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    got = TV.tree_mask(parents)
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert TV.tree_depths(parents) == [0, 1, 1, 2, 2, 2, 3]
    assert torch.equal(TV.tree_mask(TV.chain(5)), torch.ones(5, 5, dtype=torch.bool).tril())  # a chain is causal
    with pytest.raises(ValueError):
        TV.tree_mask([-1, 2, 0])  # a parent after its child


def test_ddtree_tree_is_the_metrics_tree():
    lp = TV.synthetic_logprobs(15, 32)
    assert np.all(np.diff(lp, axis=1) <= 0) and np.allclose(np.exp(lp).sum(1), 1)
    nodes = metrics.ddtree_build(lp, 32)
    parents = TV.ddtree_tree(32, 16)
    assert len(parents) == 33 and parents[0] == -1
    depths = TV.tree_depths(parents)
    for j, ranks in enumerate(nodes, start=1):  # node j's parent is its prefix; its depth is its length
        assert depths[j] == len(ranks)
        assert parents[j] == (0 if len(ranks) == 1 else nodes.index(ranks[:-1]) + 1)
    assert max(depths) > 2 and sum(p == 0 for p in parents) > 1  # a real tree: deep and branching


@pytest.mark.parametrize("prefill_chunk", [1024, 4])  # the context prefilled at once, or in chunks of 4
def test_tree_verify_gives_each_node_its_causal_path_logits(models, prefill_chunk, monkeypatch):
    """The independent formulation: node i's logits from the tree-masked verify == the last logits of a plain
    causal forward (no cache) over context + node i's root-to-node path."""
    monkeypatch.setattr(TV, "PREFILL_CHUNK", prefill_chunk)
    target, _, _, _ = models
    g = torch.Generator().manual_seed(3)
    V = target.config.vocab_size
    rng = np.random.default_rng(4)
    lp = -np.sort(-rng.normal(size=(5, 4)) * 2, axis=1)
    parents = TV.ddtree_parents(metrics.ddtree_build(lp, 14))  # 15 nodes, random tree shape
    assert max(TV.tree_depths(parents)) >= 3 and len(set(parents)) > 4
    context = torch.randint(0, V, (11,), generator=g)
    nodes = torch.randint(0, V, (len(parents),), generator=g)
    got = verify_logits(target, context, nodes, parents)
    assert got.shape == (len(parents), V)
    with torch.no_grad():
        for i in range(len(parents)):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = parents[j]
            ids = torch.cat([context, nodes[path[::-1]]])
            ref = target(ids[None], use_cache=False).logits[0, -1]
            torch.testing.assert_close(got[i], ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got, verify_logits(target, context, nodes, parents, attention="sdpa"), atol=2e-5,
                               rtol=1e-5)  # our GQA-folded attention == HF's own SDPA under the same mask
    # the check has teeth: the same nodes fed causally (one chain) disagree at a node whose path is not a prefix
    causal = verify_logits(target, context, nodes, TV.chain(len(parents)))
    off_chain = [i for i in range(len(parents)) if parents[i] != i - 1]
    assert off_chain and max((causal[i] - got[i]).abs().max().item() for i in off_chain) > 1e-2


# ---------------------------------------------------------------- measuring

def test_measure_on_cpu_returns_positive_latencies_for_every_size(models):
    target, tdir, drafter, head = models
    budgets, bs = [4, 15, 32], drafter.cfg.block_size
    lat = L.measure(target, drafter, head, context_len=24, budgets=budgets, block_size=bs, repeats=2,
                    min_repeat_s=0.0, batches=[3, 1])
    assert sorted(lat.verify_s) == sorted({bs, *(b + 1 for b in budgets)}) == [5, 16, 33]  # 15 + 1 is the block
    assert lat.batches == [1, 3] and all(sorted(by) == [1, 3] for by in lat.verify.values())
    for s in [*lat.decode.values(), *lat.draft.values(), *(x for by in lat.verify.values() for x in by.values())]:
        assert 2 <= s.n <= 6 and s.min <= s.q1 <= s.median <= s.q3 <= s.max  # at least 2 runs, at most 3x
    assert lat.measured_at and lat.measure_s > 0
    assert all(s > 0 and math.isfinite(s) for s in [lat.decode_s, lat.draft_s, *lat.verify_s.values()])
    assert (lat.device, lat.gpu, lat.dtype, lat.regime, lat.context_len, lat.note) == ("cpu", None, "float32",
                                                                                       "eager", 24, "")
    # the key a caller computes before measuring is the one the result carries (table lookups hit)
    assert lat.key == L.latency_key(target, drafter, context_len=24, budgets=budgets, block_size=bs, batches=[1, 3],
                                    repeats=2)
    assert lat.key["target"] == content_hash(tdir) == LT.target_content_hash(tdir)
    assert lat.key["regime"] == "auto" and lat.key["budgets"] == budgets and lat.key["context_len"] == 24
    assert lat.key["attention"] == TV.GQA_ATTENTION and target.config._attn_implementation == "sdpa"  # restored
    assert lat.speedup(3.0) > 0
    assert L.Latencies.from_json(json.loads(json.dumps(lat.to_json()))) == lat  # JSON-ready, and it reads back


def test_measure_regimes_on_cpu(models):
    target, _, drafter, head = models
    with pytest.raises(ValueError, match="CUDA"):
        L.measure(target, drafter, head, context_len=8, budgets=[4], block_size=16, regime="cuda-graphs")
    with pytest.raises(ValueError, match="regime"):
        L.measure(target, drafter, head, context_len=8, budgets=[4], block_size=16, regime="graphs")
    lat = L.measure(target, drafter, head, context_len=8, budgets=[], block_size=16, repeats=1, regime="eager",
                    min_repeat_s=0.0)
    assert lat.regime == "eager" and lat.key["regime"] == "eager" and sorted(lat.verify_s) == [16]


def test_target_content_hash_follows_config_and_weights(trained_fixtures, tmp_path):
    src = Path(trained_fixtures) / "target"
    t = shutil.copytree(src, tmp_path / "target")
    h = LT.target_content_hash(t)
    assert h == LT.target_content_hash(src) and h.startswith("sha256-64MiB-tree:")
    (t / "tokenizer.json").write_text("{}")  # not config or weights: same hash
    assert LT.target_content_hash(t) == h
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    h2 = LT.target_content_hash(t)
    assert h2 != h
    shard = min(t.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert LT.target_content_hash(t) not in (h, h2)


# ---------------------------------------------------------------- the table

KEY = {"schema": L.LATENCY_SCHEMA, "device": "cuda", "gpu": "NVIDIA H200", "dtype": "bfloat16",
       "target": "sha256-64MiB-tree:abc", "context_len": 2048, "regime": "auto", "block_size": 16,
       "budgets": [32, 64], "batches": [1, 4], "repeats": 7, "torch": "2.11.0", "transformers": "5.17.0",
       "payload": "0.1.0"}


def _sp(x: float, rel: float = 0.0) -> L.Spread:
    return L.Spread(median=x, q1=x * (1 - rel), q3=x * (1 + rel), min=x * (1 - 2 * rel), max=x * (1 + 2 * rel), n=7)


def _lat(key=None, decode_s=0.011, draft_s=0.002, verify_s=None, rel=0.0, **kw) -> L.Latencies:
    """Batches 1 and 4 (a batch-4 step costs 4x the batch-1 one), spread +-rel around each median."""
    verify_s = verify_s or {16: 0.012, 33: 0.013, 65: 0.015}
    per = {b: b for b in (1, 4)}
    base = {"device": "cuda:0", "gpu": "NVIDIA H200", "dtype": "bfloat16", "regime": "cuda-graphs",
            "context_len": 2048, "batches": [1, 4], "decode": {b: _sp(decode_s * m, rel) for b, m in per.items()},
            "draft": {b: _sp(draft_s * m, rel) for b, m in per.items()},
            "verify": {n: {b: _sp(s * m, rel) for b, m in per.items()} for n, s in verify_s.items()},
            "key": dict(key or KEY), "measured_at": "2026-12-03T15:00:00+00:00"}
    return L.Latencies(**{**base, **kw})


def test_table_reuses_a_matching_key_and_misses_when_any_field_changes(tmp_path):
    table = LT.LatencyTable(tmp_path / "work" / "latency.json")  # the folder is made on the first put
    assert table.get(KEY) is None
    lat = _lat()
    assert table.put(lat) and table.error is None
    got = LT.LatencyTable(tmp_path / "work" / "latency.json").get(dict(reversed(list(KEY.items()))))  # key order free
    assert got == lat and isinstance(next(iter(got.verify)), int) and isinstance(next(iter(got.decode)), int)
    for field, other in (("gpu", "NVIDIA H100 80GB HBM3"), ("dtype", "float16"), ("target", "sha256-64MiB-tree:abd"),
                         ("context_len", 4096), ("regime", "eager"), ("budgets", [32]), ("transformers", "5.18.0"),
                         ("batches", [1, 4, 16]), ("repeats", 3), ("schema", "reval.latency/1")):
        assert table.get({**KEY, field: other}) is None, field
    # a second entry beside the first; a put with an existing key replaces it
    key2 = {**KEY, "context_len": 4096}
    table.put(_lat(key=key2, context_len=4096, decode_s=0.012))
    table.put(_lat(decode_s=0.020))
    assert table.get(KEY).decode_s == 0.020 and table.get(key2).decode_s == 0.012
    assert len(json.loads(table.path.read_text())["entries"]) == 2
    assert not list(table.path.parent.glob(".*tmp"))  # the atomic write leaves no temp file


@pytest.mark.parametrize("damage", ["garbage", "truncated", "not-a-table", "bad-entry", "empty", "deep", "folder",
                                    "no-verify-size", "no-verify-batch", "no-draft-batch", "absurd-small",
                                    "absurd-large", "infinity", "quartiles-out-of-order"])
def test_table_survives_a_damaged_file(tmp_path, damage):
    """A damaged file is a miss; so is an entry lacking a time its key asks for, or holding an absurd one
    (each said in `refused`): measured again and replaced, never a KeyError or an infinite speedup."""
    path = tmp_path / "latency.json"
    good = LT.LatencyTable(path)
    good.put(_lat())
    text = path.read_text()
    data = json.loads(text)
    entry = data["entries"][0]
    plant = {"bad-entry": lambda: entry["decode"]["1"].update(median=-1),
             "no-verify-size": lambda: entry["verify"].pop("33"),
             "no-verify-batch": lambda: entry["verify"]["65"].pop("4"),
             "no-draft-batch": lambda: entry["draft"].pop("1"),
             "absurd-small": lambda: [s.update(min=1e-300, q1=1e-300, median=1e-300, q3=1e-300, max=1e-300)
                                      for s in entry["draft"].values()],
             "absurd-large": lambda: entry["decode"]["4"].update(median=1e308, q3=1e308, max=1e308),
             "infinity": lambda: entry["decode"]["4"].update(max=math.inf),
             "quartiles-out-of-order": lambda: entry["verify"]["16"]["1"].update(q1=1.0)}
    if damage in plant:
        plant[damage]()
        path.write_text(json.dumps(data))  # Infinity as JSON's non-standard token, as a planted file may hold
    elif damage == "garbage":
        path.write_bytes(b"\xff\xfe\x00garbage")
    elif damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "not-a-table":
        path.write_text(json.dumps([1, 2, 3]))
    elif damage == "empty":
        path.write_text("")
    elif damage == "deep":
        path.write_text("[" * 100000 + "]" * 100000)
    elif damage == "folder":
        path.unlink()
        path.mkdir()
    table = LT.LatencyTable(path)
    assert table.get(KEY) is None
    assert (table.refused is not None) == (damage in plant)
    if damage == "folder":
        assert table.put(_lat()) is False and "cannot write" in table.error  # said, not raised
        return
    assert table.put(_lat(decode_s=0.03))  # replaced by a good file
    assert table.get(KEY).decode_s == 0.03
    assert json.loads(path.read_text())["schema"] == LT.TABLE_SCHEMA


def test_latencies_json_round_trip_and_validation():
    lat = _lat(note="CUDA graphs failed (X); eager", regime="eager")
    assert L.Latencies.from_json(json.loads(json.dumps(lat.to_json()))) == lat
    for bad in ({"regime": "graphs"}, {"batches": [4, 1]}, {"batches": [1]}, {"draft": {"1": 1.0, "4": 1.0}},
                {"verify": {"x": 1.0}}, {"context_len": True}, {"key": []}):
        d = {**lat.to_json(), **bad}
        with pytest.raises((TypeError, ValueError)):
            L.Latencies.from_json(d)
    assert dataclasses.replace(lat, gpu=None) == L.Latencies.from_json({**lat.to_json(), "gpu": None})


def test_spread_of_runs():
    s = L.Spread.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.min, s.q1, s.median, s.q3, s.max, s.n) == (1.0, 2.0, 3.0, 4.0, 5.0, 5)
    assert L.Spread.of([2.0]) == L.Spread(median=2.0, q1=2.0, q3=2.0, min=2.0, max=2.0, n=1)
    assert s.rel_iqr == pytest.approx(2 / 3)


def test_the_best_method_is_named_only_outside_the_noise():
    """The issue's busy-CPU numbers (verify 16 tokens 19.2 ms, 17 tokens 8.8 ms...) as medians: with a tight
    spread the best is named; with a spread wider than the lead it is 'within noise' with the tied methods."""
    verify = {16: 0.0192, 17: 0.0088, 33: 0.0166, 65: 0.0105}
    key = {**KEY, "budgets": [16, 32, 64]}
    taus = {"block": 3.0, "ddtree_16": 3.2, "ddtree_32": 3.4, "ddtree_64": 3.6}
    tight = P.by_batch(_lat(key=key, verify_s=verify, rel=0.001), taus)
    assert [r["batch"] for r in tight] == [1, 4]
    assert tight[0]["best_method"] == "ddtree_16" and tight[0]["tied"] == []  # 3.26x vs DDTree-64's 3.17x
    assert P.verdict(tight[0]).startswith("ddtree_16 (3.26x)")
    wide = P.by_batch(_lat(key=key, verify_s=verify, rel=0.05), taus)
    assert wide[0]["best_method"] is None and wide[0]["tied"] == ["ddtree_16", "ddtree_64"]
    assert wide[0]["best_speedup"] == tight[0]["best_speedup"]  # the same medians
    assert P.verdict(wide[0]) == "within noise: ddtree_16, ddtree_64 (~3.26x)"
    for r in wide:
        assert all(r["low"][m] < v < r["high"][m] for m, v in r["projected"].items())


def test_where_speculation_stops_paying():
    """At batch 4 the verify costs 8x its batch-1 time, decode 4x: the block's 1.6x at batch 1 is < 1 there."""
    lat = _lat(decode_s=0.010, draft_s=0.001, verify_s={16: 0.009, 33: 0.010, 65: 0.011})
    lat.verify = {n: {1: by[1], 4: _sp(by[1].median * 8)} for n, by in lat.verify.items()}
    rows = P.by_batch(lat, {"block": 1.6, "ddtree_32": None})
    assert rows[0]["projected"]["block"] == pytest.approx(1.6) and rows[1]["projected"]["block"] < 1
    assert P.stops_paying(rows) == {"block": 4, "ddtree_32": None}
    assert P.stops_text(rows, P.stops_paying(rows)) == "block at batch 4 (0.84x)"
    lat.verify[16][4] = L.Spread(median=0.072, q1=0.05, q3=0.08, min=0.03, max=0.09, n=7)  # a wide spread
    wide = P.by_batch(lat, {"block": 1.6})
    assert P.stops_text(wide, P.stops_paying(wide)) == "block at batch 4 (0.84x, within noise)"
    assert rows[0]["projected"]["ddtree_32"] is None  # no tau: not projected
    assert P.project(lat, "ddtree_128", 3.0, 1) is None  # no verify time: not projected (not a KeyError)


def test_pooled_taus_weigh_every_round_once():
    per_prompt = [{"acceptance_lengths": [1, 1, 1, 1], "ddtree_acceptance_lengths": {"16": [2, 2, 2]}},
                  {"acceptance_lengths": [7], "ddtree_acceptance_lengths": {"16": [8]}}]
    assert P.pooled_taus(per_prompt) == {"block": 11 / 5, "ddtree_16": 14 / 4}  # the per-prompt mean: 4.0, 5.0


def test_the_target_signature_sees_inode_ctime_and_folder(trained_fixtures, tmp_path):
    """Names, sizes and mtimes alone decide nothing: a copy with the mtimes kept (cp -p), a write in place with
    the mtime put back (touch -r) and another folder each give a new signature."""
    import os
    src = Path(trained_fixtures) / "target"
    a = shutil.copytree(src, tmp_path / "a")  # copy2 keeps the mtimes
    sig = LT.target_signature(a)
    assert sig == LT.target_signature(a) and sig != LT.target_signature(src)
    link = tmp_path / "link"
    link.symlink_to(a)
    assert LT.target_signature(link) == sig  # the folder's real path
    shard = min(a.glob("*.safetensors"))
    st = shard.stat()
    shard.write_bytes(shard.read_bytes())  # the same bytes rewritten in place...
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # ...and the mtime put back
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and LT.target_signature(a) != sig


@pytest.mark.parametrize("ours", [True, False])  # our GQA-folded attention, HF's SDPA
def test_a_decode_step_runs_without_a_mask_and_gives_the_masked_logits(models, ours):
    """One token sees the whole context: it goes without a mask (HF's prepared-mask mapping of Nones, SDPA's
    fastest kernel), and gives what the explicit 4D mask gives."""
    target, _, _, _ = models
    g = torch.Generator().manual_seed(5)
    V = target.config.vocab_size
    impl = TV._attention(target) if ours else "sdpa"
    assert (impl == TV.GQA_ATTENTION) == ours
    groups = TV._groups(target, impl)
    with torch.inference_mode(), TV._attention_of(target, impl):
        cache = TV._slot_cache(target, 20)
        TV._prefill(target, cache, torch.randint(0, V, (19,), generator=g), groups)
        step = TV._Step(target, cache, torch.randint(0, V, (1,), generator=g), [-1], 19, groups)
        unmasked = step()
        assert step.mask_map is not None  # this transformers takes it
        step.mask_map = None
        torch.testing.assert_close(unmasked, step(), atol=1e-5, rtol=1e-5)
        ids = torch.cat([torch.randint(0, V, (19,), generator=torch.Generator().manual_seed(5)), step.ids[0]])
        torch.testing.assert_close(unmasked[0], target(ids[None], use_cache=False).logits[0, -1], atol=2e-5, rtol=1e-5)


def test_a_batched_step_gives_every_sequence_the_batch_one_answer(models):
    """What `measure` times at batch b is b copies of the batch-1 work: the verify over `_batched_cache` gives each
    sequence the batch-1 logits, and the drafter's batched block each sequence the batch-1 drafts."""
    target, _, drafter, head = models
    g = torch.Generator().manual_seed(7)
    V = target.config.vocab_size
    impl = TV._attention(target)
    groups = TV._groups(target, impl)
    parents = TV.ddtree_tree(8, drafter.cfg.block_size)
    ids = torch.randint(0, V, (len(parents),), generator=g)
    with torch.inference_mode(), TV._attention_of(target, impl):
        one = TV._slot_cache(target, 20 + len(parents))
        TV._prefill(target, one, torch.randint(0, V, (20,), generator=g), groups)
        three = TV._batched_cache(target, one, 3)
        single = TV._Step(target, one, ids, parents, 20, groups)()
        batched = TV._Step(target, three, ids, parents, 20, groups, batch=3)()
        assert batched.shape == (3, *single.shape)
        for row in batched:
            torch.testing.assert_close(row, single, atol=2e-5, rtol=1e-5)
        drafts = [L._draft_fn(drafter, head, 24, [8], b, torch.Generator().manual_seed(1), torch.device("cpu"))()
                  for b in (1, 3)]
    assert drafts[1].shape[0] == 3 and all(torch.equal(r, drafts[0][0]) for r in drafts[1])
