"""Tiny random drafters and targets, built locally and written to disk in the real layouts (tests, fixtures).

Nothing is downloaded. Sizes are small enough that a whole test file stays well under a few seconds.
- `tiny_drafter_config(**overrides)`: a 2-layer drafter (1 sliding + 1 full, GQA 4/2 heads, H=32, V=96).
- `random_drafter(cfg, seed)` / `random_head(cfg, seed)`: random weights, norms perturbed so they matter.
- `write_zlab_drafter(dir, cfg, sd, shards=1)`: config.json + model.safetensors (or sharded + index).
- `write_pt_drafter(path, cfg, sd, wrap=None, prefix="", config_inside=True)`: the team's .pt layout.
- `write_tiny_target(dir, multimodal=False, tied=False, ...)`: a Qwen3ForCausalLM saved sharded with an
  index. The multimodal variant REWRITES the saved keys `model.*` -> `model.language_model.*` (lm_head stays
  top level) and nests the config under `text_config`, as Qwen3.5/3.6 checkpoints are laid out; we do not
  build a real Qwen3_5 model.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from remote_payload.contract.drafterconfig import DrafterConfig
from remote_payload.eval.drafter import DFlashDrafter, TargetHead

TINY_TARGET = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 96}


def tiny_drafter_config(**overrides) -> DrafterConfig:
    d = {
        "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_hidden_layers": 2, "num_target_layers": 6, "vocab_size": 96, "block_size": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 512,
        "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 3, 4]},
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
    }
    for k, v in overrides.items():
        if k in ("mask_token_id", "target_layer_ids"):
            d["dflash_config"] = {**d["dflash_config"], k: v}
        else:
            d[k] = v
    return DrafterConfig.from_dict(d, source="tiny_drafter_config")


def random_drafter(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.eval()


def random_head(cfg: DrafterConfig, seed: int = 0, tied: bool = False) -> TargetHead:
    g = torch.Generator().manual_seed(seed + 1000)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    lm_head = embed if tied else torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) / cfg.hidden_size**0.5
    return TargetHead(embed=embed, lm_head=lm_head)


def write_zlab_drafter(directory, cfg: DrafterConfig, state_dict: dict, shards: int = 1) -> Path:
    """z-lab folder: config.json + model.safetensors, or `shards` files + model.safetensors.index.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg_dict = cfg.to_dict()
    if cfg.fc_layer_ids == cfg.target_layer_ids:
        cfg_dict.pop("fc_layer_ids")  # real z-lab configs do not have it
    (directory / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    sd = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if shards == 1:
        save_file(sd, directory / "model.safetensors", metadata={"format": "pt"})
        return directory
    keys = sorted(sd)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[s::shards]}
        save_file(part, directory / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
             "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory


def write_pt_drafter(path, cfg: DrafterConfig, state_dict: dict, *, wrap: str | None = None, prefix: str = "",
                     config_inside: bool = True, step: int | None = None) -> Path:
    """The team's .pt: a state dict (optionally `{wrap: sd}`, keys optionally prefixed) + a config, either
    as a `config` entry inside the file or as config.json next to it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {prefix + k: v.detach().cpu() for k, v in state_dict.items()}
    obj: dict = {wrap: sd} if wrap else dict(sd)
    if config_inside:
        if not wrap:
            raise ValueError("a config inside the file needs a wrapped state dict (wrap='model' or 'state_dict')")
        obj["config"] = cfg.to_dict()
    else:
        (path.parent / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    if step is not None:
        obj["step"] = step
    torch.save(obj, path)
    return path


def write_tiny_target(directory, *, multimodal: bool = False, tied: bool = False, seed: int = 0,
                      max_shard_size: str = "64KB", **overrides) -> Path:
    """A random Qwen3ForCausalLM saved sharded with an index (see module doc for the multimodal variant)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    torch.manual_seed(seed)
    cfg = Qwen3Config(**{**TINY_TARGET, **overrides}, tie_word_embeddings=tied)
    Qwen3ForCausalLM(cfg).save_pretrained(directory, max_shard_size=max_shard_size)
    if not multimodal:
        return directory
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        sd = load_file(directory / shard)
        save_file({_mm_key(k): v for k, v in sd.items()}, directory / shard, metadata={"format": "pt"})
    index["weight_map"] = {_mm_key(k): v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index, indent=2))
    text_config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text_config}, indent=2))
    return directory


def _mm_key(key: str) -> str:
    return "model.language_model." + key[len("model."):] if key.startswith("model.") else key


def fixture_recipe_target(directory):
    """(path, tokenizer, model): a random-init target of the trained fixtures' shape (fixtures.Recipe: a tiny
    Qwen3, the fixtures' WordLevel tokenizer), seed 0, saved at `directory`: what the extract tests run on."""
    import random

    from remote_payload.tools import fixtures
    tok = fixtures.train_tokenizer(random.Random(0))
    torch.manual_seed(0)
    model = fixtures.make_target(fixtures.Recipe(), tok.get_vocab_size(), tok.token_to_id("<|eos|>"),
                                 tok.token_to_id("<|pad|>"))
    fixtures.save_target(model, tok, Path(directory))
    return Path(directory), tok, model


def write_prompts(path, chosen) -> Path:
    """A .jsonl prompt file of (name, prompt) pairs."""
    path = Path(path)
    path.write_text("".join(json.dumps({"name": n, "prompt": t}) + "\n" for n, t in chosen))
    return path
