"""Strict loading: both drafter layouts, the target head in every key variant, and every bad input."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from remote_payload.contract.contenthash import parse_step
from remote_payload.contract.drafterconfig import DrafterConfig, check_features, default_target_layer_ids
from remote_payload.contract.errors import CheckpointError, ConfigError, FeatureMismatchError, PayloadError
from remote_payload.eval.checkpoint import load_drafter, load_target_head
from tests.tiny_models import (
    random_drafter,
    random_head,
    tiny_drafter_config,
    write_pt_drafter,
    write_tiny_target,
    write_zlab_drafter,
)


@pytest.fixture(scope="module")
def drafter():
    cfg = tiny_drafter_config()
    return cfg, random_drafter(cfg, seed=1)


def _same_weights(model, sd):
    got = model.state_dict()
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k


# ---- drafter layouts ----------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [1, 3])
def test_zlab_folder_loads(tmp_path, drafter, shards):
    cfg, model = drafter
    write_zlab_drafter(tmp_path / "checkpoint-4000", cfg, model.state_dict(), shards=shards)
    loaded, info = load_drafter(tmp_path / "checkpoint-4000")
    _same_weights(loaded, model.state_dict())
    assert loaded.cfg == cfg and not any(p.requires_grad for p in loaded.parameters())
    assert (info.layout, info.name, info.step) == ("zlab", "checkpoint-4000", 4000)
    assert len(info.weight_files) == shards
    assert info.num_parameters == sum(p.numel() for p in model.parameters())
    assert info.weight_stats["norm.weight"]["mean"] == pytest.approx(float(model.norm.weight.detach().mean()), abs=1e-5)
    assert info.content_hash.startswith("sha256-64MiB-tree:") and len(info.content_hash) == 18 + 64


@pytest.mark.parametrize("wrap,prefix,config_inside", [("model", "module.", True), ("state_dict", "drafter.", True),
                                                        (None, "", False), ("model", "module.drafter.", False)])
def test_pt_layout_loads(tmp_path, drafter, wrap, prefix, config_inside):
    cfg, model = drafter
    path = write_pt_drafter(tmp_path / "run1" / "drafter_step4000.pt", cfg, model.state_dict(), wrap=wrap,
                            prefix=prefix, config_inside=config_inside)
    loaded, info = load_drafter(path, dtype=torch.float32)
    _same_weights(loaded, model.state_dict())
    assert (info.layout, info.step, info.stripped_prefix) == ("pt", 4000, prefix)
    assert info.config_source.endswith("['config']" if config_inside else "config.json")


def test_pt_step_field_and_generic_name(tmp_path, drafter):
    cfg, model = drafter
    path = write_pt_drafter(tmp_path / "exp7" / "model.pt", cfg, model.state_dict(), wrap="model", step=1234)
    _, info = load_drafter(path)
    assert (info.name, info.step) == ("exp7", 1234)


def test_layouts_agree_and_dtype_is_applied(tmp_path, drafter):
    cfg, model = drafter
    write_zlab_drafter(tmp_path / "z", cfg, model.state_dict())
    pt = write_pt_drafter(tmp_path / "p" / "d.pt", cfg, model.state_dict(), wrap="model")
    (mz, iz), (mp, ip) = load_drafter(tmp_path / "z"), load_drafter(pt)
    head = random_head(cfg)
    feats = torch.randn(9, cfg.fc_in_features)
    with torch.no_grad():
        torch.testing.assert_close(mz.naive_block(feats, 5, 9, head), mp.naive_block(feats, 5, 9, head))
    assert iz.num_parameters == ip.num_parameters
    bf, _ = load_drafter(tmp_path / "z", dtype=torch.bfloat16)
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16}


def test_content_hash_tracks_the_weights(tmp_path, drafter):
    cfg, model = drafter
    sd = model.state_dict()
    write_zlab_drafter(tmp_path / "a", cfg, sd)
    write_zlab_drafter(tmp_path / "b", cfg, sd)
    write_zlab_drafter(tmp_path / "c", cfg, {**sd, "norm.weight": sd["norm.weight"] + 1})
    ha, hb, hc = (load_drafter(tmp_path / n)[1].content_hash for n in "abc")
    assert ha == hb != hc


def test_pt_four_of_five_layers(tmp_path):
    """The team's layout: 5 tapped layers in the config, fc consumes the first 4 (fc.weight [H, 4H])."""
    cfg5 = tiny_drafter_config(target_layer_ids=[0, 1, 2, 3, 4])
    cfg4 = DrafterConfig.from_dict({**cfg5.to_dict(), "fc_layer_ids": [0, 1, 2, 3]})
    model = random_drafter(cfg4)
    raw = cfg5.to_dict()
    raw.pop("fc_layer_ids")  # the .pt config does not say: the rule derives it from fc's width
    path = tmp_path / "d.pt"
    torch.save({"model": model.state_dict(), "config": raw}, path)
    loaded, info = load_drafter(path)
    assert info.fc_layer_ids == [0, 1, 2, 3] and loaded.fc.weight.shape == (32, 128)
    assert check_features(loaded.cfg, [0, 1, 2, 3, 4], 32) == [0, 1, 2, 3]
    # An explicit fc_layer_ids wins over the rule
    torch.save({"model": random_drafter(DrafterConfig.from_dict({**raw, "fc_layer_ids": [1, 2, 3, 4]})).state_dict(),
                "config": {**raw, "fc_layer_ids": [1, 2, 3, 4]}}, path)
    assert load_drafter(path)[1].fc_layer_ids == [1, 2, 3, 4]


# ---- bad drafters -------------------------------------------------------------------------------
def _err(exc_type, fn, *args, **kw) -> str:
    with pytest.raises(exc_type) as ei:
        fn(*args, **kw)
    assert isinstance(ei.value, PayloadError) and ei.value.exit_code == 3
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_missing_key_names_it_and_the_closest(tmp_path, drafter):
    cfg, model = drafter
    sd = dict(model.state_dict())
    del sd["layers.1.mlp.up_proj.weight"]
    write_zlab_drafter(tmp_path / "d", cfg, sd, shards=2)
    msg = _err(CheckpointError, load_drafter, tmp_path / "d")
    assert "'layers.1.mlp.up_proj.weight'" in msg and "Closest:" in msg and "Nothing was evaluated" in msg
    assert "'layers.1.mlp.gate_proj.weight'" in msg or "'layers.0.mlp.up_proj.weight'" in msg
    pt = write_pt_drafter(tmp_path / "d.pt", cfg, sd, wrap="model")
    assert "'layers.1.mlp.up_proj.weight'" in _err(CheckpointError, load_drafter, pt)


def test_prefixed_keys_that_are_not_stripped_fail_with_closest(tmp_path, drafter):
    cfg, model = drafter
    sd = {"model." + k: v for k, v in model.state_dict().items()}  # "model." is not a prefix we strip
    write_zlab_drafter(tmp_path / "d", cfg, sd)
    msg = _err(CheckpointError, load_drafter, tmp_path / "d")
    assert "drafter needs 'fc.weight'" in msg and "Closest: 'model.fc.weight'" in msg


def test_unexpected_key_is_an_error(tmp_path, drafter):
    cfg, model = drafter
    sd = {**model.state_dict(), "layers.2.mlp.up_proj.weight": torch.zeros(48, 32)}
    write_zlab_drafter(tmp_path / "d", cfg, sd)
    msg = _err(CheckpointError, load_drafter, tmp_path / "d")
    assert "'layers.2.mlp.up_proj.weight'" in msg and "Closest:" in msg and "2 layers" in msg


def test_misshaped_key_is_an_error(tmp_path, drafter):
    cfg, model = drafter
    sd = {**model.state_dict(), "layers.0.self_attn.k_norm.weight": torch.ones(4)}
    write_zlab_drafter(tmp_path / "d", cfg, sd)
    msg = _err(CheckpointError, load_drafter, tmp_path / "d")
    assert "'layers.0.self_attn.k_norm.weight' has shape [4]" in msg and "needs [8]" in msg
    sd = {**model.state_dict(), "fc.weight": torch.zeros(32, 64)}  # 2 layers' worth, config says 3
    write_zlab_drafter(tmp_path / "e", cfg, sd)
    assert "fc_layer_ids=[1, 3, 4]" in _err(CheckpointError, load_drafter, tmp_path / "e")


def test_truncated_and_corrupt_safetensors(tmp_path, drafter):
    cfg, model = drafter
    write_zlab_drafter(tmp_path / "d", cfg, model.state_dict(), shards=2)
    shard = tmp_path / "d" / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    msg = _err(CheckpointError, load_drafter, tmp_path / "d")
    assert str(shard) in msg and "truncated or corrupt" in msg
    shard.write_bytes(b"\x00" * 64)
    assert str(shard) in _err(CheckpointError, load_drafter, tmp_path / "d")
    shard.unlink()
    assert "model-00002-of-00002.safetensors" in _err(CheckpointError, load_drafter, tmp_path / "d")


def test_index_that_points_at_the_wrong_shard(tmp_path, drafter):
    cfg, model = drafter
    write_zlab_drafter(tmp_path / "d", cfg, model.state_dict(), shards=2)
    index_path = tmp_path / "d" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["norm.weight"] = next(s for s in shards if s != index["weight_map"]["norm.weight"])
    index_path.write_text(json.dumps(index))
    msg = _err(CheckpointError, load_drafter, tmp_path / "d")
    assert "maps 'norm.weight'" in msg and "Closest:" in msg


def test_bad_files_and_configs(tmp_path, drafter):
    cfg, model = drafter
    assert "does not exist" in _err(CheckpointError, load_drafter, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert "neither model.safetensors.index.json nor model.safetensors" in _err(
        CheckpointError, load_drafter, tmp_path / "empty")
    torch.save({"model": model.state_dict()}, tmp_path / "lonely.pt")
    assert "no 'config' entry" in _err(ConfigError, load_drafter, tmp_path / "lonely.pt")
    (tmp_path / "pickled").mkdir()
    torch.save({"model": model.state_dict(), "config": cfg.to_dict(), "args": object.__new__(_Opaque)},
               tmp_path / "pickled" / "x.pt")
    assert "weights-only" in _err(CheckpointError, load_drafter, tmp_path / "pickled" / "x.pt")
    bad_cfg = {**cfg.to_dict(), "layer_types": ["sliding_attention", "ful_attention"]}
    write_zlab_drafter(tmp_path / "z", cfg, model.state_dict())
    (tmp_path / "z" / "config.json").write_text(json.dumps(bad_cfg))
    msg = _err(ConfigError, load_drafter, tmp_path / "z")
    assert str(tmp_path / "z" / "config.json") in msg and "did you mean 'full_attention'" in msg


class _Opaque:
    pass


# ---- config -------------------------------------------------------------------------------------
def test_config_parsing_and_errors():
    cfg = tiny_drafter_config()
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    base = {k: v for k, v in cfg.to_dict().items() if k not in ("fc_layer_ids",)}
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    no_ids = {**base, "dflash_config": {"mask_token_id": 95}, "num_target_layers": 6}
    assert DrafterConfig.from_dict(no_ids).target_layer_ids == [1, 3]
    v5 = {k: v for k, v in base.items() if k != "rope_theta"} | {"rope_parameters": {"rope_theta": 5e5,
                                                                                      "rope_type": "default"}}
    assert DrafterConfig.from_dict(v5).rope_theta == 5e5
    cases = [
        ({k: v for k, v in base.items() if k != "vocab_size"}, "missing field 'vocab_size'"),
        ({**base, "hidden_size": "32"}, "'hidden_size' must be int"),
        ({**base, "layer_types": ["sliding", "full_attention"]}, "unknown layer type 'sliding'"),
        ({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4}}, "rope type 'yarn' is not implemented"),
        ({**base, "num_key_value_heads": 3}, "not a multiple"),
        ({**base, "fc_layer_ids": [1, 2]}, "fc_layer_ids [1, 2] must be distinct members"),
        ({**base, "is_causal": "yes"}, "'is_causal' must be"),
        ({**base, "dflash_config": {**base["dflash_config"], "mask_token_id": 96}},
         "mask_token_id=96 is outside the vocabulary (vocab_size=96)"),
        ({**base, "sliding_window": None}, "'sliding_window' is missing"),
        ({**{k: v for k, v in base.items() if k not in ("dflash_config", "num_target_layers")}, "mask_token_id": 95},
         "missing field 'dflash_config.target_layer_ids'"),
    ]
    for d, want in cases:
        with pytest.raises(ConfigError) as ei:
            DrafterConfig.from_dict(d, source="/x/config.json")
        assert want in str(ei.value) and str(ei.value).startswith("/x/config.json: "), (want, str(ei.value))


# ---- target head --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {name: write_tiny_target(root / name, seed=0, **kw) for name, kw in {
        "qwen3": {}, "multimodal": {"multimodal": True}, "tied": {"tied": True},
        "tied_mm": {"tied": True, "multimodal": True}, "single": {"max_shard_size": "10MB"}}.items()}


def test_target_head_key_variants(targets):
    from transformers import Qwen3ForCausalLM

    ref = Qwen3ForCausalLM.from_pretrained(targets["qwen3"])
    ref_embed, ref_lm = ref.model.embed_tokens.weight.detach(), ref.lm_head.weight.detach()
    expect = {"qwen3": ("model.embed_tokens.weight", "lm_head.weight"),
              "multimodal": ("model.language_model.embed_tokens.weight", "lm_head.weight"),
              "single": ("model.embed_tokens.weight", "lm_head.weight")}
    for name, (ek, lk) in expect.items():
        head, info = load_target_head(targets[name], vocab_size=96, hidden_size=32)
        assert (info.embed_key, info.lm_head_key, info.tied) == (ek, lk, False), name
        assert torch.equal(head.embed, ref_embed) and torch.equal(head.lm_head, ref_lm), name
        assert not torch.equal(head.embed, head.lm_head)
    assert load_target_head(targets["single"], vocab_size=96, hidden_size=32)[1].source.endswith("model.safetensors")
    assert load_target_head(targets["qwen3"], vocab_size=96, hidden_size=32)[1].source.endswith("index.json")


def test_target_head_tied(targets):
    for name in ("tied", "tied_mm"):  # the flag at top level, and inside text_config
        head, info = load_target_head(targets[name], vocab_size=96, hidden_size=32, dtype=torch.bfloat16)
        assert info.tied and info.lm_head_key is None
        assert head.lm_head is head.embed and head.embed.dtype == torch.bfloat16


def test_target_head_errors(targets, tmp_path):
    import shutil

    msg = _err(CheckpointError, load_target_head, targets["qwen3"], vocab_size=100, hidden_size=32)
    assert "'model.embed_tokens.weight'" in msg and "[96, 32]" in msg and "[100, 32]" in msg
    # no lm_head and no tying -> error naming the index and the closest keys
    d = shutil.copytree(targets["tied"], tmp_path / "untied")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    msg = _err(CheckpointError, load_target_head, d, vocab_size=96, hidden_size=32)
    assert "model.safetensors.index.json has no lm_head" in msg and "Closest:" in msg
    # no embedding under any known name
    d = shutil.copytree(targets["single"], tmp_path / "noembed")
    sd = load_file(d / "model.safetensors")
    sd["model.embed.weight"] = sd.pop("model.embed_tokens.weight")
    save_file(sd, d / "model.safetensors")
    msg = _err(CheckpointError, load_target_head, d, vocab_size=96, hidden_size=32)
    assert "'model.embed_tokens.weight'" in msg and "Closest: 'model.embed.weight'" in msg
    assert "neither" in _err(CheckpointError, load_target_head, tmp_path, vocab_size=96, hidden_size=32)


# ---- drafter vs cache ---------------------------------------------------------------------------
def test_check_features():
    cfg = tiny_drafter_config(target_layer_ids=[1, 2, 3, 4, 5])
    assert check_features(cfg, [1, 2, 3, 4, 5], 32) == [0, 1, 2, 3, 4]
    assert check_features(cfg, [0, 1, 2, 3, 4, 5], 32) == [1, 2, 3, 4, 5]  # a superset serves it
    msg = _err(FeatureMismatchError, check_features, cfg, [1, 2, 3, 4], 32)
    assert msg == ("drafter fc expects 160 input features (5 layers x 32: [1, 2, 3, 4, 5]); the cache holds 128 "
                   "(4 layers x 32: [1, 2, 3, 4]), without layers [5]. Re-extract with --layers 1,2,3,4,5, or "
                   "evaluate a 4-layer drafter.")
    assert "hidden sizes differ" in _err(FeatureMismatchError, check_features, cfg, [1, 2, 3, 4, 5], 64)


# test-only (was eval/checkpoint.py's; nothing in the payload calls it)
def select_features(feats: torch.Tensor, indices: list[int], hidden_size: int) -> torch.Tensor:
    """feats [T, n_cache*H] -> [T, len(indices)*H] in `indices` order; a view when they are consecutive."""
    n = len(indices)
    if indices == list(range(indices[0], indices[0] + n)):
        return feats[:, indices[0] * hidden_size:(indices[0] + n) * hidden_size]
    T = feats.shape[0]
    idx = torch.tensor(indices, device=feats.device)
    return feats.view(T, -1, hidden_size).index_select(1, idx).reshape(T, n * hidden_size)


def test_select_features():
    feats = torch.arange(2 * 4 * 3).float().view(2, 12)  # T=2, 4 cached layers of H=3
    view = select_features(feats, [1, 2], 3)
    assert view.data_ptr() == feats[:, 3:].data_ptr() and view.tolist() == feats[:, 3:9].tolist()
    picked = select_features(feats, [3, 0], 3)
    assert picked.tolist() == torch.cat([feats[:, 9:12], feats[:, 0:3]], dim=1).tolist()


def test_parse_step():
    assert parse_step("/r/step-4000/model.pt") == 4000
    assert parse_step("/r/x/drafter_step4000.pt") == 4000
    assert parse_step("/r/checkpoint-12") == 12
    assert parse_step("/r/final.pt") is None
    assert parse_step("/r/step-5/model.pt", field_value=7) == 7
