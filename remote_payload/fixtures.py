"""Tiny offline fixtures with real signal: `python -m remote_payload fixtures --out DIR [--quick]`.

A small synthetic language (counting up and down, skip-counting, fizzbuzz, named cycles: random only
in the first few tokens, deterministic after), a WordLevel tokenizer trained on it, a tiny Qwen3 target
trained to predict it, a cache extracted from that target with `target.extract`, and DFlash drafters trained
on the target's features. Deterministic (fixed seeds, CPU) and cached: skipped when DIR/fixtures.json holds
the same recipe hash.

Layout of DIR (all paths in fixtures.json are relative to DIR):

    fixtures.json             {"recipe_hash", "recipe", "paths": {...}, "quality": {...}, "build_s"}
    tokenizer.json            WordLevel; specials <|pad|> <|eos|> <|mask|> <|unk|> (mask = DFlash mask token)
    target/                   Qwen3ForCausalLM (config, generation_config, >= 2 safetensors shards + index,
                              tokenizer.json); untied lm_head
    target-mm/                the same weights with multimodal keys: model.language_model.* + top-level
                              lm_head.weight (index rewritten); weights-only (not loadable by transformers)
    prompts.jsonl             {name, prompt} per line (fizzbuzz, count-07, pattern-03, skip-2, ...)
    cache/                    reval cache of the target over prompts.jsonl, layer_ids = recipe.cache_layers
    drafters/step-NNNN/       z-lab layout (config.json + model.safetensors) along training, step-0000 untrained
    drafter-good/             z-lab layout, the final drafter (taps all cache layers)
    drafter-pt/step-NNNN.pt   team .pt layout; fc consumes the first k-1 of the k cache layers
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

FIXTURES_JSON = "fixtures.json"
SPECIALS = ["<|pad|>", "<|eos|>", "<|mask|>", "<|unk|>"]
NUMBERS = [f"n{i:02d}" for i in range(30)]
CYCLES = {  # pattern id -> cycle of words
    "p0": ["red", "green", "blue"],
    "p1": ["sun", "moon", "star", "sky"],
    "p2": ["up", "down"],
    "p3": ["one", "two", "three", "four", "five"],
    "p4": ["cat", "dog", "bird"],
    "p5": ["red", "red", "blue"],
}
FIZZBUZZ = ["fizzbuzz" if i % 15 == 0 else "fizz" if i % 3 == 0 else "buzz" if i % 5 == 0 else f"n{i:02d}"
            for i in range(1, 31)]
PROMPTS = [  # name, prompt (in-distribution starts; the continuation is determined by them)
    ("fizzbuzz", "fizzbuzz n01 n02"),
    ("count-07", "count n07 n08"),
    ("count-22", "count n22 n23"),
    ("skip-3", "skip n03 n06"),
    ("skip-4", "skip n05 n09"),
    ("pattern-01", "pattern p1 moon"),
    ("pattern-03", "pattern p3 three"),
    ("pattern-04", "pattern p4 cat"),
    ("countdown-15", "countdown n15 n14"),
    ("skip-2", "skip n20 n22"),
]


@dataclass
class Recipe:
    seed: int = 0
    seq_len: int = 144  # training sequence length (>= prompt + completion)
    target_layers: int = 5
    hidden_size: int = 64
    intermediate_size: int = 192
    heads: int = 4
    kv_heads: int = 2
    target_steps: int = 500
    target_batch: int = 16
    target_lr: float = 5e-3
    cache_layers: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    max_new_tokens: int = 120
    drafter_layers: int = 2
    drafter_steps: int = 400
    drafter_ckpt_every: int = 80
    pt_drafter_steps: int = 200
    drafter_batch: int = 32  # sequences per step
    drafter_anchors: int = 8  # anchors per sequence per step
    drafter_lr: float = 3e-3
    threads: int = 2
    version: int = 1  # bump when the build changes without a field changing

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


QUICK = Recipe(target_steps=250, drafter_steps=160, drafter_ckpt_every=32, pt_drafter_steps=80)


# ---- the language ------------------------------------------------------------------------------------
def sample_sequence(rng: random.Random, length: int) -> list[str]:
    """One sentence of the synthetic language, `length` words: a keyword, a random start, then a rule."""
    # No free copying (repeated random phrases): the induction head it needs emerges too slowly here.
    kind = rng.choice(["count", "countdown", "skip", "fizzbuzz", "pattern"])
    if kind == "count":
        s = rng.randrange(30)
        body = [NUMBERS[(s + k) % 30] for k in range(length)]
    elif kind == "countdown":
        s = rng.randrange(30)
        body = [NUMBERS[(s - k) % 30] for k in range(length)]
    elif kind == "skip":
        s, d = rng.randrange(30), rng.randint(2, 4)
        body = [NUMBERS[(s + k * d) % 30] for k in range(length)]
    elif kind == "fizzbuzz":
        s = rng.randrange(30)
        body = [FIZZBUZZ[(s + k) % 30] for k in range(length)]
    else:
        pid = rng.choice(sorted(CYCLES))
        c, s = CYCLES[pid], rng.randrange(len(CYCLES[pid]))
        body = [pid] + [c[(s + k) % len(c)] for k in range(length)]
    return ([kind] + body)[:length]


def train_tokenizer(rng: random.Random):
    """WordLevel tokenizer trained on a sample of the language (+ specials); whitespace-split words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    corpus = [" ".join(sample_sequence(rng, 64)) for _ in range(400)]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=1))
    return tok


def encode_batch(tok, rng: random.Random, n: int, length: int) -> torch.Tensor:
    """n fresh sentences -> ids [n, length]."""
    return torch.tensor([tok.encode(" ".join(sample_sequence(rng, length))).ids for _ in range(n)])


# ---- the target --------------------------------------------------------------------------------------
def make_target(r: Recipe, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
                      num_hidden_layers=r.target_layers, num_attention_heads=r.heads, num_key_value_heads=r.kv_heads,
                      head_dim=r.hidden_size // r.heads, max_position_embeddings=512, rope_theta=10000.0,
                      tie_word_embeddings=False, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    return Qwen3ForCausalLM(cfg)


def save_target(model, tok, out: Path, max_shard_size: str = "200KB") -> None:
    """save_pretrained in >= 2 safetensors shards + index, plus tokenizer.json."""
    model.save_pretrained(str(out), max_shard_size=max_shard_size, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    if not (out / "model.safetensors.index.json").exists():
        raise RuntimeError(f"{out}: expected a sharded checkpoint; lower max_shard_size")


def write_mm_variant(src: Path, out: Path) -> None:
    """Copy of a Qwen3 target with multimodal keys: model.X -> model.language_model.X, lm_head.weight kept."""
    from safetensors.torch import load_file, save_file
    out.mkdir(parents=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    rename = {k: ("model.language_model." + k[len("model."):] if k.startswith("model.") else k)
              for k in index["weight_map"]}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(src / shard))
        save_file({rename[k]: v for k, v in tensors.items()}, str(out / shard), metadata={"format": "pt"})
    index["weight_map"] = {rename[k]: v for k, v in index["weight_map"].items()}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    for f in ("config.json", "generation_config.json", "tokenizer.json"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)


def train_target(r: Recipe, tok, log) -> tuple[object, float]:
    """Train the tiny target on fresh sentences each step; returns (model, held-out accuracy)."""
    torch.manual_seed(r.seed)
    rng = random.Random(r.seed + 1)
    V = tok.get_vocab_size()
    model = make_target(r, V, tok.token_to_id("<|eos|>"), tok.token_to_id("<|pad|>"))
    opt = torch.optim.AdamW(model.parameters(), lr=r.target_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=r.target_lr, total_steps=r.target_steps, pct_start=0.1)
    model.train()
    for step in range(r.target_steps):
        ids = encode_batch(tok, rng, r.target_batch, r.seq_len)  # [B, L]
        logits = model(ids).logits  # [B, L, V]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == r.target_steps - 1:
            log(f"target step {step}: loss {loss.item():.3f}")
    model.eval()
    return model, target_accuracy(model, tok, random.Random(r.seed + 2))


@torch.no_grad()
def target_accuracy(model, tok, rng: random.Random, n: int = 64, length: int = 144, skip: int = 12) -> float:
    """Next-token argmax accuracy on fresh sentences, past the first `skip` (random) words."""
    ids = encode_batch(tok, rng, n, length)
    pred = model(ids).logits[:, skip - 1:-1].argmax(-1)
    return (pred == ids[:, skip:]).float().mean().item()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="fixture directory (reused when its recipe hash matches)")
    p.add_argument("--quick", action="store_true", help="fewer training steps (weaker models, faster)")
