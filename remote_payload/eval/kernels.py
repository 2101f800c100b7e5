"""Fused GPU kernels for the drafting's hot spots, each beside the plain torch code it replaces.

`row_logsumexp(logits)` [N, V] -> [N, 1] fp32. torch's `logsumexp(logits.float())` writes an fp32 copy of
[N, V] and reads it in several passes. On CUDA, bf16: one pass of CUDA C (rtc.py: compiled by NVRTC once per
host, no start to pay) that also takes every 32 columns' maximum for the top-k; where it cannot run, one Triton
pass (the same contract) when the run is long enough to pay for Triton's start (`plan`; REVAL_TRITON=1/0 forces
it), else torch's fused log-softmax. All equal the torch path within fp32 rounding (tests/gpu); what each costs
at the 27B sizes: docs/benchmarks.md.
`row_topk(logits, k)` -> the k largest of each row with their ids, in one defined order: value descending, ties
by the lower id (what a stable descending sort and `argmax` give; torch.topk leaves ties to its kernel). The
reference (`topk_reference`) runs torch.topk over unique integer keys (value bits | inverted id); the fast path
(`topk_chunked`, any device) takes the maximum of each group of columns in one coalesced pass, keeps the k
best groups and selects among their k*group values only, equal to the reference by construction (see its doc)
and by test (tests/test_kernels.py, tests/gpu).
`rope` and `silu_mul` / `silu_and_mul`: apply_rope and silu(gate) * up as one pass each, with torch's numbers
bit for bit (tests/gpu): in the eval the CUDA C ones (rtc.py), else Triton's where it runs. `rms_norm`:
transformers' RMSNorm in one pass (its roundings; the mean's summation order Triton's). The last three also
serve extract's decode steps (fastgen.FusedLayers), always as Triton passes. The Triton kernels live in
triton_kernels.py, the CUDA C ones in rtc.py.
REVAL_TORCH_KERNELS=1 turns the fast paths off (the reference runs everywhere); REVAL_RTC=0 the CUDA C ones
(the eval then takes Triton's where `plan` chose it, else torch's).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from remote_payload.contract.errors import PayloadError
from remote_payload.eval import rtc

# REVAL_SDPA: the attention kernel of the drafter's forward on CUDA. efficient (default): the memory-efficient kernel
# first (then cuDNN's, then the math one, where a shape rules it out); torch: torch's own choice, cuDNN's on an
# H100/H200, whose kernel CUDA compiles at run time on a host's first run; cudnn | flash | math: that one only.
# On an H200 the efficient kernel's eval stage was as fast as cuDNN's or faster, and a fresh host's first eval
# compiles nothing for it (docs/benchmarks.md: the process table's REVAL_SDPA row).
SDPA_CHOICES = ("efficient", "torch", "cudnn", "flash", "math")


def sdpa_backend() -> str:
    v = os.environ.get("REVAL_SDPA", "").strip().lower() or "efficient"
    if v not in SDPA_CHOICES:
        raise PayloadError(f"REVAL_SDPA={v!r}: not an attention kernel choice; set one of {', '.join(SDPA_CHOICES)} "
                           "or unset it (default efficient)")
    return v


def _backends(which: str) -> list:
    from torch.nn.attention import SDPBackend as B
    return {"efficient": [B.EFFICIENT_ATTENTION, B.CUDNN_ATTENTION, B.MATH], "cudnn": [B.CUDNN_ATTENTION],
            "flash": [B.FLASH_ATTENTION], "math": [B.MATH]}[which]


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """F.scaled_dot_product_attention with the kernels REVAL_SDPA names, in its order (`sdpa_backend`)."""
    which = sdpa_backend()
    if which == "torch" or not q.is_cuda:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(_backends(which), set_priority=True):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

_triton = None


def _load_triton():
    """The Triton kernels (triton_kernels.py, triton_decode.py) by name, or False where Triton is not installed."""
    global _triton
    if _triton is None:
        try:
            from remote_payload.eval import triton_decode, triton_kernels
        except ImportError:
            _triton = False
            return _triton
        _triton = {"lse": triton_kernels.lse_kernel, "rope": triton_kernels.rope_kernel,
                   "silu_mul": triton_kernels.silu_mul_kernel, "rms_norm": triton_kernels.rms_norm_kernel,
                   # fastgen's split-KV decode attention (extract's decode steps)
                   "decode_split": triton_decode.decode_split_kernel,
                   "decode_combine": triton_decode.decode_combine_kernel}
    return _triton


def fast_kernels_enabled(t: Tensor) -> bool:
    """CUDA, REVAL_TORCH_KERNELS unset: the fused paths run (Triton's where `plan` says it pays)."""
    return t.is_cuda and not os.environ.get("REVAL_TORCH_KERNELS")


def prepare(device: torch.device) -> None:
    """Load the CUDA C logsumexp (rtc.py: compiled once per host, then read from its cache) and import Triton
    (a fraction of a second) if it will be used, now rather than at the first batch."""
    if device.type == "cuda" and not os.environ.get("REVAL_TORCH_KERNELS") and rtc.available(device) is not None:
        _use_triton()  # only where the CUDA C passes do not run: they stand in for Triton's in the eval


def _rtc(logits: Tensor) -> bool:
    """The CUDA C pass (rtc.py) takes these logits here."""
    return rtc.applies(logits) and rtc.available(logits.device) is None


# Triton's first use in a fresh process (import, kernel from its cache) costs the eval stage about half a second;
# its lse saves a few ms per batch of 27B-size logits: it pays past ~6e10 elements. Starting it earlier, beside
# the weight load, with a lower threshold was a wash (docs/benchmarks.md), so the threshold stayed; the eval's
# passes are CUDA C (rtc.py), and Triton's plan matters only where those cannot run (no NVRTC, not bf16).
TRITON_PAYS_ELEMENTS = 6e10
_planned = False


def plan(logit_elements: float, device: torch.device | None = None) -> bool:
    """Say how many logits (rows x vocabulary) the run will reduce: Triton is used when that pays for its
    start (REVAL_TRITON=1 / 0 forces it on / off) and, on `device`, the CUDA C passes do not run (then nothing
    of Triton's is imported). Returns the decision."""
    global _planned
    _planned = logit_elements >= TRITON_PAYS_ELEMENTS
    if device is not None and rtc.available(device) is None:
        return False
    return _use_triton()


def _use_triton() -> bool:
    forced = os.environ.get("REVAL_TRITON")
    wanted = forced == "1" if forced in ("0", "1") else _planned
    return wanted and bool(_load_triton())


def row_logsumexp(logits: Tensor, top_ids: Tensor | None = None) -> Tensor:
    """[N, V] (any float dtype) -> logsumexp over V in fp32, [N, 1].

    CUDA: fused. With Triton (where `plan` chose it), one pass over the logits; otherwise from torch's fused
    log-softmax (its own fp32 max/sum, one fp32 write, no fp32 copy of the input): lse = x[j] - logsm[j] at
    each row's maximal column j (`top_ids` [N, 1] when the caller has them; a column holding -inf would give
    -inf - -inf). Both equal `logsumexp(logits.float())` within fp32 rounding (tests/gpu)."""
    if not (fast_kernels_enabled(logits) and logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[0]):
        return torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    if _rtc(logits):
        return rtc.lse_cmax(logits, want_max=False)[0]
    if _use_triton():
        return _triton_lse(logits)[0]
    j = logits.argmax(-1, keepdim=True) if top_ids is None else top_ids
    logsm = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    return logits.gather(1, j).float() - logsm.gather(1, j)


def _order_keys(x: Tensor) -> Tensor:
    """Integer keys that order like the float values (-0.0 == +0.0): int32 for 16-bit floats, int64 else."""
    if x.dtype in (torch.bfloat16, torch.float16):
        b = x.view(torch.int16).int()
        b = b.masked_fill(b == -32768, 0)  # -0.0 is +0.0
        return b ^ ((b >> 15) & 0x7FFF)  # negatives: the magnitude bits flipped, so larger is larger
    b = x.float().view(torch.int32).long()
    b = b.masked_fill(b == -(1 << 31), 0)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _unique_keys(x: Tensor) -> tuple[Tensor, int]:
    """[N, M] values -> unique keys (value, then the lower column first) and the column bits used."""
    m = x.shape[-1]
    bits = max(1, (m - 1).bit_length())
    key = _order_keys(x)
    if key.dtype == torch.int32 and bits <= 16:
        return (key << 16) | (65535 - torch.arange(m, device=x.device, dtype=torch.int32)), 16
    return (key.long() << bits) | ((1 << bits) - 1 - torch.arange(m, device=x.device)), bits


def topk_reference(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """[N, V] -> (values [N, k], ids [N, k] long): value descending, ties by the lower id."""
    ids = _unique_keys(logits)[0].topk(k, dim=-1).indices
    return logits.gather(-1, ids), ids


TOPK_GROUPS = (32, 64, 16, 8)  # 32 first: see LSE_CHUNK


def topk_chunk(v: int, k: int) -> int | None:
    """How many columns `topk_chunked` puts in a group for V columns, or None when grouping does not pay."""
    return next((g for g in TOPK_GROUPS if v % g == 0 and v // g >= 4 * k), None)


def topk_chunked(logits: Tensor, k: int, group: int) -> tuple[Tensor, Tensor]:
    """`topk_reference`, reading the full rows once (one max per group of columns), then k*group values only.

    Group c holds columns c, c+C, ..., c+(group-1)C (C = V/group: the max runs down a [group, C] view, one
    coalesced pass). Groups are ranked by (their maximum, then the lower column holding it); the k best are kept.
    Exact: were a top-k value e in none of them, each of k better groups has a maximal column m that beats e
    (a larger value; or the same maximum in a lower column than the first maximal column of e's group, which
    is <= e's column when e is that maximum), so e would not be in the top k. The kept values, gathered as
    [group, k] with the groups ascending, are in column order: ties among them resolve as in the full row."""
    n, v = logits.shape
    cols = v // group
    lanes = logits.view(n, group, cols)
    top, j = lanes.max(dim=1)  # [N, C]: each group's maximum and the first lane holding it
    first = j * cols + torch.arange(cols, device=logits.device)  # the column of that maximum
    key = (_order_keys(top).long() << 32) | ((1 << 32) - 1 - first)
    best = key.topk(k, dim=-1).indices.sort(dim=-1).values  # [N, k] groups, ascending
    kept = lanes.gather(2, best[:, None, :].expand(n, group, k)).reshape(n, group * k)  # in column order
    pos = _unique_keys(kept)[0].topk(k, dim=-1).indices  # [N, k], best first
    ids = (pos // k) * cols + best.gather(1, pos % k)
    return kept.gather(1, pos), ids


def row_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """[N, V] -> (values [N, k], ids [N, k] long), value descending, ties by the lower id (module doc)."""
    chunk = topk_chunk(logits.shape[-1], k) if logits.dim() == 2 and logits.is_contiguous() else None
    if chunk is None or os.environ.get("REVAL_TORCH_KERNELS"):
        return topk_reference(logits, k)
    return topk_chunked(logits, k, chunk)


# Columns per maximum in the Triton pass (a divisor of its BLOCK). 32 at the 27B sizes (1,920 x 248,320, k 512):
# a top-k over 7,760 chunk maxima then over 512 x 32 kept values; 64 made the second top-k 32,768 values wide,
# the slower one (docs/benchmarks.md).
LSE_CHUNK = rtc.CHUNK  # 32: the CUDA C pass (rtc.py) takes the same chunks


def _triton_lse(logits: Tensor, chunk_max: bool = False) -> tuple[Tensor, Tensor | None]:
    """The Triton pass over [N, V] contiguous logits: (logsumexp [N, 1] fp32, each LSE_CHUNK columns' maximum
    [N, V / LSE_CHUNK] in the logits' dtype (exact: a maximum is one of the values) when asked, else None)."""
    n, v = logits.shape
    lse = torch.empty(n, device=logits.device, dtype=torch.float32)
    cmax = torch.empty(n, v // LSE_CHUNK, device=logits.device, dtype=logits.dtype) if chunk_max else lse
    _load_triton()["lse"][(n,)](logits, lse, cmax, v, logits.stride(0), v // LSE_CHUNK if chunk_max else 0, BLOCK=2048,
                         CHUNK=LSE_CHUNK, WANT_MAX=chunk_max, num_warps=8)
    return lse[:, None], cmax if chunk_max else None


def topk_from_chunk_max(logits: Tensor, k: int, chunk: int, chunk_max: Tensor) -> tuple[Tensor, Tensor]:
    """`topk_reference` from the maximum of every `chunk` contiguous columns ([N, V/chunk], any float dtype).

    Exact, as `topk_chunked` (chunks ranked by their maximum, then the lower chunk: a lower chunk holds lower
    columns), gathering only the k best chunks' k*chunk values, in column order."""
    n, v = logits.shape
    # in the logits' dtype (exact: each maximum is one of the values): 16-bit values give 32-bit keys
    best = _unique_keys(chunk_max.to(logits.dtype))[0].topk(k, dim=-1).indices.sort(dim=-1).values  # [N, k] chunks
    blocks = logits.view(n, v // chunk, chunk)
    kept = blocks.gather(1, best[..., None].expand(n, k, chunk)).reshape(n, k * chunk)
    pos = _unique_keys(kept)[0].topk(k, dim=-1).indices
    ids = best.gather(1, pos // chunk) * chunk + pos % chunk
    return kept.gather(1, pos), ids


def lse_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """[N, V] -> (logsumexp [N, 1] fp32, top-k values [N, k], ids [N, k]) as `row_logsumexp` + `row_topk`.
    With Triton (where `plan` chose it) the one pass that computes the logsumexp also takes every LSE_CHUNK columns'
    maximum, and the top-k reads only the k best chunks: no separate full pass for the top-k."""
    n, v = logits.shape if logits.dim() == 2 else (0, 0)
    if (n and fast_kernels_enabled(logits) and logits.is_contiguous() and v % LSE_CHUNK == 0
            and v // LSE_CHUNK >= 4 * k):
        cmax = None
        if _rtc(logits):  # CUDA C: no start to pay, so at every size (rtc.py)
            lse, cmax = rtc.lse_cmax(logits)
        elif _use_triton():
            lse, cmax = _triton_lse(logits, chunk_max=True)
        if cmax is not None:
            return (lse, *topk_from_chunk_max(logits, k, LSE_CHUNK, cmax))
    vals, ids = row_topk(logits, k)
    return row_logsumexp(logits, ids[:, :1]), vals, ids


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _triton_now(always: bool) -> bool:
    """Triton for this call: where `plan` chose it (the eval), or wherever it is installed (`always`: extract's
    decode steps, which pay its start at once)."""
    return bool(_load_triton()) if always else _use_triton()


def rope(x: Tensor, cos: Tensor, sin: Tensor, *, always: bool = False) -> Tensor | None:
    """`drafter.apply_rope` as one pass (five torch kernels, broadcasting cos/sin over the heads; CUDA C in the
    eval, Triton with `always`), the same bf16 numbers: x [..., NH, d] contiguous bf16, cos/sin [..., 1, d] bf16
    with x's leading shape.
    None where it does not apply (neither pass available, another dtype or layout, a gradient wanted): the
    caller runs apply_rope. always: see `_triton_now`."""
    if x.dim() < 2 or (torch.is_grad_enabled() and x.requires_grad):
        return None
    nh, d = x.shape[-2:]
    if not (fast_kernels_enabled(x) and x.dtype == cos.dtype == sin.dtype == torch.bfloat16 and x.is_contiguous()
            and cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape == (*x.shape[:-2], 1, d)
            and nh > 0 and d % 2 == 0 and _pow2(d // 2)):
        return None
    if not always and rtc.available(x.device) is None:  # the eval: CUDA C (rtc.py), no start to pay
        return rtc.rope(x, cos, sin)
    if not _triton_now(always):
        return None
    out = torch.empty_like(x)
    rows = x.numel() // (nh * d)
    if rows:
        _load_triton()["rope"][(rows,)](x, cos, sin, out, NH=nh, NHP=1 << (nh - 1).bit_length(), HALF=d // 2,
                                        num_warps=4)
    return out


SILU_BLOCK = 1024


def silu_mul(gate_up: Tensor) -> Tensor | None:
    """[rows, 2I] (gate | up, the fused projection's output) -> silu(gate) * up [rows, I] in one Triton pass,
    the same bf16 numbers as `F.silu(gate).mul_(up)` (IEEE division, libdevice exp as torch's CUDA kernel).
    None where it does not apply (no Triton planned, not bf16, not row-contiguous)."""
    two_i = gate_up.shape[-1]
    if gate_up.dim() != 2 or two_i % 2:
        return None
    return silu_and_mul(gate_up[:, :two_i // 2], gate_up[:, two_i // 2:])


def silu_and_mul(gate: Tensor, up: Tensor, *, always: bool = False) -> Tensor | None:
    """silu(gate) * up for two [..., I] tensors (rows evenly strided, the last dimension contiguous) in one
    Triton pass, the same bf16 numbers as `F.silu(gate) * up`; [..., I] contiguous. None where it does not apply.
    always: see `_triton_now`."""
    if not (gate.shape == up.shape and gate.dim() >= 1 and fast_kernels_enabled(gate)
            and gate.dtype == up.dtype == torch.bfloat16 and up.device == gate.device):
        return None
    inner = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    if g2 is None or u2 is None:
        return None
    if not always and rtc.available(gate.device) is None:  # the eval: CUDA C (rtc.py), no start to pay
        return rtc.silu_mul(g2, u2, gate.shape)
    if not _triton_now(always):
        return None
    rows = g2.shape[0]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if rows and inner:
        grid = (rows, -(-inner // SILU_BLOCK))
        _load_triton()["silu_mul"][grid](g2, u2, out, inner, g2.stride(0), u2.stride(0), BLOCK=SILU_BLOCK,
                                         num_warps=4)
    return out


def _rows(t: Tensor) -> Tensor | None:
    """t as [rows, n] without a copy (evenly strided rows, unit stride within), or None."""
    n = t.shape[-1]
    if t.stride(-1) != 1 and n > 1:
        return None
    try:
        return t.view(-1, n)
    except RuntimeError:  # rows not evenly strided
        return None


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, always: bool = False) -> Tensor | None:
    """transformers' RMSNorm (`weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`, fp32 inside) over x's last
    dimension in one Triton pass: x contiguous bf16 (or fp32), weight [n] of x's dtype. Its roundings are torch's;
    the mean's summation order is Triton's (so a bf16 output may rarely be one ulp from torch's). None where it
    does not apply. always: see `_triton_now`."""
    if x.dim() < 1 or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return None
    n = x.shape[-1]
    if not (fast_kernels_enabled(x) and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float32)
            and weight.shape == (n,) and weight.is_contiguous() and x.is_contiguous() and 0 < n <= 16384
            and weight.device == x.device and _triton_now(always)):
        return None
    out = torch.empty_like(x)
    rows = x.numel() // n
    if rows:
        block = 1 << (n - 1).bit_length()
        _load_triton()["rms_norm"][(rows,)](x, weight, out, n, 1.0 / n, float(eps), BLOCK=block,
                                            BF16=x.dtype == torch.bfloat16, num_warps=4 if block <= 2048 else 8)
    return out
