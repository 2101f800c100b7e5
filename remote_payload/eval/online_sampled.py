"""Online speculative decoding at temperature T: `eval --online N` on a sampled cache (issue 29 item 4).

online.py checks the offline walk of a greedy cache by greedy decoding; here the target's posterior is SAMPLED
at the cache's transform (temperature, then top-k, then top-p: sampling.py), each decode from its own seeded
generator, with the same pieces (the target over a KV cache cropped on rejection, the drafter's growing context
K/V). A decode of a prompt (`decode`):

    prefill the prompt; the first bonus ~ p(. | prompt)
    per round at anchor a (the bonus, the token at a, committed):
        the drafter's block -> q_1..q_{bs-1}, its distributions for a+1..a+bs-1 (after the same transform)
        drafts: greedy   x_i = argmax of the drafter's logits      (z-lab dflash_generate, vLLM's default)
                sampled  x_i ~ q_i, independently                  (z-lab at T > 0, EAGLE, vLLM's probabilistic)
        verify: ONE target forward of [bonus, x_1..x_{n-1}] -> p_1..p_n, n = min(bs, end - a)
        greedy drafts:  s_i ~ p_i; accept while x_i == s_i; the next bonus is s at the first mismatch (or s_n)
        sampled drafts: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) while accepted; at the first
                        rejection the next bonus ~ max(0, p_i - q_i) normalised; all accepted: the next ~ p_n
        record acc + 1; keep positions 0..a+acc (crop the KV cache, append their features)
    the sequence ends as extract's did: at a stop token (the target's eos ids, kept) or at prompt + max_new_tokens
    (cache.json's generation record); the walk's rules then apply (metrics.walk): no round once a >= end - 1, a
    round's drafts past the end never accepted; at most max_blocks rounds.

Draws, from the decode's generator (CPU, float64 uniforms, inverse CDF: sampling.sample_with_uniforms), in a fixed
order a round: greedy drafts n (the posterior at a+1..a+n); sampled drafts bs-1 (the drafts), n-1 (the accept
tests), 1 (the next bonus). A decode is `generator_for(regime seed, b"online\\0" + prompt name, seed index)`: bytes
keys never equal extract's (str) keys, so the online draws are independent of the cache's own samples.

Why its mean estimates the offline tau at T: both rules commit an ancestral sample of the target at T (rejection
sampling is lossless; a greedy draft is kept exactly when it equals the posterior's sample), and a decode's rounds
are a function of what it commits and of its drafts' randomness, as the offline figure's are of the cached y
(the walk over y for greedy drafts, E[tau | y] for sampled ones: expect.py). So the online tau averaged over
seeds and the offline tau averaged over the cache's samples estimate the same expectation, prompt by prompt.

`coupled=y` (tests): the target's sample at each position is y's token and the end is len(y); with greedy drafts
the rounds are then the offline walk over y, round by round. This module decodes the plain block; the online DDTree
decode, coupled likewise, is online_tree.py.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from remote_payload.eval.drafter import DFlashDrafter, TargetHead, logits_topk
from remote_payload.eval.online import _crop, _forward, _GrowingContext, _new_rollback_kv, _sync, check_inputs
from remote_payload.eval.sampling import generator_for, sample_with_uniforms, transform_logprobs

DRAFT_RULES = ("greedy", "sampled")


@dataclass
class Decode:
    """One online decode of one prompt."""
    lengths: list[int]  # per round, incl. the bonus token
    tokens: list[int]  # the committed tokens after the prompt (the first bonus first), cut at the end

    @property
    def tau(self) -> float | None:
        """The walk's per-prompt tau: tokens committed by the rounds / rounds."""
        return sum(self.lengths) / len(self.lengths) if self.lengths else None


@dataclass
class SeededPrompt:
    """One prompt decoded online once per seed."""
    name: str
    prompt_len: int
    decodes: list[Decode]  # one per seed index 0..seeds-1
    spec_s: float  # the seeds' decodes, wall seconds (each the median over its timed runs), summed
    target_only_s: float  # target-only sampled decoding of the same token counts, summed likewise
    spec_runs: list[float] = field(default_factory=list)  # per timed run: the seeds' seconds summed
    target_only_runs: list[float] = field(default_factory=list)

    @property
    def seed_taus(self) -> list[float | None]:
        return [d.tau for d in self.decodes]


def online_generator(seed: int, name: str, index: int) -> torch.Generator:
    """The draws of decode `index` of prompt `name` (module docstring): never extract's draws of that prompt."""
    return generator_for(seed, b"online\0" + name.encode("utf-8"), index)


def _uniforms(gen: torch.Generator | None, k: int, dev: torch.device) -> Tensor:
    return torch.rand(k, dtype=torch.float64, generator=gen).to(dev)


def _posterior(p: Tensor, gen, coupled: Sequence[int] | None, a: int, dev: torch.device) -> Tensor:
    """p [n, V] log-probs for positions a+1..a+n -> the target's sample there [n]: drawn, or y's tokens
    (coupled; a position past y's end takes the argmax: the walk never reads it)."""
    n = p.shape[0]
    if coupled is None:
        return sample_with_uniforms(p, _uniforms(gen, n, dev))
    y = list(coupled[a + 1:a + 1 + n])
    fill = p[len(y):].argmax(-1).tolist()
    return torch.tensor(y + fill, dtype=torch.long, device=dev)


def _verify_sampled(p: Tensor, q: Tensor, drafts: Tensor, gen, dev: torch.device) -> tuple[int, Tensor]:
    """Rejection sampling of drafts [n-1] ~ q [.., V] against p [n, V] (log-probs) -> (accepted, next token [1])."""
    n = p.shape[0]
    u = _uniforms(gen, n, dev)  # n-1 accept tests, then the next token
    x = drafts[:n - 1, None]
    lq, lp = q[:n - 1].gather(1, x)[:, 0].double(), p[:n - 1].gather(1, x)[:, 0].double()
    ratio = torch.exp((lp - lq).clamp(max=0.0))  # q(x) > 0 (x was drawn from q); p(x) = 0 -> 0
    acc = int((u[:n - 1] < ratio).int().cumprod(0).sum()) if n > 1 else 0
    if acc < n - 1:
        resid = (p[acc].double().exp() - q[acc].double().exp()).clamp(min=0.0)
        if not bool(resid.sum() > 0):  # p == q up to rounding: the residual is empty, p itself is the law
            resid = p[acc].double().exp()
        law = resid.log()[None]
    else:
        law = p[n - 1:n]
    return acc, sample_with_uniforms(law, u[-1:])


@torch.no_grad()
def decode(target, drafter: DFlashDrafter, head: TargetHead, fc_layer_ids: list[int], prompt: Sequence[int], *,
           transform: tuple[float, int, float], draft: str, max_blocks: int, end: int, eos: set[int] | frozenset,
           generator: torch.Generator | None = None, coupled: Sequence[int] | None = None) -> Decode:
    """One prompt's speculative decode at the transform (module docstring). end: the sequence's last position + 1
    unless a stop token ends it earlier (extract's prompt + max_new_tokens); coupled: y (prompt + completion),
    whose tokens are the target's samples (greedy drafts only; end = len(y), no stop tokens)."""
    if draft not in DRAFT_RULES:
        raise ValueError(f"draft rule {draft!r}: use {' or '.join(DRAFT_RULES)}")
    P = len(prompt)
    if coupled is not None:
        if draft != "greedy":
            raise ValueError("the coupled decode feeds y's tokens as the target's samples: greedy drafts only")
        if list(coupled[:P]) != list(prompt):
            raise ValueError("coupled: y does not start with the prompt")
        end, eos = len(coupled), frozenset()
    dev = head.embed.device
    bs = drafter.cfg.block_size
    kv = _new_rollback_kv(target)
    ctx = _GrowingContext(drafter, max(end, P + 1), dev)
    logits, feats = _forward(target, torch.tensor(list(prompt), dtype=torch.long, device=dev), 0, kv,
                             fc_layer_ids, last_only=True)  # [1, V], [P, n_fc*H]
    ctx.append(feats)
    bonus = _posterior(transform_logprobs(logits[-1:], *transform), generator, coupled, P - 1, dev)  # [1]
    tokens = [int(bonus)]
    if tokens[0] in eos:
        end = min(end, P + 1)
    lengths: list[int] = []
    a = P
    while a < end - 1 and len(lengths) < max_blocks:
        hidden = drafter.draft_hidden(ctx.view(), torch.tensor([a], device=dev), bonus, head, bounds=(a, a))
        n = min(bs, end - a)  # verify no position past the end (the walk cuts acceptance there)
        if draft == "greedy":
            drafts = logits_topk(hidden, head, 1).argmax_ids[0]  # [bs-1]: online.py's drafts
        else:
            rows = hidden[0, 1:]  # [bs-1, H]
            q = transform_logprobs(torch.nn.functional.linear(rows, head.lm_head.to(rows.dtype)), *transform)
            drafts = sample_with_uniforms(q, _uniforms(generator, bs - 1, dev))  # [bs-1]
        logits, feats = _forward(target, torch.cat([bonus, drafts[:n - 1]]), a, kv, fc_layer_ids)  # [n, V]
        p = transform_logprobs(logits, *transform)  # [n, V]: positions a+1..a+n
        if draft == "greedy":
            s = _posterior(p, generator, coupled, a, dev)  # [n]
            acc = int((drafts[:n - 1] == s[:n - 1]).int().cumprod(0).sum()) if n > 1 else 0
            nxt = s[acc:acc + 1]
        else:
            acc, nxt = _verify_sampled(p, q, drafts, generator, dev)
        committed = [*drafts[:acc].tolist(), int(nxt)]  # positions a+1..a+acc+1 (one host sync a round)
        stop = next((i for i, t in enumerate(committed) if t in eos), None)
        if stop is not None:  # the sequence ends at the stop token (position a+1+stop), as extract's did
            end = min(end, a + stop + 2)
            acc = min(acc, stop + 1)
        _crop(kv, a + acc + 1)  # keep positions 0..a+acc
        ctx.append(feats[:acc + 1])
        bonus = nxt
        tokens += committed[:acc + 1]
        lengths.append(acc + 1)
        a += acc + 1
    return Decode(lengths=lengths, tokens=tokens[:max(end - P, 0)])


@torch.no_grad()
def _target_only(target, prompt: Sequence[int], n: int, transform: tuple, gen: torch.Generator) -> None:
    """Target-only decoding at the transform: the prompt's prefill (its token) then n single-token steps."""
    from remote_payload.target.forward import last_logits_kw, new_kv
    dev = next(target.parameters()).device
    kv, keep = new_kv(target), last_logits_kw(target)
    P = len(prompt)
    ids = torch.tensor(list(prompt), dtype=torch.long, device=dev)[None]
    logits = target(ids, None, None, kv, use_cache=True, **keep).logits[0, -1:]
    out = []
    for j in range(n + 1):
        nxt = sample_with_uniforms(transform_logprobs(logits, *transform), _uniforms(gen, 1, dev))  # [1]
        out.append(nxt)
        if j < n:
            pos = torch.tensor([[P + j]], device=dev)
            logits = target(nxt.view(1, 1), None, pos, kv, use_cache=True, **keep).logits[0, -1:]
    torch.cat(out).tolist()  # one host sync at the end


@torch.no_grad()
def online_at_t(target_model, drafter: DFlashDrafter, head: TargetHead, layer_ids_in_cache_order: list[int] | None,
                prompts: list[tuple[str, list[int]]], max_blocks: int, *, transform: tuple[float, int, float],
                seed: int, draft: str, seeds: int, max_new_tokens: int, eos: set[int], repeats: int = 1,
                rehearse: bool = True, timed: bool = True, progress=None) -> list[SeededPrompt]:
    """prompts: (name, the prompt's token ids). Each decoded `seeds` times (decode index 0..seeds-1, each its own
    generator: `online_generator(seed, name, index)`), at most max_new_tokens after the prompt. timed: each decode
    timed `repeats` times (its generator re-made: the same tokens) beside target-only decoding of as many tokens,
    after an untimed rehearsal of the prompt's first decode (CUDA kernel plans; online.py). Raises ValueError as
    online.online_check does (a target that cannot be rolled back, layers, devices) and on seeds < 1."""
    fc, dev = check_inputs(target_model, drafter, head, layer_ids_in_cache_order, repeats)
    if seeds < 1:
        raise ValueError(f"seeds {seeds} must be >= 1")
    out = []
    for name, prompt in prompts:
        kw = {"transform": transform, "draft": draft, "max_blocks": max_blocks, "end": len(prompt) + max_new_tokens,
              "eos": eos}
        job = _Job(target_model, drafter, head, fc, list(prompt), name, kw, seed, dev)
        out.append(job.run(seeds, repeats if timed else 0, rehearse))
        if progress is not None:
            progress(len(out), len(prompts), name)
    return out


@dataclass
class _Job:
    """One prompt's decodes (online_at_t)."""
    target: object
    drafter: DFlashDrafter
    head: TargetHead
    fc: list[int]
    prompt: list[int]
    name: str
    kw: dict
    seed: int
    dev: torch.device

    def decode(self, k: int) -> Decode:
        return decode(self.target, self.drafter, self.head, self.fc, self.prompt,
                      generator=online_generator(self.seed, self.name, k), **self.kw)

    def plain(self, tokens: int) -> None:
        _target_only(self.target, self.prompt, tokens, self.kw["transform"], online_generator(self.seed, self.name, -1))

    def run(self, seeds: int, repeats: int, rehearse: bool) -> SeededPrompt:
        """repeats 0: untimed (one decode a seed, no target-only runs)."""
        if repeats and rehearse:
            self.plain(sum(self.decode(0).lengths))
        decodes, spec, plain = [], [], []
        for k in range(seeds):
            runs_s, runs_t = [], []
            for _ in range(max(repeats, 1)):
                _sync(self.dev)
                t0 = time.perf_counter()
                d = self.decode(k)
                _sync(self.dev)
                runs_s.append(time.perf_counter() - t0)
                if repeats:
                    t0 = time.perf_counter()
                    self.plain(sum(d.lengths))
                    _sync(self.dev)
                    runs_t.append(time.perf_counter() - t0)
            decodes.append(d)
            spec.append(runs_s)
            plain.append(runs_t)
        n_runs = len(spec[0]) if repeats else 0
        return SeededPrompt(
            name=self.name, prompt_len=len(self.prompt), decodes=decodes,
            spec_s=sum(statistics.median(r) for r in spec),
            target_only_s=sum(statistics.median(r) for r in plain) if repeats else 0.0,
            spec_runs=[sum(r[i] for r in spec) for i in range(n_runs)],
            target_only_runs=[sum(r[i] for r in plain) for i in range(n_runs)])
