"""The fixed-slot KV cache of extract's decoder (fastgen.greedy_static), and what the decoder relies on.

transformers 5.x's StaticCache (StaticLayer.update, read in 5.24's cache_utils.py) writes a call's keys and
values at its own counter (`cumulative_length`, advanced by every update), not at the `cache_position` the
forward is given. greedy_static's slot `cp` (the mask's next visible slot, the split-KV attention's filled
length) and that counter agree only because every forward on the cache runs once, in order: the prefill writes
slots 0..P-1, then each decode step one slot, advancing both (in the CUDA graph too: the counter is a device
tensor the replay advances; the capture records a step without running it). A forward that skipped `cp`'s
advance, or one run twice, would put K/V where the mask does not look. tests/test_fastgen.py checks the two agree
before every step, and that the installed transformers still writes at its counter.

Between batches of one shape the decoder keeps the cache (fastgen._Shape) and `reset_static_cache` empties it in
place: K/V zeroed and every layer's counter back to 0, the very tensors the captured graph reads and advances, so
the next prefill writes slots 0..P-1 and leaves the counter at P, the slot the decoder's `cp` starts at.
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


def _tensors(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:  # transformers 4.x: key_cache / value_cache lists, written at cache_position
        return [*getattr(cache, "key_cache", []), *getattr(cache, "value_cache", [])]
    return [t for x in layers for t in (getattr(x, "keys", None), getattr(x, "values", None),
                                         getattr(x, "cumulative_length", None)) if t is not None]


def reset_static_cache(cache) -> bool:
    """Empty the cache for the next batch of its shape (transformers' own `reset`: K/V zeroed, counters 0), in
    place. False (nothing to reuse: make a new cache) where that reset replaced a tensor instead of zeroing it,
    or a counter is not a device tensor (an int the captured graph could not advance)."""
    before = [(id(t), t.data_ptr()) if hasattr(t, "data_ptr") else None for t in _tensors(cache)]
    cache.reset()
    after = [(id(t), t.data_ptr()) if hasattr(t, "data_ptr") else None for t in _tensors(cache)]
    return before == after and None not in after
