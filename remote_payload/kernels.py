"""Fused GPU kernels for the drafting's hot spots, each beside the plain torch code it replaces.

`row_logsumexp(logits)` [N, V] -> [N, 1] fp32. torch's `logsumexp(logits.float())` writes an fp32 copy of
[N, V] and reads it in several passes (at the 27B sizes, 248,320-token vocabulary and 1,920 rows a batch:
4.5 ms of a 29 ms batch). On CUDA: one Triton pass over the bf16 logits with an online max/sum per lane in
fp32 (0.41 ms) when the run is long enough to pay for Triton's start (`plan`; REVAL_TRITON=1/0 forces it),
else from torch's fused log-softmax (3.2 ms). Both equal the torch path within fp32 rounding (tests/gpu).
REVAL_TORCH_KERNELS=1 turns the fast paths off (the reference runs everywhere).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

_triton = None


def _load_triton():
    global _triton
    if _triton is None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _triton = False
            return _triton

        @triton.jit
        def lse_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            base = x_ptr + row * stride
            m = tl.full([BLOCK], float("-inf"), tl.float32)
            s = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n_cols, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(base + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m, x)
                empty = m_new == float("-inf")  # nothing seen by this lane yet: keep s = 0, no inf - inf
                s = tl.where(empty, 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
                m = m_new
            top = tl.max(m, 0)
            total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), 0)
            tl.store(out_ptr + row, top + tl.log(total))

        _triton = lse_kernel
    return _triton


def fast_kernels_enabled(t: Tensor) -> bool:
    """CUDA, REVAL_TORCH_KERNELS unset: the fused paths run (Triton's where `plan` says it pays)."""
    return t.is_cuda and not os.environ.get("REVAL_TORCH_KERNELS")


def prepare(device: torch.device) -> None:
    """Import Triton (0.24 s on an H200 host) now, if it will be used, rather than at the first batch."""
    if device.type == "cuda" and not os.environ.get("REVAL_TORCH_KERNELS"):
        _use_triton()


# Triton's first use in a fresh process (import, kernel from its cache) cost the eval stage ~0.5 s on an H200
# host; its lse saves ~4 ms per 1,920 x 248,320 logits (8.4e-12 s an element): it pays past ~6e10 elements.
TRITON_PAYS_ELEMENTS = 6e10
_planned = False


def plan(logit_elements: float) -> bool:
    """Say how many logits (rows x vocabulary) the run will reduce: Triton is used when that pays for its
    start (REVAL_TRITON=1 / 0 forces it on / off). Returns the decision."""
    global _planned
    _planned = logit_elements >= TRITON_PAYS_ELEMENTS
    return _use_triton()


def _use_triton() -> bool:
    forced = os.environ.get("REVAL_TRITON")
    wanted = forced == "1" if forced in ("0", "1") else _planned
    return wanted and bool(_load_triton())


def row_logsumexp(logits: Tensor) -> Tensor:
    """[N, V] (any float dtype) -> logsumexp over V in fp32, [N, 1].

    CUDA: fused. With Triton (where `plan` chose it), one pass over the logits; otherwise from torch's fused
    log-softmax (its own fp32 max/sum, one fp32 write, no fp32 copy of the input): lse = x[:, 0] - logsm[:, 0].
    Both equal `logsumexp(logits.float())` within fp32 rounding (tests/gpu)."""
    if not (fast_kernels_enabled(logits) and logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[0]):
        return torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    if _use_triton():
        n, v = logits.shape
        out = torch.empty(n, device=logits.device, dtype=torch.float32)
        _load_triton()[(n,)](logits, out, v, logits.stride(0), BLOCK=2048, num_warps=8)
        return out[:, None]
    logsm0 = torch.log_softmax(logits, dim=-1, dtype=torch.float32)[:, :1]
    return logits[:, :1].float() - logsm0
