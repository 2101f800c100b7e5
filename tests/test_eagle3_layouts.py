"""EAGLE-3 checkpoint layouts beyond SafeAILab's: SpecForge (flat config with fc_norm / norm_output, embed_tokens
shipped) and vllm-project/speculators (nested transformer_layer_config, `layers.0.*`), each built from the tiny trained
fixture head as that project saves it, evaluate to the SafeAILab layout's tau; the math variants (fc_norm,
norm_before_fc, norm_before_residual, SGLang's bias, either norm_output) equal a plain reference forward."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from remote_payload.contract.eagle3config import Eagle3Config, looks_like_eagle3
from remote_payload.contract.errors import ConfigError
from remote_payload.eagle3.loader import is_eagle3, load_eagle3

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 64,
         "intermediate_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
         "vocab_size": 80, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": False}


def speculators_config(flat: dict, **top) -> dict:
    """A speculators eagle3 config.json for the head a flat (SafeAILab) config describes."""
    layer = {k: v for k, v in flat.items() if k not in ("draft_vocab_size", "target_hidden_size", "architectures")}
    layer.update(architectures=["LlamaForCausalLM"], model_type="llama")
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "speculators_version": "0.3.0",
            "transformer_layer_config": layer, "draft_vocab_size": flat["draft_vocab_size"],
            "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": None, "embed_requires_grad": False,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                   "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}},
            **top}


@pytest.fixture(scope="module")
def e3():
    from remote_payload.tools import eagle3_fixtures
    root = ROOT / ".cache" / "eagle3-fixtures"
    return root, eagle3_fixtures.build(root, log=lambda line: None)


def _write(tmp: Path, name: str, cfg: dict, sd: dict) -> Path:
    from safetensors.torch import save_file
    out = tmp / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return out


def _embed(root: Path) -> torch.Tensor:
    from safetensors import safe_open
    with safe_open(str(root / "target" / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def _tau(e3, path: Path) -> float:
    from remote_payload.tools.eagle3_fixtures import chain_quality
    root, meta = e3
    head, _ = load_eagle3(path, embed=_embed(root))
    return chain_quality(head, root / "cache", meta["taps"], 5)["tau"]


def test_specforge_and_speculators_checkpoints_evaluate_as_the_safeailab_head(e3, tmp_path):
    from safetensors.torch import load_file
    root, meta = e3
    flat = json.loads((root / "eagle3" / "config.json").read_text())
    sd = load_file(str(root / "eagle3" / "model.safetensors"))
    embed = _embed(root)
    # SpecForge: the SafeAILab keys plus its own embed_tokens; fc_norm / norm_output in the config (3.0 values)
    sf = _write(tmp_path, "specforge", {**flat, "fc_norm": False, "norm_output": True},
                {**sd, "embed_tokens.weight": embed})
    # speculators: the nested config, `layers.0.*`, d2t/t2d buffers, embed_tokens saved
    sp = _write(tmp_path, "speculators", speculators_config(flat),
                {**{k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}, "embed_tokens.weight": embed})
    assert is_eagle3(sf) and is_eagle3(sp)
    base = meta["quality"]["chain_5"]["tau"]
    for path, layout in ((sf, "specforge"), (sp, "speculators")):
        _head, info = load_eagle3(path)
        assert (info.layout, info.embed_source) == (layout, "checkpoint")
        assert _tau(e3, path) == pytest.approx(base, abs=1e-6), layout


# ---- the variants' math against a plain reference ----------------------------------------------------------------
def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):  # x [T, h, d], rotate-half RoPE as Llama
    d = x.shape[-1]
    ang = pos[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)
    cos, sin = (torch.cat([ang, ang], -1).cos().float()[:, None], torch.cat([ang, ang], -1).sin().float()[:, None])
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def _reference_two_steps(sd: dict, cfg: dict, feats, toks, embed, variant: dict):
    """Step 0 over the prefix (last slot) and one chain step fed the drafted token, written from the spec and the
    projects' forward code: -> (logits step 0, logits step 1)."""
    H, nh, nkv = 64, 4, 2
    d = H // nh
    a = feats
    if variant.get("norm_before_fc"):
        a = _rms(a, sd["input_norm.weight"])
    if variant.get("fc_norm"):
        a = torch.cat([_rms(c, sd[f"fc_norm.{i}.weight"]) for i, c in enumerate(a.chunk(3, -1))], -1)
    u = a @ sd["fc.weight"].T + (sd["fc.bias"] if variant.get("bias") else 0)
    W = {k[len("midlayer."):]: v for k, v in sd.items() if k.startswith("midlayer.")}

    def layer(hid, tok_emb, pos, past):
        z = torch.cat([_rms(tok_emb, W["input_layernorm.weight"]), _rms(hid, W["hidden_norm.weight"])], -1)
        q = _rope((z @ W["self_attn.q_proj.weight"].T).unflatten(-1, (nh, d)), pos)
        k = _rope((z @ W["self_attn.k_proj.weight"].T).unflatten(-1, (nkv, d)), pos)
        v = (z @ W["self_attn.v_proj.weight"].T).unflatten(-1, (nkv, d))
        K, V = torch.cat([past[0], k]) if past else k, torch.cat([past[1], v]) if past else v
        Kr, Vr = K.repeat_interleave(nh // nkv, 1), V.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, Kr) / math.sqrt(d)
        n, m = q.shape[0], K.shape[0]
        s = s.masked_fill(torch.ones(n, m).tril(m - n) == 0, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), Vr).flatten(1) @ W["self_attn.o_proj.weight"].T
        res = _rms(hid, W["hidden_norm.weight"]) if variant.get("norm_before_residual") else hid
        m1 = res + o
        x = _rms(m1, W["post_attention_layernorm.weight"])
        g = m1 + (torch.nn.functional.silu(x @ W["mlp.gate_proj.weight"].T) * (x @ W["mlp.up_proj.weight"].T)) @ \
            W["mlp.down_proj.weight"].T
        return g, (K, V)

    def head_out(g):  # -> (logits, the hidden fed back)
        if variant.get("speculators_norm_output"):
            g = _rms(g, sd["norm.weight"])
            return g @ sd["lm_head.weight"].T, g
        if variant.get("specforge_norm_output") is False:
            return g @ sd["lm_head.weight"].T, g
        return _rms(g, sd["norm.weight"]) @ sd["lm_head.weight"].T, g

    p = feats.shape[0]
    g, kv = layer(u, embed[toks[1:p + 1]], torch.arange(p), None)
    l0, h = head_out(g[-1:])
    d1 = int(l0.argmax()) + int(sd["d2t"][int(l0.argmax())])
    g1, _ = layer(h, embed[torch.tensor([d1])], torch.tensor([p]), kv)
    return l0, head_out(g1)[0]


@pytest.mark.parametrize("variant", [
    {"fc_norm": True, "norm_before_residual": True},
    {"norm_before_fc": True, "bias": True},
    {"speculators_norm_output": True, "fc_norm": True},
    {"specforge_norm_output": False, "fc_norm": True},
], ids=["fc_norm+residual", "norm_before_fc+bias", "speculators-norm_output", "specforge-norm_output-false"])
@torch.no_grad()
def test_layout_variants_equal_a_plain_reference_forward(e3, tmp_path, variant):
    from safetensors.torch import load_file

    from remote_payload.eagle3.walk import ttt_steps
    from remote_payload.eval.cache import open_cache
    root, meta = e3
    flat = json.loads((root / "eagle3" / "config.json").read_text())
    sd = load_file(str(root / "eagle3" / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    extra = {}
    if variant.get("fc_norm"):
        extra.update({f"fc_norm.{i}.weight": 1 + 0.3 * torch.randn(64, generator=g) for i in range(3)})
    if variant.get("norm_before_fc"):
        extra["input_norm.weight"] = 1 + 0.3 * torch.randn(192, generator=g)
    if variant.get("bias"):
        extra["fc.bias"] = 0.1 * torch.randn(64, generator=g)
    sd = {**sd, **extra}
    flags = {k: True for k in ("fc_norm", "norm_before_fc", "norm_before_residual", "bias") if variant.get(k)}
    if "speculators_norm_output" in variant:
        cfg = speculators_config(flat, norm_output=True, **flags)
        sd = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    else:
        cfg = {**flat, **flags, **({"norm_output": False, "fc_norm": bool(flags.get("fc_norm"))}
                                    if "specforge_norm_output" in variant else {})}
    path = _write(tmp_path, "head", cfg, sd)
    embed = _embed(root)
    head, _ = load_eagle3(path, embed=embed)
    ids, feats = open_cache(root / "cache").load(0, layer_ids=[k - 1 for k in meta["taps"]])
    anchors = torch.arange(8, len(ids) - 2)
    steps = {s: lg for _, s, lg in ttt_steps(head, feats, ids, anchors - 1, 2)}
    # step 1 of the TTT pass is fed the cached token, the reference the drafted one: an anchor where they agree
    agree = (head.to_target(steps[0].argmax(-1)) == ids[anchors + 1]).nonzero()[:, 0]
    assert agree.numel() > 0
    j = int(agree[len(agree) // 2])
    a = int(anchors[j])
    saved = {k.replace("layers.0.", "midlayer."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    ref0, ref1 = _reference_two_steps(saved, cfg, feats[:a], ids, embed, variant)
    assert torch.allclose(steps[0][j], ref0[0], atol=1e-4)
    assert torch.allclose(steps[1][j], ref1[0], atol=1e-4)
    base, _ = load_eagle3(root / "eagle3", embed=embed)
    plain = {s: lg for _, s, lg in ttt_steps(base, feats, ids, anchors - 1, 1)}
    assert not torch.allclose(plain[0], steps[0], atol=1e-3)  # the variant changes the numbers


# ---- config: what each layout says -------------------------------------------------------------------------------
def test_layouts_are_told_apart_and_norm_output_read_by_whose_it_is():
    base = {**LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 40}
    assert Eagle3Config.from_dict(base).layout == "eagle"
    sf = Eagle3Config.from_dict({**base, "fc_norm": True, "norm_output": False})
    assert (sf.layout, sf.fc_norm, sf.lm_head_norm, sf.feed_normed) == ("specforge", True, False, False)
    assert Eagle3Config.from_dict(sf.to_dict()) == sf
    sp = Eagle3Config.from_dict(speculators_config(base, norm_output=True, norm_before_residual=True,
                                                   eagle_aux_hidden_state_layer_ids=[1, 15, 28]))
    assert (sp.layout, sp.lm_head_norm, sp.feed_normed, sp.norm_before_residual) == ("speculators", True, True, True)
    assert sp.tap_ids(32) == [1, 15, 28] and looks_like_eagle3(speculators_config(base))
    with pytest.raises(ConfigError, match="norm_output=True is refused.*does not say whose"):
        Eagle3Config.from_dict({**base, "norm_output": True})  # a flat config without fc_norm: SafeAILab's has none
    with pytest.raises(ConfigError, match="both true"):
        Eagle3Config.from_dict({**base, "fc_norm": True, "norm_before_fc": True})
    qwen = speculators_config(base)
    qwen["transformer_layer_config"]["model_type"] = "qwen3"
    with pytest.raises(ConfigError, match="transformer_layer_config.model_type='qwen3'"):
        Eagle3Config.from_dict(qwen)
    with pytest.raises(ConfigError, match="unknown key 'lora_rank'"):
        Eagle3Config.from_dict({**speculators_config(base), "lora_rank": 8})
    with pytest.raises(ConfigError, match="speculators_model_type='mlp'"):
        Eagle3Config.from_dict({**speculators_config(base), "speculators_model_type": "mlp"})


def test_a_variant_without_its_weights_is_refused_naming_the_key(e3, tmp_path):
    from safetensors.torch import load_file

    from remote_payload.contract.errors import CheckpointError
    root, _ = e3
    flat = json.loads((root / "eagle3" / "config.json").read_text())
    out = tmp_path / "h"
    shutil.copytree(root / "eagle3", out)
    (out / "config.json").write_text(json.dumps({**flat, "fc_norm": True}))
    with pytest.raises(CheckpointError, match="needs 'fc_norm.0.weight'"):
        load_eagle3(out, embed=torch.zeros(80, 64))
    sd = load_file(str(root / "eagle3" / "model.safetensors"))
    plain = _write(tmp_path, "extra", flat, {**sd, "fc.bias": torch.zeros(64)})
    with pytest.raises(CheckpointError, match="'fc.bias'"):
        load_eagle3(plain, embed=torch.zeros(80, 64))
    norms = {f"fc_norm.{i}.weight": torch.ones(64 if i else 32) for i in range(3)}
    short = _write(tmp_path, "short", {**flat, "fc_norm": True}, {**sd, **norms})
    with pytest.raises(CheckpointError, match=r"'fc_norm.0.weight' has shape \[32\] but .*config.json needs \[64\] "
                                              r"\(hidden_size 64, target_hidden_size 64"):
        load_eagle3(short, embed=torch.zeros(80, 64))
