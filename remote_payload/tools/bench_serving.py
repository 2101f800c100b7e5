"""The serving-regime rows (issue 29 item 6) of `make bench-doc --parts serving`, each measured n times:
  sampled extraction   extract's fast path (static cache, CUDA graph, hooked prefill) on an 8B-class random target,
                       64 prompts x 64 new tokens, greedy against sampled (T=0.7, top-k 20, top-p 0.95, one sample a
                       prompt: the per-(prompt, sample) uniforms and the prefill's log p(y)), interleaved per run
  latency table        eval --speedup's measurement at batch 1, 4, 16, 64 (decode, the drafter's block, verify of
                       the block and of DDTree-16/64/256's trees) for the 8B and 27B classes: its cost the first
                       time on a host, the table lookup that replaces it later, and the latencies per batch
  projection check     the tiny trained fixtures (fp32), `eval --speedup --online N`: the online decode's measured
                       speedup at batch 1 against the projection over the same prompts from the same run's table
Random weights at the real sizes on CUDA (bf16); the tiny sizes on a CPU. Readings are benchdoc `Sample`s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from remote_payload.tools.benchrows import T_LATENCY, T_PROJECTION, T_SAMPLED, Sample

SAMPLED = (0.7, 20, 0.95)
BUDGETS = [16, 64, 256]
BATCHES = [1, 4, 16, 64]


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def part_sampled(dev, dtype, repeats: int) -> list[Sample]:
    """Greedy and sampled extraction on one model and one prompt set, interleaved per run."""
    from remote_payload.eval.regime import Regime
    from remote_payload.extract.batching import batches, extract_batch
    from remote_payload.extract.decode import choose_generator
    from remote_payload.tools.bench_extract import SETUPS, random_target
    cfg, n, _single, new, layers = SETUPS["cuda" if dev.type == "cuda" else "cpu"]
    model = random_target(cfg, dev, dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg["vocab_size"], (int(torch.randint(32, 129, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    gen = choose_generator(model)
    t, k, p = SAMPLED
    regime = Regime(temperature=t, top_k=k, top_p=p, seed=0, samples=1)
    groups = batches([len(x) + new for x in prompts], 32, 32768)

    def run(reg):
        for group in groups:
            rows = [(f"p{i}", 0) for i in group]
            extract_batch(model, gen, [prompts[i] for i in group], new, set(), layers, regime=reg,
                          rows=None if reg is None else rows).wait()
    run(None)  # warm-up of both paths (graphs, kernels, the sampler's)
    run(regime)
    out = []
    for r in range(repeats):
        rates = {}
        for label, reg in ((("greedy", None), ("sampled", regime)) if r % 2 == 0 else
                           (("sampled", regime), ("greedy", None))):
            _sync(dev)
            t0 = time.perf_counter()
            run(reg)
            _sync(dev)
            rates[label] = n * new / (time.perf_counter() - t0)
        out += [Sample(T_SAMPLED, label, "tokens/s", v) for label, v in rates.items()]
        out.append(Sample(T_SAMPLED, "sampled", "x greedy", rates["sampled"] / rates["greedy"]))
    return out


def _drafter(size: str, dev, dtype):
    from remote_payload.tools.bench import PRESETS
    from remote_payload.tools.bench_speedup import random_drafter
    base = PRESETS["27b" if dev.type == "cuda" else "tiny"]
    if size == "8B-class":  # the 27B drafter's shape at the 8B target's width, depth and vocabulary
        base = {**base, "hidden_size": 4096, "intermediate_size": 12288, "num_target_layers": 36,
                "vocab_size": 151936, "dflash_config": {"mask_token_id": 151669,
                                                         "target_layer_ids": [1, 9, 17, 25, 33]}}
    return random_drafter(base, dev, dtype, f"bench {size}")


def part_latency(dev, dtype, repeats: int) -> list[Sample]:
    """The latency table of each size class, measured `repeats` times (each a first time: a new table)."""
    from remote_payload.tools.bench_decode import QWEN3_27B, copy_bandwidth
    from remote_payload.tools.bench_extract import QWEN3_8B, TINY, random_target
    from remote_payload.tools.bench_speedup import measured_and_reused
    sizes = [("8B-class", QWEN3_8B), ("27B-class", QWEN3_27B)] if dev.type == "cuda" else [("tiny", TINY)]
    budgets = BUDGETS if dev.type == "cuda" else [16]
    out = []
    for size, tcfg in sizes:
        drafter, head = _drafter(size, dev, dtype)
        target = random_target({**tcfg, "vocab_size": drafter.cfg.vocab_size}, dev, dtype)
        weight_bytes = sum(x.numel() * x.element_size() for x in target.parameters())
        bs = drafter.cfg.block_size
        kw = {"context_len": 1024, "budgets": budgets, "block_size": bs, "target_hash": "bench",
              "batches": BATCHES}
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                lat, first, reuse = measured_and_reused(target, drafter, head, kw, Path(tmp))
            out += [Sample(T_LATENCY, f"{size}: the table's cost", "measure, first time (s)", first),
                    Sample(T_LATENCY, f"{size}: the table's cost", "reuse: key + lookup (ms)", 1e3 * reuse)]
            floor_ms = 1e3 * weight_bytes / copy_bandwidth(dev)  # NaN on a CPU
            out.append(Sample(T_LATENCY, f"{size}: the weights at the copy rate (floor)", "b1 (ms)", floor_ms))
            out.append(Sample(T_LATENCY, f"{size}: decode step", "b1, of floor (%)",
                              100 * floor_ms / (1e3 * lat.decode[1].median)))
            for b in BATCHES:
                out.append(Sample(T_LATENCY, f"{size}: decode step", f"b{b} (ms)", 1e3 * lat.decode[b].median))
                out.append(Sample(T_LATENCY, f"{size}: drafter block", f"b{b} (ms)", 1e3 * lat.draft[b].median))
                for nn, by in sorted(lat.verify.items()):
                    what = "block" if nn == bs else f"DDTree-{nn - 1}"
                    out.append(Sample(T_LATENCY, f"{size}: verify {nn} ({what})", f"b{b} (ms)",
                                      1e3 * by[b].median))
        del drafter, head, target
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def part_projection(dev, repeats: int, fixtures: Path | None = None) -> list[Sample]:
    """`eval --speedup --online 8` on the trained fixtures in a subprocess, `repeats` times."""
    fx = fixtures or Path(__file__).resolve().parents[2] / ".cache" / "fixtures"
    if not (fx / "cache").is_dir():
        raise RuntimeError(f"{fx}: no trained fixtures (make test builds them; carry .cache/fixtures to a GPU host)")
    out = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            argv = [sys.executable, "-m", "remote_payload", "eval", "--drafter", str(fx / "drafter-good"),
                    "--target", str(fx / "target"), "--cache", str(fx / "cache"), "--device", dev.type,
                    "--dtype", "fp32", "--run-dir", str(run_dir), "--speedup", "--online", "8",
                    "--online-repeats", "5", "--ddtree-budgets", "16,64", "--latency-table",
                    str(Path(tmp) / "latency.json")]
            done = subprocess.run(argv, check=False, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
            if done.returncode != 0:
                raise RuntimeError(f"eval --speedup --online failed ({done.returncode}): {done.stderr[-2000:]}")
            on = json.loads((run_dir / "results.json").read_text())["online"]
        measured, projected = on["measured_speedup"], on["projected_speedup"]
        out += [Sample(T_PROJECTION, "block, 8 prompts", "measured online (x)", measured),
                Sample(T_PROJECTION, "block, 8 prompts", "projected (x)", projected),
                Sample(T_PROJECTION, "block, 8 prompts", "measured / projected", measured / projected),
                Sample(T_PROJECTION, "block, 8 prompts", "tau (pooled)", on["projected_tau"])]
    return out
