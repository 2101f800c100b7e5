"""The GPU paths, run on a CUDA machine with `make test-gpu` (CI has no GPU; `make test` does not collect
this folder, see tests/conftest.py). Each compares the CUDA path with the CPU reference."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from remote_payload.__main__ import main as payload_main
from remote_payload.eval import metrics as m
from remote_payload.eval.safetensors_io import read_header, read_tensors
from tests.samples import random_targets, sorted_logprobs

assert torch.cuda.is_available(), "tests/gpu needs a CUDA device (run it with make test-gpu on a GPU host)"


def test_ddtree_vectorised_on_cuda_equals_heap():
    rng = np.random.default_rng(6)
    n, depth, k = 64, 15, 128
    lp = torch.tensor(sorted_logprobs(rng, (n, depth, k)), dtype=torch.float32).to(torch.bfloat16).float()
    ranks = random_targets(rng, n, depth, k)
    got = m.ddtree_accept_lengths(lp.cuda(), torch.tensor(ranks).cuda(), [1, 16, 128])
    for b in (1, 16, 128):
        assert got[b].tolist() == [m.ddtree_accept_heap(lp[j].numpy(), ranks[j], b) for j in range(n)], b


def test_cuda_reader_equals_load_file(st_file):
    ref = load_file(st_file)
    for staging_bytes in (100, 1 << 20):
        got = read_tensors(read_header(st_file), list(ref), device="cuda", staging_bytes=staging_bytes)
        for k, v in ref.items():
            assert got[k].is_cuda and torch.equal(got[k].cpu(), v), k
    bf = read_tensors(read_header(st_file), ["bf16"], device="cuda", dtype=torch.float32)["bf16"]
    assert bf.dtype == torch.float32 and torch.equal(bf.cpu(), ref["bf16"].float())


def test_eval_on_cuda_fp32_equals_cpu_and_bf16_is_close(trained_fixtures, tmp_path):
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    p = {k: str(trained_fixtures / v) for k, v in meta["paths"].items() if isinstance(v, str)}
    res = {}
    for dev, dt in (("cpu", "fp32"), ("cuda", "fp32"), ("cuda", "bf16")):
        out = tmp_path / f"{dev}-{dt}"
        assert payload_main(["eval", "--drafter", p["drafter_good"], "--target", p["target"], "--cache", p["cache"],
                             "--run-dir", str(out), "--device", dev, "--dtype", dt]) == 0
        res[dev, dt] = json.loads((out / "results.json").read_text())
    cpu, gpu, bf = res["cpu", "fp32"], res["cuda", "fp32"], res["cuda", "bf16"]
    assert [p["acceptance_lengths"] for p in gpu["per_prompt"]] == [p["acceptance_lengths"] for p in cpu["per_prompt"]]
    assert gpu["metrics"]["ddtree_tau"] == cpu["metrics"]["ddtree_tau"]
    assert abs(bf["metrics"]["tau"] - cpu["metrics"]["tau"]) < 0.1 * cpu["metrics"]["tau"]
    assert abs(bf["metrics"]["position_1_accuracy"] - cpu["metrics"]["position_1_accuracy"]) < 0.02


@pytest.mark.parametrize("triton", ["0", "1"])
def test_fused_logsumexp_equals_torch(triton, monkeypatch):
    from remote_payload.eval import kernels
    from remote_payload.eval.kernels import fast_kernels_enabled, row_logsumexp
    monkeypatch.setenv("REVAL_TRITON", triton)
    monkeypatch.setenv("REVAL_RTC", "0" if triton == "1" else "1")  # Triton's pass, or the CUDA C one
    assert kernels._use_triton() == (triton == "1")
    g = torch.Generator(device="cuda").manual_seed(0)
    for dt, shape in ((torch.bfloat16, (257, 50001)), (torch.float32, (33, 4097)), (torch.bfloat16, (5, 7)),
                      (torch.bfloat16, (64, 50016))):  # the last one the CUDA C pass takes (V % 32 == 0)
        x = (torch.randn(shape, generator=g, device="cuda") * 4).to(dt)
        assert fast_kernels_enabled(x)
        got, ref = row_logsumexp(x), torch.logsumexp(x.float(), dim=-1, keepdim=True)
        assert got.shape == ref.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)


def test_logits_topk_fast_path_equals_torch_path(monkeypatch):
    from remote_payload.eval.drafter import TargetHead, logits_topk
    g = torch.Generator(device="cuda").manual_seed(1)
    H, V = 256, 30011
    head = TargetHead(embed=torch.randn(V, H, generator=g, device="cuda").bfloat16(),
                      lm_head=(torch.randn(V, H, generator=g, device="cuda") * H ** -0.5).bfloat16())
    hidden = torch.randn(24, 16, H, generator=g, device="cuda").bfloat16()
    tgt = torch.randint(0, V, (24, 15), generator=g, device="cuda")
    monkeypatch.setenv("REVAL_TRITON", "1")
    monkeypatch.setenv("REVAL_RTC", "0")
    triton = logits_topk(hidden, head, 64, target_ids=tgt)
    monkeypatch.setenv("REVAL_TRITON", "0")
    monkeypatch.setenv("REVAL_RTC", "1")
    fast = logits_topk(hidden, head, 64, target_ids=tgt)
    monkeypatch.setenv("REVAL_TORCH_KERNELS", "1")
    ref = logits_topk(hidden, head, 64, target_ids=tgt)
    for got in (fast, triton):
        for k in ("argmax_ids", "topk_ids", "target_ranks"):
            assert torch.equal(getattr(got, k), getattr(ref, k)), k
        torch.testing.assert_close(got.topk_logprobs, ref.topk_logprobs, rtol=0, atol=2e-5)
        torch.testing.assert_close(got.target_logprobs, ref.target_logprobs, rtol=0, atol=2e-5)


def test_eval_fast_kernels_equal_torch_kernels_in_bf16(trained_fixtures, tmp_path, monkeypatch, capsys):
    """The pipelined eval (a prime beside the load, warm-up after it, features read ahead, DDTree on the
    device) with the fused kernels gives the same walks as with plain torch kernels: exact acceptance, DDTree
    and width-k taus."""
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    p = {k: str(trained_fixtures / v) for k, v in meta["paths"].items() if isinstance(v, str)}
    res = {}
    for mode in ("fast", "triton", "torch"):
        monkeypatch.setenv("REVAL_TRITON", "1" if mode == "triton" else "0")
        monkeypatch.setenv("REVAL_RTC", "1" if mode == "fast" else "0")
        monkeypatch.setenv("REVAL_WARMUP", "1" if mode == "fast" else "0")
        if mode == "torch":
            monkeypatch.setenv("REVAL_TORCH_KERNELS", "1")
        out = tmp_path / mode
        assert payload_main(["eval", "--drafter", p["drafter_good"], "--target", p["target"], "--cache", p["cache"],
                             "--run-dir", str(out), "--device", "cuda", "--dtype", "bf16"]) == 0
        res[mode] = json.loads((out / "results.json").read_text())
        log = capsys.readouterr().out
        assert ("primed beside the load" in log) == (mode == "fast"), log[-2000:]
    ref = res["torch"]
    for fast in (res["fast"], res["triton"]):
        for key in ("acceptance_lengths", "ddtree_acceptance_lengths", "tree_width_acceptance_lengths",
                    "position_hits"):
            assert [q[key] for q in fast["per_prompt"]] == [q[key] for q in ref["per_prompt"]], key
    assert ref["metrics"]["tau"] > 1.5  # the trained drafter drafts for real: the comparison is not vacuous


def test_fused_rmsnorm_equals_the_reference_within_one_bf16_step(monkeypatch):
    from remote_payload.eval.drafter import RMSNorm
    g = torch.Generator(device="cuda").manual_seed(2)
    norm = RMSNorm(5120, 1e-6).cuda().bfloat16()
    norm.weight.data = (torch.rand(5120, generator=g, device="cuda") + 0.5).bfloat16()
    x = (torch.randn(2048, 5120, generator=g, device="cuda") * 3).bfloat16()
    fast = norm(x)
    monkeypatch.setenv("REVAL_TORCH_KERNELS", "1")
    ref = norm(x)
    assert fast.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(fast, ref, rtol=2**-6, atol=1e-5)  # fp32 statistics; two bf16 roundings (norm, scale)
    assert (fast != ref).float().mean() < 0.01


def test_fused_projections_on_cuda_equal_the_separate_ones():
    from tests.tiny_models import random_drafter, random_head, tiny_drafter_config
    cfg = tiny_drafter_config(hidden_size=256, intermediate_size=512, sliding_window=40)
    model, head = random_drafter(cfg, seed=4), random_head(cfg)
    model = model.cuda().bfloat16()
    head.embed, head.lm_head = head.embed.cuda().bfloat16(), head.lm_head.cuda().bfloat16()
    feats = torch.randn(300, cfg.fc_in_features, device="cuda").bfloat16()
    anchors = torch.arange(100, 228, device="cuda")
    bonus = torch.randint(0, cfg.vocab_size, (128,), device="cuda")
    with torch.no_grad():
        ref = model.draft_hidden(model.precompute_context(feats), anchors, bonus, head)
        model.fuse_projections()
        got = model.draft_hidden(model.precompute_context(feats), anchors, bonus, head)
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_chunked_topk_on_cuda_equals_the_reference_at_the_27b_vocabulary():
    from remote_payload.eval.kernels import topk_chunk, topk_chunked, topk_reference
    from tests.samples import tricky_logits
    V, k = 248320, 512
    chunk = topk_chunk(V, k)
    x = tricky_logits(8, V, torch.bfloat16, 0).cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    big = (torch.randn(1920, V, generator=g, device="cuda") * 2).bfloat16()  # bf16: many ties among 248k values
    for logits in (x, big):
        got, ref = topk_chunked(logits, k, chunk), topk_reference(logits, k)
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])
    assert torch.equal(ref[1][:, 0], big.float().argmax(-1))


@pytest.mark.parametrize("triton", ["0", "1"])
def test_lse_topk_with_and_without_triton_equals_the_references(triton, monkeypatch):
    from remote_payload.eval import kernels
    from tests.samples import tricky_logits
    monkeypatch.setenv("REVAL_TRITON", triton)
    monkeypatch.setenv("REVAL_RTC", "0" if triton == "1" else "1")  # Triton's pass, or the CUDA C one
    V, k = 248320, 512
    x = tricky_logits(8, V, torch.bfloat16, 1).cuda()
    g = torch.Generator(device="cuda").manual_seed(6)
    big = (torch.randn(1920, V, generator=g, device="cuda") * 2).bfloat16()
    for logits in (x, big):
        lse, vals, ids = kernels.lse_topk(logits, k)
        ref_v, ref_i = kernels.topk_reference(logits, k)
        assert torch.equal(ids, ref_i) and torch.equal(vals, ref_v)
        torch.testing.assert_close(lse, torch.logsumexp(logits.float(), -1, keepdim=True), rtol=1e-6, atol=1e-5)


def test_drafting_on_several_streams_equals_one_stream(monkeypatch):
    """Batches alternate between two streams and the DDTree runs on a third, prompts queued ahead as the eval
    does: the same numbers as everything on one stream (REVAL_STREAMS=1), bit for bit."""
    from remote_payload.eval.anchors import enqueue_anchors
    from remote_payload.eval.kernels import plan
    from tests.tiny_models import random_drafter, random_head, tiny_drafter_config
    cfg = tiny_drafter_config(hidden_size=512, intermediate_size=1024, sliding_window=64, vocab_size=32768,
                              max_position_embeddings=4096)
    model, head = random_drafter(cfg, seed=7), random_head(cfg)
    model = model.cuda().bfloat16()
    head.embed, head.lm_head = head.embed.cuda().bfloat16(), head.lm_head.cuda().bfloat16()
    model.fuse_projections()
    g = torch.Generator(device="cuda").manual_seed(8)
    prompts = [(torch.randn(T, cfg.fc_in_features, generator=g, device="cuda").bfloat16(),
                torch.randint(0, cfg.vocab_size, (T,), generator=g, device="cuda")) for T in (700, 420, 900)]
    plan(1e12)  # the Triton path too, where it is installed

    def run_all():
        pending = [enqueue_anchors(model, head, f, ids, 40, ids.shape[0] - 60, batch_size=64,
                                   budgets=[16, 64, 256], widths=[4, 8]) for f, ids in prompts]
        return [p.result() for p in pending]

    monkeypatch.setenv("REVAL_STREAMS", "1")
    ref = run_all()
    monkeypatch.delenv("REVAL_STREAMS")
    for _ in range(2):
        got = run_all()
        for a, b in zip(got, ref):
            assert np.array_equal(a.drafts, b.drafts) and np.array_equal(a.target_rank, b.target_rank)
            assert torch.equal(a.topk_logprobs, b.topk_logprobs)
            assert all(np.array_equal(a.tree_acc[k], b.tree_acc[k]) for k in b.tree_acc)
    assert sum(int(r.tree_acc[256].sum()) for r in ref) > 0  # some targets inside the trees: not vacuous


@pytest.mark.parametrize("fused", ["cuda-c", "triton"])
def test_fused_rope_equals_apply_rope_bit_for_bit(fused, monkeypatch):
    """The fused RoPE (one pass: rtc.py's CUDA C, or Triton's) gives apply_rope's bf16 numbers exactly, at the 27B
    shapes (32 query and 8 key heads of 128) and positions up to the context limit."""
    from remote_payload.eval import kernels, rtc
    from remote_payload.eval.drafter import apply_rope, rope_cos_sin
    monkeypatch.setenv("REVAL_TRITON", "1")
    monkeypatch.setenv("REVAL_RTC", "1" if fused == "cuda-c" else "0")
    assert (rtc.available(torch.device("cuda")) is None) == (fused == "cuda-c")
    g = torch.Generator(device="cuda").manual_seed(9)
    pos = torch.randint(0, 262144, (2, 64, 16), generator=g, device="cuda")
    cos, sin = rope_cos_sin(pos, 128, 1e7)
    cos, sin = cos[..., None, :].bfloat16(), sin[..., None, :].bfloat16()
    for heads in (32, 8):
        x = (torch.randn(2, 64, 16, heads, 128, generator=g, device="cuda") * 4).bfloat16()
        got = kernels.rope(x, cos, sin)
        monkeypatch.setenv("REVAL_TORCH_KERNELS", "1")
        ref = apply_rope(x, cos, sin)
        monkeypatch.delenv("REVAL_TORCH_KERNELS")
        assert got is not None and torch.equal(got, ref), heads


@pytest.mark.parametrize("fused", ["cuda-c", "triton"])
def test_fused_silu_mul_equals_torch_bit_for_bit(fused, monkeypatch):
    from remote_payload.eval import kernels, rtc
    monkeypatch.setenv("REVAL_TRITON", "1")
    monkeypatch.setenv("REVAL_RTC", "1" if fused == "cuda-c" else "0")
    assert (rtc.available(torch.device("cuda")) is None) == (fused == "cuda-c")
    g = torch.Generator(device="cuda").manual_seed(10)
    gu = (torch.randn(2048, 2 * 17408, generator=g, device="cuda") * 6).bfloat16()
    gu[0, :8] = torch.tensor([0.0, -0.0, 88.0, -88.0, 1e4, -1e4, float("inf"), float("-inf")])
    got = kernels.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate).mul_(up)
    assert got is not None and got.shape == ref.shape
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())
    g3, u3 = gate[:1000, :1000].contiguous().view(10, 100, 1000)[:, ::20], up[:50, :1000].reshape(10, 5, 1000)
    got3 = kernels.silu_and_mul(g3, u3)  # [10, 5, 1000]: rows strided, n not a multiple of the block
    ref3 = torch.nn.functional.silu(g3) * u3  # row 0 holds silu(-inf) = NaN
    assert got3 is not None and torch.equal(got3.isnan(), ref3.isnan()) and ref3.isnan().any()
    assert torch.equal(got3.nan_to_num(), ref3.nan_to_num())


def test_cuda_c_logsumexp_and_chunk_maxima_equal_the_references(tmp_path, monkeypatch):
    """rtc.py's pass, compiled by NVRTC into a fresh kernel cache: the logsumexp equals torch's fp32 one within
    rounding (-inf rows, NaN, ties, strided rows), every 32 columns' maximum is exact; a damaged cached cubin
    is compiled again and rewritten whole."""
    from remote_payload.eval import rtc
    from tests.samples import tricky_logits
    monkeypatch.setenv("REVAL_KERNEL_CACHE", str(tmp_path / "k"))
    monkeypatch.setenv("REVAL_RTC", "1")
    dev = torch.device("cuda")
    rtc._state.clear()
    rtc._pending.clear()  # an earlier test's precompile read the default cache
    assert rtc.available(dev) is None and rtc.how(dev).startswith("compiled by NVRTC in")
    cubins = list((tmp_path / "k").glob("*.cubin"))
    assert len(cubins) == 1 and rtc.read_cached(cubins[0]) is not None
    g = torch.Generator(device="cuda").manual_seed(3)
    tricky = tricky_logits(8, 248320, torch.bfloat16, 1).cuda()
    tricky[5] = float("-inf")  # nothing but -inf
    tricky[6, 1000] = float("nan")
    tricky[7] = float("-inf")
    tricky[7, 77] = 2.5  # one finite value
    wide = (torch.randn(40, 50048, generator=g, device="cuda") * 3).bfloat16()
    cases = [tricky, (torch.randn(1920, 248320, generator=g, device="cuda") * 2).bfloat16(),
             (torch.randn(257, 50016, generator=g, device="cuda") * 4).bfloat16(), wide[:, :50016],
             torch.randn(3, 32, generator=g, device="cuda").bfloat16()]
    for x in cases:
        assert rtc.applies(x)
        lse, cmax = rtc.lse_cmax(x)
        ref = torch.logsumexp(x.float(), -1, keepdim=True)
        assert lse.shape == ref.shape and lse.dtype == torch.float32
        torch.testing.assert_close(lse, ref, rtol=1e-6, atol=1e-5, equal_nan=True)
        n, v = x.shape
        ref_max = x.float().reshape(n, v // 32, 32).amax(-1).bfloat16()
        clean = ~torch.isnan(x.float()).any(-1)  # fmaxf skips a NaN; such a row's lse is NaN (checked above)
        assert torch.equal(cmax[clean], ref_max[clean])
        assert rtc.lse_cmax(x, want_max=False)[1] is None
    assert torch.isnan(rtc.lse_cmax(tricky)[0][6]).all() and rtc.lse_cmax(tricky)[0][5].item() == float("-inf")
    assert rtc.lse_cmax(tricky)[0][7].item() == 2.5
    cubins[0].write_bytes(b"reval-cubin-1\n" + b"0" * 40)  # damaged: its checksum disagrees
    rtc._state.clear()
    rtc._pending.clear()
    assert rtc.available(dev) is None and rtc.read_cached(cubins[0]) is not None
    assert rtc.how(dev).startswith("compiled by NVRTC in")
    rtc._state.clear()
    rtc._pending.clear()
    rtc.precompile(dev)  # now the kept cubin, read on precompile's thread
    assert rtc.available(dev) is None and rtc.how(dev) == "from the kernel cache"
    from remote_payload.eval import kernels
    assert kernels.plan(1e12, dev) is False  # a long run: the CUDA C passes, Triton not started
    monkeypatch.setenv("REVAL_RTC", "0")
    assert kernels.plan(1e12, dev) is True and kernels.plan(1e9, dev) is False
    torch.testing.assert_close(rtc.lse_cmax(cases[2])[0], torch.logsumexp(cases[2].float(), -1, keepdim=True),
                               rtol=1e-6, atol=1e-5)


def test_each_reval_sdpa_kernel_gives_the_math_kernels_attention(monkeypatch):
    """kernels.sdpa under each REVAL_SDPA choice (the drafter's masked, GQA-folded attention shape, bf16) equals
    the math kernel's output within bf16 rounding; the default (efficient) is what the eval runs."""
    from remote_payload.eval import kernels
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(8, 4, 16 * 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(8, 4, 384, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(8, 4, 384, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    vis = torch.rand(8, 1, 64, 384, device="cuda", generator=g) > 0.3
    vis[..., 0] = True  # every query sees a key
    mask = torch.zeros(vis.shape, dtype=torch.bfloat16, device="cuda").masked_fill_(~vis, float("-inf"))
    monkeypatch.setenv("REVAL_SDPA", "math")
    ref = kernels.sdpa(q, k, v, mask, 128 ** -0.5).float()
    for choice in ("efficient", "torch", "cudnn"):
        monkeypatch.setenv("REVAL_SDPA", choice)
        out = kernels.sdpa(q, k, v, mask, 128 ** -0.5).float()
        assert (out - ref).abs().max().item() < 3e-2, choice
