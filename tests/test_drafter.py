"""The drafter: fast path == naive path, the attention rules, logits_topk, and the building blocks vs HF."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remote_payload.eval.drafter import apply_rope, logits_topk, rope_cos_sin, visible
from tests.tiny_models import random_drafter, random_head, tiny_drafter_config

ATOL = 1e-4


def _fast_logits(model, feats, anchors, bonus, head):
    ctx = model.precompute_context(feats)
    hidden = model.draft_hidden(ctx, anchors, bonus, head)  # [n, bs, H]
    return F.linear(hidden[:, 1:], head.lm_head)  # [n, bs-1, V]


def _naive_logits(model, feats, anchors, bonus, head):
    return torch.stack([model.naive_block(feats, int(b), int(a), head) for a, b in zip(anchors, bonus)])


@pytest.mark.parametrize("is_causal", [None, True, False])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])  # MQA, GQA, MHA
def test_fast_path_equals_naive(is_causal, kv_heads):
    cfg = tiny_drafter_config(is_causal=is_causal, num_key_value_heads=kv_heads, sliding_window=5)
    model, head = random_drafter(cfg, seed=kv_heads), random_head(cfg)
    T = 23  # context longer than the window (5) and than the block (16)
    feats = torch.randn(T, cfg.fc_in_features, generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([1, 2, 4, 6, 11, 17, T])  # a=1 and the last possible anchor
    bonus = torch.randint(0, cfg.vocab_size, (len(anchors),), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fast, naive = _fast_logits(model, feats, anchors, bonus, head), _naive_logits(model, feats, anchors, bonus,
                                                                                         head)
    assert fast.shape == naive.shape == (len(anchors), cfg.block_size - 1, cfg.vocab_size)
    assert naive.abs().max() > 0.5  # not a degenerate all-zero comparison
    torch.testing.assert_close(fast, naive, atol=ATOL, rtol=1e-4)


def test_fused_projections_equal_the_separate_ones_and_keep_the_weights():
    cfg = tiny_drafter_config(sliding_window=5)
    model, head = random_drafter(cfg, seed=3), random_head(cfg)
    feats = torch.randn(23, cfg.fc_in_features, generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([1, 5, 12, 23])
    bonus = torch.randint(0, cfg.vocab_size, (4,), generator=torch.Generator().manual_seed(2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = _fast_logits(model, feats, anchors, bonus, head)
        model.fuse_projections()
        att, mlp = model.layers[0].self_attn, model.layers[0].mlp
        assert att.qkv_weight is not None and mlp.gate_up_weight is not None
        assert att.k_proj.weight.data_ptr() == att.qkv_weight[att.q_proj.out_features:].data_ptr()  # a view
        fused = _fast_logits(model, feats, anchors, bonus, head)
    assert fused.abs().max() > 0.5
    torch.testing.assert_close(fused, ref, atol=ATOL, rtol=1e-4)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    with torch.no_grad():  # an in-place update of a parameter reaches the fused weight (one storage)
        model.layers[0].mlp.up_proj.weight.add_(1.0)
    assert torch.equal(mlp.gate_up_weight[cfg.intermediate_size:], before["layers.0.mlp.up_proj.weight"] + 1.0)


@pytest.mark.parametrize("m", [16, 37])  # whole groups; 3 groups with the last one padded
def test_anchor_groups_equal_naive_across_prompts(m):
    from remote_payload.eval.drafter import ATTN_GROUP
    assert ATTN_GROUP < m or m == ATTN_GROUP
    cfg = tiny_drafter_config(sliding_window=7)
    model, head = random_drafter(cfg, seed=m), random_head(cfg)
    gen = torch.Generator().manual_seed(m)
    lengths = [60, 45]
    feats = [torch.randn(n, cfg.fc_in_features, generator=gen) for n in lengths]
    anchors = torch.stack([torch.randint(1, n + 1, (m,), generator=gen) for n in lengths])  # [2, m], any order
    bonus = torch.randint(0, cfg.vocab_size, anchors.shape, generator=gen)
    with torch.no_grad():
        hidden = model.draft_hidden(model.precompute_context(feats), anchors, bonus, head)  # [2, m, bs, H]
        assert hidden.shape == (2, m, cfg.block_size, cfg.hidden_size)
        for b in range(2):
            naive = _naive_logits(model, feats[b], anchors[b], bonus[b], head)
            torch.testing.assert_close(F.linear(hidden[b, :, 1:], head.lm_head), naive, atol=ATOL, rtol=1e-4)


def test_multi_prompt_batch_equals_per_prompt():
    cfg = tiny_drafter_config()
    model, head = random_drafter(cfg, seed=3), random_head(cfg)
    gen = torch.Generator().manual_seed(4)
    lengths = [9, 30, 17]
    feats = [torch.randn(n, cfg.fc_in_features, generator=gen) for n in lengths]
    anchors = torch.tensor([[1, 9], [30, 12], [5, 5]])  # [B, m]
    bonus = torch.randint(0, cfg.vocab_size, anchors.shape, generator=gen)
    with torch.no_grad():
        batched = model.draft_hidden(model.precompute_context(feats), anchors, bonus, head)  # [B, m, bs, H]
        for b in range(len(lengths)):
            single = model.draft_hidden(model.precompute_context(feats[b]), anchors[b], bonus[b], head)
            torch.testing.assert_close(batched[b], single, atol=ATOL, rtol=1e-4)
            naive = _naive_logits(model, feats[b], anchors[b], bonus[b], head)
            torch.testing.assert_close(F.linear(batched[b, :, 1:], head.lm_head), naive, atol=ATOL, rtol=1e-4)
    assert batched.shape == (3, 2, cfg.block_size, cfg.hidden_size)


def test_reused_context_gives_the_same_drafts():
    """Calls of different sizes on one ContextKV (it is only read) == fresh ones."""
    cfg = tiny_drafter_config()
    model, head = random_drafter(cfg, seed=12), random_head(cfg)
    feats = torch.randn(25, cfg.fc_in_features, generator=torch.Generator().manual_seed(13))
    ctx = model.precompute_context(feats)
    with torch.no_grad():
        for anchors in ([3, 9], [1, 4, 8, 16, 20, 25], [24], [2, 7]):
            a = torch.tensor(anchors)
            bonus = a % cfg.vocab_size
            reused = model.draft_hidden(ctx, a, bonus, head)
            fresh = model.draft_hidden(model.precompute_context(feats), a, bonus, head)
            torch.testing.assert_close(reused, fresh, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(F.linear(reused[:, 1:], head.lm_head),
                                       _naive_logits(model, feats, a, bonus, head), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("fast", [True, False])
def test_sliding_window_hides_old_context(fast):
    """All-sliding drafter, window W: anchor a's block (queries at a..a+bs-1) sees context t > a-W only."""
    W, a, T = 4, 12, 20
    cfg = tiny_drafter_config(layer_types=["sliding_attention"] * 2, sliding_window=W)
    model, head = random_drafter(cfg, seed=5), random_head(cfg)
    feats = torch.randn(T, cfg.fc_in_features, generator=torch.Generator().manual_seed(6))
    run = _fast_logits if fast else _naive_logits
    args = (torch.tensor([a]), torch.tensor([7]), head)
    with torch.no_grad():
        base = run(model, feats, *args)
        old, edge, future = feats.clone(), feats.clone(), feats.clone()
        old[: a - W + 1] += 3.0  # positions <= a-W: outside every query's window
        edge[a - W + 1] += 3.0  # the oldest position the bonus row still sees
        future[a:] += 3.0  # not context for anchor a at all
        torch.testing.assert_close(run(model, old, *args), base, atol=1e-6, rtol=0)
        torch.testing.assert_close(run(model, future, *args), base, atol=1e-6, rtol=0)
        assert (run(model, edge, *args) - base).abs().max() > 1e-3


def test_full_attention_sees_all_context_and_is_causal_changes_the_block():
    cfg = tiny_drafter_config(layer_types=["full_attention"] * 2)
    model, head = random_drafter(cfg, seed=7), random_head(cfg)
    feats = torch.randn(20, cfg.fc_in_features, generator=torch.Generator().manual_seed(8))
    args = (torch.tensor([15]), torch.tensor([3]), head)
    with torch.no_grad():
        base = _fast_logits(model, feats, *args)
        old = feats.clone()
        old[0] += 3.0
        assert (_fast_logits(model, old, *args) - base).abs().max() > 1e-3
        model.cfg.is_causal = True  # same weights, causal block
        causal = _fast_logits(model, feats, *args)
        torch.testing.assert_close(causal, _naive_logits(model, feats, *args), atol=ATOL, rtol=1e-4)
    assert (causal - base).abs().max() > 1e-3
    # Row 0 (the bonus) no longer sees the mask tokens after it.
    assert (causal[0, 0] - base[0, 0]).abs().max() > 1e-4


def test_visibility_rule_matches_reference_convention():
    q = torch.arange(10, 14)[:, None]
    k = torch.arange(14)[None, :]
    vis = visible(q, k, causal=True, window=3)
    assert vis[0].nonzero().flatten().tolist() == [8, 9, 10]  # p - t < W, t <= p
    assert visible(q, k, causal=False, window=None).all()
    bidir = visible(q, k, causal=False, window=3)
    assert bidir[0].nonzero().flatten().tolist() == [8, 9, 10, 11, 12]  # |p - t| < W


def test_logits_topk_matches_full_softmax():
    cfg = tiny_drafter_config()
    model, head = random_drafter(cfg, seed=9), random_head(cfg)
    feats = torch.randn(12, cfg.fc_in_features, generator=torch.Generator().manual_seed(10))
    anchors, bonus = torch.tensor([3, 8, 12]), torch.tensor([1, 2, 3])
    with torch.no_grad():
        hidden = model.draft_hidden(model.precompute_context(feats), anchors, bonus, head)
        naive = _naive_logits(model, feats, anchors, bonus, head)  # [3, 15, V]
        targets = torch.randint(0, cfg.vocab_size, (3, cfg.block_size - 1), generator=torch.Generator().manual_seed(11))
        out = logits_topk(hidden, head, 5, target_ids=targets)
    logp = naive.log_softmax(-1)
    assert torch.equal(out.argmax_ids, naive.argmax(-1))
    torch.testing.assert_close(out.topk_logprobs, logp.topk(5, dim=-1).values, atol=ATOL, rtol=1e-4)
    assert torch.equal(out.topk_ids[..., 0], out.argmax_ids)
    torch.testing.assert_close(out.target_logprobs, logp.gather(-1, targets[..., None])[..., 0], atol=ATOL, rtol=1e-4)
    ranks = (naive > naive.gather(-1, targets[..., None])).sum(-1)
    assert torch.equal(out.target_ranks, ranks.clamp(max=5))  # exact below k=5, capped at k
    assert (ranks >= 5).any() and (ranks < 5).any()  # both branches exercised
    assert torch.equal(logits_topk(hidden, head, 1, target_ids=out.argmax_ids).target_ranks,
                       torch.zeros_like(ranks))
    # [B, m, bs, H] input keeps its leading dims
    assert logits_topk(hidden.view(1, 3, *hidden.shape[1:]), head, 2).topk_ids.shape == (1, 3, 15, 2)


def test_paths_are_differentiable():
    cfg = tiny_drafter_config()
    model, head = random_drafter(cfg), random_head(cfg)
    feats = torch.randn(10, cfg.fc_in_features)
    model.naive_block(feats, 3, 7, head).logsumexp(-1).sum().backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0
    model.zero_grad()
    model.draft_hidden(model.precompute_context(feats), torch.tensor([7]), torch.tensor([3]), head).sum().backward()
    assert model.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0


def test_bad_anchors_are_refused():
    cfg = tiny_drafter_config()
    model, head = random_drafter(cfg), random_head(cfg)
    ctx = model.precompute_context(torch.randn(6, cfg.fc_in_features))
    for bad in (0, 7):
        with pytest.raises(ValueError, match="anchor"):
            model.draft_hidden(ctx, torch.tensor([bad]), torch.tensor([1]), head)
    with pytest.raises(ValueError, match=r"\[T, 96\]"):
        model.precompute_context(torch.randn(6, 64))


def test_rmsnorm_and_rope_match_transformers_qwen3():
    """Our building blocks against transformers' Qwen3 ones (the reference drafter is built from them)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as hf_apply

    cfg = tiny_drafter_config(rope_theta=1e6)
    model = random_drafter(cfg)
    hf_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    hf_norm.weight.data.copy_(model.norm.weight.data)
    x = torch.randn(3, 5, cfg.hidden_size)
    torch.testing.assert_close(model.norm(x), hf_norm(x))

    hf_cfg = Qwen3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                         head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, max_position_embeddings=512)
    pos = torch.arange(40, 60)[None]
    q = torch.randn(1, cfg.num_attention_heads, 20, cfg.head_dim)
    k = torch.randn(1, cfg.num_key_value_heads, 20, cfg.head_dim)
    hf_cos, hf_sin = Qwen3RotaryEmbedding(hf_cfg)(q, pos)
    q_ref, k_ref = hf_apply(q, k, hf_cos, hf_sin)
    cos, sin = rope_cos_sin(pos[0], cfg.head_dim, cfg.rope_theta)  # [20, d]
    torch.testing.assert_close(apply_rope(q, cos, sin), q_ref)
    torch.testing.assert_close(apply_rope(k, cos, sin), k_ref)


def test_target_rank_is_its_position_in_the_topk_order_even_when_tied():
    """Tokens 2 and 5 have identical lm_head rows, so their logits always tie. The drafted tree's rank-0 node
    is topk_ids[0]; the other tied token must get rank 1, never 0 (else width-1 would accept undrafted tokens)."""
    cfg = tiny_drafter_config()
    model, head = random_drafter(cfg, seed=4), random_head(cfg)
    lm = head.lm_head.clone()
    lm[5] = lm[2] * 50  # large: make the tied pair the argmax
    lm[2] = lm[5]
    head = type(head)(embed=head.embed, lm_head=lm)
    feats = torch.randn(10, cfg.fc_in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.draft_hidden(model.precompute_context(feats), torch.tensor([4, 9]), torch.tensor([1, 2]), head)
        first = logits_topk(hidden, head, 4).topk_ids[..., 0]  # [2, 15]: 2 or 5 (the tie)
        other = torch.where(first == 2, torch.full_like(first, 5), torch.full_like(first, 2))
        out = logits_topk(hidden, head, 4, target_ids=other)
    assert set(first.unique().tolist()) <= {2, 5}
    assert (out.target_ranks == 1).all()
    assert (logits_topk(hidden, head, 4, target_ids=first).target_ranks == 0).all()


def test_a_fresh_process_drafts_without_importing_sympy():
    """torch.broadcast_shapes (and other torch._refs paths) import sympy on first use: ~3 s of a fresh eval
    process on a GPU host (measured: the first prompt took 3.8 s, the others 0.13 s). The fast path avoids them."""
    import subprocess
    import sys
    code = (
        "import sys, torch\n"
        "import remote_payload.eval.run\n"
        "from remote_payload.eval.anchors import draft_all_anchors\n"
        "from tests.tiny_models import random_drafter, random_head, tiny_drafter_config\n"
        "cfg = tiny_drafter_config(); model, head = random_drafter(cfg), random_head(cfg)\n"
        "feats = torch.randn(40, cfg.fc_in_features); ids = torch.randint(0, cfg.vocab_size - 1, (40,))\n"
        "out = draft_all_anchors(model, head, feats, ids, 9, 20, batch_size=8, budgets=[4], widths=[2])\n"
        "assert out.drafts.shape == (20, cfg.block_size - 1)\n"
        "print('sympy' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stdout.strip() == "False", p.stdout + p.stderr
