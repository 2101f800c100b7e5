"""Greedy decoding at the GPU's memory-bandwidth pace: a static KV cache, one fixed-shape decode step captured
as a CUDA graph, the argmax on the device and eos looked at every few steps (no host sync per step).

`greedy_static` computes what `target.greedy_complete_batch` computes (left padding, pads masked out, positions
counted from each prompt's first real token; a row ends at its eos, kept): the same model, the same masks, the
keys of a row being its prompt and its completion so far. What differs is the shape: the KV cache holds
`P + max_new_tokens (+1)` slots from the start (StaticCache), so every decode step has the same shapes and one
captured graph replays it. The attention mask is built here as a 4D additive mask (transformers uses a 4D mask
as given), so nothing in the step depends on host-side values.

On the CPU (or with graphs=False) the same step runs eagerly: the tests compare it with the dynamic-cache
decoder token for token.
"""
from __future__ import annotations

import torch


def _bucket(n: int, to: int) -> int:
    return -(-n // to) * to


def cache_kw(model) -> str:
    """The forward's name for the KV cache: `cache` in newer transformers, `past_key_values` before."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class _StaticStep:
    """One decode step over fixed buffers: reads tok/pos/cp/mask, writes the argmax into out and advances them."""

    def __init__(self, model, cache, tok, pos, cp, mask, out, P: int, forward=None):
        self.model, self.cache, self.P, self.kw = model, cache, P, cache_kw(model)
        self.forward = forward or model
        self.tok, self.pos, self.cp, self.mask, self.out = tok, pos, cp, mask, out
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self) -> None:
        logits = self.forward(input_ids=self.tok, attention_mask=self.mask, position_ids=self.pos,
                            cache_position=self.cp, use_cache=True, logits_to_keep=1,
                            **{self.kw: self.cache}).logits  # [B, 1, V]
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1] long, on the device
        self.out.index_copy_(1, self.cp - self.P, nxt)  # out [B, max_new]: column cp-P
        self.tok.copy_(nxt)
        self.pos.add_(1)
        self.mask.index_fill_(3, self.cp + 1, 0.0)  # the next token's slot becomes visible
        self.cp.add_(1)

    def capture(self) -> None:
        """Capture one step as a CUDA graph. The steps before it ran for real (the warm-up is real progress), so
        every state the model or the cache keeps on the device, ours or its own, stays consistent."""
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self()

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self()


def _compiled(model):
    """model.forward through torch.compile (fusion only: the CUDA graph is ours), once per model."""
    fn = getattr(model, "_reval_compiled_forward", None)
    if fn is None:
        fn = torch.compile(model.forward, dynamic=False)
        model._reval_compiled_forward = fn
    return fn


def _static_cache(model, B: int, L: int, device, dtype):
    from transformers import StaticCache
    cfg = model.config
    for kw in ({"config": cfg, "max_batch_size": B, "max_cache_len": L, "device": device, "dtype": dtype},
               {"config": cfg, "max_cache_len": L}):
        try:
            return StaticCache(**kw)
        except TypeError:
            continue
    raise RuntimeError("this transformers' StaticCache takes neither (config, max_batch_size, max_cache_len, ...) "
                       "nor (config, max_cache_len)")


@torch.no_grad()
def greedy_static(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int], pad_id: int = 0, *,
                  graphs: bool | None = None, compile: bool = False, eos_every: int = 16,
                  bucket: int = 64) -> list[list[int]]:
    """Greedy completions of `prompts` (token id lists) at once; rows as `greedy_complete_batch` returns them.

    graphs: capture the decode step as a CUDA graph (default: on CUDA). eos_every: steps between the host's
    looks at the generated tokens (the only syncs of the loop). bucket: the padded prompt length is a multiple
    of it, so a few shapes serve many batches. compile: run the step through torch.compile (kernel fusion;
    compiled once per model and shape) before capturing it."""
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    graphs = dev.type == "cuda" if graphs is None else graphs
    B = len(prompts)
    P = _bucket(max(len(p) for p in prompts), bucket)
    L = P + max_new_tokens + 1  # +1: the slot the step after the last one would make visible
    lens = torch.tensor([len(p) for p in prompts])
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    real = torch.zeros((B, L), dtype=torch.bool)  # key slots holding a real token of the row
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        real[i, P - len(p):P] = True
    ids, real = ids.to(dev), real.to(dev)
    neg = torch.finfo(dtype).min
    # prefill: query i (slot i) sees key slot j iff j <= i and j is real; a pad query sees itself (kept finite)
    slots = torch.arange(P, device=dev)
    causal = slots[None, :] <= slots[:, None]  # [P, P]
    vis = causal[None] & real[:, None, :P]  # [B, P, P]
    vis |= torch.eye(P, dtype=torch.bool, device=dev)[None]
    pre_mask = torch.zeros((B, 1, P, L), dtype=dtype, device=dev).masked_fill_(
        ~torch.cat([vis, torch.zeros((B, P, L - P), dtype=torch.bool, device=dev)], 2)[:, None], neg)
    pos = (real[:, :P].long().cumsum(1) - 1).clamp(min=0)  # [B, P]
    cache = _static_cache(model, B, L, dev, dtype)
    logits = model(input_ids=ids, attention_mask=pre_mask, position_ids=pos, cache_position=torch.arange(P, device=dev),
                   use_cache=True, logits_to_keep=1, **{cache_kw(model): cache}).logits
    first = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]

    # decode buffers (fixed for the whole loop): the token to feed, its position, its cache slot, the mask
    tok = first.clone()
    posb = (lens.to(dev)[:, None]).clone()  # the first completion token's position = the prompt's length
    cp = torch.tensor([P], dtype=torch.long, device=dev)
    mask = torch.zeros((B, 1, 1, L), dtype=dtype, device=dev).masked_fill_(~real[:, None, None, :], neg)
    mask[..., P] = 0.0  # slot P: the first completion token, fed by the first step
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=dev)
    out[:, :1] = first
    step = _StaticStep(model, cache, tok, posb, cp, mask, out, P - 1,  # step k writes column cp - (P - 1)
                       forward=_compiled(model) if compile else None)
    done = 1
    if graphs and max_new_tokens > 3:
        side = torch.cuda.Stream()  # warm-up (allocations, kernel choice, compilation): 2 real steps
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
            step()
        torch.cuda.current_stream().wait_stream(side)
        done = 3
        step.capture()
    eos = torch.tensor(sorted(eos_ids) or [-1], device=dev)
    while done < max_new_tokens:
        n = min(eos_every, max_new_tokens - done)
        for _ in range(n):
            step.step()
        done += n
        if bool(torch.isin(out[:, :done], eos).any(1).all()):  # one host sync per eos_every steps
            break
    rows = out[:, :done].tolist()
    result = []
    for p, r in zip(prompts, rows):
        comp = []
        for t in r:
            comp.append(t)
            if t in eos_ids:
                break
        result.append(list(p) + comp)
    return result
