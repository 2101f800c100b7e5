"""The `extract` rows of `python -m remote_payload bench`: batched extraction vs the batch-1 loop.

A random-weight Qwen3 target of the 8B class (36 layers, H=4096, vocab 151,936; `tiny` on CPU) built on the
device, random prompts of different lengths, no eos (every prompt runs to max_new_tokens). Both rows do
what `extract` does per prompt, disk writes left out: greedy generation with a KV cache, then one prefill of
prompt + completion for the tapped hidden states.
  batch-1   `greedy_complete` + `tapped_features`, one prompt at a time (the loop `extract` used to run)
  batched   `batches` -> `greedy_complete_batch` + `tapped_features_all_layers` (output_hidden_states: every
            layer materialised; what `extract` ran before the hooked prefill)
  fast      `batches` -> `extract_batch`: fastgen.greedy_static (CUDA graph on CUDA) + `prefill_batch` (hooks on
            the tapped blocks, the argmax agreement; features copied to the host) — what `extract` runs now
Reported: completion tokens per second, and the speed-up over batch-1 (`extract_rates`: each path timed n times).
"""
from __future__ import annotations

import time

import torch

from remote_payload.extract.batching import batches, extract_batch
from remote_payload.extract.decode import choose_generator, greedy_complete_batch
from remote_payload.target.forward import greedy_complete, last_logits_kw, tapped_features

QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1e6,
            "max_position_embeddings": 40960, "tie_word_embeddings": False}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "tie_word_embeddings": False}
# (target config, prompts batched, prompts batch-1, max new tokens, layers tapped)
SETUPS = {"cuda": (QWEN3_8B, 64, 3, 64, [1, 9, 17, 25, 33]), "cpu": (TINY, 16, 4, 32, [0, 1, 3])}


@torch.no_grad()
def tapped_features_all_layers(model, seqs: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]:
    """The feature prefill `extract` ran before `prefill_batch` (kept as the reference: tests compare with it):
    right-padded, output_hidden_states=True (every layer's hidden states), hs[l+1] of each tapped layer."""
    dev = next(model.parameters()).device
    T = max(len(x) for x in seqs)
    ids = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)] = x
    hs = model(ids.to(dev), output_hidden_states=True, use_cache=False, **last_logits_kw(model)).hidden_states
    n = model.config.get_text_config().num_hidden_layers
    if len(hs) != n + 1:
        raise RuntimeError(f"expected {n + 1} hidden states (embeddings + {n} blocks), got {len(hs)}")
    tapped = torch.stack([hs[l + 1] for l in layer_ids], dim=2)  # [B, T, n_layers, H]
    return [tapped[i, :len(x)] for i, x in enumerate(seqs)]


def random_target(cfg: dict, dev: torch.device, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3ForCausalLM._from_config(Qwen3Config(**cfg), dtype=dtype)
    return model.eval()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def extract_rates(dev: torch.device, dtype: torch.dtype, repeats: int = 1) -> tuple[str, dict[str, list[float]]]:
    """The three paths on one model, each timed `repeats` times after one warm-up: (the setup's words,
    {"batch-1" | "batched" | "fast": [completion tokens/s per run]})."""
    cfg, n_batched, n_single, new, layers = SETUPS["cuda" if dev.type == "cuda" else "cpu"]
    model = random_target(cfg, dev, dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg["vocab_size"], (int(torch.randint(32, 129, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n_batched)]
    # warm-up: kernels, allocator, cuBLAS for both paths
    greedy_complete_batch(model, prompts[:2], 2, set())
    tapped_features(model, greedy_complete(model, torch.tensor(prompts[0], device=dev), 2, set()).to(dev), layers)
    gen = choose_generator(model)
    extract_batch(model, gen, prompts[:2], 4, set(), layers).wait()  # warm-up of the static path
    groups = batches([len(p) + new for p in prompts], 32, 32768)

    def single():
        for p in prompts[:n_single]:
            ids = greedy_complete(model, torch.tensor(p, device=dev), new, set())
            tapped_features(model, ids.to(dev), layers)

    def batched():
        for group in groups:
            seqs = greedy_complete_batch(model, [prompts[i] for i in group], new, set())
            tapped_features_all_layers(model, [torch.tensor(x) for x in seqs], layers)

    def fast():
        for group in groups:
            extract_batch(model, gen, [prompts[i] for i in group], new, set(), layers).wait()
    rates: dict[str, list[float]] = {"batch-1": [], "batched": [], "fast": []}
    for _ in range(repeats):
        for key, fn, n in (("batch-1", single, n_single), ("batched", batched, n_batched), ("fast", fast, n_batched)):
            _sync(dev)
            t = time.perf_counter()
            fn()
            _sync(dev)
            rates[key].append(n * new / (time.perf_counter() - t))
    name = "Qwen3-8B-class" if dev.type == "cuda" else "tiny Qwen3"
    what = (f"{name}, {n_batched} prompts (batch-1: {n_single}) x {new} new tokens, fast = "
            f"{gen.name}{' + CUDA graph' if gen.graphs else ''}, hooked prefill")
    return what, rates


def bench_extract(dev: torch.device, dtype: torch.dtype) -> list:
    from remote_payload.tools.benchrows import Row
    what, rates = extract_rates(dev, dtype)
    single_rate, batched_rate, fast_rate = rates["batch-1"][0], rates["batched"][0], rates["fast"][0]
    return [Row("extract batch-1", 0, 0, 0, f"{what}: {single_rate:,.0f} tokens/s"),
            Row("extract batched", 0, 0, 0,
                f"{batched_rate:,.0f} tokens/s = {batched_rate / single_rate:.1f}x batch-1"),
            Row("extract fast", 0, 0, 0, f"{fast_rate:,.0f} tokens/s = {fast_rate / single_rate:.1f}x batch-1, "
                f"{fast_rate / batched_rate:.1f}x batched")]
