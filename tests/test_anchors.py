"""remote_payload.eval.anchors: the pipelined drafting (features read ahead by a thread, a prompt queued before the
previous one's outputs are taken) hands out exactly what drafting each prompt on its own gives."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from remote_payload.contract.errors import PayloadError
from remote_payload.eval import metrics
from remote_payload.eval.anchors import draft_all_anchors, drafted_prompts
from remote_payload.eval.cache import open_cache
from remote_payload.extract.writer import CacheWriter
from tests.tiny_models import random_drafter, random_head, tiny_drafter_config


def _cache(path, cfg, lengths, bad_id=False):
    g = torch.Generator().manual_seed(0)
    with CacheWriter(path, layer_ids=cfg.fc_layer_ids, hidden_size=cfg.hidden_size) as w:
        for i, T in enumerate(lengths):
            ids = torch.randint(0, cfg.vocab_size - 1, (T,), generator=g)
            if bad_id and i == 1:
                ids[3] = cfg.vocab_size
            w.add(f"p{i}", 5 + i, ids, torch.randn(T, len(cfg.fc_layer_ids), cfg.hidden_size, generator=g))
    return open_cache(path)


def test_pipelined_prompts_equal_one_prompt_at_a_time(tmp_path):
    cfg = tiny_drafter_config()
    model, head = random_drafter(cfg, seed=2), random_head(cfg, seed=3)
    cache = _cache(tmp_path / "c", cfg, [30, 47, 21, 38])
    budgets, widths = [4, 16], [2]

    def n_of(i):
        p = cache.prompts[i]
        return metrics.num_anchors(p.prompt_len, p.seq_len, 3, cfg.block_size)
    got = list(drafted_prompts(model, head, cache, len(cache), n_of, device=torch.device("cpu"),
                               dtype=torch.float32, batch_size=8, budgets=budgets, widths=widths))
    assert [i for i, _, _ in got] == [0, 1, 2, 3]
    for i, ids, out in got:
        ids_ref, feats = cache.load(i)
        ref = draft_all_anchors(model, head, feats, ids_ref, cache.prompts[i].prompt_len, n_of(i), batch_size=5,
                                budgets=budgets, widths=widths)
        assert torch.equal(ids, ids_ref) and out.drafts.shape == (n_of(i), cfg.block_size - 1)
        assert np.array_equal(out.drafts, ref.drafts) and np.array_equal(out.target_rank, ref.target_rank)
        heap = {b: [metrics.ddtree_accept_heap(ref.topk_logprobs[j].double().numpy(), ref.target_rank[j], b)
                    for j in range(n_of(i))] for b in budgets}
        assert {b: a.tolist() for b, a in out.tree_acc.items()} == heap  # the device half + resolve == the heap


def test_a_token_outside_the_vocabulary_is_bad_input(tmp_path):
    cfg = tiny_drafter_config()
    cache = _cache(tmp_path / "c", cfg, [30, 40], bad_id=True)
    gen = drafted_prompts(random_drafter(cfg), random_head(cfg), cache, 2, lambda i: 4, device=torch.device("cpu"),
                          dtype=torch.float32, batch_size=8, budgets=[4], widths=[])
    with pytest.raises(PayloadError, match="outside the drafter's vocabulary"):
        list(gen)



def test_triton_is_planned_only_where_it_pays(monkeypatch):
    from remote_payload.eval import kernels
    monkeypatch.delenv("REVAL_TRITON", raising=False)
    monkeypatch.setattr(kernels, "_load_triton", lambda: True)  # the decision, not the import
    seeds = 4790 * 15 * 248320  # the seeds' 10 x 30 run at the 27B vocabulary: Triton's start does not pay
    assert kernels.plan(seeds) is False and kernels.plan(30 * seeds) is True
    monkeypatch.setenv("REVAL_TRITON", "0")
    assert kernels.plan(30 * seeds) is False
    monkeypatch.setenv("REVAL_TRITON", "1")
    assert kernels.plan(seeds) is True
    kernels.plan(0)


def test_warm_up_runs_the_first_prompts_shapes_once_and_only_on_cuda_unless_off(monkeypatch):
    """The warm-up's body (CUDA-only in use) runs anywhere: it drafts every batch shape of the prompt and leaves
    the weights as they were; `warm_up` itself declines on the CPU and under REVAL_WARMUP=0."""
    from remote_payload.eval import anchors
    cfg = tiny_drafter_config(sliding_window=7)
    model, head = random_drafter(cfg, seed=5), random_head(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    real = anchors.enqueue_anchors
    monkeypatch.setattr(anchors, "enqueue_anchors", lambda *a, **kw: seen.append(a[5]) or real(*a, **kw))
    shape = {"seq_len": 90, "prompt_len": 20, "n": 69, "batch_size": 16, "budgets": [4, 8], "widths": [2]}
    parts = anchors._warm_run(model, head, torch.device("cpu"), torch.float32, **shape)
    assert set(parts) == {"queue", "wait"} and all(v >= 0 for v in parts.values())
    assert seen == [2 * 16 + 69 % 16]  # two whole batches and the tail: every shape, not every batch
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert anchors.warm_up(model, head, torch.device("cpu"), torch.float32, **shape) is None
    monkeypatch.setenv("REVAL_WARMUP", "0")
    assert anchors.warmup_mode() == "off"
    monkeypatch.setenv("REVAL_WARMUP", "1")
    assert anchors.warmup_mode() == "after"


def test_prime_drafts_a_miniature_with_the_drafters_kernel_shapes(monkeypatch):
    """anchors.prime (beside the weight load, CUDA only in use) drafts on a miniature that keeps what picks the
    kernels (layer types, heads, head size, block size, vocabulary, tapped layers) and shrinks only the widths;
    it declines on the CPU and under REVAL_WARMUP=0."""
    from remote_payload.eval import anchors
    cfg = tiny_drafter_config(sliding_window=7)
    seen = []
    real = anchors.enqueue_anchors
    monkeypatch.setattr(anchors, "enqueue_anchors", lambda d, *a, **kw: seen.append(d.cfg) or real(d, *a, **kw))
    s = anchors._prime_run(cfg, torch.device("cpu"), torch.float32, batch_size=16, budgets=[4, 8], widths=[2])
    assert s > 0 and len(seen) == 1
    small = seen[0]
    assert small.hidden_size == small.intermediate_size == anchors.PRIME_HIDDEN != cfg.hidden_size
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "block_size",
                "num_hidden_layers", "layer_types", "sliding_window", "target_layer_ids"):
        assert getattr(small, key) == getattr(cfg, key), key
    assert anchors.prime(cfg, torch.device("cpu"), torch.float32, batch_size=16, budgets=[4], widths=[]) is None


def test_prime_outcome_is_said_never_raised():
    """The prime's seconds go into the warm-up's log line; a prime that failed is said there (the warm-up on the
    real weights does its work), never raised, never silent; on the CPU no prime starts."""
    from concurrent.futures import Future

    from remote_payload.eval import steps
    ok, bad = Future(), Future()
    ok.set_result(1.25)
    bad.set_exception(RuntimeError("CUDA out of\nmemory"))
    assert steps._prime_outcome(ok) == {"primed beside the load": 1.25}
    assert steps._prime_outcome(bad) == {"prime failed": "RuntimeError: CUDA out of memory"}
    assert steps._prime_outcome(None) == {}
    assert steps._start_prime(None, None, torch.device("cpu"), torch.float32, 16) is None
