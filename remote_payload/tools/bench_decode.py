"""`python -m remote_payload.tools.bench_decode`: greedy decoding for `extract`, against the memory-bandwidth floor.

Random-weight Qwen3 targets built on the device (the 8B class: 36 layers, H 4096; the 27B class: 64 layers,
H 5120; a tiny one on the CPU), 32 prompts of 32-128 tokens, 64 new tokens, no eos (every row runs to the end),
bf16 on CUDA. Every row decodes the same prompts in the same process:
  reval dynamic        decode.greedy_complete_batch (a DynamicCache, one host sync a step: what extract ran)
  reval static         fastgen.greedy_static, the step run eagerly (static KV cache, 4D mask, argmax on device)
  + CUDA graph, SDPA   the decode step captured as one CUDA graph, the model's own (SDPA) attention
  + CUDA graph, grouped ... with fastgen.grouped_decode_attention's torch matmuls over the whole static cache
  + CUDA graph, split  ... its split-KV Triton kernels over the filled slots only, the model's own layers
  + Triton passes      ... and the RMSNorms, SiLU MLPs and RoPE as one Triton pass each (fastgen.FusedLayers:
                       extract's default on CUDA in bf16)
  + compile            ... the step traced through torch.compile first (extract --compile; 1st call = compile)
  HF generate          transformers generate(), dynamic cache / cache_implementation="static"
  floor                the weights' bytes / the copy bandwidth measured here (each decode step reads them once;
                       the KV cache's reads, ~5% more at these lengths, are not counted)
Reported: the whole call (tokens per second = decode steps x batch / seconds, ms per step, fraction of the floor:
prefill, graph capture and decode together, what extract pays) and, for reval's static rows, one decode step
alone (the loop after the warm-up, synced at its ends), and whether each row's tokens equal `reval dynamic`'s
(bf16 near-ties may differ; the tests check fp32 on CPU and CUDA).
Then the feature prefill (prefill_batch over extract's batches) in useful TFLOP/s against a bf16 matmul measured
in the same run.

What it measured: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from remote_payload.extract.batching import batches
from remote_payload.extract.decode import greedy_complete_batch
from remote_payload.extract.fastgen import greedy_static
from remote_payload.extract.prefill import prefill_batch
from remote_payload.tools.bench import _env, measure_peak
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


def prefill_rate(model, cfg: dict, prompts: list[list[int]], new: int, layer_ids: list[int], dev,
                 repeats: int = 1) -> tuple:
    """extract's feature prefill (`prefill_batch`: hooked tapped blocks + the argmax agreement) over the batches
    extract forms (`batches`: longest first), on prompt + completion, one untimed run then `repeats` timed:
    ([seconds], useful FLOPs). Useful = 2 x non-embedding parameters per real token + causal attention
    (2 T^2 x heads x head_dim per layer, per row) + the lm_head over the completion positions the agreement
    reads; padding is not counted."""
    seqs = [p + [(7 * i + j) % cfg["vocab_size"] for j in range(new)] for i, p in enumerate(prompts)]
    groups = batches([len(x) for x in seqs], 32, 32768)

    def run():
        for g in groups:
            prefill_batch(model, [torch.tensor(seqs[i]) for i in g], layer_ids, [len(prompts[i]) for i in g])
    times, _ = _timed(run, dev, repeats)
    body = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    L, qd = cfg["num_hidden_layers"], cfg["num_attention_heads"] * cfg["head_dim"]
    flops = sum(2 * body * len(x) + 2 * L * len(x) ** 2 * qd + 2 * cfg["vocab_size"] * cfg["hidden_size"] * new
                for x in seqs)
    return times, flops


def _timed(fn, dev, repeats: int = 2) -> tuple[list[float], object]:
    """fn once (warm-up; graph capture inside the call is counted in the timed runs too, as extract pays it),
    then `repeats` timed calls: ([seconds], the last output)."""
    fn()
    _sync(dev)
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return times, out


def _prompts(cfg: dict, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, cfg["vocab_size"], (int(torch.randint(32, 129, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def _generate_rows(model, prompts, new, dev, ref, name, repeats, impls=("dynamic", "static")) -> list[tuple]:
    n, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((n, P), dtype=torch.long)
    mask = torch.zeros((n, P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    rows = []
    for impl in impls:
        kw = {"cache_implementation": "static"} if impl == "static" else {}

        def gen(kw=kw):
            o = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=0, **kw)
            return [list(p) + o[i, P:].tolist() for i, p in enumerate(prompts)]
        try:
            times, out = _timed(gen, dev, repeats)
            rows.append((f"{name}: transformers generate(), {impl} cache", times, out == ref, []))
        except Exception as e:  # noqa: BLE001 - a library path that does not run here is a row that says so
            rows.append((f"{name}: transformers generate(), {impl} cache: {type(e).__name__}", [], None, []))
    return rows


def measure(cfg: dict, name: str, dev, dtype, n: int = 32, new: int = 64, hf: bool = True, quick: bool = False,
            compile_rows: bool = True, repeats: int = 2, prefill: bool | None = None,
            hf_impls=("dynamic", "static")) -> dict:
    """Every row of one model size, each timed `repeats` times after a warm-up: {"rows": [(label, [seconds per
    call], same tokens, [ms per decode step per call])], "floor_s", "weight_bytes", "bw" (the median of "bws",
    three copy readings), "prefill": None or ([seconds], flops, peak FLOP/s) (by default unless `quick`), "n",
    "new"}."""
    model = random_target(cfg, dev, dtype)
    prompts = _prompts(cfg, n)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bws = [copy_bandwidth(dev) for _ in range(3)]  # the copy's rate moves with the clock: the median of three
    bw = statistics.median(bws)
    floor_s = weight_bytes / bw if not math.isnan(bw) else float("nan")
    rows = []
    ref = None  # --quick: the graph rows only, their tokens compared with each other's
    if not quick:
        times, ref = _timed(lambda: greedy_complete_batch(model, prompts, new, set()), dev, repeats)
        rows.append((f"{name}: reval dynamic (greedy_complete_batch)", times, True, []))

    def static(**kw):
        steps: list[float] = []

        def call():
            ph: dict = {}
            out = greedy_static(model, prompts, new, set(), phases=ph, **kw)
            steps.append(1e3 * ph["decode_s"] / ph["decode_steps"])  # this call's steady decode step
            return out
        times, out = _timed(call, dev, repeats)
        return times, out, steps[1:]  # the warm-up's step left out

    if not quick or dev.type != "cuda":
        t, out, st = static(graphs=False)
        rows.append((f"{name}: reval static, eager step", t, out == ref if ref else None, st))
    if dev.type == "cuda":
        if not quick:
            t, out, st = static(graphs=True, grouped_attention=False)
            rows.append((f"{name}: reval static + CUDA graph, SDPA attention", t, out == ref, st))
        with _env("REVAL_DECODE_ATTENTION", "grouped"), _env("REVAL_DECODE_FUSED", "0"):
            t, out, st = static(graphs=True)
        ref = ref or out
        rows.append((f"{name}: reval static + CUDA graph, grouped attention (torch)", t, out == ref, st))
        with _env("REVAL_DECODE_FUSED", "0"):
            t, out, st = static(graphs=True)
        rows.append((f"{name}: reval static + CUDA graph, split-KV, the model's own layers", t, out == ref, st))
        t, out, st = static(graphs=True)
        rows.append((f"{name}: + RMSNorm/SiLU/RoPE as Triton passes (extract's default)", t, out == ref, st))
    if dev.type == "cuda" and compile_rows:
        t0 = time.perf_counter()
        greedy_static(model, prompts, new, set(), graphs=True, compile=True)  # the compilation, once per shape
        first_s = time.perf_counter() - t0
        t, out, st = static(graphs=True, compile=True)
        rows.append((f"{name}: reval static + compile + CUDA graph (1st call {first_s:.0f} s)", t, out == ref, st))
    if hf:
        rows += _generate_rows(model, prompts, new, dev, ref, name, repeats, hf_impls)
    pre = None
    if dev.type == "cuda" and (not quick if prefill is None else prefill):
        L = cfg["num_hidden_layers"]
        layer_ids = [1, L // 4, L // 2, 3 * L // 4, L - 3]
        pre_times, flops = prefill_rate(model, cfg, prompts + prompts, new, layer_ids, dev, repeats)
        pre = (pre_times, flops, measure_peak(dev) * 1e12)  # bench.py's peak: the median of 5 readings
    model = None  # the next size needs the memory
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"rows": rows, "floor_s": floor_s, "weight_bytes": weight_bytes, "bw": bw, "bws": bws, "prefill": pre,
            "n": n, "new": new}


def bench(cfg: dict, name: str, dev, dtype, n: int = 32, new: int = 64, hf: bool = True,
          quick: bool = False, compile_rows: bool = True) -> tuple[list[tuple], str | None]:
    """`measure`'s rows as printed: each row's best of two calls."""
    m = measure(cfg, name, dev, dtype, n, new, hf, quick, compile_rows)
    floor_s, out_rows = m["floor_s"], []
    for label, times, same, steps in m["rows"]:
        s = min(times) if times else float("nan")
        step = min(steps) if steps else float("nan")
        ok = not math.isnan(s)
        tps = n * new / s if ok else float("nan")
        frac = floor_s * new / s if ok and not math.isnan(floor_s) else float("nan")
        ms = 1e3 * s / new if ok else float("nan")
        out_rows.append((label, tps, ms, frac, step, 1e3 * floor_s / step, same))
    if not math.isnan(floor_s):
        label = f"{name}: memory-bandwidth floor ({m['weight_bytes'] / 1e9:.1f} GB / {m['bw'] / 1e12:.2f} TB/s)"
        out_rows.append((label, n / floor_s, 1e3 * floor_s, 1.0, 1e3 * floor_s, 1.0, None))
    prefill_line = None
    if m["prefill"]:
        times, flops, peak = m["prefill"]
        pre_s = min(times)
        prefill_line = (f"{name}: feature prefill of {2 * n} prompts + {new} tokens in extract's batches: "
                        f"{1e3 * pre_s:.0f} ms, {flops / pre_s / 1e12:.0f} TFLOP/s useful = "
                        f"{flops / pre_s / peak:.0%} of the bf16 matmul peak measured here ({peak / 1e12:.0f} "
                        "TFLOP/s, the median of 5 readings)")
    return out_rows, prefill_line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help="comma list of 8b,27b,tiny (default: 8b,27b on CUDA, tiny on CPU)")
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt (default 64; extract's default is 512)")
    p.add_argument("--quick", action="store_true",
                   help="reval's CUDA-graph rows only (no dynamic, eager, SDPA or generate() rows, no prefill)")
    p.add_argument("--no-compile", action="store_true", help="no torch.compile row (its compilation takes ~1 min)")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sizes = (args.sizes or ("8b,27b" if dev.type == "cuda" else "tiny")).split(",")
    table, prefills = [], []
    for s in sizes:
        cfg = {"8b": QWEN3_8B, "27b": QWEN3_27B, "tiny": TINY}[s]
        name = {"8b": "8B-class", "27b": "27B-class", "tiny": "tiny"}[s]
        rows, pre = bench(cfg, name, dev, dtype, hf=s != "27b" and not args.quick, new=args.new,
                          quick=args.quick, compile_rows=not args.no_compile)
        table += rows
        prefills += [pre] if pre else []
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"decode at batch 32, {args.new} new tokens, {str(dtype).removeprefix('torch.')} on {gpu}")
    print("whole call (prefill, capture, decode: what extract pays) | one decode step alone (after the warm-up)")
    print(f"{'row':<72} {'tokens/s':>9} {'ms/step':>8} {'of floor':>8} | {'ms/step':>8} {'of floor':>8}  same tokens")
    for label, tps, ms, frac, step, sfrac, same in table:
        steady = "" if math.isnan(step) else f"{step:>8.2f} {sfrac:>8.0%}"
        print(f"{label:<72} {tps:>9,.0f} {ms:>8.2f} {frac:>8.0%} | {steady:>17}  {'' if same is None else same}")
    for line in prefills:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
