"""Checkpoint layouts that serving engines load (vLLM's DFlash loader): each field honoured exactly, or refused.

The attention-layout rules are checked against a table of vLLM's cases; every honoured field is checked equal
to an independent formulation on the trained fixtures (an equivalent checkpoint in a layout reval already
verifies), with per-prompt acceptance lengths compared exactly; every refused field is one line, exit 3.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from remote_payload.__main__ import main as payload_main
from remote_payload.contract.contenthash import content_hash
from remote_payload.contract.drafterconfig import TRANSFORMERS_DEFAULTS, DrafterConfig
from remote_payload.contract.errors import CheckpointError, ConfigError
from remote_payload.eval.checkpoint import load_drafter
from tests.tiny_models import random_drafter, random_head, tiny_drafter_config

BASE = tiny_drafter_config().to_dict()  # 2 layers: sliding (window 5) + full, mask 95, vocab 96


def _cfg(**top) -> dict:
    d = {k: v for k, v in BASE.items() if k not in ("layer_types", "sliding_window")}
    dflash = dict(d["dflash_config"])
    dflash.update(top.pop("dflash", {}))
    d["dflash_config"] = dflash
    d.update(top)
    return d


def _layout(d: dict, allow=()) -> list[tuple]:
    cfg = DrafterConfig.from_dict(d, source="/x/config.json", allow_unknown=allow)
    return [(cfg.layer_type(i)[:4], cfg.layer_window(i), cfg.layer_is_causal(i)) for i in range(2)]


S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("name, d, want", [
    ("neither: full, bidirectional", _cfg(), [("full", None, False)] * 2),
    ("use_swa, no layer_types: MiMo (all sliding, non-causal)",
     _cfg(dflash={"use_swa": True, "swa_window_size": 4}), [("slid", 4, False)] * 2),
    ("dflash causal true overrides every layer", _cfg(dflash={"causal": True}), [("full", None, True)] * 2),
    ("dflash causal false on a mixed list: the sliding layer is bidirectional",
     _cfg(layer_types=[S, F], sliding_window=5, dflash={"causal": False}), [("slid", 5, False), ("full", None, False)]),
    ("mixed list: causal iff sliding (Gemma-4 style)",
     _cfg(layer_types=[S, F], sliding_window=5), [("slid", 5, True), ("full", None, False)]),
    ("swa_window_size wins over sliding_window",
     _cfg(layer_types=[S, S], sliding_window=8, dflash={"swa_window_size": 4}), [("slid", 4, True)] * 2),
    ("use_swa forces sliding on an all-full list (causal from the list: none)",
     _cfg(layer_types=[F, F], sliding_window=6, dflash={"use_swa": True}), [("slid", 6, False)] * 2),
    ("use_swa beside a list that has sliding layers: the list decides",
     _cfg(layer_types=[F, S], sliding_window=6, dflash={"use_swa": True}), [("full", None, False), ("slid", 6, True)]),
    ("top-level is_causal wins over dflash causal (z-lab rule, as vLLM)",
     _cfg(layer_types=[S, F], sliding_window=5, is_causal=False, dflash={"causal": True}),
     [("slid", 5, False), ("full", None, False)]),
    ("use_swa false is the default", _cfg(dflash={"use_swa": False, "swa_window_size": 4}),
     [("full", None, False)] * 2),
])
def test_attention_layout_follows_vllms_rules(name, d, want):
    assert _layout(d) == want, name
    again = DrafterConfig.from_dict(DrafterConfig.from_dict(d).to_dict())
    assert [(again.layer_type(i)[:4], again.layer_window(i), again.layer_is_causal(i)) for i in range(2)] == want


@pytest.mark.parametrize("d, want", [
    (_cfg(dflash={"use_swa": True}), "dflash_config.use_swa is true but no window is given"),
    (_cfg(layer_types=[S, F]), "layer_types has sliding layers but no window is given"),
    (_cfg(dflash={"use_swa": "yes"}), "'dflash_config.use_swa' must be true, false or absent"),
    (_cfg(dflash={"causal": 1}), "'dflash_config.causal' must be true, false or absent"),
    (_cfg(dflash={"use_swa": True, "swa_window_size": 0}), "dflash_config.swa_window_size=0 must be a positive"),
])
def test_a_layout_that_cannot_be_resolved_is_one_line(d, want):
    with pytest.raises(ConfigError) as ei:
        DrafterConfig.from_dict(d, source="/x/config.json")
    msg = str(ei.value)
    assert msg.startswith("/x/config.json: ") and "\n" not in msg
    assert want in msg, msg


@pytest.mark.parametrize("top, dflash, named", [
    ({"add_swa_attention_sink_bias": True}, {}, "add_swa_attention_sink_bias=True"),
    ({}, {"attention_sink_bias": True}, "dflash_config.attention_sink_bias=True"),
    ({"draft_vocab_size": 32}, {}, "draft_vocab_size=32 != vocab_size=96"),
    ({"logit_scale": 2.0}, {}, "logit_scale=2.0"),
    ({"target_hidden_size": 64}, {}, "target_hidden_size=64 != hidden_size=32"),
    ({"use_aux_hidden_state": False}, {}, "use_aux_hidden_state=False"),
    ({}, {"use_aux_hidden_state": False}, "dflash_config.use_aux_hidden_state=False"),
    ({"projector_type": "domino"}, {}, "projector_type='domino'"),
    ({}, {"projector_type": "domino"}, "dflash_config.projector_type='domino'"),
    ({"is_neox_style": False}, {}, "is_neox_style=False"),
    ({"hidden_act": "gelu"}, {}, "hidden_act='gelu'"),
    ({"attention_bias": True}, {}, "attention_bias=True"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, {}, "partial_rotary_factor=0.5"),
    ({"final_logit_softcapping": 30.0}, {}, "final_logit_softcapping=30.0"),
])
def test_fields_reval_does_not_implement_are_refused_by_name(top, dflash, named):
    with pytest.raises(ConfigError) as ei:
        DrafterConfig.from_dict(_cfg(**top, dflash=dflash), source="/x/config.json")
    msg = str(ei.value)
    assert named in msg and "\n" not in msg and ("refusing" in msg or "not implemented" in msg), msg


TO_DICT_457 = Path(__file__).parent / "data" / "transformers-4.57.1-to_dict-config.json"  # Qwen3Config(...).to_dict()


def _other(v):
    """A value that is not transformers' default `v`."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 3
    return "something else" if v is None or isinstance(v, str) else None


def test_a_config_written_by_transformers_to_dict_is_honoured_at_the_base_class_defaults():
    """transformers' to_dict() writes every PretrainedConfig attribute (4.57: 56, 36 of them beyond the bookkeeping
    keys: is_decoder, temperature, top_k, ...): accepted at the base class's defaults, with nothing to allow;
    each one at another value is refused naming it. The written file is 4.57.1's; the installed transformers
    (whatever its version) gives the live one: a real subclass's to_dict() plus the generation parameters it
    knows (5.x pops them from a config on load, 4.x writes them)."""
    transformers = pytest.importorskip("transformers")
    from transformers import GenerationConfig, Qwen3Config
    recorded = json.loads(TO_DICT_457.read_text())
    live = Qwen3Config(**{k: recorded[k] for k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "num_hidden_layers", "vocab_size", "max_position_embeddings", "rms_norm_eps", "architectures",
        "tie_word_embeddings", "block_size", "num_target_layers", "dflash_config")}, rope_theta=10000.0).to_dict()
    gen = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    live = {**gen, **live}
    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    assert set(base().to_dict()) <= set(live)  # every base-class attribute is in the live config
    for d in (recorded, live):
        cfg = DrafterConfig.from_dict(d, source="/x/config.json")
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.mask_token_id, cfg.target_layer_ids) == (32, 2, 95,
                                                                                                     [1, 3, 4])
        assert cfg.allowed_unknown == [] and DrafterConfig.from_dict(cfg.to_dict()) == cfg
    generic = sorted((set(recorded) | set(gen)) & set(TRANSFORMERS_DEFAULTS))
    assert len(set(recorded) & set(TRANSFORMERS_DEFAULTS)) == 36 and {"is_decoder", "temperature"} <= set(generic)
    for key in generic:
        d = {**live, **recorded}
        d[key] = _other(d[key])
        with pytest.raises(ConfigError) as ei:
            DrafterConfig.from_dict(d, source="/x/config.json")
        msg = str(ei.value)
        assert f"key {key!r}={d[key]!r}" in msg and f"--allow-unknown-config {key}" in msg and "\n" not in msg, msg
        assert DrafterConfig.from_dict(d, allow_unknown=[key]).allowed_unknown == [key]
    d = {**recorded, "temperature": 1, "top_k": 50.0}  # the same numbers in another JSON spelling
    assert DrafterConfig.from_dict(d).allowed_unknown == []


def test_neutral_values_of_those_fields_are_the_model_reval_evaluates():
    neutral = _cfg(hidden_act="silu", attention_bias=False, is_neox_style=True, logit_scale=1.0, draft_vocab_size=96,
                   target_hidden_size=32, use_aux_hidden_state=True, add_swa_attention_sink_bias=False,
                   final_logit_softcapping=None, dflash={"attention_sink_bias": False, "use_aux_hidden_state": True})
    a, b = DrafterConfig.from_dict(neutral), DrafterConfig.from_dict(_cfg())
    assert dataclasses.replace(a, extra={}) == dataclasses.replace(b, extra={})  # only the kept text differs


def test_an_unknown_key_is_refused_unless_allowed_by_name():
    for d, key in ((_cfg(frobnicate=3), "frobnicate"), (_cfg(dflash={"draft_temperature": 0.5}),
                                                        "dflash_config.draft_temperature")):
        with pytest.raises(ConfigError) as ei:
            DrafterConfig.from_dict(d, source="/x/config.json")
        msg = str(ei.value)
        assert f"unknown key {key!r}" in msg and f"--allow-unknown-config {key}" in msg and "\n" not in msg
        cfg = DrafterConfig.from_dict(d, allow_unknown=[key])
        assert cfg.allowed_unknown == [key]
        assert DrafterConfig.from_dict(cfg.to_dict(), allow_unknown=[key]) == cfg  # kept for to_dict
    # bookkeeping keys need no permission
    hf = _cfg(architectures=["DFlashDraftModel"], torch_dtype="bfloat16", transformers_version="4.57.0",
              auto_map={"AutoModel": "x.DFlash"}, use_cache=True, model_type="qwen3", use_sliding_window=False,
              max_window_layers=28, attention_dropout=0.0, tie_word_embeddings=False, dflash={"t2d": None})
    assert DrafterConfig.from_dict(hf).allowed_unknown == []


# ---- on the trained fixtures: honoured fields equal an independent formulation --------------------------------
def _variant(fx, tmp_path: Path, name: str, edit=None, weights=None) -> Path:
    """A copy of the good drafter with its config.json edited (edit(dict) -> dict) and/or weights renamed."""
    d = tmp_path / name
    shutil.copytree(fx["drafter_good"], d)
    if edit is not None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(edit(cfg)))
    if weights is not None:
        sd = load_file(d / "model.safetensors")
        save_file(weights(sd), d / "model.safetensors")
    return d


def _eval(tmp_path, drafter, fx, *extra, name, target=None) -> tuple[int, dict | None]:
    run_dir = tmp_path / "runs" / name
    rc = payload_main(["eval", "--drafter", str(drafter), "--target", str(target or fx["target"]), "--cache",
                       str(fx["cache"]), "--run-dir", str(run_dir), "--name", name, "--device", "cpu",
                       "--num-prompts", "4", "--max-blocks", "8", *extra])
    res = run_dir / "results.json"
    return rc, json.loads(res.read_text()) if res.exists() else None


def _acceptance(res: dict) -> list[list[int]]:
    return [p["acceptance_lengths"] for p in res["per_prompt"]]


def test_use_swa_equals_an_all_sliding_non_causal_list_and_the_window_bites(fx, tmp_path, capsys):
    """MiMo's layout (use_swa + swa_window_size, no layer_types) == layer_types all sliding + sliding_window 4 +
    is_causal false, per prompt and round; and the fixtures' contexts (120+ tokens) exceed the window by more
    than a block, so it is not full attention (the old reval evaluated full attention here)."""
    def mimo(c):
        c.pop("layer_types", None)
        c["dflash_config"].update(use_swa=True, swa_window_size=4)
        return c

    def zlab(c):
        return {**c, "layer_types": ["sliding_attention"], "sliding_window": 4, "is_causal": False}

    rc_m, mimo_res = _eval(tmp_path, _variant(fx, tmp_path, "mimo", mimo), fx, name="mimo")
    rc_z, zlab_res = _eval(tmp_path, _variant(fx, tmp_path, "zlab", zlab), fx, name="zlab")
    rc_f, full_res = _eval(tmp_path, fx["drafter_good"], fx, name="full")
    assert rc_m == rc_z == rc_f == 0
    assert _acceptance(mimo_res) == _acceptance(zlab_res)
    assert _acceptance(mimo_res) != _acceptance(full_res)
    assert mimo_res["drafter"]["attention"] == [{"layer": 0, "type": "sliding_attention", "window": 4,
                                                  "causal_in_block": False}]
    assert mimo_res["comparability"]["attention"] == "sliding_attention/4/bidirectional"
    out = capsys.readouterr().out
    assert "attention (type/window/causal inside the block): sliding_attention/4/bidirectional" in out


def test_sliding_window_longer_context_fast_path_equals_the_naive_reference():
    """Window 4 over a 60-token context (more than window + block): the batched path == the naive block."""
    cfg = DrafterConfig.from_dict(_cfg(dflash={"use_swa": True, "swa_window_size": 4}))
    model, head = random_drafter(cfg, seed=11), random_head(cfg)
    feats = torch.randn(60, cfg.fc_in_features, generator=torch.Generator().manual_seed(12))
    anchors, bonus = torch.tensor([30, 45, 60]), torch.tensor([5, 6, 7])
    with torch.no_grad():
        fast = model.draft_hidden(model.precompute_context(feats), anchors, bonus, head)
        fast = torch.nn.functional.linear(fast[:, 1:], head.lm_head)
        for j, a in enumerate(anchors.tolist()):
            naive = model.naive_block(feats, int(bonus[j]), a, head)
            torch.testing.assert_close(fast[j], naive, atol=1e-4, rtol=1e-4)


def _write_target_with_row(fx, tmp_path: Path, row: int, vec: torch.Tensor) -> Path:
    """A copy of the fixture target whose embedding row `row` is `vec` (the shard that holds it rewritten)."""
    t = tmp_path / "target-row"
    shutil.copytree(fx["target"], t)
    index = json.loads((t / "model.safetensors.index.json").read_text())["weight_map"]
    key = next(k for k in index if k.endswith("embed_tokens.weight"))
    shard = t / index[key]
    sd = load_file(shard)
    sd[key] = sd[key].clone()
    sd[key][row] = vec.to(sd[key].dtype)
    save_file(sd, shard, metadata={"format": "pt"})
    return t


@pytest.mark.parametrize("form", ["tensor", "dict"])
def test_mask_embedding_equals_a_target_whose_mask_row_is_that_vector(fx, tmp_path, form):
    cfg = json.loads((fx["drafter_good"] / "config.json").read_text())
    mask_id, H = cfg["dflash_config"]["mask_token_id"], cfg["hidden_size"]
    vec = torch.randn(H, generator=torch.Generator().manual_seed(5))
    d = _variant(fx, tmp_path, "with-mask")
    torch.save(vec if form == "tensor" else {"mask_token_id": mask_id, "embedding": vec}, d / "mask_embedding.pt")
    rc, with_file = _eval(tmp_path, d, fx, name="maskfile")
    rc2, with_row = _eval(tmp_path, fx["drafter_good"], fx, name="maskrow",
                          target=_write_target_with_row(fx, tmp_path, mask_id, vec))
    rc3, plain = _eval(tmp_path, fx["drafter_good"], fx, name="plain")
    assert rc == rc2 == rc3 == 0
    assert _acceptance(with_file) == _acceptance(with_row)
    assert with_file["metrics"]["ddtree_tau"] == with_row["metrics"]["ddtree_tau"]
    assert _acceptance(with_file) != _acceptance(plain)  # it is not ignored
    assert with_file["drafter"]["mask_embedding"] == str(d / "mask_embedding.pt")
    assert content_hash(d) != content_hash(fx["drafter_good"])  # the file is part of what the ledger names


def test_mask_embedding_for_another_id_or_shape_is_refused(fx, tmp_path, capsys):
    cfg = json.loads((fx["drafter_good"] / "config.json").read_text())
    mask_id, H = cfg["dflash_config"]["mask_token_id"], cfg["hidden_size"]
    for name, obj, want in (("id", {"mask_token_id": mask_id + 1, "embedding": torch.zeros(H)},
                             f"is for mask_token_id {mask_id + 1} but the drafter's config says {mask_id}"),
                            ("shape", torch.zeros(H + 1), f"the mask embedding must be {H} floats")):
        d = _variant(fx, tmp_path, f"bad-{name}")
        torch.save(obj, d / "mask_embedding.pt")
        rc, res = _eval(tmp_path, d, fx, name=f"bad-{name}")
        err = capsys.readouterr().err
        assert rc == 3 and res is None and want in err, err
        with pytest.raises(CheckpointError):
            load_drafter(d)


@pytest.mark.parametrize("what", ["fifo", "too-large"])
def test_mask_embedding_that_is_not_a_small_regular_file_is_one_line(fx, tmp_path, what):
    """A FIFO (preflight passed it and torch.load waited for a writer for ever) or an oversized file at
    mask_embedding.pt: eval and preflight exit 3 in one line, read through the regular-file check; the content
    hash covers the file (a FIFO is refused there too, not left out of the hash)."""
    d = _variant(fx, tmp_path, what)
    if what == "fifo":
        os.mkfifo(d / "mask_embedding.pt")
    else:
        torch.save(torch.zeros(1 << 16), d / "mask_embedding.pt")  # 256 KiB of floats for a 64-wide drafter
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    run = tmp_path / "runs" / what
    args = {"eval": ["--cache", str(fx["cache"]), "--run-dir", str(run), "--device", "cpu", "--num-prompts", "1"],
            "preflight": ["--cache", str(fx["cache"])]}
    for command, extra in args.items():
        if command == "preflight" and what != "fifo":
            continue  # preflight reads no weights (only names them); the eval refuses the size
        p = subprocess.run([sys.executable, "-m", "remote_payload", command, "--drafter", str(d), "--target",
                            str(fx["target"]), *extra], env=env, capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL, check=False)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 3 and len(lines) == 1 and "mask_embedding.pt" in lines[0], (command, p.stderr)
        assert ("not a regular file" if what == "fifo" else "larger than 64 KiB") in lines[0], lines
    assert not (run / "results.json").exists()
    if what == "fifo":
        with pytest.raises(OSError, match="not a regular file"):
            content_hash(d)
    else:
        assert content_hash(d) != content_hash(fx["drafter_good"])


def test_midlayer_weight_names_load_as_layer_0(fx, tmp_path):
    """vLLM's `midlayer.` names (one-layer EAGLE-style heads) are the same tensors as `layers.0.`."""
    d = _variant(fx, tmp_path, "midlayer",
                 weights=lambda sd: {k.replace("layers.0.", "midlayer."): v for k, v in sd.items()})
    assert any(k.startswith("midlayer.") for k in load_file(d / "model.safetensors"))
    rc, mid = _eval(tmp_path, d, fx, name="mid")
    rc2, base = _eval(tmp_path, fx["drafter_good"], fx, name="base")
    assert rc == rc2 == 0 and _acceptance(mid) == _acceptance(base)
    assert mid["drafter"]["renamed_weights"] == ["midlayer. -> layers.0."]
    both = _variant(fx, tmp_path, "both", weights=lambda sd: {
        **sd, **{k.replace("layers.0.", "midlayer."): v.clone() for k, v in sd.items() if k.startswith("layers.0.")}})
    with pytest.raises(CheckpointError, match="two tensors for the drafter's"):
        load_drafter(both)


def test_refused_and_allowed_keys_end_to_end(fx, tmp_path, capsys):
    """eval and preflight exit 3 naming the key; --allow-unknown-config KEY runs and records it."""
    d = _variant(fx, tmp_path, "unknown", lambda c: {**c, "frobnicate": 3})
    rc, res = _eval(tmp_path, d, fx, name="unknown")
    err = capsys.readouterr().err
    assert rc == 3 and res is None and "unknown key 'frobnicate'" in err and err.count("\n") == 1
    assert payload_main(["preflight", "--drafter", str(d), "--target", str(fx["target"]),
                         "--cache", str(fx["cache"])]) == 3
    assert "--allow-unknown-config frobnicate" in capsys.readouterr().err
    assert payload_main(["preflight", "--drafter", str(d), "--target", str(fx["target"]), "--cache",
                         str(fx["cache"]), "--allow-unknown-config", "frobnicate"]) == 0
    rc, res = _eval(tmp_path, d, fx, "--allow-unknown-config", "frobnicate", name="allowed")
    assert rc == 0 and res["drafter"]["allowed_unknown_config"] == {"frobnicate": "3"}
    sink = _variant(fx, tmp_path, "sink", lambda c: {**c, "dflash_config": {**c["dflash_config"],
                                                                              "attention_sink_bias": True}})
    rc, res = _eval(tmp_path, sink, fx, "--allow-unknown-config", "dflash_config.attention_sink_bias", name="sink")
    assert rc == 3 and res is None  # a field reval knows it does not implement cannot be allowed away
    assert "dflash_config.attention_sink_bias=True" in capsys.readouterr().err


@pytest.mark.parametrize("top, dflash, won, lost, winner", [
    ({"mask_token_id": 7}, {}, "dflash_config.mask_token_id=95", "mask_token_id=7", "dflash_config.mask_token_id"),
    ({"target_layer_ids": [1, 3]}, {}, "dflash_config.target_layer_ids=[1, 3, 4]", "target_layer_ids=[1, 3]",
     "dflash_config.target_layer_ids"),
    ({"block_size": 16}, {"block_size": 8}, "block_size=16", "dflash_config.block_size=8", "block_size"),
    ({"rope_parameters": {"rope_theta": 5e5}}, {}, "rope_theta=10000.0", "rope_parameters.rope_theta=500000.0",
     "rope_theta"),
    ({"is_causal": False}, {"causal": True}, "is_causal=False", "dflash_config.causal=True", "is_causal"),
    ({"layer_types": [S, F], "sliding_window": 5}, {"swa_window_size": 4}, "dflash_config.swa_window_size=4",
     "sliding_window=5", "dflash_config.swa_window_size"),
    ({"layer_types": [F, F], "sliding_window": 5}, {"use_swa": True}, "dflash_config.use_swa=True",
     f"layer_types={[F, F]}", "dflash_config.use_swa (every layer slides)"),
    ({"layer_types": [S, F], "sliding_window": 5}, {"use_swa": True}, "dflash_config.use_swa=True",
     f"layer_types={[S, F]}", "layer_types"),
])
def test_fields_that_disagree_are_named_with_the_winner(top, dflash, won, lost, winner):
    cfg = DrafterConfig.from_dict(_cfg(**top, dflash=dflash))
    assert cfg.conflicts == [f"{won} and {lost} differ: {winner} wins"]
    assert DrafterConfig.from_dict(_cfg()).conflicts == []
    same = DrafterConfig.from_dict(_cfg(mask_token_id=95, block_size=16, dflash={"block_size": 16}, rope_theta=1e4,
                                        rope_parameters={"rope_theta": 10000}))
    assert same.conflicts == []  # equal values (10000 == 10000.0) are no conflict


def test_a_conflict_is_a_warning_line_and_a_note_and_the_winner_is_evaluated(fx, tmp_path, capsys):
    """block_size at the top level and another in dflash_config: the top level wins (as documented), the eval
    says so in its log and results.json's notes, and its numbers are the plain drafter's."""
    d = _variant(fx, tmp_path, "conflict", lambda c: {**c, "block_size": 16,
                                                      "dflash_config": {**c["dflash_config"], "block_size": 8}})
    rc, res = _eval(tmp_path, d, fx, name="conflict")
    out = capsys.readouterr().out
    rc2, plain = _eval(tmp_path, fx["drafter_good"], fx, name="plain")
    said = "block_size=16 and dflash_config.block_size=8 differ: block_size wins"
    assert rc == rc2 == 0 and f"warning: drafter config: {said}" in out
    assert res["notes"] == [f"drafter config: {said}"] and plain["notes"] is None
    assert _acceptance(res) == _acceptance(plain) and res["options"]["block_size"] == 16


def test_reval_run_refuses_an_unknown_key_before_launch_and_passes_the_allowance(fx, here, capsys, tmp_path):
    """The controller's preflight refuses the key (exit 3, nothing created); `reval run --allow-unknown-config
    KEY` hands the allowance to the preflight and the eval, and the pulled results.json records it."""
    from tests.runtools import reval
    d = _variant(fx, tmp_path, "unknown-run", lambda c: {**c, "frobnicate": [1, 2]})
    argv = ["run", "local", "--drafter", str(d), "--target", str(fx["target"]), "--cache", str(fx["cache"]),
            "--num-prompts", "2", "--max-blocks", "4", "--name", "uk"]
    rc, _, err = reval(capsys, *argv)
    assert rc == 3 and "unknown key 'frobnicate'" in err and "--allow-unknown-config frobnicate" in err
    assert not (here / "runs" / "local" / "uk").exists() and not list((here / ".reval").rglob("runs/uk"))
    rc, _, err = reval(capsys, *argv, "--allow-unknown-config", "frobnicate")
    assert rc == 0, err
    res = json.loads((here / "runs" / "local" / "uk" / "results.json").read_text())
    assert res["drafter"]["allowed_unknown_config"] == {"frobnicate": "[1, 2]"}
