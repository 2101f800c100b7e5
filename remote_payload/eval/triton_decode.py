"""Split-KV decode attention in Triton (imported only where Triton is installed and a CUDA decode asks for it).

One new token per row over a static KV cache whose filled length `n` lives on the device (the decode step's
cache position + 1), so one captured CUDA graph serves every step and each step reads the filled slots only:
a static cache of P + 512 slots costs a step what its filled part costs, not its whole length.

Grid (B x Hkv, S): each program takes the G query heads of one KV head (one `tl.dot` of [G padded to 16, d] x
[d, BLOCK_N] per key block, K and V read once for the group) over its share of the filled slots (the n slots
cut into S equal parts, read from the device at run time), with an online softmax in fp32; it writes its
unnormalised output and its (max, sum). The combine kernel weighs the S parts. The additive mask (pads) is
read per slot. Numbers: fp32 scores and softmax, P x V with P in the value dtype (as flash kernels do); equal to
`fastgen.grouped_decode_attention` within bf16 rounding (tests/gpu).
"""
import triton
import triton.language as tl


@triton.jit
def decode_split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, cp_ptr, part_ptr, ml_ptr,
                        sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_l, scale,
                        HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                        S: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    hk = (bh % HKV).to(tl.int64)
    n = tl.load(cp_ptr) + 1  # filled slots: up to and including the one this step wrote
    share = tl.cdiv(tl.cdiv(n, S), BLOCK_N) * BLOCK_N
    start = s * share
    end = tl.minimum(start + share, n)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + (hk * G + g)[:, None] * sq_h + d[None, :], mask=(g < G)[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    kb = k_ptr + b * sk_b + hk * sk_h
    vb = v_ptr + b * sv_b + hk * sv_h
    for j in range(start, end, BLOCK_N):
        offs = j + tl.arange(0, BLOCK_N)
        ok = offs < end
        k = tl.load(kb + offs[:, None] * sk_l + d[None, :], mask=ok[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k)) * scale  # [GP, BLOCK_N] fp32
        am = tl.load(mask_ptr + b * sm_b + offs * sm_l, mask=ok, other=float("-inf")).to(tl.float32)
        sc = sc + am[None, :]
        m_new = tl.maximum(m_i, tl.max(sc, 1))  # finite: a block holds at least one slot < end
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vb + offs[:, None] * sv_l + d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    row = bh.to(tl.int64) * S + s
    keep = g < G
    tl.store(part_ptr + (row * G + g)[:, None] * D + d[None, :], acc, mask=keep[:, None])
    tl.store(ml_ptr + (row * 2) * G + g, m_i, mask=keep)
    tl.store(ml_ptr + (row * 2 + 1) * G + g, l_i, mask=keep)


@triton.jit
def decode_combine_kernel(part_ptr, ml_ptr, out_ptr, so_b, so_h,
                          HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, S: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // HKV
    hk = bh % HKV
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    keep = g < G
    top = tl.full([GP], float("-inf"), tl.float32)
    for s in range(S):
        top = tl.maximum(top, tl.load(ml_ptr + ((bh * S + s) * 2) * G + g, mask=keep, other=float("-inf")))
    top = tl.where(keep, top, 0.0)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for s in range(S):
        row = bh * S + s
        m = tl.load(ml_ptr + (row * 2) * G + g, mask=keep, other=float("-inf"))
        w = tl.exp(m - top)  # an empty part (m = -inf): 0
        total += w * tl.load(ml_ptr + (row * 2 + 1) * G + g, mask=keep, other=0.0)
        acc += w[:, None] * tl.load(part_ptr + (row * G + g)[:, None] * D + d[None, :], mask=keep[:, None], other=0.0)
    out = acc / tl.where(keep, total, 1.0)[:, None]
    tl.store(out_ptr + b * so_b + (hk * G + g)[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=keep[:, None])
