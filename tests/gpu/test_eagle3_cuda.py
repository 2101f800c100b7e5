"""EAGLE-3's `eval --online N` and `--speedup` on CUDA in bf16 (issue 31), on the trained tiny EAGLE-3 fixtures
(remote_payload/tools/eagle3_fixtures.py; carry .cache/eagle3-fixtures to skip its ~1 min CPU build):

- the online decode (the whole target verifying over its KV cache, the head drafting from the verify passes'
  features) agrees with the offline walk on most rounds, for the chain K=5 and EAGLE's default tree; a cache whose
  mid and high taps are swapped in cache.json (the offline walk reads the wrong states, the online decode the right
  ones) falls below that bar, so the bar would catch a wrong tap;
- `--speedup` measures in CUDA graphs (the draft step `_draft_chunk` and the verify captured; no fallback note), its
  latencies positive and finite, the tree's draft step (depth+1 = 8 level steps of top_k 10) slower than the
  chain's (5 steps) at batch 1, and each projection recomputed from the recorded latencies and the pooled tau.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from remote_payload.__main__ import main as payload_main

assert torch.cuda.is_available(), "tests/gpu needs a CUDA device"

ROOT = Path(__file__).resolve().parents[2]
AGREE = 0.8  # the share of online rounds equal to the offline walk's; bf16 near-ties may differ, a wrong tap fails
PROMPTS = 3
CHAIN, TREE = "eagle3-chain-5", "eagle3-tree-60,7,10"


@pytest.fixture(scope="module")
def e3() -> Path:
    from remote_payload.tools import eagle3_fixtures
    root = ROOT / ".cache" / "eagle3-fixtures"
    eagle3_fixtures.build(root, log=lambda line: None)
    return root


def _eval(root: Path, run: Path, cache: Path, *extra: str) -> dict:
    assert payload_main(["eval", "--drafter", str(root / "eagle3"), "--target", str(root / "target"), "--cache",
                         str(cache), "--device", "cuda", "--dtype", "bf16", "--num-prompts", str(PROMPTS),
                         "--max-blocks", "64", *extra, "--run-dir", str(run)]) == 0
    return json.loads((run / "results.json").read_text())


@pytest.fixture(scope="module")
def runs(e3, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("e3cuda")
    swapped = tmp / "cache-swapped"  # cache.json says the mid and high taps' layers are each other's
    shutil.copytree(e3 / "cache", swapped)
    meta = json.loads((swapped / "cache.json").read_text())
    ids, hf = meta["layer_ids"], meta["hf_hidden_states"]
    meta.update(layer_ids=[ids[0], ids[2], ids[1]], hf_hidden_states=[hf[0], hf[2], hf[1]])
    (swapped / "cache.json").write_text(json.dumps(meta))
    online = ["--online", str(PROMPTS), "--online-repeats", "1"]
    speedup = ["--speedup", "--speedup-batches", "1,4", "--speedup-repeats", "3", "--latency-table",
               str(tmp / "latency.json")]  # a fresh table: measured here, never reused from another run
    return {"chain": _eval(e3, tmp / "chain", e3 / "cache", *online, *speedup),
            "tree": _eval(e3, tmp / "tree", e3 / "cache", "--eagle-tree", "default", *online, *speedup),
            "swapped": _eval(e3, tmp / "swapped", swapped, *online)}


def _agreement(res: dict) -> float:
    on = res["online"]
    assert on["prompts"] == PROMPTS and on["rounds"] > 10 and on["spec_s"] > 0 and on["target_only_s"] > 0
    return on["rounds_agreeing"] / on["rounds"]


def test_online_agrees_with_the_offline_walk_and_a_swapped_tap_fails_the_bar(runs):
    got = {name: _agreement(res) for name, res in runs.items()}
    print("online rounds agreeing with the offline walk (bf16, CUDA):", got)
    assert got["chain"] >= AGREE and got["tree"] >= AGREE, got
    assert got["swapped"] < AGREE, got  # the bar catches a wrong tap
    assert runs["chain"]["online"]["method"] == CHAIN and runs["tree"]["online"]["method"] == TREE


def _latencies(sp: dict) -> dict[tuple[str, int, int], float]:
    for x in sp["latencies"]:
        vals = [x[f] for f in ("min", "q1", "median", "q3", "max")]
        assert all(math.isfinite(v) and 0 < v < 1 for v in vals) and vals == sorted(vals), x
    return {(x["step"], x["tokens"], x["batch"]): x["median"] for x in sp["latencies"]}


def test_speedup_is_measured_in_cuda_graphs_and_its_projection_recomputes(runs):
    draft = {}
    for name, method, n in (("chain", CHAIN, 6), ("tree", TREE, 60)):
        res = runs[name]
        sp, on = res["speedup"], res["online"]
        assert sp["regime"] == "cuda-graphs" and sp["note"] == "", (sp["regime"], sp["note"])
        assert sp["dtype"] == "bfloat16" and sp["device"].startswith("cuda") and not sp["reused"]
        lat = _latencies(sp)
        assert set(lat) == {(s, k, b) for s, k in (("decode", 1), ("draft", n), ("verify", n)) for b in (1, 4)}
        lens = [x for p in res["per_prompt"] for x in p["acceptance_lengths"]]
        tau = sum(lens) / len(lens)
        for r in sp["by_batch"]:  # the projection from the recorded latencies and the pooled tau
            b = r["batch"]
            want = tau * lat["decode", 1, b] / (lat["draft", n, b] + lat["verify", n, b])
            assert r["projected"] == {method: pytest.approx(want, rel=1e-3)}, (name, r)
        # the online section's projection: batch 1, the pooled offline tau of the prompts decoded online
        want = on["projected_tau"] * lat["decode", 1, 1] / (lat["draft", n, 1] + lat["verify", n, 1])
        assert on["projected_speedup"] == pytest.approx(want, rel=1e-3), (name, on)
        draft[name] = lat["draft", n, 1]
    print(f"draft step at batch 1 (cuda-graphs): chain {draft['chain'] * 1e3:.3f} ms, tree "
          f"{draft['tree'] * 1e3:.3f} ms")
    assert draft["tree"] > draft["chain"]  # 8 sequential level steps of 10 nodes against 5 of one
