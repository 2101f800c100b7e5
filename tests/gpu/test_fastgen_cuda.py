"""fastgen on CUDA: the captured decode step equals the eager step and the dynamic-cache decoder (fp32), and in
bf16 the graph replays exactly what the eager static step computes."""
from __future__ import annotations

import torch

from remote_payload.eval.fastgen import greedy_static
from remote_payload.eval.target import greedy_complete_batch
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
