"""The DFlash block drafter (spec §1) in two implementations that must agree.

- `DFlashDrafter.naive_block`: one anchor, recomputes everything; the obviously-right reference
  (differentiable, fp32-friendly; also what training uses).
- `precompute_context` + `draft_hidden` + `logits_topk`: many anchors at once. Context K/V are computed
  ONCE per prompt (the context never passes through the layers) and shared by every anchor and round.
  Each call writes only its blocks' K/V into slot rows after the context and runs one SDPA over
  [context | slots] with a mask, so the context is never copied per anchor or round (a measured pitfall).

Attention visibility (read from z-lab `dflash/model.py` `_attention_mask`, positions absolute):
- full layers, `is_causal` unset: everything (all context, bidirectional inside the block);
- sliding layers: a query at position p sees key position t iff `p - t < sliding_window` (so W keys
  including itself; flash-attn "window_size=(W-1, 0)"), and, being causal, `t <= p`;
- `is_causal` in config.json overrides the per-layer default for ALL layers (reference rule).
The drafter owns no embedding and no lm_head: `TargetHead` holds the target's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from remote_payload.config import DrafterConfig
from remote_payload.kernels import row_logsumexp


@dataclass
class TargetHead:
    embed: Tensor  # [V, H]
    lm_head: Tensor  # [V, H]; the same tensor as `embed` when the target ties them


@dataclass
class ContextKV:
    """Per-layer context keys/values for B prompts, padded to the longest; built by `precompute_context`.

    Rows [0, T) hold the context (k_norm + RoPE at positions 0..T-1 applied); rows [T, R) are slots that
    `draft_hidden` overwrites with the current blocks' K/V (then zero padding up to an aligned R).
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


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
    """x [..., d]; cos/sin broadcastable to x, fp32 (cast to x's dtype, as HF does)."""
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

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _block_ids(self, bonus_ids: Tensor) -> Tensor:
        """bonus_ids [...] -> [..., bs]: the bonus token followed by bs-1 mask tokens."""
        ids = torch.full((*bonus_ids.shape, self.cfg.block_size), self.cfg.mask_token_id,
                         dtype=torch.long, device=bonus_ids.device)
        ids[..., 0] = bonus_ids
        return ids

    # ---- reference path -------------------------------------------------------------------------
    def naive_block(self, feats_prefix: Tensor, bonus_id: int, a: int, head: TargetHead) -> Tensor:
        """feats_prefix [>=a, n_fc*H] (rows 0..a-1 are used) -> logits [bs-1, V] fp32; row k-1 predicts a+k."""
        cfg, dt = self.cfg, self.dtype
        bs, nh, kvh, d = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        ctx = self.hidden_norm(self.fc(feats_prefix[:a].to(dt)))  # [a, H]
        ids = self._block_ids(torch.tensor(bonus_id, device=ctx.device))
        x = F.embedding(ids, head.embed).to(dt)  # [bs, H]
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
    def precompute_context(self, feats: Tensor | list[Tensor], anchors_per_prompt: int = 1) -> ContextKV:
        """feats [T, n_fc*H] for one prompt, or a list of [T_i, n_fc*H] (padded to max T_i) -> ContextKV.

        Reserves block slots for `anchors_per_prompt` anchors per `draft_hidden` call (it grows them if a
        call needs more, at the cost of one copy of the buffers).
        """
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
        R = _rows(T, anchors_per_prompt * cfg.block_size)
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
        Each layer writes the blocks' K/V into ctx's slot rows (overwriting the previous call's) and runs
        ONE SDPA over [context | slots] with a mask: the context is never copied. Autograd through two
        calls on the same ctx is therefore not supported (train with one call per `precompute_context`).
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
        T, S = ctx.T, m * bs
        _ensure_slots(ctx, S)
        dev = anchors.device
        x = F.embedding(self._block_ids(bonus_ids), head.embed).to(dt).view(B * m * bs, H)
        q_pos = anchors[..., None] + torch.arange(bs, device=dev)  # [B, m, bs]
        cos, sin = rope_cos_sin(q_pos, d, cfg.rope_theta)
        cos, sin = cos[..., None, :], sin[..., None, :]  # [B, m, bs, 1, d]: broadcast over heads
        masks: dict[tuple, tuple[int, Tensor]] = {}
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            key = (cfg.layer_is_causal(i), cfg.layer_window(i))
            if key not in masks:
                masks[key] = _slot_mask(anchors, q_pos, T, ctx.k[i].shape[2], g, a_min, *key)
            lo, mask = masks[key]  # mask [B, 1, m*g*bs, R-lo]

            h = layer.input_layernorm(x)
            q = apply_rope(att.q_norm(att.q_proj(h).view(B, m, bs, nh, d)), cos, sin)
            kb = apply_rope(att.k_norm(att.k_proj(h).view(B, m, bs, kvh, d)), cos, sin)
            vb = att.v_proj(h).view(B, m, bs, kvh, d)
            K, V = ctx.k[i], ctx.v[i]  # [B, kvh, R, d]
            K[:, :, T:T + S] = kb.permute(0, 3, 1, 2, 4).reshape(B, kvh, S, d)  # slot j*bs+k = anchor j, row k
            V[:, :, T:T + S] = vb.permute(0, 3, 1, 2, 4).reshape(B, kvh, S, d)
            # GQA without repeating K/V: the g query heads sharing a kv head become extra query rows.
            qg = q.view(B, m, bs, kvh, g, d).permute(0, 3, 1, 4, 2, 5).reshape(B, kvh, m * g * bs, d)
            o = F.scaled_dot_product_attention(qg, K[:, :, lo:], V[:, :, lo:], attn_mask=mask, scale=d**-0.5)
            o = o.view(B, kvh, m, g, bs, d).permute(0, 2, 4, 1, 3, 5).reshape(B * m * bs, nh * d)
            x = x + att.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).view(*shape, bs, H)


_ALIGN_ROWS = 16  # SDPA's memory-efficient kernel wants the key length (mask's last dim) aligned


def _rows(T: int, slots: int) -> int:
    return -(-(T + slots) // _ALIGN_ROWS) * _ALIGN_ROWS


def _ensure_slots(ctx: ContextKV, slots: int) -> None:
    """Grow the slot rows after the context if a call needs more (one copy, then reused)."""
    R = ctx.k[0].shape[2]
    if ctx.T + slots <= R:
        return
    pad = _rows(ctx.T, slots) - R
    ctx.k = [F.pad(k, (0, 0, 0, pad)) for k in ctx.k]
    ctx.v = [F.pad(v, (0, 0, 0, pad)) for v in ctx.v]


def _slot_mask(anchors: Tensor, q_pos: Tensor, T: int, R: int, g: int, a_min: int, causal: bool,
               window: int | None) -> tuple[int, Tensor]:
    """anchors [B, m], q_pos [B, m, bs] -> (lo, mask [B, 1, m*g*bs, R-lo]) over keys lo..R-1, True = attend.

    Rows [0, T): context, visible iff t < a (and q_pos - t < window). Rows [T, T+m*bs): block slots,
    anchor j's own bs rows only, under the block rule (causal / window). The rest: never.
    `lo` skips context rows no query can see in a sliding layer (rounded down to keep alignment).
    """
    B, m, bs = q_pos.shape
    dev = anchors.device
    lo = 0 if window is None else max(0, a_min - window + 1) // _ALIGN_ROWS * _ALIGN_ROWS
    t = torch.arange(lo, T, device=dev)
    vis_ctx = (t < anchors[..., None, None]).expand(B, m, bs, T - lo)  # [B, m, bs, T-lo]
    if window is not None:
        vis_ctx = vis_ctx & (q_pos[..., None] - t < window)
    kk = torch.arange(bs, device=dev)
    rule = visible(kk[:, None], kk[None, :], causal=causal, window=window)  # [bs, bs]
    own = torch.eye(m, dtype=torch.bool, device=dev)[:, None, :, None] & rule[None, :, None, :]  # [m, bs, m, bs]
    vis_blk = own.reshape(1, m, bs, m * bs).expand(B, m, bs, m * bs)
    never = torch.zeros(B, m, bs, R - T - m * bs, dtype=torch.bool, device=dev)
    mask = torch.cat([vis_ctx, vis_blk, never], dim=-1)  # [B, m, bs, R-lo]
    return lo, mask[:, None, :, None].expand(B, 1, m, g, bs, R - lo).reshape(B, 1, m * g * bs, R - lo)


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
    lse = row_logsumexp(logits)  # fp32 [N, 1]; one pass over the logits on CUDA (kernels.py)
    top_val, top_ids = logits.topk(k, dim=-1)
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
