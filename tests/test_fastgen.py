"""fastgen.greedy_static (static KV cache, fixed-shape decode step, argmax on the device) computes what the
dynamic-cache decoder computes: token for token, row for row, on the CPU in fp32 (the GPU graph path is
tests/gpu/test_fastgen_cuda.py)."""
from __future__ import annotations

import torch

from remote_payload.extract.decode import greedy_complete_batch
from remote_payload.extract.fastgen import greedy_static
from remote_payload.target.forward import greedy_complete
from remote_payload.target.load import eos_ids_of, load_target
from remote_payload.tools.bench_extract import TINY, random_target


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_static_decoding_equals_the_dynamic_cache_row_for_row_with_eos(trained_fixtures):
    """The trained fixture target stops at its eos: rows of different prompt lengths end at different steps."""
    t = trained_fixtures / "target"
    model = load_target(t, torch.device("cpu"), torch.float32)
    prompts = _prompts(model.config.vocab_size, (3, 5, 9, 17, 30, 64, 70))
    free = greedy_complete_batch(model, prompts, 48, eos_ids_of(t))
    eos = {free[0][len(prompts[0]) + 6]}  # a token the first row produces: rows stop at different steps
    want = greedy_complete_batch(model, prompts, 48, eos)
    for eos_every in (1, 5, 16):
        assert greedy_static(model, prompts, 48, eos, eos_every=eos_every, bucket=16) == want
    assert [greedy_static(model, [p], 48, eos)[0] for p in prompts[:3]] == \
        [greedy_complete(model, torch.tensor(p), 48, eos).tolist() for p in prompts[:3]]
    ended = [r for r in want if r[-1] in eos]
    assert ended and len({len(r) for r in want}) > 1  # the eos handling is exercised


def test_static_decoding_without_eos_runs_every_step_and_handles_one_token():
    model = random_target(TINY, torch.device("cpu"), torch.float32)
    prompts = _prompts(TINY["vocab_size"], (1, 7, 40, 64, 65))
    want = greedy_complete_batch(model, prompts, 20, set())
    assert greedy_static(model, prompts, 20, set()) == want
    assert all(len(r) == len(p) + 20 for r, p in zip(want, prompts))
    assert greedy_static(model, prompts, 1, set()) == greedy_complete_batch(model, prompts, 1, set())


def test_grouped_decode_attention_equals_the_models_own_and_is_restored(monkeypatch):
    """The decode steps run `grouped_decode_attention` (counted), the numbers equal SDPA's with GQA (fp32), the
    prefill keeps the model's own attention, and the model's implementation is back afterwards."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import remote_payload.extract.fastgen as fg
    model = random_target(TINY, torch.device("cpu"), torch.float32)
    assert TINY["num_attention_heads"] > TINY["num_key_value_heads"]  # grouped: G = 2
    own = model.config._attn_implementation
    calls = {"grouped": 0, "other": 0}
    real = fg.grouped_decode_attention

    def counting(module, query, key, value, attention_mask, **kw):
        calls["grouped" if query.shape[2] == 1 else "other"] += 1
        out, _ = real(module, query, key, value, attention_mask, **kw)
        if query.shape[2] == 1:  # the same numbers as the library's SDPA over the same inputs
            ref, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return out, None
    monkeypatch.setattr(fg, "grouped_decode_attention", counting)
    prompts = _prompts(TINY["vocab_size"], (4, 30, 65))
    got = greedy_static(model, prompts, 12, set())
    layers = TINY["num_hidden_layers"]
    assert calls["grouped"] == 11 * layers and calls["other"] == layers  # 11 decode steps; one prefill
    assert model.config._attn_implementation == own
    assert got == greedy_static(model, prompts, 12, set(), grouped_attention=False) \
        == greedy_complete_batch(model, prompts, 12, set())


def _split_kv_cases() -> None:
    """Run under TRITON_INTERPRET=1 (Triton's interpreter: the kernels on the CPU): splitkv._split_decode (the
    split-KV kernels + their launch) against grouped_decode_attention over the filled slots only."""
    import remote_payload.extract.fastgen as fg
    from remote_payload.extract import splitkv

    class Module:
        config = object()
    torch.manual_seed(0)
    # (B, H, Hkv, d, cache slots, cache position, parts, dtype): G = 4 (8B), 5 (27B: not a power of 2), 1;
    # the position in the first block, at block edges, the last slot; more parts than 64-slot blocks (empty parts)
    cases = [(3, 8, 2, 16, 300, 97, 3, torch.float32), (2, 10, 2, 32, 200, 63, 2, torch.float32),
             (2, 10, 2, 32, 200, 64, 5, torch.float32), (2, 4, 4, 16, 64, 63, 4, torch.float32),
             (2, 8, 2, 16, 130, 6, 1, torch.float32), (2, 8, 2, 32, 257, 255, 3, torch.float16)]
    for B, H, Hkv, d, L, cp, S, dt in cases:
        q = torch.randn(B, 1, H, d, dtype=dt).transpose(1, 2)  # [B, H, 1, d] with the model's strides
        k = torch.randn(B, Hkv, L, d, dtype=dt)
        v = torch.randn(B, Hkv, L, d, dtype=dt)
        k[:, :, cp + 1:] = float("nan")  # unfilled slots: never read
        v[:, :, cp + 1:] = float("nan")
        mask = torch.zeros(B, 1, 1, L, dtype=dt)
        mask[0, ..., :3] = torch.finfo(dt).min  # row 0's left padding
        mask[..., cp + 1:] = torch.finfo(dt).min
        got = splitkv._split_decode(q, k, v, mask, torch.tensor([cp]), d ** -0.5, splits=S)
        want, _ = fg.grouped_decode_attention(Module(), q.float(), k[:, :, :cp + 1].float(),
                                              v[:, :, :cp + 1].float(), mask[..., :cp + 1].float())
        assert got.shape == (B, 1, H, d) and got.dtype == dt
        tol = 1e-5 if dt == torch.float32 else 2e-3
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol, msg=f"case {(B, H, Hkv, d, L, cp, S)}")


def test_split_kv_kernels_equal_grouped_attention_under_the_triton_interpreter():
    """The split-KV decode kernels (CUDA in use) run here under Triton's interpreter, fp32 and fp16 (its bf16 dot
    is numpy's, not the GPU's: bf16 is tests/gpu's), and equal the torch grouped attention over the filled slots,
    NaN in every unfilled slot (so a read past the cache position would show)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", "from tests.test_fastgen import _split_kv_cases; _split_kv_cases()"],
                       check=False, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def _fused_cases() -> None:
    """Run under TRITON_INTERPRET=1: greedy_static with FusedLayers active on a bf16 Qwen3 (CUDA + bf16 in use;
    here the kernels run on the CPU in Triton's interpreter). SiLU * up goes through a counting torch stand-in
    (its kernel calls libdevice, which the interpreter lacks: tests/gpu has the kernel)."""
    import torch.nn.functional as F
    import transformers.models.qwen3.modeling_qwen3 as mq

    import remote_payload.eval.kernels as K
    import remote_payload.extract.fastgen as fg
    K.fast_kernels_enabled = lambda t: True
    fg.fused_available = lambda device, dtype: True
    calls = {"rms_norm": 0, "rope": 0, "silu_and_mul": 0}

    def counted(name, fn):
        def call(*a, **kw):
            out = fn(*a, **kw)
            calls[name] += out is not None
            return out
        return call
    K.rms_norm, K.rope = counted("rms_norm", K.rms_norm), counted("rope", K.rope)
    K.silu_and_mul = counted("silu_and_mul", lambda g, u, always=False: F.silu(g) * u)
    cfg = {**TINY, "num_hidden_layers": 2}
    model = random_target(cfg, torch.device("cpu"), torch.bfloat16)
    own_rope = mq.apply_rotary_pos_emb
    # a module whose forward is its own already (accelerate's hooks set one) is left alone
    hooked = model.model.layers[1].mlp
    hooked.forward = hooked.forward
    prompts = _prompts(cfg["vocab_size"], (3, 9, 20), seed=4)
    own = greedy_static(model, prompts, 6, set(), graphs=False, fused=False)
    assert calls == {"rms_norm": 0, "rope": 0, "silu_and_mul": 0}
    got = greedy_static(model, prompts, 6, set(), graphs=False)
    steps, L = 5, cfg["num_hidden_layers"]  # 6 tokens: the prefill's and 5 decode steps
    assert calls == {"rms_norm": steps * (4 * L + 1), "rope": steps * 2 * L, "silu_and_mul": steps * (L - 1)}, calls
    assert got == own, (got, own)
    assert mq.apply_rotary_pos_emb is own_rope
    assert [m for m in model.modules() if "forward" in m.__dict__] == [hooked]
    assert fg.decode_fused_name(model) == f"RMSNorm x{4 * L + 1}, SiLU * up x{L - 1}, RoPE as Triton passes " \
                                          "(fastgen.FusedLayers)"
    assert fg.decode_fused_name(model, compile=True) is None


def test_fused_layers_run_the_decode_steps_and_are_restored_under_the_triton_interpreter():
    """fastgen.FusedLayers (extract's decode steps on CUDA in bf16): the RMSNorms, RoPE and SiLU MLPs of every
    layer go through the kernels at every decode step and never in the prefill, the tokens equal the model's
    own layers', a hooked module keeps its forward, everything is restored after."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "from tests.test_fastgen import _fused_cases; _fused_cases()"],
                       check=False, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_fused_layers_only_where_their_kernels_run(monkeypatch):
    """CUDA + bf16 + Triton; REVAL_DECODE_FUSED=0 or REVAL_TORCH_KERNELS turn them off; on this CPU nothing is
    replaced and the cache's record says none."""
    import remote_payload.extract.fastgen as fg
    cuda = torch.device("cuda")
    assert fg.fused_available(cuda, torch.bfloat16) is True
    assert fg.fused_available(cuda, torch.float16) is False
    assert fg.fused_available(torch.device("cpu"), torch.bfloat16) is False
    monkeypatch.setenv("REVAL_DECODE_FUSED", "0")
    assert fg.fused_available(cuda, torch.bfloat16) is False
    monkeypatch.delenv("REVAL_DECODE_FUSED")
    monkeypatch.setenv("REVAL_TORCH_KERNELS", "1")
    assert fg.fused_available(cuda, torch.bfloat16) is False
    model = random_target(TINY, torch.device("cpu"), torch.bfloat16)
    fl = fg.FusedLayers(model)
    assert not fl.active and fg.decode_fused_name(model) is None
    with fl:
        assert not any("forward" in m.__dict__ for m in model.modules())


def test_static_cache_writes_where_the_decoder_looks_before_every_step(monkeypatch):
    """transformers' StaticCache writes at its own counter, not at cache_position (extract/staticcache.py):
    greedy_static's slot `cp` must equal every layer's counter before each step, or K/V land where the mask
    does not look. A spy on the real cache and step (CPU, a tiny model)."""
    import remote_payload.extract.fastgen as fg
    model = random_target(TINY, torch.device("cpu"), torch.float32)
    made, seen = [], []
    real_cache, real_call = fg._static_cache, fg._StaticStep.__call__

    def cache_spy(*a, **k):
        made.append(real_cache(*a, **k))
        return made[-1]

    def step_spy(self):
        seen.append((int(self.cp), [int(layer.cumulative_length) for layer in self.cache.layers]))
        return real_call(self)
    monkeypatch.setattr(fg, "_static_cache", cache_spy)
    monkeypatch.setattr(fg._StaticStep, "__call__", step_spy)
    prompts = _prompts(TINY["vocab_size"], (3, 9, 20))
    assert greedy_static(model, prompts, 12, set(), bucket=16) == greedy_complete_batch(model, prompts, 12, set())
    assert len(made) == 1 and len(seen) == 11  # the first token comes from the prefill
    assert all(counters == [cp] * TINY["num_hidden_layers"] for cp, counters in seen), seen
    assert [cp for cp, _ in seen] == list(range(32, 43))  # P = 32 (prompts padded to the bucket), then one a step


def test_transformers_static_cache_ignores_cache_position():
    """What extract/staticcache.py rests on, in the installed transformers: an update writes at the layer's
    counter whatever cache_position says. If this fails, StaticCache honours cache_position now: the note (and
    the in-order caveat) can go."""
    from remote_payload.extract.staticcache import static_cache
    model = random_target(TINY, torch.device("cpu"), torch.float32)
    cache = static_cache(model, 1, 8, torch.device("cpu"), torch.float32)
    kv = torch.ones(1, TINY["num_key_value_heads"], 1, TINY["head_dim"])
    cache.update(kv, kv, 0, cache_position=torch.tensor([5]), kwargs={"cache_position": torch.tensor([5])})
    keys = cache.layers[0].keys[0, :, :, 0]  # [heads, slots]
    assert keys[:, 0].eq(1).all() and keys[:, 5].eq(0).all(), "StaticCache wrote at cache_position"


def test_one_shape_is_captured_once_and_reused_batch_after_batch(monkeypatch):
    """extract's batches of one shape share one decode state (fastgen._Shape: one StaticCache, one set of step
    buffers, on CUDA one graph): each batch resets the cache (K/V zeroed, the write counter back to 0 in place) and
    loads its own values. Three batches of one shape (greedy, then sampled) give the tokens and leave the cache
    holding the K/V that a fresh state per batch gives, and before every step the cache's counter, the decoder's
    slot and the mask's visible slot agree (the first step after a reset at P). Another shape drops the kept one."""
    import remote_payload.extract.fastgen as fg
    from remote_payload.eval.regime import Regime
    from remote_payload.extract.decode import draws
    model = random_target(TINY, torch.device("cpu"), torch.float32)
    made, seen = [], []
    real_cache, real_call = fg._static_cache, fg._StaticStep.__call__

    def step_spy(self):
        visible = (self.mask[:, 0, 0] == 0).int()
        seen.append((int(self.cp), [int(x.cumulative_length) for x in self.cache.layers],
                     bool(visible[:, int(self.cp)].all()), int(visible[:, int(self.cp) + 1:].sum())))
        return real_call(self)
    monkeypatch.setattr(fg, "_static_cache", lambda *a, **k: made.append(real_cache(*a, **k)) or made[-1])
    monkeypatch.setattr(fg._StaticStep, "__call__", step_spy)
    batches = [_prompts(TINY["vocab_size"], lens, seed=s) for s, lens in
               enumerate(((3, 40, 17), (33, 9, 5), (64, 1, 20)))]  # every batch: 3 rows, P = 64
    sampler = draws(Regime(temperature=0.8, top_p=0.9, seed=3), [("a", 0), ("b", 0), ("c", 1)], 6)
    greedy_rows = []
    for kw in ({}, {"sampler": sampler}):
        fresh = []
        for b in batches:
            fresh.append((greedy_static(model, b, 6, set(), reuse=False, **kw),
                          [(x.keys.clone(), x.values.clone()) for x in made[-1].layers]))
        assert "_reval_decode" not in model.__dict__
        made.clear()
        seen.clear()
        for b, (tokens, kv) in zip(batches, fresh):
            assert greedy_static(model, b, 6, set(), **kw) == tokens
            cache = model._reval_decode.cache
            assert all(torch.equal(x.keys, k) and torch.equal(x.values, v) for x, (k, v) in zip(cache.layers, kv))
        assert len(made) == 1 and len(seen) == 3 * 5
        assert [cp for cp, _, _, _ in seen] == list(range(64, 69)) * 3
        assert all(counters == [cp] * TINY["num_hidden_layers"] and at_cp and after == 0
                   for cp, counters, at_cp, after in seen), seen
        if kw:  # the sampled rows are not greedy's
            assert all(tokens != greedy for (tokens, _), greedy in zip(fresh, greedy_rows))
        greedy_rows = [tokens for tokens, _ in fresh]
    made.clear()
    greedy_static(model, batches[0][:2], 6, set())  # 2 rows: a shape of its own, the kept one dropped
    assert len(made) == 1 and model._reval_decode.key[0] == 2


def test_fused_projections_equal_the_separate_ones_fp32(monkeypatch):
    """q/k/v and gate/up as one GEMM each (fusedproj.Projections, in FusedLayers; CUDA in a 16-bit dtype, here
    forced on the CPU in fp32 with the model's own layers otherwise): every attention and MLP takes the fused
    GEMMs, a decode step's hidden states and the decoded tokens equal the separate GEMMs', the Linears' weights
    become views of the concatenated ones (the same values, no second copy), the model's own forward gives the
    same numbers after, and the record says so."""
    import remote_payload.extract.fastgen as fg
    import remote_payload.extract.fusedproj as fp
    model = random_target(TINY, torch.device("cpu"), torch.float32)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    before = {n: getattr(attn, n).weight.clone() for n in fp.QKV} | {n: getattr(mlp, n).weight.clone()
                                                                      for n in fp.GATE_UP}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prompts = _prompts(TINY["vocab_size"], (3, 9, 20), seed=5)
    ids = torch.tensor([p[:3] for p in prompts])
    own = model(ids, output_hidden_states=True).hidden_states
    want = greedy_static(model, prompts, 8, set(), reuse=False)
    step = torch.tensor([[7], [8], [9]])
    monkeypatch.setattr(fp, "projections_available", lambda device, dtype: True)
    fl = fg.FusedLayers(model)
    assert fl.projections and not fl.active  # the Triton passes stay off on the CPU
    with torch.no_grad():
        separate = model(step, output_hidden_states=True).hidden_states
        with fl:
            fused = model(step, output_hidden_states=True).hidden_states
    L = TINY["num_hidden_layers"]
    assert fl.counts == {"mlp": L, "qkv": L}
    assert all(torch.equal(a, b) for a, b in zip(separate, fused))
    assert greedy_static(model, prompts, 8, set(), reuse=False) == want
    qkv, gate_up = attn.__dict__["_reval_cat_q_proj"][0], mlp.__dict__["_reval_cat_gate_proj"][0]
    for n, w in before.items():
        lin = getattr(attn if n in fp.QKV else mlp, n)
        whole = qkv if n in fp.QKV else gate_up
        assert torch.equal(lin.weight, w) and lin.weight.untyped_storage().data_ptr() == whole.data_ptr()
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == nbytes
    assert all(torch.equal(a, b) for a, b in zip(own, model(ids, output_hidden_states=True).hidden_states))
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert fg.decode_fused_name(model) == f"q/k/v x{L} and gate/up x{L} one GEMM each (fastgen.FusedLayers)"
    monkeypatch.undo()
    assert fg.decode_fused_name(model) is None  # on the CPU: neither
    cuda = torch.device("cuda")
    assert fp.projections_available(cuda, torch.bfloat16) and not fp.projections_available(cuda, torch.float32)
    monkeypatch.setenv("REVAL_DECODE_PROJ", "separate")
    assert not fp.projections_available(cuda, torch.bfloat16)
