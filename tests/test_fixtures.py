"""remote_payload.tools.fixtures: the trained tiny target/cache/drafters carry real signal and load through the
real loaders; the training loss's batched path agrees with the naive reference (values and gradients)."""
from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from remote_payload.eval.cache import open_cache
from remote_payload.eval.checkpoint import load_drafter, load_target_head
from remote_payload.eval.drafter import DFlashDrafter, TargetHead
from remote_payload.tools import fixtures


@pytest.fixture(scope="module")
def meta(trained_fixtures):
    return json.loads((trained_fixtures / fixtures.FIXTURES_JSON).read_text())


def test_layout_and_recipe(trained_fixtures, meta):
    assert meta["recipe_hash"] == fixtures.recipe_hash(fixtures.Recipe())
    p = meta["paths"]
    for key in ("tokenizer", "target", "target_mm", "prompts", "cache", "drafter_good", "drafter_pt"):
        assert (trained_fixtures / p[key]).exists(), key
    assert len(p["drafters"]) >= 6 and p["drafters"][0] == "drafters/step-0000"
    assert all((trained_fixtures / s / "model.safetensors").is_file() for s in p["drafters"])
    index = json.loads((trained_fixtures / "target/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    # a second build call reuses the directory as is
    before = (trained_fixtures / fixtures.FIXTURES_JSON).stat().st_mtime_ns
    assert fixtures.build(trained_fixtures, log=lambda s: None) == meta
    assert (trained_fixtures / fixtures.FIXTURES_JSON).stat().st_mtime_ns == before


def test_quality_is_real_signal(meta):
    q, V = meta["quality"], meta["vocab_size"]
    assert q["target_accuracy"] > 0.9
    good, untrained, pt = q["drafter_good"], q["drafter_untrained"], q["drafter_pt"]
    assert good["position_1_accuracy"] > 0.5 and good["position_1_accuracy"] > 20 / V
    assert good["mean_acceptance_length"] > 3
    assert pt["position_1_accuracy"] > 0.4
    assert untrained["position_1_accuracy"] < 0.2 and untrained["mean_acceptance_length"] < 1.5
    # where an eval's walk spends its rounds (each completion's start), not only on average over all anchors:
    # uniform training anchors gave 13 on average and 1.66 here (every round of tests/test_online.py's walk short)
    assert good["tau_max_blocks_8"] > 3 and untrained["tau_max_blocks_8"] < 1.5
    losses = list(q["drafter_loss"].values())
    assert losses[-1] < losses[0] / 5


@pytest.mark.slow
def test_the_builds_walk_tau_is_the_evals(trained_fixtures, meta, tmp_path):
    """fixtures.json's tau_max_blocks_8 is the tau `eval --max-blocks 8` reports for the same drafter and cache
    (the build's quality numbers say what an eval of the fixtures will show)."""
    from remote_payload.__main__ import main as payload_main
    p, run_dir = meta["paths"], tmp_path / "run"
    assert payload_main(["eval", "--drafter", str(trained_fixtures / p["drafter_good"]), "--target",
                         str(trained_fixtures / p["target"]), "--cache", str(trained_fixtures / p["cache"]),
                         "--run-dir", str(run_dir), "--device", "cpu", "--max-blocks", "8"]) == 0
    tau = json.loads((run_dir / "results.json").read_text())["metrics"]["tau"]
    assert round(tau, 3) == meta["quality"]["drafter_good"]["tau_max_blocks_8"] > 3


def test_cache_matches_prompts_and_tokenizer(trained_fixtures, meta):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(trained_fixtures / "tokenizer.json"))
    assert tok.token_to_id("<|mask|>") == meta["mask_token_id"] and tok.get_vocab_size() == meta["vocab_size"]
    c = open_cache(trained_fixtures / "cache")
    assert c.layer_ids == meta["cache_layers"] and c.hidden_size == meta["recipe"]["hidden_size"]
    prompts = [json.loads(ln) for ln in (trained_fixtures / "prompts.jsonl").read_text().splitlines()]
    assert [p.name for p in c.prompts] == [p["name"] for p in prompts] and 8 <= len(prompts) <= 12
    for i, p in enumerate(prompts):
        ids, _ = c.load(i)
        assert tok.decode(ids[:c.prompts[i].prompt_len].tolist()) == p["prompt"]
        assert c.prompts[i].seq_len - c.prompts[i].prompt_len == meta["recipe"]["max_new_tokens"]
    assert tok.decode(c.load(1)[0][:8].tolist()) == "count n07 n08 n09 n10 n11 n12 n13"


def test_mm_variant_has_the_same_weights_under_multimodal_keys(trained_fixtures, meta):
    def tensors(d):
        index = json.loads((d / "model.safetensors.index.json").read_text())
        out = {}
        for shard in set(index["weight_map"].values()):
            with safe_open(str(d / shard), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
        assert set(out) == set(index["weight_map"])
        return out
    plain, mm = tensors(trained_fixtures / "target"), tensors(trained_fixtures / "target-mm")
    assert "lm_head.weight" in mm and all(k.startswith("model.language_model.") for k in mm if k != "lm_head.weight")
    assert len(plain) == len(mm)
    for k, v in plain.items():
        assert torch.equal(v, mm[k.replace("model.", "model.language_model.", 1)])
    V, H = meta["vocab_size"], meta["recipe"]["hidden_size"]
    h1, i1 = load_target_head(trained_fixtures / "target", vocab_size=V, hidden_size=H)
    h2, i2 = load_target_head(trained_fixtures / "target-mm", vocab_size=V, hidden_size=H)
    assert i1.embed_key == "model.embed_tokens.weight" and i2.embed_key == "model.language_model.embed_tokens.weight"
    assert torch.equal(h1.embed, h2.embed) and torch.equal(h1.lm_head, h2.lm_head) and not i1.tied


def test_drafters_load_through_the_real_loader(trained_fixtures, meta):
    layers = meta["cache_layers"]
    good, info = load_drafter(trained_fixtures / meta["paths"]["drafter_good"])
    assert info.layout == "zlab" and info.fc_layer_ids == layers and good.cfg.mask_token_id == meta["mask_token_id"]
    pt, info = load_drafter(trained_fixtures / meta["paths"]["drafter_pt"])
    assert info.layout == "pt" and info.fc_layer_ids == layers[:-1] and info.step == meta["recipe"]["pt_drafter_steps"]
    assert pt.cfg.target_layer_ids == layers
    steps = [load_drafter(trained_fixtures / s)[1].step for s in meta["paths"]["drafters"]]
    assert steps == sorted(steps) and steps[0] == 0


def test_build_refuses_a_directory_that_is_not_a_fixtures_dir(tmp_path, capsys):
    from remote_payload.__main__ import main as payload_main
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert payload_main(["fixtures", "--out", str(tmp_path / "mine")]) == 3
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "holds no fixtures.json" in out[0]
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(f.name for f in tmp_path.iterdir()) == [".mine.lock", "mine"]


def test_language_and_tokenizer_are_deterministic():
    a = [fixtures.sample_sequence(random.Random(3), 40) for _ in range(5)]
    b = [fixtures.sample_sequence(random.Random(3), 40) for _ in range(5)]
    assert a == b and all(len(s) == 40 for s in a)
    t1, t2 = fixtures.train_tokenizer(random.Random(0)), fixtures.train_tokenizer(random.Random(0))
    assert t1.to_str() == t2.to_str()
    assert all(t1.token_to_id(s) is not None for s in fixtures.SPECIALS)
    assert t1.token_to_id("<|unk|>") not in t1.encode(" ".join(a[0])).ids


def test_block_loss_agrees_with_naive_block_values_and_gradients():
    r = fixtures.Recipe(drafter_layers=2)
    V, H = 40, r.hidden_size
    cfg = fixtures.drafter_config(r, V, mask_id=2, n_fc=3)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    head = TargetHead(embed=torch.randn(V, H), lm_head=torch.randn(V, H))
    ids = torch.randint(0, V, (2, 30))
    feats = torch.randn(2, 30, 3 * H)
    anchors = torch.tensor([[3, 20], [25, 9]])  # 25: rows past the end are ignored

    fast = fixtures.block_loss(drafter, head, ids, feats, anchors)
    g_fast = torch.autograd.grad(fast, [drafter.fc.weight, drafter.layers[1].mlp.down_proj.weight])
    logits, labels = [], []
    for b in range(2):
        for a in anchors[b].tolist():
            logits.append(drafter.naive_block(feats[b], int(ids[b, a]), a, head))  # [15, V]
            lab = [int(ids[b, a + k]) if a + k < 30 else -100 for k in range(1, 16)]
            labels.append(torch.tensor(lab))
    slow = F.cross_entropy(torch.cat(logits), torch.cat(labels), ignore_index=-100)
    g_slow = torch.autograd.grad(slow, [drafter.fc.weight, drafter.layers[1].mlp.down_proj.weight])
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    for x, y in zip(g_fast, g_slow):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-6)
