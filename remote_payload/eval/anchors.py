"""Drafting at every anchor of a prompt, queued on the device with no host sync until its outputs are needed.

`enqueue_anchors` queues one prompt's whole drafting (context K/V once, batches of anchors, lm_head + top-k,
the targets' ranks, the DDTree acceptance's device half) and the copies of its small outputs into pinned host
memory; `PendingAnchors.result()` waits for them (the one sync). `drafted_prompts` keeps the device a prompt
ahead of the host: prompt i+1's features are read and checked by a thread and its drafting queued before
prompt i's outputs are waited for, so the walks and metrics of prompt i run while the device computes.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from remote_payload.contract.errors import PayloadError
from remote_payload.eval import metrics


@dataclass
class AnchorOutputs:
    """Per-anchor results of one prompt, anchors a = prompt_len + j (metrics.py conventions)."""

    drafts: np.ndarray  # [n, bs-1] int
    target_rank: np.ndarray  # [n, bs-1] int, -1 past the end
    topk_logprobs: torch.Tensor | None  # [n, bs-1, K] fp32 sorted descending, on the device (DDTree)
    tree_acc: dict | None = None  # {budget: acc [n]} (DDTree), computed with the drafts
    target_q: np.ndarray | None = None  # [n, bs-1] float: log q(g[a+k]) under a sampling transform (sampled drafts)


class PendingAnchors:
    """One prompt's queued drafting; `result()` waits for its outputs (the only host sync)."""

    def __init__(self, drafts, ranks, topk, finite, acc, tied, budgets, target_q=None):
        """On CUDA the copies are queued on the current stream (the caller's side stream, where the DDTree ran)."""
        self.topk, self.ranks, self.budgets = topk, ranks, budgets
        small = [drafts, ranks, finite, acc, tied] + ([] if target_q is None else [target_q])
        self.event = None
        if drafts.device.type == "cuda":
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in small]
            for h, t in zip(self.host, small):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            self._sources = small  # alive until the copies are done: freed earlier, another stream could reuse them
        else:
            self.host = small

    def result(self) -> AnchorOutputs:
        if self.event is not None:
            self.event.synchronize()
            self._sources = None
        drafts, ranks, finite, acc, tied, *q = self.host
        if not bool(finite):
            raise PayloadError("drafter produced NaN/inf logits: check the weights' dtype and the cache features")
        tree_acc = (metrics.ddtree_resolve(acc.numpy(), tied.numpy(), self.topk, self.ranks, self.budgets)
                    if self.budgets else None)
        return AnchorOutputs(drafts.numpy(), ranks.numpy(), self.topk, tree_acc, q[0].numpy() if q else None)


@torch.inference_mode()
def enqueue_anchors(drafter, head, feats: torch.Tensor, ids: torch.Tensor, prompt_len: int, n: int, *,
                    batch_size: int, budgets: list[int], widths: list[int] = (),
                    transform: tuple | None = None) -> PendingAnchors:
    """feats [T, n_fc*H], ids [T] (both on the drafter's device) -> the queued outputs at anchors
    prompt_len..prompt_len+n-1. Targets are g[a+k] (k = 1..bs-1), -1 past the end. transform (sampled
    drafts): also log q(g[a+k]) under it (`_target_q`)."""
    from remote_payload.eval.drafter import logits_topk
    bs = drafter.cfg.block_size
    dev, T = feats.device, ids.shape[0]
    # top-k per row: DDTree needs the top-B values, width-k trees ranks below k (ranks are capped at k)
    k = min(max([*budgets, *widths, 1]), drafter.cfg.vocab_size)
    ctx = drafter.precompute_context(feats)  # context K/V once per prompt
    offsets = torch.arange(1, bs, device=dev)
    lanes = _Lanes(dev)
    finite, drafts, ranks, topk, qs = [], [], [], [], []
    for j, s in enumerate(range(0, n, batch_size)):
        with lanes.batch(j):
            lo, hi = prompt_len + s, prompt_len + min(n, s + batch_size)
            anchors = torch.arange(lo, hi, device=dev)  # [m]
            hidden = drafter.draft_hidden(ctx, anchors, ids[anchors], head, bounds=(lo, hi - 1))  # [m, bs, H]
            pos = anchors[:, None] + offsets  # [m, bs-1]
            tgt = torch.where(pos < T, ids[pos.clamp(max=T - 1)], -1)
            out = logits_topk(hidden, head, k, target_ids=tgt.clamp(min=0))
            if transform is not None:
                qs.append(_target_q(hidden, head, tgt.clamp(min=0), transform))
            finite.append(torch.isfinite(out.topk_logprobs[..., 0]).all())
            drafts.append(out.argmax_ids)
            ranks.append(out.target_ranks.masked_fill(tgt < 0, -1))
            if budgets:
                topk.append(out.topk_logprobs)
    lanes.join()
    width = bs - 1
    finite_t = torch.stack(finite).all() if finite else torch.ones((), dtype=torch.bool, device=dev)
    drafts_t = torch.cat(drafts) if drafts else torch.zeros(0, width, dtype=torch.long, device=dev)
    ranks_t = torch.cat(ranks) if ranks else torch.zeros(0, width, dtype=torch.long, device=dev)
    topk_t = (torch.cat(topk) if topk else torch.zeros(0, width, k, device=dev)) if budgets else None
    with lanes.tail():  # the DDTree and the host copies beside the next prompt's drafting
        if budgets:
            acc, tied = metrics.ddtree_accept_device(topk_t, ranks_t, budgets)
        else:
            acc = tied = torch.zeros(0, device=dev)
        q_t = None if transform is None else (torch.cat(qs) if qs else torch.zeros(0, width, device=dev))
        return PendingAnchors(drafts_t, ranks_t, topk_t, finite_t, acc, tied, sorted(set(budgets)), q_t)


def _target_q(hidden: torch.Tensor, head, tgt: torch.Tensor, transform: tuple) -> torch.Tensor:
    """hidden [m, bs, H], tgt [m, bs-1] -> [m, bs-1] fp32: log q(tgt) under the sampling transform, q the drafter's
    distribution at each block position (the lm_head GEMM as logits_topk runs it, then sampling.token_logprobs)."""
    from remote_payload.eval.sampling import token_logprobs
    rows = hidden[:, 1:, :].contiguous().view(-1, hidden.shape[-1])
    logits = torch.nn.functional.linear(rows, head.lm_head.to(rows.dtype))
    return token_logprobs(logits, tgt.reshape(-1), *transform).view(tgt.shape)


class _Lanes:
    """CUDA streams for one prompt's drafting: batch j runs on lane j % 2, so one batch's memory-bound tail
    (logsumexp, top-k, ranks) runs beside the next batch's GEMMs; the DDTree and the host copies run on a
    third stream beside the next prompt. Every lane waits for the current stream's work (the context K/V, the
    features' copies) before its first batch; `join` makes the current stream wait for both. Kernels and their
    order per batch are those of one stream: the outputs are the same numbers (tests/gpu).
    REVAL_STREAMS=1 runs everything on the current stream. CPU: no streams."""

    def __init__(self, dev: torch.device):
        self.on = dev.type == "cuda" and os.environ.get("REVAL_STREAMS", "").strip() != "1"
        if self.on:
            self.main = torch.cuda.current_stream(dev)
            if str(dev) not in _LANES:  # made once per device, kept for the process
                _LANES[str(dev)] = [torch.cuda.Stream(dev) for _ in range(3)]
            *self.lanes, self.side = _LANES[str(dev)]
            self.waited: set[int] = set()

    def batch(self, j: int):
        if not self.on:
            return contextlib.nullcontext()
        lane = self.lanes[j % 2]
        if j % 2 not in self.waited:
            lane.wait_stream(self.main)
            self.waited.add(j % 2)
        return torch.cuda.stream(lane)

    def join(self) -> None:
        if self.on:
            for j in self.waited:
                self.main.wait_stream(self.lanes[j])

    def tail(self):
        if not self.on:
            return contextlib.nullcontext()
        self.side.wait_stream(self.main)
        return torch.cuda.stream(self.side)


_LANES: dict[str, list] = {}


def draft_all_anchors(drafter, head, feats: torch.Tensor, ids: torch.Tensor, prompt_len: int, n: int, *,
                      batch_size: int, budgets: list[int], widths: list[int] = ()) -> AnchorOutputs:
    """feats [T, n_fc*H] (on the drafter's device), ids [T] -> outputs at anchors prompt_len..prompt_len+n-1."""
    return enqueue_anchors(drafter, head, feats, ids.to(feats.device), prompt_len, n, batch_size=batch_size,
                           budgets=budgets, widths=widths).result()


def drafted_prompts(drafter, head, cache, count: int, anchors_of: Callable[[int], int], *, device: torch.device,
                    dtype: torch.dtype, batch_size: int, budgets: list[int], widths: list[int],
                    transform: tuple | None = None) -> Iterator[tuple[int, torch.Tensor, AnchorOutputs]]:
    """(i, ids [T] on the CPU, outputs) for cache prompts 0..count-1 in order, the device one prompt ahead.
    anchors_of(i): how many anchors of prompt i to draft. Token ids outside the vocabulary are bad input."""
    from remote_payload.eval.kernels import plan
    cfg = drafter.cfg
    pin = device.type == "cuda"
    if pin:
        plan(sum(anchors_of(i) for i in range(count)) * (cfg.block_size - 1) * cfg.vocab_size, device)

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
                                     budgets=budgets, widths=widths, transform=transform)
            if pending is not None:
                yield pending[0], pending[1], pending[2].result()
            pending = (i, ids, queued, feats)  # feats: the pinned source stays alive until the copy is done
        if pending is not None:
            yield pending[0], pending[1], pending[2].result()


def warmup_mode() -> str:
    """REVAL_WARMUP: after (default; also 1) | off (also 0). `prime` runs beside the load, `warm_up` after it.
    Warming up *during* the load on throwaway full-size weights was slower (allocating them fought the load's
    copies), so that mode is gone; the prime drafts on a miniature (~0.3 GB) instead (docs/benchmarks.md)."""
    return "off" if os.environ.get("REVAL_WARMUP", "").strip().lower() in ("0", "off") else "after"


PRIME_HIDDEN = 256  # the miniature's hidden and intermediate sizes (its heads keep the drafter's count and size)


def prime(cfg, device: torch.device, dtype: torch.dtype, *, batch_size: int, budgets: list[int],
          widths: list[int]) -> float | None:
    """While the weights load (on a thread of its own): the drafting's code path once on a miniature of the
    drafter (the same layer types, heads, head size, block size and vocabulary; hidden and MLP 256 wide; zero
    weights and features), so that a process's first calls (CUDA's lazy loading of each kernel, cuBLAS's and
    cuDNN's start, cuDNN's attention kernel compiled at run time, the CUDA C kernels' load, Triton's start) are
    paid beside the load rather than in `warm_up` after it. Nothing it computes is kept. CUDA only
    (`warmup_mode`). Seconds, or None when it did not run."""
    if device.type != "cuda" or warmup_mode() == "off":
        return None
    return _prime_run(cfg, device, dtype, batch_size=batch_size, budgets=budgets, widths=widths)


@torch.inference_mode()
def _prime_run(cfg, device, dtype, *, batch_size, budgets, widths) -> float:
    import time

    from remote_payload.contract.drafterconfig import DrafterConfig
    from remote_payload.eval.drafter import DFlashDrafter, TargetHead
    t = time.perf_counter()
    d = {**cfg.to_dict(), "hidden_size": PRIME_HIDDEN, "intermediate_size": PRIME_HIDDEN}
    small = DrafterConfig.from_dict(d, source="the warm-up's miniature", allow_unknown=cfg.allowed_unknown)
    with torch.device(device):
        drafter = DFlashDrafter(small).to(dtype)
        for p in drafter.parameters():
            p.zero_()
        head = torch.zeros(small.vocab_size, PRIME_HIDDEN, dtype=dtype)
    bs, prompt_len = small.block_size, 8  # a prompt of 8 tokens and 4 blocks; 2 blocks' anchors drafted
    _warm_run(drafter, TargetHead(head, head), device, dtype, seq_len=prompt_len + 4 * bs, prompt_len=prompt_len,
              n=2 * bs, batch_size=batch_size, budgets=budgets, widths=widths)
    return time.perf_counter() - t


@torch.inference_mode()
def warm_up(drafter, head, device: torch.device, dtype: torch.dtype, *, seq_len: int, prompt_len: int, n: int,
            batch_size: int, budgets: list[int], widths: list[int]) -> dict | None:
    """One prompt's drafting (and its host copies) with the loaded weights on zero features, so that the
    kernels are loaded, cuBLAS, cuDNN's attention plans and Triton ready and the allocator holds the blocks the
    eval needs: every shape of a prompt of `seq_len` tokens, `n` anchors. CUDA only (`warmup_mode`).
    Returns the seconds of its parts ({"queue", "wait"}) or None when it did not run."""
    if device.type != "cuda" or n < 1 or warmup_mode() == "off":
        return None
    return _warm_run(drafter, head, device, dtype, seq_len=seq_len, prompt_len=prompt_len, n=n,
                     batch_size=batch_size, budgets=budgets, widths=widths)


def _warm_run(drafter, head, device, dtype, *, seq_len, prompt_len, n, batch_size, budgets, widths) -> dict:
    import time

    from remote_payload.eval.kernels import prepare
    prepare(device)
    t0 = time.perf_counter()
    n = min(n, 2 * batch_size + n % batch_size)  # every shape the prompt's batches take, not all of them
    feats = torch.zeros(seq_len, drafter.cfg.fc_in_features, dtype=dtype, device=device)
    ids = torch.randint(0, drafter.cfg.vocab_size, (seq_len,), device=device)
    pending = enqueue_anchors(drafter, head, feats, ids, prompt_len, n, batch_size=batch_size, budgets=budgets,
                              widths=widths)
    t1 = time.perf_counter()
    if pending.event is not None:
        pending.event.synchronize()
    return {"queue": t1 - t0, "wait": time.perf_counter() - t1}
