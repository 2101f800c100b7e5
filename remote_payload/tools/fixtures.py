"""Tiny offline fixtures with real signal: `python -m remote_payload fixtures --out DIR [--quick]`.

A small synthetic language (counting up and down, skip-counting, fizzbuzz, named cycles: random only
in the first few tokens, deterministic after), a WordLevel tokenizer trained on it, a tiny Qwen3 target
trained to predict it, a cache extracted from that target with `extract`, and DFlash drafters trained
on the target's features. Deterministic (fixed seeds, CPU) and cached: skipped when DIR/fixtures.json holds
the same recipe hash.

Layout of DIR (all paths in fixtures.json are relative to DIR):

    fixtures.json             {"recipe_hash", "recipe", "paths": {...}, "quality": {...}, "build_s"}
    tokenizer.json            WordLevel; specials <|pad|> <|eos|> <|mask|> <|unk|> (mask = DFlash mask token)
    target/                   Qwen3ForCausalLM (config, generation_config, >= 2 safetensors shards + index,
                              tokenizer.json, tokenizer_config.json with CHAT_TEMPLATE); untied lm_head
    target-mm/                the same weights with multimodal keys: model.language_model.* + top-level
                              lm_head.weight (index rewritten); weights-only (not loadable by transformers)
    prompts.jsonl             {name, prompt} per line (fizzbuzz, count-07, pattern-03, skip-2, ...)
    cache/                    reval cache of the target over prompts.jsonl, layer_ids = recipe.cache_layers
    drafters/step-NNNN/       z-lab layout (config.json + model.safetensors) along training, step-0000 untrained
    drafter-good/             z-lab layout, the final drafter (taps all cache layers)
    drafter-pt/step-NNNN.pt   team .pt layout; fc consumes the first k-1 of the k cache layers

API: `build(out, *, quick=False, log=print) -> dict` (fixtures.json's content); tests use the session
fixture `trained_fixtures` (tests/conftest.py), which builds into <repo>/.cache/fixtures/.
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

from remote_payload.contract.errors import PayloadError

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
# The target's chat template, so that multi-turn prompt files (z-lab's {"turns": [...]}) can be extracted as
# shipped. The language has no roles or turn markers: the turns and the target's replies follow each other,
# one space apart, so a single-turn prompt renders to itself (the fixture cache is the raw-text one).
CHAT_TEMPLATE = ("{%- for m in messages -%}{%- if not loop.first %} {% endif -%}{{- m.content -}}{%- endfor -%}")
PROMPTS = [  # name, prompt (in-distribution starts; the continuation is determined by them)
    ("fizzbuzz", "fizzbuzz n01 n02"),
    ("count-07", "count n07 n08"),
    ("count-22", "count n22 n23"),
    ("skip-3", "skip n03 n06 n09"),
    ("skip-4", "skip n05 n09 n13"),
    ("pattern-01", "pattern p1 moon"),
    ("pattern-03", "pattern p3 three"),
    ("pattern-04", "pattern p4 cat"),
    ("countdown-15", "countdown n15 n14"),
    ("skip-2", "skip n20 n22 n24"),
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
    target_steps: int = 150
    target_batch: int = 16
    target_lr: float = 5e-3
    cache_layers: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    max_new_tokens: int = 120
    drafter_layers: int = 1
    drafter_steps: int = 400
    drafter_ckpt_every: int = 80
    pt_drafter_steps: int = 200
    drafter_batch: int = 8  # sequences per step
    drafter_anchors: int = 16  # anchors per sequence per step
    drafter_early_anchors: int = 8  # of those, drawn near the start (train_drafter says why)
    drafter_lr: float = 5e-3
    threads: int = 2
    version: int = 1  # bump when the build changes without a field changing

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


QUICK = Recipe(target_steps=100, drafter_steps=100, drafter_ckpt_every=20, pt_drafter_steps=60)


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
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "unk_token": "<|unk|>", "chat_template": CHAT_TEMPLATE}, indent=1) + "\n")
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
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
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


# ---- the drafters ------------------------------------------------------------------------------------
@torch.no_grad()
def training_features(target, tok, r: Recipe, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """n fresh sentences -> (ids [n, L], feats [n, L, len(cache_layers) * H]) from one batched prefill."""
    ids = encode_batch(tok, random.Random(r.seed + 3), n, r.seq_len)
    hs = target(ids, output_hidden_states=True).hidden_states
    return ids, torch.cat([hs[l + 1] for l in r.cache_layers], -1)


def drafter_config(r: Recipe, vocab_size: int, mask_id: int, n_fc: int):
    from remote_payload.contract.drafterconfig import DrafterConfig
    return DrafterConfig(
        hidden_size=r.hidden_size, intermediate_size=r.intermediate_size, num_attention_heads=r.heads,
        num_key_value_heads=r.kv_heads, head_dim=r.hidden_size // r.heads, num_hidden_layers=r.drafter_layers,
        vocab_size=vocab_size, mask_token_id=mask_id, target_layer_ids=list(r.cache_layers),
        fc_layer_ids=list(r.cache_layers[:n_fc]), layer_types=["full_attention"] * r.drafter_layers,
        rope_theta=10000.0, num_target_layers=r.target_layers, block_size=16, max_position_embeddings=512)


def block_loss(drafter, head, ids: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Mean CE of draft rows 1..15 vs ids[a+1..a+15] (positions past the end ignored).

    ids [B, L], feats [B, L, n_fc*H], anchors [B, m] with 1 <= a < L."""
    bs, L = drafter.cfg.block_size, ids.shape[1]
    ctx = drafter.precompute_context(list(feats))
    bonus = ids.gather(1, anchors)  # [B, m]
    hidden = drafter.draft_hidden(ctx, anchors, bonus, head)  # [B, m, bs, H]
    logits = F.linear(hidden[:, :, 1:], head.lm_head)  # [B, m, bs-1, V]
    pos = anchors[..., None] + torch.arange(1, bs)  # [B, m, bs-1]
    labels = ids.gather(1, pos.clamp(max=L - 1).flatten(1)).view_as(pos).masked_fill(pos >= L, -100)
    return F.cross_entropy(logits.flatten(0, 2), labels.flatten(), ignore_index=-100)


def train_drafter(r: Recipe, cfg, head, ids, feats, steps: int, save_at, log) -> dict[int, float]:
    """AdamW on random anchors; `save_at(step, drafter)` at step 0 and every drafter_ckpt_every steps.

    Returns {step: mean training loss over the steps since the previous checkpoint}."""
    from remote_payload.eval.drafter import DFlashDrafter
    torch.manual_seed(r.seed + 10)
    g = torch.Generator().manual_seed(r.seed + 11)
    drafter = DFlashDrafter(cfg)
    opt = torch.optim.AdamW(drafter.parameters(), lr=r.drafter_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=r.drafter_lr, total_steps=steps, pct_start=0.1)
    feats = feats[..., :cfg.fc_in_features]
    n, L = ids.shape
    # Half the anchors among the first 2 * block_size positions, the rest anywhere: an eval's walk starts at each
    # prompt's first completion token and spends its first rounds there while acceptance is short (all of them
    # under --max-blocks 8). Uniform anchors put a fifth there and the drafter learned the start last: the mean
    # over all anchors was 13 while `eval --max-blocks 8` gave tau 1.7.
    early_hi = min(3 + 2 * cfg.block_size, L - 1)
    losses, window = {}, []
    save_at(0, drafter)
    for step in range(1, steps + 1):
        rows = torch.randint(0, n, (r.drafter_batch,), generator=g)
        anchors = torch.cat([
            torch.randint(3, early_hi, (r.drafter_batch, r.drafter_early_anchors), generator=g),
            torch.randint(3, L - 1, (r.drafter_batch, r.drafter_anchors - r.drafter_early_anchors), generator=g)], 1)
        loss = block_loss(drafter, head, ids[rows], feats[rows], anchors)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        window.append(loss.item())
        if step % r.drafter_ckpt_every == 0 or step == steps:
            losses[step] = sum(window) / len(window)
            log(f"drafter (fc {len(cfg.fc_layer_ids)} layers) step {step}: loss {losses[step]:.3f}")
            window = []
            save_at(step, drafter)
    return losses


QUALITY_BLOCKS = 8  # drafter_quality's walk: the rounds of `eval --max-blocks 8` (tests/test_online.py)


@torch.no_grad()
def drafter_quality(drafter, head, cache_dir: Path) -> dict:
    """Teacher-forced over every completion anchor of the cache: position-1 accuracy and the mean
    acceptance length incl. bonus (LCP of drafts vs the greedy continuation, + 1), both over ALL anchors
    (mostly the easy middle of a completion), and `tau_max_blocks_8`: the tau `eval --max-blocks 8` reports
    on this cache (metrics.walk from each prompt's first completion token, macro over prompts)."""
    from remote_payload.eval import metrics
    from remote_payload.eval.cache import open_cache
    cache = open_cache(cache_dir)
    hits, accept, walks = [], [], []
    for i, p in enumerate(cache.prompts):
        ids, feats = cache.load(i, layer_ids=drafter.cfg.fc_layer_ids)  # [T], [T, n_fc*H]
        anchors = torch.arange(p.prompt_len, p.seq_len - 1)
        hidden = drafter.draft_hidden(drafter.precompute_context(feats), anchors, ids[anchors], head)
        drafts = F.linear(hidden[:, 1:], head.lm_head).argmax(-1)  # [n, bs-1]
        pos = anchors[:, None] + torch.arange(1, drafter.cfg.block_size)
        want = ids[pos.clamp(max=p.seq_len - 1)].masked_fill(pos >= p.seq_len, -1)
        ok = (drafts == want).long()
        hits.append(ok[:, 0].float())
        accept.append(ok.cumprod(1).sum(1).float() + 1)
        walks.append(metrics.walk(ok.cumprod(1).sum(1).numpy(), p.prompt_len, p.seq_len, QUALITY_BLOCKS,
                                  drafter.cfg.block_size))
    return {"position_1_accuracy": round(torch.cat(hits).mean().item(), 4),
            "mean_acceptance_length": round(torch.cat(accept).mean().item(), 3),
            f"tau_max_blocks_{QUALITY_BLOCKS}": round(metrics.summarize(walks, drafter.cfg.block_size)["tau"], 3)}


def write_zlab(directory: Path, cfg, drafter) -> None:
    """z-lab layout: config.json (no fc_layer_ids when fc taps them all, as published) + model.safetensors."""
    from safetensors.torch import save_file
    directory.mkdir(parents=True)
    d = cfg.to_dict()
    if cfg.fc_layer_ids == cfg.target_layer_ids:
        d.pop("fc_layer_ids")
    (directory / "config.json").write_text(json.dumps(d, indent=1))
    sd = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    save_file(sd, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_pt(path: Path, cfg, drafter, step: int) -> None:
    """Team .pt layout: {"model": state_dict, "config": config (no fc_layer_ids: fc's width says), "step"}."""
    d = cfg.to_dict()
    d.pop("fc_layer_ids")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {k: v.detach().clone() for k, v in drafter.state_dict().items()}, "config": d,
                "step": step}, path)


# ---- the build ---------------------------------------------------------------------------------------
def recipe_hash(r: Recipe) -> str:
    """The recipe plus the sources that decide what gets trained (this module and the drafter's math)."""
    h = hashlib.sha256(r.hash().encode())
    for mod in ("tools/fixtures.py", "eval/drafter.py"):
        h.update((Path(__file__).parents[1] / mod).read_bytes())
    return h.hexdigest()[:16]


def build(out: str | os.PathLike, *, quick: bool = False, log=print) -> dict:
    """Build (or reuse) the fixtures in `out`; returns fixtures.json's content. Safe to call concurrently."""
    import fcntl
    out = Path(out)
    r = QUICK if quick else Recipe()
    rh = recipe_hash(r)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others then reuse its result
        meta = _existing(out)
        if meta and meta.get("recipe_hash") == rh:
            return meta
        if meta is None and out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise PayloadError(f"--out {out} exists and holds no {FIXTURES_JSON}: it is not a fixtures directory; "
                               "choose a new or empty one (an older fixtures build there is replaced)")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            meta = _build_into(tmp, r, rh, log)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _existing(out: Path) -> dict | None:
    try:
        return json.loads((out / FIXTURES_JSON).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _build_into(d: Path, r: Recipe, rh: str, log) -> dict:
    from transformers.utils import logging as hf_logging

    from remote_payload.eval.drafter import TargetHead
    from remote_payload.extract.command import extract
    t0 = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(r.threads)
    hf_logging.disable_progress_bar()  # our own progress lines are enough
    try:
        tok = train_tokenizer(random.Random(r.seed))
        tok.save(str(d / "tokenizer.json"))
        V, mask_id = tok.get_vocab_size(), tok.token_to_id("<|mask|>")
        target, acc = train_target(r, tok, log)
        log(f"target next-token accuracy {acc:.3f} ({time.time() - t0:.0f}s)")
        save_target(target, tok, d / "target")
        write_mm_variant(d / "target", d / "target-mm")
        with open(d / "prompts.jsonl", "w") as f:
            f.writelines(json.dumps({"name": n, "prompt": p}) + "\n" for n, p in PROMPTS)
        extract(d / "target", d / "prompts.jsonl", d / "cache", max_new_tokens=r.max_new_tokens,
                layer_ids=r.cache_layers, device="cpu", dtype="fp32", log=log)

        head = TargetHead(embed=target.model.embed_tokens.weight.detach(), lm_head=target.lm_head.weight.detach())
        ids, feats = training_features(target, tok, r)
        k = len(r.cache_layers)
        good_cfg, pt_cfg = drafter_config(r, V, mask_id, k), drafter_config(r, V, mask_id, k - 1)
        steps = []

        def save_zlab(step, drafter):
            steps.append(f"drafters/step-{step:04d}")
            write_zlab(d / steps[-1], good_cfg, drafter)
        good_loss = train_drafter(r, good_cfg, head, ids, feats, r.drafter_steps, save_zlab, log)
        shutil.copytree(d / steps[-1], d / "drafter-good")
        pt_path = f"drafter-pt/step-{r.pt_drafter_steps:04d}.pt"

        def save_pt(step, drafter):
            if step == r.pt_drafter_steps:
                write_pt(d / pt_path, pt_cfg, drafter, step)
        pt_loss = train_drafter(r, pt_cfg, head, ids, feats, r.pt_drafter_steps, save_pt, log)

        from remote_payload.eval.checkpoint import load_drafter
        quality = {"target_accuracy": round(acc, 4),
                   "drafter_loss": {str(s): round(v, 4) for s, v in good_loss.items()},
                   "drafter_pt_loss": {str(s): round(v, 4) for s, v in pt_loss.items()},
                   "drafter_good": drafter_quality(load_drafter(d / "drafter-good")[0], head, d / "cache"),
                   "drafter_untrained": drafter_quality(load_drafter(d / steps[0])[0], head, d / "cache"),
                   "drafter_pt": drafter_quality(load_drafter(d / pt_path)[0], head, d / "cache")}
    finally:
        torch.set_num_threads(threads)
        hf_logging.enable_progress_bar()
    meta = {"recipe_hash": rh, "recipe": dataclasses.asdict(r), "build_s": round(time.time() - t0, 1),
            "vocab_size": V, "mask_token_id": mask_id, "eos_token_id": tok.token_to_id("<|eos|>"),
            "cache_layers": list(r.cache_layers),
            "paths": {"tokenizer": "tokenizer.json", "target": "target", "target_mm": "target-mm",
                      "prompts": "prompts.jsonl", "cache": "cache", "drafters": steps,
                      "drafter_good": "drafter-good", "drafter_pt": pt_path},
            "quality": quality}
    (d / FIXTURES_JSON).write_text(json.dumps(meta, indent=1) + "\n")
    log(f"fixtures built in {meta['build_s']}s: target acc {acc:.3f}, good drafter {quality['drafter_good']}")
    return meta


def main(args: argparse.Namespace) -> int:
    try:
        meta = build(args.out, quick=args.quick)
    except PayloadError as e:
        print(f"error: {e}")
        return e.exit_code
    q = meta["quality"]
    print(f"fixtures in {args.out} (recipe {meta['recipe_hash']}): target accuracy {q['target_accuracy']:.3f}, "
          f"good drafter position-1 accuracy {q['drafter_good']['position_1_accuracy']:.3f}")
    return 0
