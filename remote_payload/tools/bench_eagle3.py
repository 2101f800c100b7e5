"""The `eagle3` part of benchdoc: the EAGLE-3 eval stage in-process at the 8B class with RANDOM weights (a head for
a Llama-3.1-8B-shaped target: hidden 4096, 32 target layers, vocabulary 128,256, draft vocabulary 32,000) over a
cache of random features at the seeds' run's shape (10 prompts x 60 + 480 tokens, 30 rounds), as the DFlash
payload part builds its own: the chain K=5 and the default tree (60,7,10) at every anchor, then the walk, as
eagle3/evaluate.py's step 5 runs them (walk.chain_drafts / tree.draft_trees + accept_lengths, metrics).

rounds/s: anchors drafted a second (one anchor = one round's chain or tree); % of peak: useful FLOPs (the prefix's
fc and K/V projections once a prompt; per anchor every head forward's q/k/v, attention over the prefix and its
path, o_proj, MLP and lm_head; a tree level step is top_k forwards) over the seconds, against the run's bf16 matmul
peak (bench.measure_peak), as the DFlash rows. On CPU (no peak) a tiny size runs: the smoke test's.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from remote_payload.contract.eagle3config import Eagle3Config
from remote_payload.eagle3.model import Eagle3Drafter
from remote_payload.eagle3.tree import TreeShape, accept_lengths, draft_trees
from remote_payload.eagle3.walk import chain_drafts
from remote_payload.eval import metrics
from remote_payload.tools.benchrows import T_EAGLE3, Sample

SIZES = {  # hidden, intermediate, heads, kv heads, target layers, vocabulary, draft vocabulary
    "8b": (4096, 14336, 32, 8, 32, 128256, 32000),
    "tiny": (64, 128, 4, 2, 8, 512, 128),
}
SHAPES = {"8b": (10, 30, 60, 480), "tiny": (2, 8, 24, 64)}  # prompts, rounds, prompt_len, completion
CHAIN, TREE = 5, TreeShape(60, 7, 10)


def random_head(size: str, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> Eagle3Drafter:
    """A head of SIZES[size] with random weights (std 0.02, norms 1), a random draft vocabulary, and the target's
    embedding random too."""
    H, inter, nh, nkv, _L, V, Vd = SIZES[size]
    cfg = Eagle3Config(hidden_size=H, intermediate_size=inter, num_attention_heads=nh, num_key_value_heads=nkv,
                       head_dim=H // nh, vocab_size=V, draft_vocab_size=Vd, target_hidden_size=H,
                       rms_norm_eps=1e-5, rope_theta=500000.0)
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        head = Eagle3Drafter(cfg)
    head = head.to_empty(device=dev).to(dtype)
    for name, p in head.named_parameters():
        p.data.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g).mul_(0.02))
    used = torch.randperm(V, generator=g)[:Vd].sort().values
    head.d2t = (used - torch.arange(Vd)).to(dev)
    head.t2d = torch.zeros(V, dtype=torch.bool, device=dev)
    head.t2d[used.to(dev)] = True
    head.embed = torch.randn(V, H, generator=g).mul_(0.02).to(dev, dtype)
    return head


def anchor_flops(cfg: Eagle3Config, ctx: float, forwards: list[int]) -> float:
    """Useful FLOPs of one anchor: forwards[s] head forwards at step s (step 0: the anchor's slot, its q/k/v from
    the prefix pass), each over ctx prefix keys plus its path's s."""
    H, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    body = 2 * (q * H + 3 * H * cfg.intermediate_size + H * cfg.draft_vocab_size)  # o_proj, MLP, lm_head
    qkv = 2 * 2 * H * (q + 2 * kv)
    return sum(n * (body + (qkv if s else 0) + 2 * 2 * q * (ctx + s)) for s, n in enumerate(forwards))


def prefix_flops(cfg: Eagle3Config, T: int) -> float:
    H, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return 2 * T * cfg.fc_in_features * H + 2 * T * 2 * H * (q + 2 * kv)


def eval_rate(head: Eagle3Drafter, data, prompt_len: int, rounds: int, tree: TreeShape | None,
              dev: torch.device) -> tuple[int, float, float]:
    """(anchors drafted, seconds, useful FLOPs) of the eval's step 5 over `data` [(ids, feats)] (module doc)."""
    K = tree.max_accept if tree else CHAIN
    bs = K + 1
    forwards = [1, *[tree.top_k] * tree.depth] if tree else [1] * CHAIN
    anchors_total, flops = 0, 0.0
    _sync(dev)
    t = time.perf_counter()
    with torch.inference_mode():
        for ids, feats in data:
            T = ids.shape[0]
            n = metrics.num_anchors(prompt_len, T, rounds, bs)
            anchors = torch.arange(prompt_len, prompt_len + n, device=dev)
            if tree is None:
                drafts, _ = chain_drafts(head, feats, ids, anchors, K)
            else:
                _, drafts = accept_lengths(draft_trees(head, feats, ids, anchors, tree), ids, anchors, width=K)
            d, g = drafts.numpy(), ids.cpu().numpy()
            metrics.prompt_metrics(d, np.full_like(d, -1), None, g, prompt_len, rounds, bs)
            anchors_total += n
            flops += prefix_flops(head.cfg, prompt_len + n) + n * anchor_flops(head.cfg, prompt_len + n / 2, forwards)
    _sync(dev)
    return anchors_total, time.perf_counter() - t, flops


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def part_eagle3(dev: torch.device, dtype: torch.dtype, repeats: int, peak: float, dflash_rate=None,
                size: str | None = None) -> list[Sample]:
    """The part's readings: rounds/s and % of peak (not on CPU) for the chain and the tree, each run `repeats`
    times after one warm-up; dflash_rate(): a DFlash seeds row's (rounds, seconds, flops) to set beside them."""
    size = size or ("8b" if dev.type == "cuda" else "tiny")
    head = random_head(size, dev, dtype)
    prompts, rounds, plen, comp = SHAPES[size]
    g = torch.Generator().manual_seed(1)
    Ht, V = head.cfg.target_hidden_size, head.cfg.vocab_size
    data = [(torch.randint(0, V, (plen + comp,), generator=g).to(dev),
             torch.randn(plen + comp, 3 * Ht, generator=g).to(dev, dtype)) for _ in range(prompts)]
    rows = [(f"EAGLE-3 chain K={CHAIN}", None), (f"EAGLE-3 tree {','.join(map(str, TREE.as_list()))}", TREE)]
    out: list[Sample] = []
    for label, tree in rows:
        eval_rate(head, data[:1], plen, rounds, tree, dev)  # warm-up
        for _ in range(repeats):
            n, secs, flops = eval_rate(head, data, plen, rounds, tree, dev)
            out.append(Sample(T_EAGLE3, f"{label} ({size})", "rounds/s", n / secs))
            if not math.isnan(peak):
                out.append(Sample(T_EAGLE3, f"{label} ({size})", "% of peak", 100 * flops / secs / 1e12 / peak))
    for _ in range(repeats if dflash_rate else 0):
        n, secs, flops = dflash_rate()
        out.append(Sample(T_EAGLE3, "DFlash block (the payload part's seeds row)", "rounds/s", n / secs))
        if not math.isnan(peak):
            out.append(Sample(T_EAGLE3, "DFlash block (the payload part's seeds row)", "% of peak",
                              100 * flops / secs / 1e12 / peak))
    return out
