"""Drafting at every anchor of a prompt, queued on the device with no host sync until its outputs are needed.

`enqueue_anchors` queues one prompt's whole drafting (context K/V once, batches of anchors, lm_head + top-k,
the targets' ranks, the DDTree acceptance's device half) and the copies of its small outputs into pinned host
memory; `PendingAnchors.result()` waits for them (the one sync). `drafted_prompts` keeps the device a prompt
ahead of the host: prompt i+1's features are read and checked by a thread and its drafting queued before
prompt i's outputs are waited for, so the walks and metrics of prompt i run while the device computes.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from . import metrics
from .errors import PayloadError


@dataclass
class AnchorOutputs:
    """Per-anchor results of one prompt, anchors a = prompt_len + j (metrics.py conventions)."""

    drafts: np.ndarray  # [n, bs-1] int
    target_rank: np.ndarray  # [n, bs-1] int, -1 past the end
    topk_logprobs: torch.Tensor | None  # [n, bs-1, K] fp32 sorted descending, on the device (DDTree)
    tree_acc: dict | None = None  # {budget: acc [n]} (DDTree), computed with the drafts


class PendingAnchors:
    """One prompt's queued drafting; `result()` waits for its outputs (the only host sync)."""

    def __init__(self, drafts, ranks, topk, finite, acc, tied, budgets):
        self.topk, self.ranks, self.budgets = topk, ranks, budgets
        small = [drafts, ranks, finite, acc, tied]
        self.event = None
        if drafts.device.type == "cuda":
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in small]
            for h, t in zip(self.host, small):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = small

    def result(self) -> AnchorOutputs:
        if self.event is not None:
            self.event.synchronize()
        drafts, ranks, finite, acc, tied = self.host
        if not bool(finite):
            raise PayloadError("drafter produced NaN/inf logits: check the weights' dtype and the cache features")
        tree_acc = (metrics.ddtree_resolve(acc.numpy(), tied.numpy(), self.topk, self.ranks, self.budgets)
                    if self.budgets else None)
        return AnchorOutputs(drafts.numpy(), ranks.numpy(), self.topk, tree_acc)


@torch.inference_mode()
def enqueue_anchors(drafter, head, feats: torch.Tensor, ids: torch.Tensor, prompt_len: int, n: int, *,
                    batch_size: int, budgets: list[int], widths: list[int] = ()) -> PendingAnchors:
    """feats [T, n_fc*H], ids [T] (both on the drafter's device) -> the queued outputs at anchors
    prompt_len..prompt_len+n-1. Targets are g[a+k] (k = 1..bs-1), -1 past the end."""
    from .drafter import logits_topk
    bs = drafter.cfg.block_size
    dev, T = feats.device, ids.shape[0]
    # top-k per row: DDTree needs the top-B values, width-k trees ranks below k (ranks are capped at k)
    k = min(max([*budgets, *widths, 1]), drafter.cfg.vocab_size)
    ctx = drafter.precompute_context(feats)  # context K/V once per prompt
    offsets = torch.arange(1, bs, device=dev)
    finite = torch.ones((), dtype=torch.bool, device=dev)
    drafts, ranks, topk = [], [], []
    for s in range(0, n, batch_size):
        lo, hi = prompt_len + s, prompt_len + min(n, s + batch_size)
        anchors = torch.arange(lo, hi, device=dev)  # [m]
        hidden = drafter.draft_hidden(ctx, anchors, ids[anchors], head, bounds=(lo, hi - 1))  # [m, bs, H]
        pos = anchors[:, None] + offsets  # [m, bs-1]
        tgt = torch.where(pos < T, ids[pos.clamp(max=T - 1)], -1)
        out = logits_topk(hidden, head, k, target_ids=tgt.clamp(min=0))
        finite &= torch.isfinite(out.topk_logprobs[..., 0]).all()
        drafts.append(out.argmax_ids)
        ranks.append(out.target_ranks.masked_fill(tgt < 0, -1))
        if budgets:
            topk.append(out.topk_logprobs)
    width = bs - 1
    drafts_t = torch.cat(drafts) if drafts else torch.zeros(0, width, dtype=torch.long, device=dev)
    ranks_t = torch.cat(ranks) if ranks else torch.zeros(0, width, dtype=torch.long, device=dev)
    topk_t = (torch.cat(topk) if topk else torch.zeros(0, width, k, device=dev)) if budgets else None
    if budgets:
        acc, tied = metrics.ddtree_accept_device(topk_t, ranks_t, budgets)
    else:
        acc = tied = torch.zeros(0, device=dev)
    return PendingAnchors(drafts_t, ranks_t, topk_t, finite, acc, tied, sorted(set(budgets)))


def draft_all_anchors(drafter, head, feats: torch.Tensor, ids: torch.Tensor, prompt_len: int, n: int, *,
                      batch_size: int, budgets: list[int], widths: list[int] = ()) -> AnchorOutputs:
    """feats [T, n_fc*H] (on the drafter's device), ids [T] -> outputs at anchors prompt_len..prompt_len+n-1."""
    return enqueue_anchors(drafter, head, feats, ids.to(feats.device), prompt_len, n, batch_size=batch_size,
                           budgets=budgets, widths=widths).result()


def drafted_prompts(drafter, head, cache, count: int, anchors_of: Callable[[int], int], *, device: torch.device,
                    dtype: torch.dtype, batch_size: int, budgets: list[int],
                    widths: list[int]) -> Iterator[tuple[int, torch.Tensor, AnchorOutputs]]:
    """(i, ids [T] on the CPU, outputs) for cache prompts 0..count-1 in order, the device one prompt ahead.
    anchors_of(i): how many anchors of prompt i to draft. Token ids outside the vocabulary are bad input."""
    from .kernels import plan
    cfg = drafter.cfg
    pin = device.type == "cuda"
    if pin:
        plan(sum(anchors_of(i) for i in range(count)) * (cfg.block_size - 1) * cfg.vocab_size)

    def read(i: int):
        ids, feats = cache.load(i, layer_ids=cfg.fc_layer_ids)  # [T], [T, n_fc*H] on the CPU, validated
        if int(ids.max()) >= cfg.vocab_size or int(ids.min()) < 0:
            raise PayloadError(f"cache {cache.path}: prompt {cache.prompts[i].name!r} holds token id "
                               f"{int(ids.max())} outside the drafter's vocabulary ({cfg.vocab_size}): the cache "
                               f"comes from another tokenizer")
        return ids, (feats.pin_memory() if pin else feats)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reval-read") as ex:
        ahead = ex.submit(read, 0) if count else None
        pending = None
        for i in range(count):
            ids, feats = ahead.result()
            ahead = ex.submit(read, i + 1) if i + 1 < count else None
            f = feats.to(device, non_blocking=True).to(dtype)
            queued = enqueue_anchors(drafter, head, f, ids.to(device, non_blocking=True),
                                     cache.prompts[i].prompt_len, anchors_of(i), batch_size=batch_size,
                                     budgets=budgets, widths=widths)
            if pending is not None:
                yield pending[0], pending[1], pending[2].result()
            pending = (i, ids, queued, feats)  # feats: the pinned source stays alive until the copy is done
        if pending is not None:
            yield pending[0], pending[1], pending[2].result()


WARMUP_MODES = ("off", "beside", "empty", "after")


def warmup_mode() -> str:
    """REVAL_WARMUP: after (default: the real weights, once loaded) | off | beside (throwaway random weights,
    during the load) | empty (uninitialised throwaway weights, during the load); 1 = beside, 0 = off.
    Measured on an H200 host (bench `process`, seeds' run): after 1.08x the floor with the eval stage 1.02x warm;
    off 1.18x / 1.56x; beside 1.36x and empty 1.30x, their throwaway weights' allocation taking 3 s beside the
    load's copies (0.0 s after it)."""
    v = os.environ.get("REVAL_WARMUP", "").strip().lower()
    v = {"": "after", "0": "off", "1": "beside"}.get(v, v)
    return v if v in WARMUP_MODES else "after"


def warm_up(cfg, device: torch.device, dtype: torch.dtype, *, seq_len: int, prompt_len: int, n: int,
            batch_size: int, budgets: list[int], widths: list[int], model=None, head=None) -> dict | None:
    """One prompt's drafting (and its host copies) on zero features, so that the kernels are loaded, cuBLAS,
    cuDNN's attention plans and Triton ready and the allocator holds the blocks the eval needs. CUDA only.
    With model/head (mode `after`): the real weights. Without (modes `beside`, `empty`): throwaway weights of
    `cfg`'s shapes, random or uninitialised, only when the device has room for a second copy of the weights.
    Returns the seconds of its parts ({"alloc", "queue", "wait"}) or None when it did not run."""
    mode = warmup_mode()
    if device.type != "cuda" or n < 1 or mode == "off" or (model is None) != (mode != "after"):
        return None
    import time

    from .drafter import DFlashDrafter, TargetHead
    from .kernels import prepare
    t0 = time.perf_counter()
    n = min(n, 2 * batch_size + n % batch_size)  # every shape the prompt's batches take, not all of them
    if model is None:
        with torch.device("meta"):
            model = DFlashDrafter(cfg).to(dtype)
        V, H = cfg.vocab_size, cfg.hidden_size
        weights = (sum(p.numel() for p in model.parameters()) + V * H) * dtype.itemsize
        if torch.cuda.mem_get_info(device)[0] < 2 * weights + (8 << 30):  # the real weights load meanwhile
            return None
        model = model.to_empty(device=device)
        table = torch.empty(V, H, device=device, dtype=dtype)
        if mode == "beside":
            for p in model.parameters():
                p.data.normal_(0, p.shape[-1] ** -0.5) if p.dim() == 2 else p.data.fill_(1.0)
            table.normal_(0, H ** -0.5)
        model.fuse_projections()
        head = TargetHead(table, table)
    prepare(device)
    t1 = time.perf_counter()
    feats = torch.zeros(seq_len, cfg.fc_in_features, dtype=dtype, device=device)
    ids = torch.randint(0, cfg.vocab_size, (seq_len,), device=device)
    pending = enqueue_anchors(model, head, feats, ids, prompt_len, n, batch_size=batch_size, budgets=budgets,
                              widths=widths)
    t2 = time.perf_counter()
    pending.event.synchronize()
    return {"alloc": t1 - t0, "queue": t2 - t1, "wait": time.perf_counter() - t2}
