"""EAGLE-3 heads: config discipline, strict loading, the batched chain vs the per-round decoder, the eval command.

The trained fixture (remote_payload/tools/eagle3_fixtures.py: a tiny Llama target + EAGLE-3 head, CPU fp32) is
built once into <repo>/.cache/eagle3-fixtures and reused while its recipe matches.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remote_payload.contract.eagle3config import Eagle3Config, looks_like_eagle3
from remote_payload.contract.errors import CheckpointError, ConfigError, FeatureMismatchError
from remote_payload.eagle3.loader import is_eagle3, load_eagle3
from remote_payload.eval import metrics
from remote_payload.eval.cache import open_cache

ROOT = Path(__file__).resolve().parents[1]
BASE = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 192,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 80,
        "draft_vocab_size": 40, "rms_norm_eps": 1e-6, "hidden_act": "silu", "model_type": "llama"}


@pytest.fixture(scope="module")
def e3():
    from remote_payload.tools import eagle3_fixtures
    root = ROOT / ".cache" / "eagle3-fixtures"
    meta = eagle3_fixtures.build(root, log=lambda line: None)
    return root, meta


def _target_embed(root: Path) -> torch.Tensor:
    from safetensors import safe_open
    with safe_open(str(root / "target" / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


# ---- config ----------------------------------------------------------------------------------------
def test_config_reads_the_safeailab_layout_and_its_taps():
    cfg = Eagle3Config.from_dict(BASE)
    assert (cfg.draft_vocab_size, cfg.target_hidden_size, cfg.head_dim, cfg.fc_in_features) == (40, 64, 16, 192)
    assert cfg.tap_ids(32) == [2, 16, 29] and cfg.cache_layer_ids(32) == [1, 15, 28]
    assert looks_like_eagle3(BASE) and not looks_like_eagle3({**BASE, "dflash_config": {}})
    plain = {k: v for k, v in BASE.items() if k != "architectures"}
    assert looks_like_eagle3(plain) and not looks_like_eagle3({**plain, "mask_token_id": 2})  # a DFlash config
    explicit = Eagle3Config.from_dict({**BASE, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}})
    assert explicit.tap_ids(32) == [1, 15, 28]  # vLLM: id k = HF hidden_states[k]
    assert explicit.tap_ids(32, "sglang") == [2, 16, 29]  # SGLang: id k = HF k+1
    assert Eagle3Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="need 3 distinct states"):
        cfg.tap_ids(6)  # {2, 3, 3}: a target of >= 7 layers


@pytest.mark.parametrize("change, named", [
    ({"norm_output": True}, "norm_output"),
    ({"fc_norm": "yes"}, "fc_norm"),
    ({"norm_before_residual": 1}, "norm_before_residual"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_hidden_layers": 2}, "num_hidden_layers"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, "eagle_aux_hidden_state_layer_ids"),
    ({"hiden_act": "silu"}, "did you mean 'hidden_act'"),
    ({"eagle_config": {"use_mtp": True}}, "eagle_config.use_mtp"),
    ({"draft_vocab_size": 81}, "draft_vocab_size"),
])
def test_config_refuses_what_it_does_not_implement(change, named):
    with pytest.raises(ConfigError, match=named):
        Eagle3Config.from_dict({**BASE, **change})


def test_an_allowed_unknown_key_is_kept_and_recorded():
    cfg = Eagle3Config.from_dict({**BASE, "my_note": 1}, allow_unknown=["my_note"])
    assert cfg.allowed_unknown == ["my_note"] and cfg.extra["my_note"] == 1


# ---- loader ----------------------------------------------------------------------------------------
def test_safetensors_and_bin_layouts_load_the_same_head(e3):
    root, _ = e3
    embed = _target_embed(root)
    a, ia = load_eagle3(root / "eagle3", embed=embed)
    b, ib = load_eagle3(root / "eagle3-bin", embed=embed)
    assert (ia.layout, ib.layout, ia.embed_source) == ("eagle", "eagle-pt", "target")
    assert is_eagle3(root / "eagle3") and is_eagle3(root / "eagle3-bin")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.d2t.dtype == torch.long and int(a.t2d.sum()) == a.cfg.draft_vocab_size


def test_a_pt_file_with_its_config_inside_is_an_eagle3_head(e3, tmp_path):
    root, _ = e3
    sd = torch.load(root / "eagle3-bin" / "pytorch_model.bin", weights_only=True)
    cfg = json.loads((root / "eagle3" / "config.json").read_text())
    torch.save({"model": {f"module.{k}": v for k, v in sd.items()}, "config": cfg}, tmp_path / "step-300.pt")
    assert is_eagle3(tmp_path / "step-300.pt")
    head, info = load_eagle3(tmp_path / "step-300.pt", embed=_target_embed(root))
    assert (info.layout, info.step, info.name) == ("eagle-pt", 300, "step-300")
    assert torch.equal(head.lm_head.weight, sd["lm_head.weight"])


def _rewrite(root: Path, tmp: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file
    out = tmp / "head"
    shutil.copytree(root / "eagle3", out)
    sd = load_file(str(out / "model.safetensors"))
    save_file(edit(sd), str(out / "model.safetensors"))
    return out


def test_loading_is_strict_and_names_the_closest_key(e3, tmp_path):
    root, _ = e3
    embed = _target_embed(root)
    gone = _rewrite(root, tmp_path / "a",
                    lambda sd: {k: v for k, v in sd.items() if k != "midlayer.hidden_norm.weight"})
    with pytest.raises(CheckpointError, match=r"needs 'midlayer.hidden_norm.weight'.*Closest: 'midlayer.*norm"):
        load_eagle3(gone, embed=embed)
    more = _rewrite(root, tmp_path / "b", lambda sd: {**sd, "midlayer.self_attn.q_norm.weight": torch.ones(16)})
    with pytest.raises(CheckpointError, match="q_norm"):
        load_eagle3(more, embed=embed)
    bad_map = _rewrite(root, tmp_path / "c", lambda sd: {**sd, "d2t": torch.zeros_like(sd["d2t"])})
    with pytest.raises(CheckpointError, match="t2d"):
        load_eagle3(bad_map, embed=embed)
    with pytest.raises(CheckpointError, match="ships no embed_tokens"):
        load_eagle3(root / "eagle3")
    vllm = _rewrite(root, tmp_path / "d", lambda sd: {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()})
    _head, info = load_eagle3(vllm, embed=embed)
    assert info.renamed == ["layers.0. -> midlayer."]


# ---- the batched chain vs the per-round decoder ------------------------------------------------------
def test_batched_chain_equals_the_per_step_chain(e3):
    """At every anchor the K batched passes draft what the plain per-step chain drafts, up to the first miss
    (where teacher forcing and the chain's own token part ways), with the same step-0 logits."""
    from remote_payload.eagle3.online import draft_chain
    from remote_payload.eagle3.walk import chain_drafts, ttt_steps
    root, meta = e3
    head, _ = load_eagle3(root / "eagle3", embed=_target_embed(root))
    cache = open_cache(root / "cache")
    ids, feats = cache.load(0, layer_ids=[k - 1 for k in meta["taps"]])
    p0 = cache.prompts[0].prompt_len
    anchors = torch.arange(p0, min(p0 + 24, len(ids) - 1))
    drafts, _ = chain_drafts(head, feats, ids, anchors, 5, chunk=7)
    compared = 0
    for j, a in enumerate(anchors.tolist()):
        ref = draft_chain(head, feats[:a], ids[1:a + 1], 5)
        miss = next((s for s in range(5) if a + 1 + s >= len(ids) or ref[s] != int(ids[a + 1 + s])), 5)
        upto = min(miss + 1, 5)
        assert drafts[j, :upto].tolist() == ref[:upto], f"anchor {a}"
        compared += upto
    assert compared > len(anchors)  # some rounds accept drafts: later steps were compared too
    with torch.no_grad():
        _, _, step0 = next(ttt_steps(head, feats, ids, anchors[-1:] - 1, 1))
    from remote_payload.eagle3.model import attend
    with torch.no_grad():  # the plain causal pass over the prefix, its last slot
        a = int(anchors[-1])
        u = head.project(feats[:a])
        q, k, v = head.qkv(head.slot_inputs(u, ids[1:a + 1]), torch.arange(a))
        g = head.finish(u[-1:], attend(q[-1:], [(k, None)], [v], 2))
        assert torch.allclose(head.logits(g), step0, atol=1e-5)


def test_offline_walk_equals_online_decoding_round_by_round(e3):
    """The offline chain walk over the cache equals online greedy speculative decoding with the real target
    (per round: draft K=5 from the committed prefix with target features only, verify, accept) on every prompt."""
    from transformers import AutoModelForCausalLM

    from remote_payload.eagle3.online import decode
    from remote_payload.eagle3.walk import chain_drafts
    root, meta = e3
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), local_files_only=True).eval()
    head, _ = load_eagle3(root / "eagle3", embed=target.model.embed_tokens.weight.detach())
    cache = open_cache(root / "cache")
    K, rounds, online_all, offline_all = 5, 64, [], []
    for i, p in enumerate(cache.prompts):
        ids, feats = cache.load(i, layer_ids=[k - 1 for k in meta["taps"]])
        online, tokens = decode(target, head, ids[:p.prompt_len].tolist(), meta["taps"], K, p.seq_len, rounds)
        assert tokens == ids.tolist(), f"{p.name}: the target's greedy tokens are the cache's"
        n = metrics.num_anchors(p.prompt_len, p.seq_len, rounds, K + 1)
        drafts, _ = chain_drafts(head, feats, ids, torch.arange(p.prompt_len, p.prompt_len + n), K)
        acc = metrics.accept_lengths_vanilla(drafts.numpy(), ids.numpy(), p.prompt_len)
        offline = metrics.walk(acc, p.prompt_len, p.seq_len, rounds, K + 1)
        assert offline == online, p.name
        online_all.append(online)
        offline_all.append(offline)
    tau = metrics.summarize(offline_all, K + 1)["tau"]
    assert tau == pytest.approx(meta["quality"]["chain_5"]["tau"], abs=1e-4)
    assert 1.5 < tau <= K + 1  # a trained head accepts drafts
    print(f"\nEAGLE-3 chain K=5 on the fixture: tau offline {tau:.4f} = online "
          f"{metrics.summarize(online_all, K + 1)['tau']:.4f} over {sum(map(len, online_all))} rounds")


# ---- the eval command ------------------------------------------------------------------------------
def _eval(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote_payload", "eval", *args], cwd=cwd, check=False,
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          timeout=600)


def test_eval_command_evaluates_an_eagle3_head(e3, tmp_path):
    from remote_payload.contract.results import Result
    root, meta = e3
    p = _eval(["--drafter", str(root / "eagle3"), "--target", str(root / "target"), "--cache", str(root / "cache"),
               "--run-dir", str(tmp_path / "run"), "--max-blocks", "64", "--device", "cpu"], tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = Result.load(tmp_path / "run" / "results.json")
    assert (res.drafter.family, res.comparability.family, res.options.block_size) == ("eagle3", "eagle3", 6)
    assert res.drafter.eagle3["taps_hf_hidden_states"] == meta["taps"] == [2, 4, 5]
    assert res.drafter.fc_layer_ids == [1, 3, 4] and res.drafter.layout == "eagle"
    assert res.metrics.tau == pytest.approx(meta["quality"]["chain_5"]["tau"], abs=1e-4)
    assert len(res.metrics.per_position_acceptance_conditional) == 5 and not res.health.suspect
    assert "family" in res.comparability.key()


def test_a_cache_without_the_taps_is_refused_naming_them(e3, tmp_path):
    root, _ = e3
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    meta = json.loads((cache / "cache.json").read_text())
    meta["layer_ids"] = [1, 2, 3]  # a DFlash-style set: layer 4 (HF hidden_states[5]) is not there
    (cache / "cache.json").write_text(json.dumps(meta))
    p = _eval(["--drafter", str(root / "eagle3"), "--target", str(root / "target"), "--cache", str(cache),
               "--run-dir", str(tmp_path / "run"), "--device", "cpu"], tmp_path)
    assert p.returncode == 3, p.stderr[-2000:]
    assert "cache layers [1, 3, 4]" in p.stderr and "without [4]" in p.stderr and "--for-drafter" in p.stderr
    from remote_payload.eagle3.evaluate import resolve_taps
    from remote_payload.runtime import preflight
    with pytest.raises(FeatureMismatchError, match=r"HF hidden_states \[2, 4, 5\]"):
        resolve_taps(Eagle3Config.from_dict(json.loads((root / "eagle3" / "config.json").read_text())),
                     str(root / "target"), open_cache(cache))
    for head in ("eagle3", "eagle3-bin"):  # reval run's check on the host, before a run is created (no torch)
        preflight.check(str(root / head), str(root / "target"), str(root / "cache"))
        with pytest.raises(FeatureMismatchError, match=r"without \[4\]"):
            preflight.check(str(root / head), str(root / "target"), str(cache))


def test_chain_is_refused_for_a_dflash_drafter(tmp_path):
    d = tmp_path / "dflash"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"dflash_config": {"mask_token_id": 2}, "hidden_size": 8}))
    p = _eval(["--drafter", str(d), "--target", str(tmp_path), "--cache", str(tmp_path), "--chain", "3"], tmp_path)
    assert p.returncode == 3 and "--chain 3" in p.stderr and "DFlash" in p.stderr


def test_extract_for_an_eagle3_head_taps_its_three_states(e3):
    from remote_payload.extract.options import layers_arg
    root, _ = e3
    assert layers_arg(None, str(root / "eagle3"), str(root / "target")) == [1, 3, 4]
    meta = json.loads((root / "cache" / "cache.json").read_text())
    assert meta["layer_ids"] == [1, 3, 4] and meta["hf_hidden_states"] == [2, 4, 5]
