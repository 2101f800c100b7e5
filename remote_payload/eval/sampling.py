"""The serving transform (temperature, then top-k, then top-p), seeded sampling, the agreement figure at T>0.

The transform is the reference's (z-lab/dflash `sample`): logits / T; keep the top_k largest (0 or >= V: all);
softmax; keep, in descending order, every token whose mass BEFORE it is < top_p (so the first token always
stays); renormalise. Conventions where the reference leaves them to the kernel, made deterministic here:
- equal logits are ordered by the lower token id (a stable descending sort), so top-k keeps exactly k tokens
  and prefers the lower ids at its edge, and top-p's cut walks that same order; T = 0 is the one-hot of the
  argmax, ties to the lower id (torch.argmax, and the drafter's `logits_topk` order);
- computed in fp32 from `logits.float()` as the reference does, except top-p's cumulative mass, summed in
  float64 so that the cut is the same on every device and batch shape (an fp32 cumsum over 151936 tokens put
  a token on the other side of the cut on an H200 than on the CPU); the log-probs come from a log_softmax
  over the kept tokens (not log of the renormalised probs); a token outside the kept set has log-prob -inf.

Sampling is by inverse CDF on one float64 uniform per row, drawn from that row's own torch.Generator.
`generator_for(seed, prompt_key, sample_index)` seeds one generator per (prompt, sample) from a sha256 of the
three, so a completion's draws depend only on its own identity: the same whatever the batch it is extracted
in, its position in that batch, or the number of GPUs. Keep the generators on the CPU (the default): the
uniforms are then the same bits on every device, and drawing them costs no kernel launch per row.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

NEG_INF = float("-inf")


def check_transform(temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
    """ValueError in one line unless temperature >= 0, top_k >= 0 (0 = off) and 0 < top_p <= 1 (1 = off)."""
    if not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {temperature}")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off); got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1] (1 = off); got {top_p}")


def transform_logprobs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """logits [..., V] -> fp32 log-probs [..., V] of the serving distribution: temperature, then top-k, then
    top-p (module docstring); -inf outside the kept tokens; temperature 0: 0 at the argmax, -inf elsewhere."""
    check_transform(temperature, top_k, top_p)
    x = logits.float()
    vocab = x.shape[-1]
    if temperature == 0:
        idx = x.argmax(dim=-1, keepdim=True)
        return torch.full_like(x, NEG_INF).scatter_(-1, idx, 0.0)
    x = x / temperature
    use_k = 0 < top_k < vocab
    if not use_k and top_p >= 1:
        return torch.log_softmax(x, dim=-1)
    s, order = torch.sort(x, dim=-1, descending=True, stable=True)
    if use_k:
        s[..., int(top_k):] = NEG_INF
    if top_p < 1:  # the cut in float64: an fp32 cumsum over a 150k vocabulary moves it between devices
        probs = torch.softmax(s.double(), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the kept mass ahead of each token, in the sorted order
        s = s.masked_fill(before >= top_p, NEG_INF)
    kept = torch.full_like(x, NEG_INF).scatter_(-1, order, s)
    return torch.log_softmax(kept, dim=-1)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> Tensor:
    """logits [..., V], tokens [...] -> fp32 [...]: each token's log-prob under the transform (-inf: the
    transform gives it no mass, i.e. it is below its row's sampling threshold)."""
    lp = transform_logprobs(logits, temperature, top_k, top_p)
    return lp.gather(-1, tokens.to(lp.device).long().unsqueeze(-1)).squeeze(-1)


def agreement(logprobs_of_tokens: Tensor) -> float | None:
    """[N] log-probs of a completion's tokens under the transform (`token_logprobs`) -> the fraction of
    positions whose token has probability > 0 (>= its sampling threshold); 1.0 when the completion is exactly
    what the transform can produce; None for no positions. At T = 0: the fraction equal to the argmax."""
    lp = torch.as_tensor(logprobs_of_tokens)
    if lp.numel() == 0:
        return None
    return float((lp > NEG_INF).sum().item()) / lp.numel()


def generator_for(seed: int, prompt_key: str | bytes | int, sample_index: int,
                  device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator seeded from sha256(seed, prompt identity, sample index): the draws of one
    (prompt, sample) do not depend on which other prompts are processed, in what order or on how many GPUs.
    prompt_key: a stable identity of the prompt (its name or id in the suite; never its batch position)."""
    if isinstance(prompt_key, bytes):
        key = b"b" + prompt_key
    elif isinstance(prompt_key, (str, int)) and not isinstance(prompt_key, bool):
        key = (("s" if isinstance(prompt_key, str) else "i") + str(prompt_key)).encode("utf-8")
    else:
        raise TypeError(f"prompt_key must be str, bytes or int; got {type(prompt_key).__name__}")
    h = hashlib.sha256()
    for part in (b"reval-sampling-v1", str(int(seed)).encode(), key, str(int(sample_index)).encode()):
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no two tuples hash the same bytes
        h.update(part)
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1))
    return g


def _uniforms(rows: int, generator, device: torch.device) -> Tensor:
    """float64 [rows] in [0, 1): from one generator (rows in order), one generator per row, or torch's own."""
    if generator is None:
        return torch.rand(rows, dtype=torch.float64, device=device)
    if isinstance(generator, torch.Generator):
        return torch.rand(rows, dtype=torch.float64, device=generator.device, generator=generator).to(device)
    gens = list(generator)
    if len(gens) != rows:
        raise ValueError(f"sampling {rows} rows needs one generator per row; got {len(gens)}")
    if not rows:
        return torch.zeros(0, dtype=torch.float64, device=device)
    vals = [torch.rand((), dtype=torch.float64, device=g.device, generator=g) for g in gens]
    if all(v.device == vals[0].device for v in vals):  # CPU generators: one copy to the device, not one a row
        return torch.stack(vals).to(device)
    return torch.stack([v.to(device) for v in vals])


def sample_logprobs(logprobs: Tensor, generator=None) -> Tensor:
    """log-probs [..., V] (from `transform_logprobs`) -> long [...]: one token per row by inverse CDF on a
    float64 uniform. generator: None, one torch.Generator (rows draw from it in row-major order), or a
    sequence of generators, one per row (`generator_for`). A token of probability 0 is never returned."""
    vocab = logprobs.shape[-1]
    rows = logprobs.reshape(-1, vocab)
    if rows.shape[0] and not bool((rows > NEG_INF).any(dim=-1).all()):
        raise ValueError("cannot sample a row whose log-probs are all -inf (no token has mass)")
    u = _uniforms(rows.shape[0], generator, rows.device)
    return sample_with_uniforms(rows, u).view(logprobs.shape[:-1])


def sample_with_uniforms(logprobs: Tensor, u: Tensor) -> Tensor:
    """log-probs [R, V] (from `transform_logprobs`), float64 uniforms [R] in [0, 1) -> long [R]: the inverse
    CDF of each row at its uniform (what `sample_logprobs` does once the uniforms are drawn). No host sync, no
    check: a CUDA graph can hold it (extract's static decoder draws its uniforms before the loop)."""
    vocab = logprobs.shape[-1]
    probs = logprobs.double().exp()
    cdf = probs.cumsum(dim=-1)
    x = (u.to(device=cdf.device, dtype=torch.float64) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)  # the first index whose cdf exceeds x
    # x < cdf[-1] always (u < 1); the clamp guards the last bit: the last token with mass, never a zero one
    last = vocab - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(idx, last)


def sample(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, generator=None) -> Tensor:
    """logits [..., V] -> long [...]: a token per row from the serving transform; temperature 0 is the
    argmax (ties: the lower id) and draws nothing from the generators. generator: as `sample_logprobs`."""
    check_transform(temperature, top_k, top_p)
    if temperature == 0:
        return logits.float().argmax(dim=-1)
    return sample_logprobs(transform_logprobs(logits, temperature, top_k, top_p), generator)


def sample_rows(logits: Tensor, temperature: float, top_k: int, top_p: float,
                generators: Sequence[torch.Generator]) -> Tensor:
    """logits [B, V], one generator per row -> long [B]: the batched extraction's step (each row draws only
    from its own (prompt, sample) generator, so a row's token does not depend on the batch around it)."""
    if logits.dim() != 2:
        raise ValueError(f"sample_rows takes logits [B, V]; got shape {tuple(logits.shape)}")
    return sample(logits, temperature, top_k, top_p, generator=list(generators))
