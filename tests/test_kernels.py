"""kernels.row_topk: one defined order (value descending, ties by the lower id) on every path, and the chunked
fast path equal to the reference on the inputs that break naive top-k code (ties, -0.0, -inf, NaN-free
extremes). The same checks run on CUDA in tests/gpu."""
from __future__ import annotations

import os

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


def _triton_cpu_cases() -> None:
    """Run under TRITON_INTERPRET=1: the eval's Triton passes (kernels.lse_topk and rope with their launch code;
    on a GPU they run where `plan` chooses them) executed on the CPU by Triton's interpreter, against the plain
    torch code they replace. bf16 inputs (what the drafter runs); the interpreter's arithmetic is numpy's, so
    these check each kernel's indexing, masking, chunking and roundings, and tests/gpu the GPU's numbers.
    Also rms_norm (extract's decode steps). silu_mul calls libdevice's exp, which the interpreter does not
    implement: tests/gpu only."""
    import remote_payload.eval.kernels as K
    from remote_payload.eval.drafter import apply_rope
    os.environ["REVAL_TRITON"] = "1"
    K.fast_kernels_enabled = lambda t: True  # the CPU tensors take the fast paths (CUDA only in use)
    torch.manual_seed(0)
    # log-sum-exp + its chunk maxima + the top-k read from them: ties, -0.0, -inf; a vocabulary of 5 x 2048 +
    # 512 columns (the last 2048-column block partial)
    x = tricky_logits(5, 4 * 2048 + 1536, torch.bfloat16, 3).contiguous()
    lse, vals, ids = K.lse_topk(x, 8)
    torch.testing.assert_close(lse, torch.logsumexp(x.float(), -1, keepdim=True), rtol=1e-5, atol=1e-5)
    rv, ri = topk_reference(x, 8)
    assert torch.equal(ids, ri) and torch.equal(vals, rv)
    # RoPE on [rows, NH, d] with cos/sin [rows, 1, d]: torch's bf16 roundings, bit for bit
    xr = torch.randn(7, 3, 8, 64).to(torch.bfloat16)
    ang = torch.randn(7, 3, 1, 64)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    fused = K.rope(xr, cos, sin)
    assert fused is not None
    x1, x2 = xr.chunk(2, dim=-1)
    assert torch.equal(fused, xr * cos + torch.cat([-x2, x1], dim=-1) * sin)
    assert torch.equal(apply_rope(xr, cos, sin), fused)
    xr = torch.randn(4, 5, 32).to(torch.bfloat16)  # 5 heads (padded to 8 in the kernel; the 27B target has 40)
    ang = torch.randn(4, 1, 32)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    x1, x2 = xr.chunk(2, dim=-1)
    assert torch.equal(K.rope(xr, cos, sin), xr * cos + torch.cat([-x2, x1], dim=-1) * sin)
    # RMSNorm (extract's decode steps): transformers' roundings; the interpreter sums in numpy's order
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    for dt, shape in ((torch.bfloat16, (6, 1, 640)), (torch.bfloat16, (3, 1, 5, 16)), (torch.float32, (4, 96))):
        norm = Qwen3RMSNorm(shape[-1], eps=1e-5).to(dt)
        norm.weight.data.normal_(1.0, 0.3)
        xn = (torch.randn(shape) * 4).to(dt)
        with torch.no_grad():
            got, want = K.rms_norm(xn, norm.weight, 1e-5, always=True), norm(xn)
        ulp = want.float().abs() * (2 ** -7 if dt == torch.bfloat16 else 2 ** -20)
        assert got is not None and ((got.float() - want.float()).abs() <= ulp).all(), shape
        assert (got == want).float().mean() >= (0.99 if dt == torch.bfloat16 else 0.5), shape


def test_triton_kernels_equal_torch_under_the_triton_interpreter():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "from tests.test_kernels import _triton_cpu_cases; _triton_cpu_cases()"],
                       check=False, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_cuda_c_kernel_cache_compiles_once_keeps_a_whole_cubin_and_recompiles_a_damaged_one(tmp_path, monkeypatch):
    """rtc.py's cubin cache (the compile itself runs in tests/gpu): the first call compiles and keeps the cubin,
    the next reads it back; a truncated or altered file is compiled again and rewritten whole; a cache folder
    that cannot be written still gives the cubin. The key changes with the arch and NVRTC's version."""
    from remote_payload.eval import cudac, rtc
    monkeypatch.setenv("REVAL_KERNEL_CACHE", str(tmp_path / "k"))
    compiled = []

    def fake_compile(arch):
        compiled.append(arch)
        return b"\x7fELF cubin for " + arch.encode() + b"\x00" * 9

    cubin, cached = rtc.cubin_for("sm_90", "13.0", fake_compile)
    assert (cubin, cached, compiled) == (b"\x7fELF cubin for sm_90" + b"\x00" * 9, False, ["sm_90"])
    compiled.clear()
    assert rtc.cubin_for("sm_90", "13.0", fake_compile) == (cubin, True) and compiled == []
    path = rtc.cubin_path("sm_90", "13.0")
    assert path.parent == tmp_path / "k" and [p.name for p in path.parent.iterdir()] == [path.name]
    assert {rtc.cubin_path("sm_100", "13.0"), rtc.cubin_path("sm_90", "12.8")}.isdisjoint({path})
    blob = path.read_bytes()
    for damaged in (blob[:-3], blob[:-1] + b"X", b"", b"not a cubin at all"):
        path.write_bytes(damaged)
        assert rtc.read_cached(path) is None
        assert rtc.cubin_for("sm_90", "13.0", fake_compile) == (cubin, False) and compiled == ["sm_90"]
        assert path.read_bytes() == blob
        compiled.clear()
    path.write_bytes(blob + b"\0" * (cudac.MAX_CUBIN_BYTES + 1))  # not a cubin of ours: never read whole
    assert rtc.read_cached(path) is None and rtc.cubin_for("sm_90", "13.0", fake_compile) == (cubin, False)
    assert path.read_bytes() == blob and [p.name for p in path.parent.iterdir()] == [path.name]
    for planted in ("fifo", "/dev/zero"):  # neither may block the read or never end it: compiled again
        path.unlink()
        os.mkfifo(path) if planted == "fifo" else path.symlink_to(planted)
        assert rtc.read_cached(path) is None and rtc.cubin_for("sm_90", "13.0", fake_compile) == (cubin, False)
        assert path.read_bytes() == blob and not path.is_symlink()
    path.unlink()
    path.mkdir()  # the rename into place fails: the temp file goes too
    assert rtc.cubin_for("sm_90", "13.0", fake_compile) == (cubin, False)
    assert [p.name for p in path.parent.iterdir()] == [path.name] and path.is_dir()
    monkeypatch.setenv("REVAL_KERNEL_CACHE", str(tmp_path / "file-not-dir" / "k"))
    (tmp_path / "file-not-dir").write_text("in the way")
    assert rtc.cubin_for("sm_90", "13.0", fake_compile) == (cubin, False)


def test_cuda_c_pass_says_why_it_does_not_run_off_cuda(monkeypatch):
    from remote_payload.eval import rtc
    assert rtc.available(torch.device("cpu")) == "not a CUDA device"
    assert not rtc.applies(torch.zeros(4, 64, dtype=torch.bfloat16))
    monkeypatch.setenv("REVAL_RTC", "0")
    assert not rtc.enabled()
    monkeypatch.setenv("REVAL_RTC", "1")
    assert rtc.enabled()
    monkeypatch.setenv("REVAL_TORCH_KERNELS", "1")
    assert not rtc.enabled()


def test_reval_sdpa_names_a_kernel_or_the_eval_refuses_it(monkeypatch):
    """REVAL_SDPA picks the drafter's attention kernel on CUDA (tests/gpu/test_cuda.py checks each one's numbers);
    a value that names none is bad input, refused in one line naming the variable and the choices."""
    from remote_payload.contract.errors import PayloadError
    from remote_payload.eval import kernels
    monkeypatch.delenv("REVAL_SDPA", raising=False)
    assert kernels.sdpa_backend() == "efficient"
    monkeypatch.setenv("REVAL_SDPA", " Torch ")
    assert kernels.sdpa_backend() == "torch"
    monkeypatch.setenv("REVAL_SDPA", "fast")
    with pytest.raises(PayloadError, match=r"REVAL_SDPA='fast': not an attention kernel choice; set one of "
                                           r"efficient, torch, cudnn, flash, math"):
        kernels.sdpa_backend()
