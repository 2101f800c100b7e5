"""The target's steps as `latency.measure` times them: trees and their masks, and one forward over a static KV
cache.

The target runs over a static KV cache of `context_len` positions (filled once by a prefill, never grown: a step
writes its n rows into the slots after the context and attends over context + n keys), so repeated calls are the
same call. A DDTree verify feeds the tree of `metrics.ddtree_build` over synthetic sorted logprobs (the tree's
shape sets positions and the mask, not the FLOPs) with the tree attention mask (`tree_mask`: a node sees the
context, its ancestors and itself) at positions context_len + depth.

Attention: where the target runs HF's SDPA, `measure` runs it through `_gqa_sdpa` (registered in HF's
AttentionInterface for the measurement only): the same SDPA, the query heads that share a kv head folded into
the query rows, so the KV cache is read in place rather than copied g times as HF's SDPA does under any mask.
A decode step (one token) goes without a mask, as HF decodes. The key says which attention ran.

Hybrid targets (linear-attention layers, Qwen3.5/3.6) are not modelled faithfully: those layers ignore the tree
mask (timing only; a real tree verify of such a layer costs more than this chain-shaped one).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

# ---------------------------------------------------------------- trees and their mask

def tree_mask(parents: list[int]) -> torch.Tensor:
    """parents[i] = index of node i's parent (< i), negative for a root -> mask [n, n] bool: mask[i, j] iff
    node j is node i or one of its ancestors (what node i may attend to among the tree's nodes)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        p = int(p)
        if p >= i:
            raise ValueError(f"tree_mask: node {i}'s parent {p} must come before it (parents[i] < i)")
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of every node (a root is 0), parents as in `tree_mask`."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        if int(p) >= i:
            raise ValueError(f"tree_depths: node {i}'s parent {p} must come before it (parents[i] < i)")
        depths.append(depths[int(p)] + 1 if int(p) >= 0 else 0)
    return depths


def ddtree_parents(nodes: list[tuple[int, ...]]) -> list[int]:
    """`metrics.ddtree_build`'s nodes (rank tuples in pop order) -> parents of [root, *nodes]: the root (the
    bonus token) is node 0, nodes[j] is node j + 1. A prefix is popped before its extensions, so parents[i] < i."""
    index = {ranks: j + 1 for j, ranks in enumerate(nodes)}
    parents = [-1]
    for ranks in nodes:
        p = index.get(ranks[:-1], 0) if len(ranks) > 1 else 0
        if len(ranks) > 1 and ranks[:-1] not in index:
            raise ValueError(f"ddtree_parents: node {ranks} has no parent {ranks[:-1]} in the tree")
        parents.append(p)
    return parents


def synthetic_logprobs(depth: int, k: int) -> np.ndarray:
    """[depth, k] sorted descending: a drafter sure of its first positions and less so further on (rank r at
    depth d ~ exp(-r * 2 * 0.85^d)): a tree of plausible shape, deterministic."""
    r = np.arange(k, dtype=np.float64)
    rows = []
    for d in range(depth):
        logits = -r * 2.0 * 0.85 ** d
        rows.append(logits - np.log(np.exp(logits).sum()))
    return np.array(rows).reshape(depth, k)


def ddtree_tree(budget: int, block_size: int) -> list[int]:
    """Parents of the DDTree a verify of budget B feeds (B + 1 nodes, root first), built by `metrics.ddtree_build`
    on `synthetic_logprobs` over the block's block_size - 1 draft positions."""
    from remote_payload.eval.metrics import ddtree_build
    if budget < 1 or block_size < 2:
        raise ValueError(f"ddtree_tree: budget {budget} and block_size {block_size} must be >= 1 and >= 2")
    nodes = ddtree_build(synthetic_logprobs(block_size - 1, budget), budget)
    return ddtree_parents(nodes)


def chain(n: int) -> list[int]:
    """Parents of a chain of n nodes: the causal block (a linear DFlash verify, or one decode token)."""
    return [i - 1 for i in range(n)]


# ---------------------------------------------------------------- the target over a static KV cache

def _slot_cache(model, capacity: int):
    """A KV cache of `capacity` fixed slots per layer: `update` writes the new rows at `offset` (set by the
    caller) and returns keys/values [:offset + n]. Nothing grows and nothing moves, so one step can run again and
    again (and be captured in a CUDA graph). A DynamicCache subclass, so HF's isinstance checks hold across
    versions; only `update` and `get_seq_length` are ours."""
    from transformers import DynamicCache

    class SlotCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            end = self.offset + key_states.shape[-2]
            if end > self.capacity:
                raise ValueError(f"slot cache: {end} positions asked of a cache of {self.capacity}")
            if layer_idx not in self.slots:
                shape_k = (*key_states.shape[:-2], self.capacity, key_states.shape[-1])
                shape_v = (*value_states.shape[:-2], self.capacity, value_states.shape[-1])
                self.slots[layer_idx] = (key_states.new_zeros(shape_k), value_states.new_zeros(shape_v))
            k, v = self.slots[layer_idx]
            k[..., self.offset:end, :].copy_(key_states)
            v[..., self.offset:end, :].copy_(value_states)
            return k[..., :end, :], v[..., :end, :]

        def get_seq_length(self, layer_idx: int = 0):
            return self.offset

    try:  # hybrid targets need the config to lay out their (linear-attention) cache: as target.forward.new_kv
        cache = SlotCache(config=model.config)
    except TypeError:
        cache = SlotCache()
    cache.capacity, cache.offset, cache.slots = capacity, 0, {}
    return cache


GQA_ATTENTION = "reval_gqa_sdpa"  # our attention function's name in HF's AttentionInterface


def _gqa_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention function: SDPA with the g query heads sharing a kv head as extra query rows, so K/V are read
    in place. HF's own SDPA copies K/V g times (repeat_kv) whenever there is a mask — every verify step (what it
    costs: docs/benchmarks.md). Without a mask (a decode step) it is HF's call: SDPA's own GQA, whose flash
    kernel runs a CTA per query head. query [B, h, n, d], key/value [B, kvh, L, d], attention_mask None or
    additive [., 1, n or g*n, >= L] (`_Step` passes g*n rows) -> ([B, n, h, d], None), as HF's functions
    return."""
    import torch.nn.functional as F
    b, h, n, d = query.shape
    kvh, length = key.shape[1], key.shape[-2]
    g = h // kvh
    if attention_mask is None:  # a decode step: SDPA's own GQA (its flash kernel, a CTA per query head), as HF
        try:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=n > 1, scale=scaling, enable_gqa=True)
        except TypeError:  # torch < 2.5
            out = F.scaled_dot_product_attention(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1),
                                                 is_causal=n > 1, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    q = query.reshape(b, kvh, g * n, d)  # head j*g + i -> kv head j, rows i*n .. i*n + n - 1
    mask = attention_mask[..., :length]
    if mask.shape[-2] != g * n:
        mask = mask.repeat(1, 1, g, 1)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, kvh * g, n, d).transpose(1, 2).contiguous(), None


def _attention(model) -> str:
    """The attention `measure` runs: ours (`_gqa_sdpa`) where the model runs HF's SDPA and this transformers can
    register a function, else the model's own."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        return str(impl)
    try:
        from transformers import AttentionInterface
    except ImportError:
        return impl
    AttentionInterface.register(GQA_ATTENTION, _gqa_sdpa)
    return GQA_ATTENTION


@contextlib.contextmanager
def _attention_of(model, impl: str):
    """The model runs `impl` inside the block (its own attention restored after)."""
    old = model.config._attn_implementation
    if impl == old:
        yield
        return
    model.config._attn_implementation = impl
    try:
        yield
    finally:
        model.config._attn_implementation = old


def _groups(model, impl: str) -> int:
    """Query heads per kv head when `impl` is ours (the mask is then built with g * n rows), else 1."""
    if impl != GQA_ATTENTION:
        return 1
    cfg = model.config.get_text_config()
    return int(cfg.num_attention_heads) // int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


class _Step:
    """One target forward of the tree `parents` (node ids `ids`) over the first `offset` cache slots, with static
    inputs: calling it again runs the same kernels on the same buffers. Returns the logits [n, V] ([batch, n, V]
    for batch > 1: the same tree fed for each of `batch` sequences, over a cache of that batch: `_batched_cache`)."""

    def __init__(self, model, cache, ids: torch.Tensor, parents: list[int], offset: int, groups: int = 1,
                 batch: int = 1):
        dev = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        n = len(parents)
        if ids.shape != (n,):
            raise ValueError(f"{n} tree nodes need {n} token ids, got shape {list(ids.shape)}")
        self.model, self.cache, self.offset, self.batch = model, cache, offset, batch
        self.ids = ids.to(dev)[None].expand(batch, n).contiguous()
        self.pos = (offset + torch.tensor(tree_depths(parents)))[None].to(dev).expand(batch, n).contiguous()
        visible = torch.cat([torch.ones(n, offset, dtype=torch.bool), tree_mask(parents)], dim=1)
        # additive (0 / dtype min) [1, 1, n, offset + n]: what HF's attention functions take as is. Rows repeated
        # `groups` times for `_gqa_sdpa`; columns a view into a buffer padded to 16 (SDPA's kernels want the
        # mask's rows aligned, and would otherwise pad a copy on every call).
        length = offset + n
        padded = torch.full((n, -(-length // 16) * 16), torch.finfo(dtype).min, dtype=dtype)
        padded[:, :length].masked_fill_(visible, 0)
        self.mask = padded.repeat(groups, 1)[None, None].to(dev)[..., :length]
        # One token sees everything: no mask at all, as HF decodes (SDPA may then take its flash kernel; a
        # materialised mask slows a decode step down). Passed as HF's prepared mask
        # mapping, one None per layer type; a transformers that does not take one gets the 4D mask instead.
        self.mask_map = None
        if n == 1:
            types = getattr(model.config.get_text_config(), "layer_types", None) or []
            self.mask_map = dict.fromkeys({"full_attention", "sliding_attention", *types})

    def __call__(self) -> torch.Tensor:
        self.cache.offset = self.offset
        # positional: the cache's keyword is `past_key_values` or `cache` by transformers version
        if self.mask_map is not None:
            try:
                return self._out(self.model(self.ids, self.mask_map, self.pos, self.cache, use_cache=True).logits)
            except Exception:  # noqa: BLE001 - not taken by this transformers (first call, eager: never captured)
                self.mask_map = None
        return self._out(self.model(self.ids, self.mask, self.pos, self.cache, use_cache=True).logits)

    def _out(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[0] if self.batch == 1 else logits


def _batched_cache(model, cache, batch: int):
    """A slot cache of `batch` sequences, each a copy of `cache`'s (batch 1, prefilled): what a batch of that many
    sequences at the same context length holds (the same bytes read per step; the values do not change the cost)."""
    out = _slot_cache(model, cache.capacity)
    out.slots = {i: (k.repeat(batch, 1, 1, 1), v.repeat(batch, 1, 1, 1)) for i, (k, v) in cache.slots.items()}
    return out


PREFILL_CHUNK = 1024  # the prefill's tokens per forward: its masks stay [chunk, offset + chunk], not [T, T]


def _prefill(model, cache, context_ids: torch.Tensor, groups: int = 1) -> None:
    for lo in range(0, len(context_ids), PREFILL_CHUNK):
        part = context_ids[lo:lo + PREFILL_CHUNK]
        _Step(model, cache, part, chain(len(part)), lo, groups)()
