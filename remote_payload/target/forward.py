"""The target's plain forwards, one sequence at a time: the KV cache it decodes with (`new_kv`), greedy completion
(`greedy_complete`) and the tapped hidden states of one causal prefill (`tapped_features`).

hs[0] is the embedding output, so hs[l+1] is decoder block l's output (for the last block HF returns it after
the final norm). These are the references `extract`'s batched passes equal row for row (tests/test_extract*.py).
"""
from __future__ import annotations

import torch


def new_kv(model):
    from transformers import DynamicCache
    try:  # hybrid (linear-attention) targets such as Qwen3.5/3.6 need the config to lay out their cache
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def last_logits_kw(model) -> dict:
    """Only the last position's logits (a [B, T, vocab] tensor would dwarf the rest), where supported."""
    import inspect
    params = inspect.signature(model.forward).parameters
    return next(({k: 1} for k in ("logits_to_keep", "num_logits_to_keep") if k in params), {})


@torch.no_grad()
def greedy_complete(model, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int]) -> torch.Tensor:
    """prompt_ids [P] -> prompt + greedy completion [P + C], C <= max_new_tokens, eos kept if produced."""
    kv = new_kv(model)
    # The KV cache is passed positionally: the keyword is `past_key_values` or `cache` by transformers version.
    logits = model(prompt_ids[None], None, None, kv, use_cache=True).logits  # [1, P, V]
    out = [int(t) for t in prompt_ids]
    for _ in range(max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt in eos_ids:
            break
        logits = model(torch.tensor([[nxt]], device=prompt_ids.device), None, None, kv, use_cache=True).logits
    return torch.tensor(out, dtype=torch.long)


@torch.no_grad()
def tapped_features(model, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """ids [T] -> features [T, len(layer_ids), H]: hs[l+1] of one causal prefill."""
    hs = model(ids[None], output_hidden_states=True, use_cache=False).hidden_states
    n = model.config.get_text_config().num_hidden_layers
    if len(hs) != n + 1:
        raise RuntimeError(f"expected {n + 1} hidden states (embeddings + {n} blocks), got {len(hs)}")
    return torch.stack([hs[l + 1][0] for l in layer_ids], dim=1)
