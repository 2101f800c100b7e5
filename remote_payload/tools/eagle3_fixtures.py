"""A tiny trained Llama target + EAGLE-3 head, built locally (CPU fp32, seconds): `build(out) -> dict`.

The synthetic language and tokenizer of fixtures.py; an 8-layer Llama target (the default taps {2, 4, 5} are
distinct from 7 layers on); a cache `extract`ed with the head's taps (cache layers {1, 3, 4} = HF
hidden_states[2, 4, 5]); an EAGLE-3 head trained test-time-training style (K chained steps fed the sentence's
tokens, labelled with the target's own greedy next tokens) over a reduced draft vocabulary (the DRAFT_VOCAB
most frequent ids, d2t offsets), saved in the SafeAILab layout twice: `eagle3/` (config.json +
model.safetensors) and `eagle3-bin/` (config.json + pytorch_model.bin). Neither ships embed_tokens: the
target's is borrowed, as SafeAILab's heads do.

    DIR/eagle3-fixtures.json   {"recipe_hash", "paths", "quality": {"target_accuracy", "chain_tau", ...}}
    DIR/tokenizer.json  DIR/target/  DIR/prompts.jsonl  DIR/cache/  DIR/eagle3/  DIR/eagle3-bin/

Cached: rebuilt only when the recipe or the sources it hashes change (tests/test_eagle3.py builds it into
<repo>/.cache/eagle3-fixtures).
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from remote_payload.tools.fixtures import PROMPTS, encode_batch, train_tokenizer

META = "eagle3-fixtures.json"


@dataclass
class Recipe:
    seed: int = 0
    seq_len: int = 96
    layers: int = 8
    hidden: int = 64
    inter: int = 192
    heads: int = 4
    kv_heads: int = 2
    target_steps: int = 150
    target_batch: int = 16
    target_lr: float = 5e-3
    max_new_tokens: int = 60
    draft_vocab: int = 40
    draft_steps: int = 120
    draft_batch: int = 8
    ttt_steps: int = 5
    draft_lr: float = 4e-3
    threads: int = 1  # a loaded 2-core machine: one thread wastes less than two fighting
    version: int = 1


def recipe_hash(r: Recipe) -> str:
    h = hashlib.sha256(json.dumps(dataclasses.asdict(r), sort_keys=True).encode())
    root = Path(__file__).parents[1]
    for mod in ("tools/eagle3_fixtures.py", "tools/fixtures.py", "eagle3/model.py", "eagle3/walk.py",
                "contract/eagle3config.py"):
        h.update((root / mod).read_bytes())
    return h.hexdigest()[:16]


def train_target(r: Recipe, tok, log):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(r.seed)
    rng = random.Random(r.seed + 1)
    V = tok.get_vocab_size()
    cfg = LlamaConfig(vocab_size=V, hidden_size=r.hidden, intermediate_size=r.inter, num_hidden_layers=r.layers,
                      num_attention_heads=r.heads, num_key_value_heads=r.kv_heads, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=tok.token_to_id("<|eos|>"),
                      pad_token_id=tok.token_to_id("<|pad|>"), bos_token_id=None)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=r.target_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=r.target_lr, total_steps=r.target_steps, pct_start=0.1)
    for step in range(r.target_steps):
        ids = encode_batch(tok, rng, r.target_batch, r.seq_len)
        loss = F.cross_entropy(model(ids).logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 25 == 0 or step == r.target_steps - 1:
            log(f"eagle3 target step {step}: loss {loss.item():.3f}")
    return model.eval()


def draft_vocabulary(ids: torch.Tensor, V: int, Vd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Vd most frequent ids of `ids`, sorted (SpecForge / SafeAILab's rule) -> (d2t [Vd], t2d [V])."""
    counts = torch.bincount(ids.flatten(), minlength=V)
    used = counts.argsort(descending=True, stable=True)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(Vd), t2d


def head_config(r: Recipe, V: int):
    from remote_payload.contract.eagle3config import Eagle3Config
    return Eagle3Config(hidden_size=r.hidden, intermediate_size=r.inter, num_attention_heads=r.heads,
                        num_key_value_heads=r.kv_heads, head_dim=r.hidden // r.heads, vocab_size=V,
                        draft_vocab_size=r.draft_vocab, target_hidden_size=r.hidden, rms_norm_eps=1e-6,
                        rope_theta=10000.0)


def ttt_loss(head, ids: torch.Tensor, feats: torch.Tensor, greedy: torch.Tensor, to_draft: torch.Tensor,
             steps: int) -> torch.Tensor:
    """Mean CE over every slot t and step s of the draft logits vs the target's own next token after y[..t+s+1]
    (greedy[t+s+1]: what verification accepts), in the draft vocabulary (ids outside it, or past the end, ignored);
    the chain is fed the sentence's tokens (teacher forcing)."""
    from remote_payload.eagle3.walk import ttt_steps
    T = ids.shape[0]
    slots = torch.arange(T - 2)
    losses = []
    for _rows, s, logits in ttt_steps(head, feats, ids, slots, steps):
        pos = slots + s + 1
        label = to_draft[greedy[pos.clamp(max=T - 1)]].masked_fill(pos >= T - 1, -100)
        losses.append(F.cross_entropy(logits, label, ignore_index=-100, reduction="sum"))
    return torch.stack(losses).sum() / (len(slots) * steps)


def train_head(r: Recipe, target, tok, taps: list[int], log):
    from remote_payload.eagle3.model import Eagle3Drafter
    torch.manual_seed(r.seed + 10)
    V = tok.get_vocab_size()
    ids = encode_batch(tok, random.Random(r.seed + 3), 96, r.seq_len)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[k] for k in taps], -1)
    greedy = out.logits.argmax(-1)  # [n, L]: the target's next token after each prefix of the sentence
    d2t, t2d = draft_vocabulary(greedy, V, r.draft_vocab)
    to_draft = torch.full((V,), -100, dtype=torch.long)
    to_draft[torch.arange(r.draft_vocab) + d2t] = torch.arange(r.draft_vocab)
    head = Eagle3Drafter(head_config(r, V))
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    head.embed = target.model.embed_tokens.weight.detach()
    opt = torch.optim.AdamW(head.parameters(), lr=r.draft_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=r.draft_lr, total_steps=r.draft_steps, pct_start=0.1)
    g = torch.Generator().manual_seed(r.seed + 11)
    for step in range(1, r.draft_steps + 1):
        rows = torch.randint(0, ids.shape[0], (r.draft_batch,), generator=g).tolist()
        loss = sum(ttt_loss(head, ids[i], feats[i], greedy[i], to_draft, r.ttt_steps) for i in rows) / len(rows)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 20 == 0 or step == r.draft_steps:
            log(f"eagle3 head step {step}: loss {loss.item():.3f}")
    return head.eval().requires_grad_(False)


def save_head(head, out: Path) -> None:
    """The SafeAILab layout: config.json + model.safetensors, and the same as config.json + pytorch_model.bin."""
    from safetensors.torch import save_file
    d = head.cfg.to_dict()
    d.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_act="silu",
             tie_word_embeddings=False, max_position_embeddings=512)
    sd = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    for folder, write in ((out / "eagle3", lambda f: save_file(sd, str(f / "model.safetensors"))),
                          (out / "eagle3-bin", lambda f: torch.save(sd, f / "pytorch_model.bin"))):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(d, indent=1))
        write(folder)


def chain_quality(head, cache_dir: Path, taps: list[int], K: int, max_blocks: int = 64) -> dict:
    """tau of the offline chain walk (K drafts, macro over prompts) on the cache."""
    from remote_payload.eagle3.walk import chain_drafts
    from remote_payload.eval import metrics
    from remote_payload.eval.cache import open_cache
    cache = open_cache(cache_dir)
    walks = []
    for i, p in enumerate(cache.prompts):
        ids, feats = cache.load(i, layer_ids=[k - 1 for k in taps])
        n = metrics.num_anchors(p.prompt_len, p.seq_len, max_blocks, K + 1)
        drafts, _ = chain_drafts(head, feats, ids, torch.arange(p.prompt_len, p.prompt_len + n), K)
        acc = metrics.accept_lengths_vanilla(drafts.numpy(), ids.numpy(), p.prompt_len)
        walks.append(metrics.walk(acc, p.prompt_len, p.seq_len, max_blocks, K + 1))
    return {"chain_k": K, "max_blocks": max_blocks, "tau": round(metrics.summarize(walks, K + 1)["tau"], 4)}


def build(out, *, log=print) -> dict:
    """Build (or reuse) the fixtures in `out`; returns the meta json. Safe to call concurrently."""
    out = Path(out)
    r = Recipe()
    rh = recipe_hash(r)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            meta = json.loads((out / META).read_text())
            if meta.get("recipe_hash") == rh:
                return meta
        except (OSError, ValueError):
            pass
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            meta = _build_into(tmp, r, rh, log)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _build_into(d: Path, r: Recipe, rh: str, log) -> dict:
    from transformers.utils import logging as hf_logging

    from remote_payload.extract.command import extract
    t0 = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(r.threads)
    hf_logging.disable_progress_bar()
    try:
        tok = train_tokenizer(random.Random(r.seed))
        tok.save(str(d / "tokenizer.json"))
        target = train_target(r, tok, log)
        target.save_pretrained(str(d / "target"), safe_serialization=True)
        tok.save(str(d / "target" / "tokenizer.json"))
        cfg = head_config(r, tok.get_vocab_size())
        taps = cfg.tap_ids(r.layers)
        with open(d / "prompts.jsonl", "w") as f:
            f.writelines(json.dumps({"name": n, "prompt": p}) + "\n" for n, p in PROMPTS)
        extract(d / "target", d / "prompts.jsonl", d / "cache", max_new_tokens=r.max_new_tokens,
                layer_ids=cfg.cache_layer_ids(r.layers), device="cpu", dtype="fp32", log=log)
        head = train_head(r, target, tok, taps, log)
        save_head(head, d)
        quality = {"chain_5": chain_quality(head, d / "cache", taps, 5)}
    finally:
        torch.set_num_threads(threads)
        hf_logging.enable_progress_bar()
    meta = {"recipe_hash": rh, "recipe": dataclasses.asdict(r), "build_s": round(time.time() - t0, 1), "taps": taps,
            "paths": {"target": "target", "cache": "cache", "prompts": "prompts.jsonl", "eagle3": "eagle3",
                      "eagle3_bin": "eagle3-bin"},
            "quality": quality}
    (d / META).write_text(json.dumps(meta, indent=1) + "\n")
    log(f"eagle3 fixtures built in {meta['build_s']}s: {quality}")
    return meta
