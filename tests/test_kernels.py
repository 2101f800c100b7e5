"""kernels.row_topk: one defined order (value descending, ties by the lower id) on every path, and the chunked
fast path equal to the reference on the inputs that break naive top-k code (ties, -0.0, -inf, NaN-free
extremes). The same checks run on CUDA in tests/gpu."""
from __future__ import annotations

import pytest
import torch

from remote_payload.eval.kernels import row_topk, topk_chunk, topk_chunked, topk_reference
from tests.samples import tricky_logits


def sorted_ref(row: list[float], k: int) -> list[tuple[float, int]]:
    """The definition, by hand: (value descending, id ascending), -0.0 equal to +0.0."""
    return sorted(((v, i) for i, v in enumerate(row)), key=lambda t: (-t[0], t[1]))[:k]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_is_the_definition(dtype):
    x = tricky_logits(6, 200, dtype, 0)
    vals, ids = topk_reference(x, 17)
    for r in range(x.shape[0]):
        want = sorted_ref(x[r].float().tolist(), 17)
        assert ids[r].tolist() == [i for _, i in want], r
        assert vals[r].float().tolist() == [v for v, _ in want], r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k,chunk", [(1, 64), (5, 8), (64, 16), (128, 16), (48, 64)])
def test_chunked_equals_the_reference(dtype, k, chunk):
    x = tricky_logits(9, 64 * 48, dtype, k)
    got_v, got_i = topk_chunked(x, k, chunk)
    ref_v, ref_i = topk_reference(x, k)
    assert torch.equal(got_i, ref_i) and torch.equal(got_v, ref_v)
    assert got_i.dtype == torch.long and got_v.dtype == dtype


def test_row_topk_argmax_is_the_first_maximum_and_chunking_is_chosen_only_when_it_pays(monkeypatch):
    x = tricky_logits(6, 8192, torch.bfloat16, 3)
    vals, ids = row_topk(x, 16)
    assert torch.equal(ids[:, 0], x.float().argmax(-1))  # argmax: the first maximal id
    assert topk_chunk(8192, 16) == 32 and topk_chunk(96, 16) is None and topk_chunk(248320, 512) == 32
    assert topk_chunk(16 * 8193, 512) == 16  # 32 and 64 do not divide it
    assert topk_chunk(8191, 2) is None  # a prime width: the reference
    monkeypatch.setenv("REVAL_TORCH_KERNELS", "1")
    assert [torch.equal(a, b) for a, b in zip(row_topk(x, 16), (vals, ids))] == [True, True]


@pytest.mark.parametrize("k", [1, 9, 40])
def test_topk_from_contiguous_chunk_maxima_equals_the_reference(k):
    from remote_payload.eval.kernels import topk_from_chunk_max
    x = tricky_logits(9, 64 * 160, torch.bfloat16, k)
    cmax = x.float().view(9, 160, 64).amax(-1)  # what the Triton pass writes beside the logsumexp
    got, ref = topk_from_chunk_max(x, k, 64, cmax), topk_reference(x, k)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])


def test_fused_rope_and_silu_decline_what_they_do_not_cover():
    """kernels.rope / silu_mul answer None (the caller runs the torch code) off CUDA, for a tensor of too few
    dimensions, and where a gradient is wanted; never an error."""
    from remote_payload.eval.drafter import apply_rope, rope_cos_sin
    from remote_payload.eval.kernels import rope, silu_mul
    cos, sin = rope_cos_sin(torch.arange(6), 8, 1e4)
    assert rope(torch.ones(8), cos[0], sin[0]) is None
    x = torch.randn(6, 2, 8, requires_grad=True)
    assert rope(x, cos[:, None], sin[:, None]) is None
    assert silu_mul(torch.ones(3, 8)) is None
    out = apply_rope(x, cos[:, None], sin[:, None])  # the torch path, differentiable
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
