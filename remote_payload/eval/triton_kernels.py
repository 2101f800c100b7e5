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
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, NH: tl.constexpr, HALF: tl.constexpr):
    # one row of [rows, NH, 2*HALF]: apply_rope's four bf16 roundings (x*cos, rot*sin, their sum)
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, NH)[:, None]
    j = tl.arange(0, HALF)[None, :]
    base = row * NH * 2 * HALF + h * 2 * HALF + j
    x1 = tl.load(x_ptr + base).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF).to(tl.float32)
    c1 = tl.load(cos_ptr + row * 2 * HALF + j).to(tl.float32)
    c2 = tl.load(cos_ptr + row * 2 * HALF + HALF + j).to(tl.float32)
    s1 = tl.load(sin_ptr + row * 2 * HALF + j).to(tl.float32)
    s2 = tl.load(sin_ptr + row * 2 * HALF + HALF + j).to(tl.float32)
    lo = round_bf16(round_bf16(x1 * c1) + round_bf16(-x2 * s1))
    hi = round_bf16(round_bf16(x2 * c2) + round_bf16(x1 * s2))
    tl.store(out_ptr + base, lo.to(tl.bfloat16))  # exact: already a bf16 value
    tl.store(out_ptr + base + HALF, hi.to(tl.bfloat16))


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    # [rows, gate | up] -> silu(gate) * up: torch's two bf16 roundings, its IEEE exp and division
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(gu_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    act = round_bf16(tl.math.div_rn(g, 1.0 + libdevice.exp(-g)))
    tl.store(out_ptr + row * n_cols + offs, round_bf16(act * u).to(tl.bfloat16), mask=mask)
