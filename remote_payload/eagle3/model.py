"""The EAGLE-3 draft head (spec eagle3.md §1), as SafeAILab/EAGLE `cnets.py` computes it.

    a = cat(h_low, h_mid, h_high)                 [T, 3Ht]  the tapped target states, capture order
    u = fc(a)                                      [T, H]    (no bias)
    e = embed(x_{j+1})                             slot j pairs features j with the NEXT token
    z = cat(input_layernorm(e), hidden_norm(u))    [T, 2H]   q/k/v take 2H inputs
    m = u + o_proj(attn(z));  g = m + mlp(post_attention_layernorm(m))
    logits = lm_head(norm(g)) over the draft vocabulary; target id = i + d2t[i]

Later chain steps feed back the PRE-norm g in place of u (the residual is that hidden). Layout variants
(contract/eagle3config.py): fc_norm / input_norm before fc, fc bias, residual = hidden_norm(u)
(norm_before_residual), the post-norm hidden fed back (speculators' norm_output), no norm before lm_head (SpecForge's
norm_output false). One layer, so a
slot's key and value depend on that slot's inputs only: the prefix's K/V are computed once for every slot.

Pieces, shared by the per-round reference (online.py) and the batched walk (walk.py):
`slot_inputs` (z and the residual), `qkv` (projections + RoPE at given positions), `attend` (explicit softmax
over given keys, fp32), `finish` (o_proj, residual, MLP), `logits`/`draft_ids`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from remote_payload.contract.eagle3config import Eagle3Config
from remote_payload.eval.drafter import RMSNorm, apply_rope, rope_cos_sin


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * H, nh * d, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)


class Eagle3Drafter(nn.Module):
    """fc, midlayer.*, norm, lm_head, d2t, t2d: the SafeAILab state dict (embed_tokens optional: `embed`)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=cfg.fc_bias)
        Ht, eps = cfg.target_hidden_size, cfg.rms_norm_eps
        self.fc_norm = nn.ModuleList([RMSNorm(Ht, eps) for _ in range(3)]) if cfg.fc_norm else None
        self.input_norm = RMSNorm(3 * Ht, eps) if cfg.norm_before_fc else None
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.embed: Tensor | None = None  # [V, H]: the checkpoint's embed_tokens, else the target's (loader)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def project(self, feats: Tensor) -> Tensor:
        """feats [..., 3Ht] (the cached taps, low -> mid -> high) -> u [..., H] (after the layout's norms)."""
        a = feats.to(self.dtype)
        if self.input_norm is not None:
            a = self.input_norm(a)
        if self.fc_norm is not None:
            a = torch.cat([norm(c) for norm, c in zip(self.fc_norm, a.chunk(3, dim=-1))], dim=-1)
        return self.fc(a)

    def slot_inputs(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """hidden [..., H] (u, or a fed-back pre-norm g), tokens [...] target ids -> z [..., 2H]."""
        e = F.embedding(tokens, self.embed).to(self.dtype)
        layer = self.midlayer
        return torch.cat([layer.input_layernorm(e), layer.hidden_norm(hidden)], dim=-1)

    def qkv(self, z: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """z [..., 2H], positions [...] -> q [..., nh, d], k/v [..., nkv, d] (RoPE on q and k)."""
        cfg, att = self.cfg, self.midlayer.self_attn
        d = cfg.head_dim
        cos, sin = rope_cos_sin(positions, d, cfg.rope_theta)
        cos, sin = cos[..., None, :], sin[..., None, :]
        q = apply_rope(att.q_proj(z).unflatten(-1, (cfg.num_attention_heads, d)), cos, sin)
        k = apply_rope(att.k_proj(z).unflatten(-1, (cfg.num_key_value_heads, d)), cos, sin)
        v = att.v_proj(z).unflatten(-1, (cfg.num_key_value_heads, d))
        return q, k, v

    def finish(self, hidden: Tensor, attn: Tensor) -> Tensor:
        """hidden [..., H] (u or the fed-back hidden), attn [..., nh, d] -> the hidden fed to the next step: g
        [..., H], the pre-norm output (norm(g) when the layout feeds the post-norm hidden back: feed_normed)."""
        layer = self.midlayer
        res = layer.hidden_norm(hidden) if self.cfg.norm_before_residual else hidden
        m = res + layer.self_attn.o_proj(attn.flatten(-2).to(self.dtype))
        g = m + layer.mlp(layer.post_attention_layernorm(m))
        return self.norm(g) if self.cfg.feed_normed else g

    def logits(self, g: Tensor) -> Tensor:
        """g [..., H] (finish's output) -> draft-vocabulary logits [..., Vd] (fp32): lm_head(norm(g)), or
        lm_head(g) when g is normed already (feed_normed) or the layout has no final norm (lm_head_norm false)."""
        normed = self.cfg.feed_normed or not self.cfg.lm_head_norm
        return self.lm_head(g if normed else self.norm(g)).float()

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids (i + d2t[i])."""
        return draft_ids + self.d2t[draft_ids]


def attend(q: Tensor, keys: list[tuple[Tensor, Tensor | None]], values: list[Tensor], group: int) -> Tensor:
    """One softmax over several key sets, in fp32: q [n, nh, d]; keys[i] = (k, visible [n, m_i] bool or None) with
    k [m_i, nkv, d] (shared by the n queries) or [n, m_i, nkv, d] (a set per query), values[i] shaped as its k
    -> [n, nh, d] (GQA: query head j reads kv head j // group)."""
    d = q.shape[-1]
    qf = q.float().unflatten(1, (-1, group))  # [n, nkv, g, d]
    scores = []
    for k, vis in keys:
        eq = "nhgd,mhd->nhgm" if k.dim() == 3 else "nhgd,nmhd->nhgm"
        s = torch.einsum(eq, qf, k.float()) * d**-0.5
        if vis is not None:
            s = s.masked_fill(~vis[:, None, None, :], float("-inf"))
        scores.append(s)
    p = torch.cat(scores, -1).softmax(-1)
    out, start = 0, 0
    for s, v in zip(scores, values):
        m = s.shape[-1]
        eq = "nhgm,mhd->nhgd" if v.dim() == 3 else "nhgm,nmhd->nhgd"
        out = out + torch.einsum(eq, p[..., start:start + m], v.float())
        start += m
    return out.flatten(1, 2).to(q.dtype)
