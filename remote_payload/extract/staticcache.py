"""The fixed-slot KV cache of extract's decoder (fastgen.greedy_static), and what the decoder relies on.

transformers 5.x's StaticCache (StaticLayer.update, read in 5.24's cache_utils.py) writes a call's keys and
values at its own counter (`cumulative_length`, advanced by every update), not at the `cache_position` the
forward is given. greedy_static's slot `cp` (the mask's next visible slot, the split-KV attention's filled
length) and that counter agree only because every forward on the cache runs once, in order: the prefill writes
slots 0..P-1, then each decode step one slot, advancing both (in the CUDA graph too: the counter is a device
tensor the replay advances; the capture records a step without running it). A forward that skipped `cp`'s
advance, or one run twice, would put K/V where the mask does not look. tests/test_fastgen.py checks the two agree
before every step, and that the installed transformers still writes at its counter.
"""
from __future__ import annotations


def static_cache(model, B: int, L: int, device, dtype):
    """A StaticCache of `L` slots for `B` rows of `model` (the constructors of transformers 4.x and 5.x)."""
    from transformers import StaticCache
    cfg = model.config
    for kw in ({"config": cfg, "max_batch_size": B, "max_cache_len": L, "device": device, "dtype": dtype},
               {"config": cfg, "max_cache_len": L}):
        try:
            return StaticCache(**kw)
        except TypeError:
            continue
    raise RuntimeError("this transformers' StaticCache takes neither (config, max_batch_size, max_cache_len, ...) "
                       "nor (config, max_cache_len)")
