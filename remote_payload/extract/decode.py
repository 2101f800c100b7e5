"""How `extract` generates the completions: a batch of prompts at once, greedy or sampled, one KV cache.

`greedy_complete_batch` is the dynamic-cache reference (left padding, each row what target.forward's batch-1
`greedy_complete` computes); `choose_generator` picks fastgen.greedy_static (static KV cache, the decode step
a CUDA graph on CUDA) where the target allows it (`static_refusal`), and `generation_record` is cache.json's
"generation": how the cached completions were made. `Sampler` is the sampled regime's token choice (issue 29),
the same in both decoders: a row's token at decode step k is the transform's inverse CDF at the k-th uniform of the
row's own generator, so the batch around it never changes its draws.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from remote_payload.eval.regime import Regime
from remote_payload.eval.sampling import generator_for, sample_with_uniforms, transform_logprobs
from remote_payload.target.forward import last_logits_kw, new_kv


@dataclass
class Sampler:
    """The sampled regime's pick for a batch: the transform (temperature, top-k, top-p) and each row's uniforms
    [B, max_new_tokens] float64, uniform k for decode step k (step 0: the token after the prompt), drawn at once
    from the row's generator (`draws`). Graph-safe: `col` may be a device tensor [1]."""
    transform: tuple[float, int, float]
    uniforms: torch.Tensor

    def to(self, device) -> Sampler:
        return Sampler(self.transform, self.uniforms.to(device))

    def __call__(self, logits: torch.Tensor, col) -> torch.Tensor:
        """logits [B, V] -> tokens [B] long."""
        u = self.uniforms.index_select(1, col).squeeze(1) if torch.is_tensor(col) else self.uniforms[:, col]
        return sample_with_uniforms(transform_logprobs(logits, *self.transform), u)


def draws(regime: Regime, rows: list[tuple[str, int]], max_new_tokens: int) -> Sampler:
    """One row per (prompt key, sample index): its uniforms from generator_for(seed, key, sample) (CPU)."""
    u = torch.stack([torch.rand(max_new_tokens, dtype=torch.float64, generator=generator_for(regime.seed, k, s))
                     for k, s in rows])
    return Sampler(regime.transform, u)


@torch.no_grad()
def greedy_complete_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int],
                          pad_id: int = 0, sampler: Sampler | None = None) -> list[list[int]]:
    """Greedy completions of several prompts at once, one KV cache: prompts are LEFT-padded, pads masked
    out and positions counted from each prompt's first real token, so every row computes what an unbatched
    `greedy_complete` computes. A row stops at its eos (kept); the batch stops when all rows have.
    sampler: the sampled regime's pick instead of the argmax (`Sampler`)."""
    dev = next(model.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    kv, keep = new_kv(model), last_logits_kw(model)
    logits = model(ids, mask, pos, kv, use_cache=True, **keep).logits[:, -1]
    out = [list(p) for p in prompts]
    live = list(range(B))
    nxt_pos = pos[:, -1:] + 1
    if sampler is not None:
        sampler = sampler.to(dev)
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1) if sampler is None else sampler(logits, step)  # [B]
        toks = nxt.tolist()  # one host sync a step for the whole batch
        for i in list(live):
            out[i].append(toks[i])
            if toks[i] in eos_ids:
                live.remove(i)
        if not live or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
        logits = model(nxt[:, None], mask, nxt_pos, kv, use_cache=True, **keep).logits[:, -1]
        nxt_pos = nxt_pos + 1
    return out


@dataclass
class Generator:
    """How `extract` generates the completions: `fastgen.greedy_static` (static KV cache; the decode step a CUDA
    graph on CUDA) where the target allows it, else `greedy_complete_batch` (the dynamic-cache reference: the
    same tokens, row for row); `why` says why not greedy_static. compile: the CUDA graph's step is traced
    through torch.compile first (kernel fusion; about a minute once per batch shape, see make bench-decode).
    The decode steps' attention is fastgen.grouped_decode_attention where transformers takes it (on CUDA in
    bf16/fp16 with Triton: its split-KV kernels over the filled slots; cache.json says which); on CUDA in bf16
    their RMSNorms, SiLU MLPs and RoPE are Triton passes (fastgen.FusedLayers; cache.json's decode_fused)."""
    name: str
    graphs: bool = False
    why: str | None = None
    compile: bool = False

    def __call__(self, model, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                 sampler: Sampler | None = None) -> list[list[int]]:
        if self.name == "greedy_static":
            from remote_payload.extract.fastgen import greedy_static
            return greedy_static(model, prompts, max_new_tokens, eos, graphs=self.graphs, compile=self.compile,
                                 sampler=sampler)
        return greedy_complete_batch(model, prompts, max_new_tokens, eos, sampler=sampler)


def static_refusal(model) -> str | None:
    """Why `greedy_static` would not compute what `greedy_complete_batch` does on this model, or None. Its 4D
    mask is plain causal: no sliding windows, no linear-attention (recurrent) layers; one device."""
    cfg = model.config.get_text_config()
    types = list(getattr(cfg, "layer_types", None) or [])
    other = sorted(set(types) - {"full_attention"})
    if other:
        return f"layer types {other}"
    if not types and getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "a sliding window"
    if len({p.device for p in model.parameters()}) > 1:
        return "spread over several devices"
    return None


def choose_generator(model, compile: bool = False) -> Generator:
    """compile (extract --compile) applies to the CUDA graph's step: on the CPU there is no graph, the eager
    step runs (the generation record says so)."""
    why = static_refusal(model)
    if why:
        return Generator("greedy_complete_batch", why=why)
    cuda = next(model.parameters()).device.type == "cuda"
    return Generator("greedy_static", graphs=cuda, compile=compile and cuda)


def generation_record(model, gen: Generator, *, batch_size: int, batch_tokens: int, max_new_tokens: int,
                      sharded_over: int = 0) -> dict:
    """cache.json's "generation": what decides the cached numbers beside the target, prompts and layers (how
    many processes wrote the cache does not: a cache of several equals the cache of one)."""
    import transformers
    dev = next(model.parameters()).device
    from remote_payload.extract.fastgen import decode_attention_name, decode_fused_name
    static = gen.name == "greedy_static"
    rec = {"generator": gen.name, "cuda_graphs": gen.graphs, "compiled": gen.compile,
           "decode_attention": decode_attention_name(model) if static else None,
           "decode_fused": decode_fused_name(model, gen.compile) if static else None,
           "batch_size": batch_size, "batch_tokens": batch_tokens,
           "max_new_tokens": max_new_tokens, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
           "attn_implementation": getattr(model.config, "_attn_implementation", None),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type,
           "prefill": "hooked tapped blocks (prefill_batch)", "torch": torch.__version__,
           "transformers": transformers.__version__}
    if gen.why:
        rec["why_not_greedy_static"] = gen.why
    if sharded_over:
        rec["sharded_over_gpus"] = sharded_over
    return rec
