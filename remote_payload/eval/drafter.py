"""The DFlash block drafter (spec §1) in two implementations that must agree.

- `DFlashDrafter.naive_block`: one anchor, recomputes everything; the obviously-right reference
  (differentiable, fp32-friendly; also what training uses).
- `precompute_context` + `draft_hidden` + `logits_topk`: many anchors at once. Context K/V are computed
  ONCE per prompt (the context never passes through the layers) and shared by every anchor and round.
  Each call runs one SDPA per layer over groups of 16 anchors, a group's keys being [context | its blocks]
  under a mask: the context is copied once per group, never per anchor or round (a measured pitfall).

Attention visibility (read from z-lab `dflash/model.py` `_attention_mask`, positions absolute):
- full layers, `is_causal` unset: everything (all context, bidirectional inside the block);
- sliding layers: a query at position p sees key position t iff `p - t < sliding_window` (so W keys
  including itself; flash-attn "window_size=(W-1, 0)"), and, being causal, `t <= p`;
- `is_causal` in config.json overrides the per-layer default for ALL layers (reference rule); which layers
  slide, their window and their causality are resolved by `contract/drafterconfig.py` (vLLM's rules, one place).
The drafter owns no embedding and no lm_head: `TargetHead` holds the target's. A checkpoint's separately trained
mask embedding (`mask_embedding.pt`, vLLM's convention) replaces the embedding of every `mask_token_id` slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from remote_payload.contract.drafterconfig import DrafterConfig
from remote_payload.eval.kernels import fast_kernels_enabled, lse_topk, rope, sdpa, silu_mul


@dataclass
class TargetHead:
    embed: Tensor  # [V, H]
    lm_head: Tensor  # [V, H]; the same tensor as `embed` when the target ties them


@dataclass
class ContextKV:
    """Per-layer context keys/values for B prompts, padded to the longest; built by `precompute_context`.

    Rows [0, T) hold the context (k_norm + RoPE at positions 0..T-1 applied), then zero padding up to an
    aligned R. `draft_hidden` only reads it.
    """

    k: list[Tensor]  # per layer [B, kvh, R, d]
    v: list[Tensor]  # per layer [B, kvh, R, d]
    lengths: Tensor  # [B] long: valid positions of each prompt (context rows >= length are zero padding)
    T: int  # context rows (the longest prompt)
    host_lengths: tuple[int, ...] = ()  # `lengths` on the host (checks without a device sync)


@dataclass
class DraftLogits:
    argmax_ids: Tensor  # [..., bs-1] long: the greedy drafts
    topk_ids: Tensor  # [..., bs-1, k] long
    topk_logprobs: Tensor  # [..., bs-1, k] fp32
    target_logprobs: Tensor | None = None  # [..., bs-1] fp32: logprob of the given target ids
    target_ranks: Tensor | None = None  # [..., bs-1] long: position of the target in topk_ids, k if absent


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if fast_kernels_enabled(x) and x.dtype != torch.float32:
            # one fused kernel (fp32 statistics, result rounded to x's dtype) instead of seven passes
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_weight: Tensor | None = None  # [q|k|v, H], set by DFlashDrafter.fuse_projections

    def qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v projections of h: one GEMM over the fused weight when there is one and no gradient is
        wanted (the parameters are views into it, so both paths read the same numbers)."""
        if self.qkv_weight is None or (torch.is_grad_enabled() and self.q_proj.weight.requires_grad):
            return self.q_proj(h), self.k_proj(h), self.v_proj(h)
        q, kv = self.q_proj.out_features, self.k_proj.out_features
        return F.linear(h, self.qkv_weight).split([q, kv, kv], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

        self.gate_up_weight: Tensor | None = None  # [gate|up, H], set by DFlashDrafter.fuse_projections

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_weight is None or (torch.is_grad_enabled() and self.gate_proj.weight.requires_grad):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = F.linear(x, self.gate_up_weight)
        fused = silu_mul(gate_up.view(-1, gate_up.shape[-1]))  # one Triton pass where it runs, same numbers
        if fused is not None:
            return self.down_proj(fused.view(*gate_up.shape[:-1], -1))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """positions [...] long -> cos, sin [..., head_dim] fp32 (HF layout: the half-frequencies twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., d]; cos/sin broadcastable to x, fp32 (cast to x's dtype, as HF does). One Triton pass where
    `kernels.rope` applies (the same numbers)."""
    fused = rope(x, cos, sin)
    if fused is not None:
        return fused
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


def visible(q_pos: Tensor, k_pos: Tensor, *, causal: bool, window: int | None) -> Tensor:
    """Reference attention rule on absolute positions (broadcasting) -> bool mask, True = may attend."""
    # (torch.broadcast_shapes would do, but its first call imports sympy: seconds in a fresh process)
    diff = q_pos - k_pos
    vis = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    if window is not None:
        vis &= diff < window
        if not causal:
            vis &= -diff < window
    return vis


class DFlashDrafter(nn.Module):
    """fc, hidden_norm, layers, norm: exactly the 3 + 11*L tensors of a z-lab checkpoint (bare keys)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # [H] or None: not a parameter (a z-lab checkpoint has no such key); set by the loader from mask_embedding.pt
        self.mask_embedding: Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @torch.no_grad()
    def fuse_projections(self) -> DFlashDrafter:
        """Store each layer's q/k/v and gate/up weights as one tensor (one GEMM each instead of three and two)
        and make the parameters views into it: no second copy, state_dict and in-place updates unchanged."""
        for layer in self.layers:
            for owner, names, attr in ((layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_weight"),
                                       (layer.mlp, ("gate_proj", "up_proj"), "gate_up_weight")):
                mods = [getattr(owner, n) for n in names]
                fused = torch.cat([m.weight for m in mods])
                row = 0
                for m in mods:
                    m.weight.data = fused[row:row + m.out_features]
                    row += m.out_features
                setattr(owner, attr, fused)
        return self

    def _block_ids(self, bonus_ids: Tensor) -> Tensor:
        """bonus_ids [...] -> [..., bs]: the bonus token followed by bs-1 mask tokens."""
        ids = torch.full((*bonus_ids.shape, self.cfg.block_size), self.cfg.mask_token_id,
                         dtype=torch.long, device=bonus_ids.device)
        ids[..., 0] = bonus_ids
        return ids

    def _embed(self, ids: Tensor, head: TargetHead) -> Tensor:
        """ids [...] -> [..., H] in the drafter's dtype; slots holding mask_token_id take `mask_embedding` when
        the checkpoint ships one (as vLLM does: by id, so a bonus token equal to mask_token_id too)."""
        x = F.embedding(ids, head.embed).to(self.dtype)
        if self.mask_embedding is None:
            return x
        return torch.where((ids == self.cfg.mask_token_id)[..., None], self.mask_embedding.to(x.dtype), x)

    # ---- reference path -------------------------------------------------------------------------
    def naive_block(self, feats_prefix: Tensor, bonus_id: int, a: int, head: TargetHead) -> Tensor:
        """feats_prefix [>=a, n_fc*H] (rows 0..a-1 are used) -> logits [bs-1, V] fp32; row k-1 predicts a+k."""
        cfg, dt = self.cfg, self.dtype
        bs, nh, kvh, d = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        ctx = self.hidden_norm(self.fc(feats_prefix[:a].to(dt)))  # [a, H]
        ids = self._block_ids(torch.tensor(bonus_id, device=ctx.device))
        x = self._embed(ids, head)  # [bs, H]
        pos = torch.arange(a + bs, device=ctx.device)
        cos, sin = rope_cos_sin(pos, d, cfg.rope_theta)  # [a+bs, d]
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(att.q_norm(att.q_proj(h).view(bs, nh, d)), cos[a:, None], sin[a:, None])
            kv_in = torch.cat([ctx, h])  # [a+bs, H]
            k = apply_rope(att.k_norm(att.k_proj(kv_in).view(a + bs, kvh, d)), cos[:, None], sin[:, None])
            v = att.v_proj(kv_in).view(a + bs, kvh, d)
            k = k.repeat_interleave(nh // kvh, dim=1).float()  # query head j uses kv head j // g
            v = v.repeat_interleave(nh // kvh, dim=1).float()
            scores = torch.einsum("qhd,khd->hqk", q.float(), k) * d**-0.5  # [nh, bs, a+bs]
            vis = visible(pos[a:, None], pos[None, :], causal=cfg.layer_is_causal(i), window=cfg.layer_window(i))
            probs = scores.masked_fill(~vis, float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", probs, v).reshape(bs, nh * d).to(dt)
            x = x + att.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = self.norm(x)
        return F.linear(out[1:], head.lm_head.to(dt)).float()

    # ---- fast path ------------------------------------------------------------------------------
    def precompute_context(self, feats: Tensor | list[Tensor]) -> ContextKV:
        """feats [T, n_fc*H] for one prompt, or a list of [T_i, n_fc*H] (padded to max T_i) -> ContextKV."""
        cfg, dt = self.cfg, self.dtype
        kvh, d = cfg.num_key_value_heads, cfg.head_dim
        items = [feats] if isinstance(feats, Tensor) else list(feats)
        for f in items:
            if f.dim() != 2 or f.shape[1] != cfg.fc_in_features:
                raise ValueError(f"features must be [T, {cfg.fc_in_features}], got {list(f.shape)}")
        device = self.fc.weight.device
        host_lengths = tuple(int(f.shape[0]) for f in items)
        lengths = torch.tensor(host_lengths).to(device, non_blocking=True)
        T = max(host_lengths)
        R = _rows(T)  # aligned for the attention kernels; rows >= T are zero
        cos, sin = rope_cos_sin(torch.arange(T, device=device), d, cfg.rope_theta)  # [T, d]
        ks: list[list[Tensor]] = [[] for _ in self.layers]
        vs: list[list[Tensor]] = [[] for _ in self.layers]
        for f in items:
            n = f.shape[0]
            ctx = self.hidden_norm(self.fc(f.to(device=device, dtype=dt)))  # [n, H]
            for i, layer in enumerate(self.layers):
                att = layer.self_attn
                k = apply_rope(att.k_norm(att.k_proj(ctx).view(n, kvh, d)), cos[:n, None], sin[:n, None])
                v = att.v_proj(ctx).view(n, kvh, d)
                ks[i].append(F.pad(k.transpose(0, 1), (0, 0, 0, R - n)))  # [kvh, R, d]
                vs[i].append(F.pad(v.transpose(0, 1), (0, 0, 0, R - n)))
        return ContextKV(k=[torch.stack(k) for k in ks], v=[torch.stack(v) for v in vs], lengths=lengths, T=T,
                         host_lengths=host_lengths)

    def draft_hidden(self, ctx: ContextKV, anchors: Tensor, bonus_ids: Tensor, head: TargetHead,
                     bounds: tuple[int, int] | None = None) -> Tensor:
        """Draft blocks for many anchors -> out = norm(x) [..., bs, H] (row k predicts position a+k).

        anchors/bonus_ids: [n] (ctx holds ONE prompt) or [B, m] (m anchors for each of ctx's B prompts;
        pad unused slots with any valid anchor, e.g. 1). Anchor a sees context positions 0..a-1, so
        1 <= a <= that prompt's length.
        Anchors go in groups of ATTN_GROUP: each layer runs ONE SDPA whose batch is the groups, each group's
        keys being [context | its blocks] under a mask; the context is copied once per group, never per anchor
        or round (a measured pitfall), and ctx is not written, so calls on one ctx are independent.
        bounds: (smallest, largest) anchor when the caller knows them: checked on the host, no device sync.
        """
        cfg, dt = self.cfg, self.dtype
        bs, H = cfg.block_size, cfg.hidden_size
        nh, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        g = nh // kvh
        shape = anchors.shape
        if anchors.dim() == 1:
            anchors, bonus_ids = anchors[None], bonus_ids[None]
        B, m = anchors.shape
        if B != ctx.lengths.numel():
            raise ValueError(f"anchors are for {B} prompts but the context holds {ctx.lengths.numel()}")
        if bounds is not None and ctx.host_lengths:
            if bounds[0] < 1 or bounds[1] > min(ctx.host_lengths):
                raise ValueError("every anchor a must satisfy 1 <= a <= its prompt's context length")
            a_min = bounds[0]
        else:
            if bool((anchors < 1).any()) or bool((anchors > ctx.lengths[:, None]).any()):
                raise ValueError("every anchor a must satisfy 1 <= a <= its prompt's context length")
            a_min = int(anchors.min())
        T = ctx.T
        G = min(ATTN_GROUP, m)  # anchors sharing one attention call: their blocks' keys + the context
        mp = -(-m // G) * G  # anchors padded to whole groups with copies of the last one (outputs dropped)
        if mp != m:
            anchors = torch.cat([anchors, anchors[:, -1:].expand(B, mp - m)], 1)
            bonus_ids = torch.cat([bonus_ids, bonus_ids[:, -1:].expand(B, mp - m)], 1)
        ng, dev = mp // G, anchors.device
        x = self._embed(self._block_ids(bonus_ids), head).view(B * mp * bs, H)
        q_pos = anchors[..., None] + torch.arange(bs, device=dev)  # [B, mp, bs]
        cos, sin = rope_cos_sin(q_pos, d, cfg.rope_theta)
        cos, sin = cos[..., None, :].to(dt), sin[..., None, :].to(dt)  # [B, mp, bs, 1, d]: broadcast over heads
        masks: dict[tuple, tuple[int, Tensor]] = {}
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            key = (cfg.layer_is_causal(i), cfg.layer_window(i))
            if key not in masks:
                lo, vis = _group_mask(anchors, q_pos, T, ctx.k[i].shape[2], G, g, a_min, *key)
                if dev.type == "cuda":  # additive (0 / -inf), as SDPA turns a bool mask into in every call:
                    # once per batch, not once per layer (the CPU path keeps the bool mask)
                    vis = torch.zeros(vis.shape, dtype=dt, device=dev).masked_fill_(~vis, float("-inf"))
                masks[key] = lo, vis
            lo, mask = masks[key]  # mask [B*ng, 1, G*g*bs, (R-lo) + G*bs]

            h = layer.input_layernorm(x)
            qp, kp, vp = att.qkv(h)
            q = apply_rope(att.q_norm(qp.view(B, mp, bs, nh, d)), cos, sin)
            kb = apply_rope(att.k_norm(kp.view(B, mp, bs, kvh, d)), cos, sin)
            vb = vp.view(B, mp, bs, kvh, d)
            # keys of one group: the context (copied once per group, not per anchor) then its G blocks
            K = torch.cat([ctx.k[i][:, None, :, lo:].expand(B, ng, kvh, -1, d),
                           kb.view(B, ng, G * bs, kvh, d).transpose(2, 3)], dim=3).flatten(0, 1)
            V = torch.cat([ctx.v[i][:, None, :, lo:].expand(B, ng, kvh, -1, d),
                           vb.view(B, ng, G * bs, kvh, d).transpose(2, 3)], dim=3).flatten(0, 1)
            # GQA without repeating K/V: the g query heads sharing a kv head become extra query rows.
            qg = q.view(B, ng, G, bs, kvh, g, d).permute(0, 1, 4, 2, 5, 3, 6).reshape(B * ng, kvh, G * g * bs, d)
            o = sdpa(qg, K, V, mask, d**-0.5)
            o = o.view(B, ng, kvh, G, g, bs, d).permute(0, 1, 3, 5, 2, 4, 6).reshape(B * mp * bs, nh * d)
            x = x + att.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if mp != m:
            return self.norm(x.view(B, mp, bs, H)[:, :m]).view(*shape, bs, H)
        return self.norm(x).view(*shape, bs, H)


# Key rows are aligned to 128: SDPA's kernels want the key length aligned, and cuDNN's attention builds a plan
# for every new shape (CPU time at a new prompt length or sliding-window offset); 128 keeps the shapes few.
_ALIGN_ROWS = 128
# Anchors per attention call. All m anchors of a call in one SDPA made every query scan every block's keys
# (m*bs of them, 2,048 at m = 128) besides the context; groups of 16 scan 256, for ng = m/16 copies of the
# context keys (docs/benchmarks.md).
ATTN_GROUP = 16


def _rows(T: int) -> int:
    return -(-T // _ALIGN_ROWS) * _ALIGN_ROWS


def _group_mask(anchors: Tensor, q_pos: Tensor, T: int, R: int, G: int, g: int, a_min: int, causal: bool,
                window: int | None) -> tuple[int, Tensor]:
    """anchors [B, m], q_pos [B, m, bs] (m a multiple of G) -> (lo, mask [B*m/G, 1, G*g*bs, (R-lo) + G*bs]).

    Keys of a group: context rows lo..R-1, visible iff t < a (and q_pos - t < window; rows >= T are padding,
    never visible since a <= T), then the group's G blocks: anchor j's own bs rows only, under the block rule.
    `lo` skips context rows no query can see in a sliding layer (rounded down to keep alignment).
    """
    B, m, bs = q_pos.shape
    dev, ng = anchors.device, m // G
    lo = 0 if window is None else max(0, a_min - window + 1) // _ALIGN_ROWS * _ALIGN_ROWS
    t = torch.arange(lo, R, device=dev)
    vis_ctx = (t < anchors[..., None, None]).expand(B, m, bs, R - lo)  # [B, m, bs, R-lo]
    if window is not None:
        vis_ctx = vis_ctx & (q_pos[..., None] - t < window)
    kk = torch.arange(bs, device=dev)
    rule = visible(kk[:, None], kk[None, :], causal=causal, window=window)  # [bs, bs]
    own = torch.eye(G, dtype=torch.bool, device=dev)[:, None, :, None] & rule[None, :, None, :]  # [G, bs, G, bs]
    vis_blk = own.reshape(1, 1, G, bs, G * bs).expand(B, ng, G, bs, G * bs)
    mask = torch.cat([vis_ctx.reshape(B, ng, G, bs, R - lo), vis_blk], dim=-1)  # [B, ng, G, bs, L]
    L = mask.shape[-1]
    return lo, mask[:, :, :, None].expand(B, ng, G, g, bs, L).reshape(B * ng, 1, G * g * bs, L)


def logits_topk(hidden: Tensor, head: TargetHead, k: int, target_ids: Tensor | None = None) -> DraftLogits:
    """hidden [..., bs, H] from `draft_hidden` -> drafts for rows 1..bs-1.

    The rows go through lm_head as ONE contiguous [N*(bs-1), H] GEMM (a strided 3-D slice made cuBLAS
    run N small GEMMs). logsumexp in fp32. target_ids [..., bs-1]: also their logprob and rank.
    Past the lm_head GEMM every full-vocabulary pass costs as much as the GEMM itself, so there are
    only two (logsumexp, topk): the argmax is topk's first id, and a target's rank is its position in
    topk_ids, k when it is not among them (all that width-k trees and DDTree with budgets <= k need).
    """
    lead, (bs, H) = hidden.shape[:-2], hidden.shape[-2:]
    rows = hidden[..., 1:, :].contiguous().view(-1, H)  # [N*(bs-1), H]
    logits = F.linear(rows, head.lm_head.to(rows.dtype))  # [N*(bs-1), V]
    # logsumexp fp32 [N, 1]; the top-k by value descending, ties by the lower id (kernels.py: fused on CUDA)
    lse, top_val, top_ids = lse_topk(logits, k)
    out_shape = (*lead, bs - 1)
    res = DraftLogits(
        argmax_ids=top_ids[:, 0].view(out_shape),
        topk_ids=top_ids.view(*out_shape, k),
        topk_logprobs=(top_val.float() - lse).view(*out_shape, k),
    )
    if target_ids is not None:
        tgt = target_ids.reshape(-1, 1).to(logits.device)
        tgt_logit = logits.gather(-1, tgt)
        res.target_logprobs = (tgt_logit.float() - lse).view(out_shape)
        # The rank is the target's position in topk_ids (k when absent): the tree's rank-r node IS
        # topk_ids[r], so a target tied with the argmax (common in bf16) is not counted as drafted.
        hit = top_ids == tgt
        res.target_ranks = torch.where(hit.any(-1), hit.int().argmax(-1), k).view(out_shape)
    return res
