"""`python -m remote_payload.tools.bench_decode`: greedy decoding for `extract`, against the memory-bandwidth floor.

Random-weight Qwen3 targets built on the device (the 8B class: 36 layers, H 4096; the 27B class: 64 layers,
H 5120; a tiny one on the CPU), 32 prompts of 32-128 tokens, 64 new tokens, no eos (every row runs to the end),
bf16 on CUDA. Every row decodes the same prompts in the same process:
  reval dynamic        target.greedy_complete_batch (a DynamicCache, one host sync a step: what extract ran)
  reval static         fastgen.greedy_static, the step run eagerly (static KV cache, 4D mask, argmax on device)
  reval static+graphs  fastgen.greedy_static with the decode step captured as one CUDA graph
  HF generate          transformers generate(), dynamic cache / cache_implementation="static"
  floor                the weights' bytes / the copy bandwidth measured here (each decode step reads them once)
Reported: tokens per second (decode steps x batch / seconds), ms per step, the fraction of the floor, and
whether each row's tokens equal `reval dynamic`'s (bf16 near-ties may differ; the tests check fp32 on CPU).
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from remote_payload.eval.fastgen import greedy_static
from remote_payload.eval.target import greedy_complete_batch
from remote_payload.tools.bench_extract import QWEN3_8B, TINY, random_target

QWEN3_27B = {**QWEN3_8B, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
             "num_attention_heads": 40, "vocab_size": 151936}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(dev, nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted once each, as the floor's reads are)."""
    if dev.type != "cuda":
        return float("nan")
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(dev)
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    _sync(dev)
    return 2 * nbytes * 10 / (time.perf_counter() - t)


def _timed(fn, dev, repeats: int = 2):
    fn()  # warm-up (and graph capture inside the call: counted in the timed runs too, as extract pays it)
    _sync(dev)
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t)
    return best, out


def bench(cfg: dict, name: str, dev, dtype, n: int = 32, new: int = 64, hf: bool = True) -> list[tuple]:
    model = random_target(cfg, dev, dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg["vocab_size"], (int(torch.randint(32, 129, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(dev)
    floor_s = weight_bytes / bw if not math.isnan(bw) else float("nan")
    rows = []
    ref_s, ref = _timed(lambda: greedy_complete_batch(model, prompts, new, set()), dev)
    rows.append((f"{name}: reval dynamic (greedy_complete_batch)", ref_s, True))
    s, out = _timed(lambda: greedy_static(model, prompts, new, set(), graphs=False), dev)
    rows.append((f"{name}: reval static, eager step", s, out == ref))
    if dev.type == "cuda":
        s, out = _timed(lambda: greedy_static(model, prompts, new, set(), graphs=True), dev)
        rows.append((f"{name}: reval static + CUDA graph", s, out == ref))
        t = time.perf_counter()
        greedy_static(model, prompts, new, set(), graphs=True, compile=True)  # the compilation, once per shape
        first_s = time.perf_counter() - t
        s, out = _timed(lambda: greedy_static(model, prompts, new, set(), graphs=True, compile=True), dev)
        rows.append((f"{name}: reval static + compile + CUDA graph (1st call {first_s:.0f} s)", s, out == ref))
    if hf:
        P = max(len(p) for p in prompts)
        ids = torch.zeros((n, P), dtype=torch.long)
        mask = torch.zeros((n, P), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        for impl in ("dynamic", "static"):
            kw = {"cache_implementation": "static"} if impl == "static" else {}

            def gen(kw=kw):
                o = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, pad_token_id=0, **kw)
                return [list(p) + o[i, P:].tolist() for i, p in enumerate(prompts)]
            try:
                s, out = _timed(gen, dev)
                rows.append((f"{name}: transformers generate(), {impl} cache", s, out == ref))
            except Exception as e:  # noqa: BLE001 - a library path that does not run here is a row that says so
                rows.append((f"{name}: transformers generate(), {impl} cache: {type(e).__name__}", float("nan"), None))
    model = None  # the next size needs the memory
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    out_rows = []
    for label, s, same in rows:
        ok = not math.isnan(s)
        tps = n * new / s if ok else float("nan")
        step_ms = 1e3 * s / new if ok else float("nan")
        frac = floor_s * new / s if ok and not math.isnan(floor_s) else float("nan")
        out_rows.append((label, tps, step_ms, frac, same))
    if not math.isnan(floor_s):
        out_rows.append((f"{name}: memory-bandwidth floor ({weight_bytes / 1e9:.1f} GB / {bw / 1e12:.2f} TB/s)",
                         n / floor_s, 1e3 * floor_s, 1.0, None))
    return out_rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help="comma list of 8b,27b,tiny (default: 8b,27b on CUDA, tiny on CPU)")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sizes = (args.sizes or ("8b,27b" if dev.type == "cuda" else "tiny")).split(",")
    table = []
    for s in sizes:
        cfg = {"8b": QWEN3_8B, "27b": QWEN3_27B, "tiny": TINY}[s]
        table += bench(cfg, {"8b": "8B-class", "27b": "27B-class", "tiny": "tiny"}[s], dev, dtype, hf=s != "27b")
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"decode at batch 32, 64 new tokens, {str(dtype).removeprefix('torch.')} on {gpu}")
    print(f"{'row':<70} {'tokens/s':>10} {'ms/step':>9} {'of floor':>9}  same tokens")
    for label, tps, ms, frac, same in table:
        print(f"{label:<70} {tps:>10,.0f} {ms:>9.2f} {frac:>8.0%}  {'' if same is None else same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
