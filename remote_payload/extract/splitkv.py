"""Extract's decode attention over the static cache's filled slots: split-KV Triton kernels (a row's filled slots
cut into parts, each part's softmax partials combined), graph-safe (the filled length is a device tensor).
fastgen.grouped_decode_attention calls them where they run (`split_kv_runs`)."""
from __future__ import annotations

import os

import torch

from remote_payload.eval.kernels import _load_triton


def split_kv_available(device, dtype, head_dim: int) -> bool:
    """Whether the decode steps can attend with the split-KV Triton kernels: CUDA, a 16-bit dtype, a power-of-two
    head size, Triton installed, REVAL_DECODE_ATTENTION not `grouped`."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim >= 16
            and head_dim & (head_dim - 1) == 0 and os.environ.get("REVAL_DECODE_ATTENTION") != "grouped"
            and bool(_load_triton()))


def split_kv_runs(query, key, value) -> bool:
    return (split_kv_available(query.device, query.dtype, query.shape[-1]) and key.dtype == query.dtype
            and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1)


def _splits(programs: int, device) -> int:
    """Parts each row's filled slots are cut into: enough programs for ~4 per SM, at most 16."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(16, -(-4 * sms // programs)))


def _split_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                  filled: torch.Tensor, scale: float, splits: int = 0) -> torch.Tensor:
    kernels = _load_triton()
    B, H, _, d = query.shape
    Hkv = key.shape[1]
    G = H // Hkv
    S = splits or _splits(B * Hkv, query.device)
    gp = max(16, 1 << (G - 1).bit_length())
    part = torch.empty(B * Hkv * S * G * d, dtype=torch.float32, device=query.device)
    ml = torch.empty(B * Hkv * S * 2 * G, dtype=torch.float32, device=query.device)
    out = torch.empty((B, 1, H, d), dtype=query.dtype, device=query.device)
    m2 = mask[:, 0, -1, :]  # [B, >= L] additive
    kernels["decode_split"][(B * Hkv, S)](
        query, key, value, m2, filled, part, ml, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        key.stride(2), value.stride(0), value.stride(1), value.stride(2), m2.stride(0), m2.stride(1), scale,
        HKV=Hkv, G=G, GP=gp, D=d, S=S, BLOCK_N=64)
    kernels["decode_combine"][(B * Hkv,)](part, ml, out, out.stride(0), out.stride(2), HKV=Hkv, G=G, GP=gp, D=d, S=S)
    return out


def _split_decode_fake(query, key, value, mask, filled, scale):
    B, H, _, d = query.shape
    return query.new_empty((B, 1, H, d))


_split_op = None


def split_decode_attention(query, key, value, mask, filled, scale: float):
    """One new token per row over the static cache, reading its filled slots only (`filled` = the step's cache
    position, on the device: graph-safe): [B, 1, H, d]. A torch custom op where torch has them, so that
    torch.compile calls it as one opaque kernel."""
    global _split_op
    if _split_op is None:
        _split_op = _split_decode
        lib = getattr(torch, "library", None)
        if hasattr(lib, "custom_op"):
            try:
                op = lib.custom_op("reval::split_decode_attention", mutates_args=())(_split_decode)
                op.register_fake(_split_decode_fake)
                _split_op = op
            except Exception:  # noqa: BLE001 - registered already (a reload) or an older API: call it directly
                _split_op = _split_decode
    return _split_op(query, key, value, mask, filled, float(scale))
