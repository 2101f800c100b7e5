"""Triton kernels behind kernels.py (imported only where Triton is installed and a fast path asks for it).
Each one's numbers are those of the torch code it replaces: see kernels.py and the tests in tests/gpu."""
import triton
import triton.language as tl

try:
    from triton.language.extra import libdevice
except ImportError:  # older Triton
    from triton.language.extra.cuda import libdevice


@triton.jit
def lse_kernel(x_ptr, out_ptr, max_ptr, n_cols, stride, n_chunks, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
               WANT_MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        if WANT_MAX:  # the maximum of each CHUNK columns, for topk_from_chunk_max
            cm = tl.max(tl.reshape(x, [BLOCK // CHUNK, CHUNK]), axis=1)
            ci = start // CHUNK + tl.arange(0, BLOCK // CHUNK)
            tl.store(max_ptr + row * n_chunks + ci, cm, mask=ci < n_chunks)
        m_new = tl.maximum(m, x)
        empty = m_new == float("-inf")  # nothing seen by this lane yet: keep s = 0, no inf - inf
        s = tl.where(empty, 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
        m = m_new
    top = tl.max(m, 0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), 0)
    tl.store(out_ptr + row, top + tl.log(total))


@triton.jit
def round_bf16(v):
    # fp32 -> the nearest bf16 value (ties to even), kept in fp32: done on the bits, so that no compiler
    # folds a cast pair away (inf stays inf)
    bits = v.to(tl.uint32, bitcast=True)
    b = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    nan = (bits & 0x7FFFFFFF) > 0x7F800000  # NaN stays NaN (0x7FFFFFFF would carry into -0.0)
    return tl.where(nan, v, b.to(tl.float32, bitcast=True))


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, NH: tl.constexpr, NHP: tl.constexpr, HALF: tl.constexpr):
    # one row of [rows, NH, 2*HALF] (NHP: NH padded to a power of two): apply_rope's four bf16 roundings
    # (x*cos, rot*sin, their sum)
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, NHP)[:, None]
    j = tl.arange(0, HALF)[None, :]
    hm = h < NH
    base = row * NH * 2 * HALF + h * 2 * HALF + j
    x1 = tl.load(x_ptr + base, mask=hm, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF, mask=hm, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + row * 2 * HALF + j).to(tl.float32)
    c2 = tl.load(cos_ptr + row * 2 * HALF + HALF + j).to(tl.float32)
    s1 = tl.load(sin_ptr + row * 2 * HALF + j).to(tl.float32)
    s2 = tl.load(sin_ptr + row * 2 * HALF + HALF + j).to(tl.float32)
    lo = round_bf16(round_bf16(x1 * c1) + round_bf16(-x2 * s1))
    hi = round_bf16(round_bf16(x2 * c2) + round_bf16(x1 * s2))
    tl.store(out_ptr + base, lo.to(tl.bfloat16), mask=hm)  # exact: already a bf16 value
    tl.store(out_ptr + base + HALF, hi.to(tl.bfloat16), mask=hm)


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_cols, g_stride, u_stride, BLOCK: tl.constexpr):
    # gate [rows, n], up [rows, n] (one fused projection's halves, or two) -> silu(gate) * up: torch's two bf16
    # roundings, its IEEE exp and division
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(g_ptr + row * g_stride + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + offs, mask=mask, other=0.0).to(tl.float32)
    act = round_bf16(tl.math.div_rn(g, 1.0 + libdevice.exp(-g)))
    tl.store(out_ptr + row * n_cols + offs, round_bf16(act * u).to(tl.bfloat16), mask=mask)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, inv_n, eps, inner, s_outer, s_inner, BLOCK: tl.constexpr,
                    BF16: tl.constexpr):
    # one row of [rows, n]: transformers' RMSNorm (fp32 mean of squares, rsqrt, x * r rounded to the input's
    # dtype, times the weight rounded again): the same roundings; the sum's order is Triton's, so the mean may
    # be an fp32 ulp from torch's reduction (and a bf16 output a ulp apart, rarely). x's row r is at
    # (r // inner) * s_outer + (r % inner) * s_inner (heads of a fused projection's slice); out is contiguous
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    at = (row // inner) * s_outer + (row % inner) * s_inner
    x = tl.load(x_ptr + at + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, 0) * inv_n + eps)  # torch: rsqrtf, the same approximation
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if BF16:
        y = round_bf16(w * round_bf16(x * r))
    else:
        y = w * (x * r)
    tl.store(out_ptr + row * n_cols + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
