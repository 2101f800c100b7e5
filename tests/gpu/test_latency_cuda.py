"""The latency model on CUDA (remote_payload/eval/latency.py): random weights at small sizes, measured in both
regimes; the graph replay and the tree mask give the numbers the eager forward and the causal paths give."""
from __future__ import annotations

import pytest
import torch

from remote_payload.eval import latency as L
from remote_payload.eval import treeverify as TV
from remote_payload.eval.drafter import TargetHead
from tests.test_latency import verify_logits
from tests.tiny_models import random_drafter, tiny_drafter_config

assert torch.cuda.is_available(), "tests/gpu needs a CUDA device (run it with make test-gpu on a GPU host)"

H, V, LAYERS = 256, 4096, 4


def _models(dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=3 * H, num_hidden_layers=LAYERS,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    target = Qwen3ForCausalLM(cfg).to("cuda", dtype).eval()
    dcfg = tiny_drafter_config(hidden_size=H, intermediate_size=3 * H, num_attention_heads=8, num_key_value_heads=2,
                               head_dim=32, vocab_size=V, num_target_layers=LAYERS, mask_token_id=V - 1,
                               target_layer_ids=[1, 2], sliding_window=128)
    drafter = random_drafter(dcfg).to("cuda", dtype)
    head = TargetHead(embed=target.model.embed_tokens.weight.detach(), lm_head=target.lm_head.weight.detach())
    return target, drafter, head


@pytest.fixture(scope="module")
def bf16_models():
    return _models(torch.bfloat16)


@pytest.mark.parametrize("regime", ["eager", "cuda-graphs"])
def test_measure_on_cuda_in_each_regime(bf16_models, regime):
    target, drafter, head = bf16_models
    lat = L.measure(target, drafter, head, context_len=256, budgets=[8, 32], block_size=16, repeats=3,
                    regime=regime)
    assert lat.regime == regime and lat.key["regime"] == regime and lat.note == ""
    assert lat.key["attention"] == TV.GQA_ATTENTION and target.config._attn_implementation == "sdpa"
    assert lat.device.startswith("cuda") and lat.gpu == torch.cuda.get_device_name() and lat.dtype == "bfloat16"
    assert sorted(lat.verify_s) == [9, 16, 33] and lat.context_len == 256
    assert all(0 < s < 1 for s in [lat.decode_s, lat.draft_s, *lat.verify_s.values()])
    print(f"{regime}: decode {lat.decode_s * 1e3:.3f} ms, draft {lat.draft_s * 1e3:.3f} ms, verify "
          + ", ".join(f"{n}: {s * 1e3:.3f} ms" for n, s in sorted(lat.verify_s.items())))


def test_auto_is_cuda_graphs_and_graphs_cut_the_launch_overhead(bf16_models):
    target, drafter, head = bf16_models
    auto = L.measure(target, drafter, head, context_len=128, budgets=[16], block_size=16, repeats=3)
    assert auto.regime == "cuda-graphs" and auto.note == "" and auto.key["regime"] == "auto"
    eager = L.measure(target, drafter, head, context_len=128, budgets=[16], block_size=16, repeats=3, regime="eager")
    # at these sizes a step is launch-bound: the replay is faster than Python launching every kernel
    assert auto.decode_s < eager.decode_s and auto.draft_s < eager.draft_s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_the_eager_verify(dtype):
    target, _, _ = _models(dtype)
    g = torch.Generator().manual_seed(1)
    parents = TV.ddtree_tree(24, 16)
    impl = TV._attention(target)
    assert impl == TV.GQA_ATTENTION
    with torch.inference_mode(), TV._attention_of(target, impl):
        groups = TV._groups(target, impl)
        cache = TV._slot_cache(target, 64 + len(parents))
        TV._prefill(target, cache, torch.randint(0, V, (64,), generator=g), groups)
        step = TV._Step(target, cache, torch.randint(0, V, (len(parents),), generator=g), parents, 64, groups)
        eager = step().clone()
        replay = L._graphed(step, torch.device("cuda"))
        graphed = replay().clone()
        assert torch.equal(replay(), graphed)  # replays repeat: the cache is not advanced
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0 if dtype == torch.float32 else 1e-2)


def test_tree_verify_on_cuda_gives_each_node_its_causal_path_logits():
    target, _, _ = _models(torch.float32)
    g = torch.Generator().manual_seed(2)
    parents = TV.ddtree_tree(20, 16)
    context = torch.randint(0, V, (37,), generator=g).cuda()
    nodes = torch.randint(0, V, (len(parents),), generator=g).cuda()
    got = verify_logits(target, context, nodes, parents)
    with torch.no_grad():
        for i in range(len(parents)):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = parents[j]
            ref = target(torch.cat([context, nodes[path[::-1]]])[None], use_cache=False).logits[0, -1]
            torch.testing.assert_close(got[i], ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, verify_logits(target, context, nodes, parents, attention="sdpa"), atol=1e-4,
                               rtol=1e-4)  # our GQA-folded attention == HF's own SDPA under the same mask
