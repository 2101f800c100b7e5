"""fastgen on CUDA: the captured decode step equals the eager step and the dynamic-cache decoder (fp32), and in
bf16 the graph replays exactly what the eager static step computes."""
from __future__ import annotations

import torch

from remote_payload.extract.decode import greedy_complete_batch
from remote_payload.extract.fastgen import greedy_static
from remote_payload.tools.bench_extract import TINY, random_target

assert torch.cuda.is_available(), "tests/gpu needs a CUDA device"


def _prompts(vocab, lengths):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_cuda_graph_decoding_equals_eager_and_dynamic_fp32():
    model = random_target({**TINY, "num_hidden_layers": 2}, torch.device("cuda"), torch.float32)
    prompts = _prompts(TINY["vocab_size"], (3, 17, 40, 64, 90))
    want = greedy_complete_batch(model, prompts, 24, {5})
    assert greedy_static(model, prompts, 24, {5}, graphs=False) == want
    assert greedy_static(model, prompts, 24, {5}, graphs=True) == want


def test_cuda_graph_replays_the_eager_static_step_bf16():
    model = random_target(TINY, torch.device("cuda"), torch.bfloat16)
    prompts = _prompts(TINY["vocab_size"], (5, 33, 70))
    assert greedy_static(model, prompts, 32, set(), graphs=True) == greedy_static(model, prompts, 32, set(),
                                                                                  graphs=False)


def test_split_kv_bf16_equals_grouped_attention_at_the_targets_shapes():
    """The split-KV Triton kernels (extract's decode attention on CUDA) against the torch grouped attention over
    the filled slots, bf16, batch 32, the 8B (32/8 heads) and 27B (40/8: G = 5) shapes, a 641-slot static cache
    whose unfilled slots hold NaN (never read), row 0 left-padded; the default parts and 1 part."""
    import remote_payload.extract.fastgen as fg
    from remote_payload.extract import splitkv

    class Module:
        config = object()
    from remote_payload.eval.kernels import _load_triton
    assert _load_triton(), "Triton is installed with CUDA torch"
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for H in (32, 40):
        for cp in (128, 300, 640):
            q = torch.randn(32, 1, H, 128, dtype=torch.bfloat16, device=dev).transpose(1, 2)
            k = torch.randn(32, 8, 641, 128, dtype=torch.bfloat16, device=dev)
            v = torch.randn(32, 8, 641, 128, dtype=torch.bfloat16, device=dev)
            k[:, :, cp + 1:] = float("nan")
            v[:, :, cp + 1:] = float("nan")
            mask = torch.zeros(32, 1, 1, 641, dtype=torch.bfloat16, device=dev)
            mask[0, ..., :40] = torch.finfo(torch.bfloat16).min
            mask[..., cp + 1:] = torch.finfo(torch.bfloat16).min
            want, _ = fg.grouped_decode_attention(Module(), q.float(), k[:, :, :cp + 1].float(),
                                                  v[:, :, :cp + 1].float(), mask[..., :cp + 1].float())
            filled = torch.tensor([cp], device=dev)
            for got in (fg.split_decode_attention(q, k, v, mask, filled, 128 ** -0.5),
                        splitkv._split_decode(q, k, v, mask, filled, 128 ** -0.5, splits=1)):
                torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_split_kv_decoding_in_the_graph_equals_its_eager_step_and_compiles():
    """With split-KV in use (bf16 on CUDA), the captured graph replays what the eager static step computes; under
    torch.compile the kernels are one opaque op that gives the eager op's numbers bit for bit, and a compiled
    decode runs to the end (its tokens are bf16's: fusion changes roundings, so they are not compared here;
    fp32 equality with compile is test_extract_cuda's)."""
    import remote_payload.extract.fastgen as fg
    model = random_target(TINY, torch.device("cuda"), torch.bfloat16)
    assert "split-KV" in fg.decode_attention_name(model)
    prompts = _prompts(TINY["vocab_size"], (5, 33, 70, 128))
    graph = greedy_static(model, prompts, 80, set(), graphs=True)
    assert graph == greedy_static(model, prompts, 80, set(), graphs=False)
    dev = torch.device("cuda")
    q = torch.randn(4, 1, 4, 16, dtype=torch.bfloat16, device=dev).transpose(1, 2)
    k, v = (torch.randn(4, 2, 200, 16, dtype=torch.bfloat16, device=dev) for _ in range(2))
    mask = torch.zeros(4, 1, 1, 200, dtype=torch.bfloat16, device=dev)
    filled = torch.tensor([150], device=dev)
    eager = fg.split_decode_attention(q, k, v, mask, filled, 0.25)
    compiled = torch.compile(fg.split_decode_attention, fullgraph=True)(q, k, v, mask, filled, 0.25)
    assert torch.equal(eager, compiled)
    out = greedy_static(model, prompts, 80, set(), graphs=True, compile=True)
    assert [len(r) for r in out] == [len(p) + 80 for p in prompts]
    assert [r[len(p)] for r, p in zip(out, prompts)] == [r[len(p)] for r, p in zip(graph, prompts)]  # prefill
    same = [sum(a == b for a, b in zip(r[len(p):], w[len(p):])) for r, w, p in zip(out, graph, prompts)]
    print("compiled vs graph, equal completion tokens per row:", same)


def test_fused_layers_kernels_give_torchs_numbers_bf16():
    """The decode steps' Triton passes (fastgen.FusedLayers) against the code they replace, bf16 on CUDA at the
    8B / 27B shapes (batch 32): SiLU * up and RoPE (40 query heads: not a power of two) bit for bit; RMSNorm
    (hidden 4096 / 5120, the q/k norms over 128) equal but for a rare ulp (the mean's summation order)."""
    import torch.nn.functional as F
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    import remote_payload.eval.kernels as K
    import remote_payload.extract.fastgen as fg
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for shape in ((32, 1, 4096), (32, 1, 5120), (32, 1, 40, 128), (32, 1, 8, 128), (3, 77, 4096)):
        norm = Qwen3RMSNorm(shape[-1], eps=1e-6).to(dev, torch.bfloat16)
        norm.weight.data.normal_(1.0, 0.3)
        x = (torch.randn(shape, device=dev) * 4).to(torch.bfloat16)
        with torch.no_grad():
            got, want = K.rms_norm(x, norm.weight, 1e-6, always=True), norm(x)
        assert got is not None and got.shape == want.shape
        ulp = (want.float().abs() * 2 ** -7).clamp(min=1e-30)
        assert ((got.float() - want.float()).abs() <= ulp).all(), shape
        assert (got == want).float().mean() >= 0.999, shape
    for inner in (12288, 17408):
        gate, up = (torch.randn(32, 1, inner, device=dev).to(torch.bfloat16) * 3 for _ in range(2))
        assert torch.equal(K.silu_and_mul(gate, up, always=True), F.silu(gate) * up)
    rope = fg._rope_function(apply_rotary_pos_emb, K)
    for h in (32, 40):
        q = torch.randn(32, 1, h, 128, device=dev).to(torch.bfloat16).transpose(1, 2)
        k = torch.randn(32, 1, 8, 128, device=dev).to(torch.bfloat16).transpose(1, 2)
        ang = torch.randn(32, 1, 128, device=dev) * 50
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        got, want = rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fused_decode_replays_in_the_graph_and_matches_the_models_own_layers():
    """extract's default on CUDA bf16: the decode steps with FusedLayers active (counted), captured in the graph
    == run eagerly, token for token; against the model's own layers (REVAL_DECODE_FUSED=0) the first completion
    token (the prefill: the model's own) is equal and most tokens after it are (RMSNorm's rare ulp may tip a
    bf16 near-tie of this random model); everything restored after."""
    import os

    import transformers.models.qwen3.modeling_qwen3 as mq

    import remote_payload.extract.fastgen as fg
    cfg = {**TINY, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "head_dim": 64}
    model = random_target(cfg, torch.device("cuda"), torch.bfloat16)
    name = fg.decode_fused_name(model)
    L = cfg["num_hidden_layers"]
    assert name.startswith(f"RMSNorm x{4 * L + 1}, SiLU * up x{L}, RoPE"), name
    own_rope = mq.apply_rotary_pos_emb
    prompts = _prompts(cfg["vocab_size"], (5, 33, 70, 128))
    graph = greedy_static(model, prompts, 80, set(), graphs=True)
    assert graph == greedy_static(model, prompts, 80, set(), graphs=False)
    os.environ["REVAL_DECODE_FUSED"] = "0"
    try:
        assert fg.decode_fused_name(model) is None
        own = greedy_static(model, prompts, 80, set(), graphs=True)
    finally:
        del os.environ["REVAL_DECODE_FUSED"]
    assert [r[len(p)] for r, p in zip(own, prompts)] == [r[len(p)] for r, p in zip(graph, prompts)]
    same = sum(a == b for r, w in zip(own, graph) for a, b in zip(r, w)) / sum(len(r) for r in own)
    print("fused vs the model's own layers, equal tokens:", same)
    assert same >= 0.9
    assert mq.apply_rotary_pos_emb is own_rope
    assert not any("forward" in m.__dict__ for m in model.modules())
    fl = fg.FusedLayers(model)
    with fl:
        assert fl.counts == {"norm": 4 * L + 1, "mlp": L, "rope": 1, "qkv": L}
        assert mq.apply_rotary_pos_emb is not own_rope
    assert mq.apply_rotary_pos_emb is own_rope


def test_static_cache_counter_follows_the_graph_replays(monkeypatch):
    """extract/staticcache.py's note on CUDA: the cache's own counter (where StaticCache writes) advances with
    every replay of the captured step, so after the loop it equals the decoder's slot `cp` on every layer."""
    import remote_payload.extract.fastgen as fg
    model = random_target(TINY, torch.device("cuda"), torch.bfloat16)
    made, steps = [], []
    real_cache, real_capture = fg._static_cache, fg._StaticStep.capture
    monkeypatch.setattr(fg, "_static_cache", lambda *a, **k: made.append(real_cache(*a, **k)) or made[-1])
    monkeypatch.setattr(fg._StaticStep, "capture", lambda self: (steps.append(self), real_capture(self))[1])
    prompts = _prompts(TINY["vocab_size"], (5, 33, 70))
    greedy_static(model, prompts, 40, set(), graphs=True, eos_every=7)
    assert len(made) == 1 and len(steps) == 1 and steps[0].graph is not None
    cp = int(steps[0].cp)
    assert cp == 128 + 39  # P = 128 (prompts padded to the bucket), then one slot a step after the first token
    assert [int(layer.cumulative_length) for layer in made[0].layers] == [cp] * TINY["num_hidden_layers"]


def test_graph_captured_once_is_replayed_batch_after_batch_bf16(monkeypatch):
    """extract's default on CUDA: batches of one shape share one captured graph and static cache (fastgen._Shape),
    each batch's cache reset in place: three batches (greedy, then sampled) give the tokens a fresh capture per
    batch gives, one capture for all three, and after each the cache's counter equals the decoder's slot."""
    import remote_payload.extract.fastgen as fg
    from remote_payload.eval.regime import Regime
    from remote_payload.extract.decode import draws
    model = random_target(TINY, torch.device("cuda"), torch.bfloat16)
    steps = []
    real_capture = fg._StaticStep.capture
    monkeypatch.setattr(fg._StaticStep, "capture", lambda self: (steps.append(self), real_capture(self))[1])
    batches = [_prompts(TINY["vocab_size"], lens) for lens in ((5, 33, 70, 9), (64, 1, 2, 100), (128, 7, 7, 7))]
    sampler = draws(Regime(temperature=0.8, top_p=0.9, seed=3), [("a", 0), ("b", 0), ("c", 1), ("d", 0)], 40)
    for kw in ({}, {"sampler": sampler}):
        steps.clear()
        fresh = [greedy_static(model, b, 40, set(), reuse=False, **kw) for b in batches]
        assert len(steps) == 3 and "_reval_decode" not in model.__dict__
        steps.clear()
        for b, want in zip(batches, fresh):
            assert greedy_static(model, b, 40, set(), eos_every=7, **kw) == want
            state = model._reval_decode
            assert [int(x.cumulative_length) for x in state.cache.layers] == [int(state.cp)] * len(state.cache.layers)
            assert int(state.cp) == 128 + 39
        assert len(steps) == 1 and steps[0] is model._reval_decode.step


def test_fused_projections_in_the_graph_bf16():
    """q/k/v and gate/up as one GEMM each (extract's default on CUDA): the strided q/k heads through the RMSNorm
    pass equal the contiguous call bit for bit; the graph replays the eager fused step; against the separate GEMMs
    (REVAL_DECODE_PROJ=separate) the first token is equal and most after it (cuBLAS's other split of a larger
    GEMM may round differently)."""
    import os

    import remote_payload.eval.kernels as K
    import remote_payload.extract.fastgen as fg
    torch.manual_seed(0)
    y = torch.randn(32, 1, 6144, device="cuda").to(torch.bfloat16)
    w = torch.randn(128, device="cuda").to(torch.bfloat16)
    q = y[..., :4096].view(32, 1, 32, 128)
    k = y[..., 4096:5120].view(32, 1, 8, 128)
    for x in (q, k):
        got = K.rms_norm(x, w, 1e-6, always=True)
        assert got is not None and got.is_contiguous() and torch.equal(got, K.rms_norm(x.contiguous(), w, 1e-6,
                                                                                      always=True))
    cfg = {**TINY, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "head_dim": 64}
    model = random_target(cfg, torch.device("cuda"), torch.bfloat16)
    L = cfg["num_hidden_layers"]
    assert f"q/k/v x{L} and gate/up x{L} one GEMM each" in fg.decode_fused_name(model)
    prompts = _prompts(cfg["vocab_size"], (5, 33, 70, 128))
    graph = greedy_static(model, prompts, 80, set(), graphs=True)
    assert graph == greedy_static(model, prompts, 80, set(), graphs=False)
    os.environ["REVAL_DECODE_PROJ"] = "separate"
    try:
        assert "one GEMM" not in fg.decode_fused_name(model)
        separate = greedy_static(model, prompts, 80, set(), graphs=True)
    finally:
        del os.environ["REVAL_DECODE_PROJ"]
    assert [r[len(p)] for r, p in zip(separate, prompts)] == [r[len(p)] for r, p in zip(graph, prompts)]
    same = sum(a == b for r, w in zip(separate, graph) for a, b in zip(r, w)) / sum(len(r) for r in graph)
    print("fused vs separate projections, equal tokens:", same)
    assert same >= 0.9
