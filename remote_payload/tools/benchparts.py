"""The measuring half of benchdoc.py: each part runs its bench's rows n times and returns their readings as
`benchdoc.Sample`s (table, row, col, value). One random 27B-size checkpoint (bench.write_checkpoint) serves the
payload and process parts; the readings go to --json after each part, so a run cut short keeps what it did."""
from __future__ import annotations

import contextlib
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from remote_payload.contract.drafterconfig import DrafterConfig
from remote_payload.eval.devices import resolve_device_dtype
from remote_payload.tools import bench, bench_decode, bench_extract, bench_process, bench_serving
from remote_payload.tools.benchrows import (
    AFTER_IMPORTS,
    DEFAULT_ROW,
    T_DECODE,
    T_EVAL,
    T_EXTRACT,
    T_PEAKS,
    T_PROCESS,
    T_TIMELINE,
    Sample,
)


class Ctx:
    """What the parts share: the device, the random checkpoint on disk, its raw read's seconds."""

    def __init__(self, root: Path):
        self.dev, self.dtype = resolve_device_dtype("auto", "auto")
        self.preset = "27b" if self.dev.type == "cuda" else "tiny"
        self.cfg = DrafterConfig.from_dict(bench.PRESETS[self.preset], source=f"preset {self.preset}")
        self.root = root
        self.ddir, self.tdir = bench.write_checkpoint(self.cfg, root, self.dev, self.dtype)
        self.files = [self.ddir / "model.safetensors", *sorted(self.tdir.glob("*.safetensors"))]
        bench.raw_read_s(self.files)  # the page cache warm for every reading after
        self.raw_s = statistics.median(bench.raw_read_s(self.files)[0] for _ in range(3))
        self.gb = sum(f.stat().st_size for f in self.files) / 1e9


def part_payload(ctx: Ctx, repeats: int) -> list[Sample]:
    out: list[Sample] = []
    batch = 128 if ctx.dev.type == "cuda" else 32
    for _ in range(repeats):
        peak = bench.measure_peak(ctx.dev)
        out.append(Sample(T_PEAKS, "bf16 matmul (median of 5 readings)", "TFLOP/s", peak))
        rows, drafter, head = bench.bench_load(ctx.ddir, ctx.tdir, ctx.cfg, ctx.dev, ctx.dtype)
        raw, load, st = rows[0].seconds, rows[2].seconds, rows[3].seconds
        out += [Sample(T_PEAKS, "raw read of the weight files", "GB/s", ctx.gb / raw),
                Sample(T_PEAKS, "eval's load (drafter + target head)", "GB/s", ctx.gb / load),
                Sample(T_PEAKS, "eval's load (drafter + target head)", "x raw read", raw / load),
                Sample(T_PEAKS, "safetensors load_file(device=...)", "GB/s", ctx.gb / st)]
        naive = bench.bench_naive(drafter, head, ctx.cfg, ctx.dev, ctx.dtype, 100, 1024, 20)
        naive_rate = naive.rounds / naive.seconds
        out.append(Sample(T_EVAL, "naive: 1 prompt, 1 round at a time", "rounds/s", naive_rate))
        for name, prompts, blocks, plen, comp in bench.SCENARIOS[ctx.preset]:
            knobs = [None] + (bench.ABLATIONS if name.startswith("2k") else bench.SEEDS_ABLATIONS)
            for knob in knobs if ctx.dev.type == "cuda" else [None]:
                label = name if knob is None else f"{name}, {knob[0]}={knob[1]}"
                with bench._env(*knob) if knob else contextlib.nullcontext():
                    r = bench.bench_eval(label, drafter, head, ctx.cfg, ctx.dev, ctx.dtype, prompts, blocks, plen,
                                         comp, batch)
                rate = r.rounds / r.seconds
                out += [Sample(T_EVAL, label, "rounds/s", rate), Sample(T_EVAL, label, "x naive", rate / naive_rate)]
                if not math.isnan(peak):  # a CPU has none
                    out.append(Sample(T_EVAL, label, "% of peak", 100 * r.flops / r.seconds / 1e12 / peak))
        drafter = head = None
    return out


def part_process(ctx: Ctx, repeats: int, shape: str = "seeds") -> list[Sample]:
    sh = bench_process.SHAPES[shape]
    table = f"{T_PROCESS}: {'the seeds run' if shape == 'seeds' else '2k context'} " \
            f"({sh['prompts']} prompts x {sh['prompt_len']:,} + {sh['completion']} tokens, {sh['max_blocks']} blocks)"
    cache = bench_process.write_cache(ctx.cfg, ctx.root, ctx.dev, ctx.dtype, sh, name=f"cache-{shape}")
    argv = bench_process.eval_argv(ctx.ddir, ctx.tdir, cache, ctx.dev, sh)
    bench_process.init_once(ctx.dev)  # the interpreter's files into the page cache, as the eval runs find them
    warm = bench_process.warm_eval_s(argv, repeats)
    if ctx.dev.type == "cuda":
        torch.cuda.empty_cache()
    out: list[Sample] = []
    floor = float("nan")
    for _r, label, wall, t in bench_process.rounds(argv, ctx.dev, ctx.root / f"runs-{shape}", repeats,
                                                   fresh=shape == "seeds"):
        if label == "init":
            floor = wall + ctx.raw_s + statistics.median(warm)
            out += [Sample(table, "bare init (import torch, CUDA context)", "wall (s)", wall),
                    Sample(table, "floor", "wall (s)", floor)]
            continue
        label = DEFAULT_ROW if label == "default" else label
        seg = t["segments"]
        imports = sum(seg.get(k, 0.0) for k in ("interpreter start", "import torch", "import the eval"))
        out += [Sample(table, label, "wall (s)", wall), Sample(table, label, "x floor", wall / floor),
                Sample(table, label, AFTER_IMPORTS, wall - imports),
                Sample(table, label, "load (s)", t["load_s"]), Sample(table, label, "warm-up (s)", t["warm_up_s"]),
                Sample(table, label, "eval stage (s)", t["eval_s"])]
        if shape == "seeds":
            col = label.split(" (")[0].removeprefix("REVAL_").replace(", same caches", "")
            out += [Sample(T_TIMELINE, name, col, secs) for name, secs in seg.items()]
    return out + [Sample(table, "warm eval stage in-process", "eval stage (s)", w) for w in warm]


def part_extract(ctx: Ctx, repeats: int) -> list[Sample]:
    what, rates = bench_extract.extract_rates(ctx.dev, ctx.dtype, repeats)
    out = []
    for key in ("batch-1", "batched", "fast"):
        for i, rate in enumerate(rates[key]):
            out.append(Sample(T_EXTRACT, f"{key}: {what}" if key == "fast" else key, "tokens/s", rate))
            out.append(Sample(T_EXTRACT, f"{key}: {what}" if key == "fast" else key, "x batch-1",
                              rate / rates["batch-1"][i]))
    return out


def part_decode(ctx: Ctx, repeats: int, new: int = 64) -> list[Sample]:
    out = []
    table = f"{T_DECODE} (batch 32, {new} new tokens)"
    sizes = [("8B-class", bench_extract.QWEN3_8B, True), ("27B-class", bench_decode.QWEN3_27B, False)] \
        if ctx.dev.type == "cuda" else [("tiny", bench_extract.TINY, True)]
    for name, cfg, hf in sizes:
        m = bench_decode.measure(cfg, name, ctx.dev, ctx.dtype, new=new, hf=hf, quick=True, compile_rows=False,
                                 repeats=repeats, prefill=new == 64, hf_impls=("static",))
        n, new, floor_s = m["n"], m["new"], m["floor_s"]
        for label, times, _same, steps in m["rows"]:
            for s in times:
                out += [Sample(table, label, "whole call tokens/s", n * new / s),
                        Sample(table, label, "whole call, of floor (%)", 100 * floor_s * new / s)]
            out += [Sample(table, label, "a step (ms)", st) for st in steps]
            out += [Sample(table, label, "a step, of floor (%)", 100 * 1e3 * floor_s / st) for st in steps]
        out += [Sample(table, f"{name}: memory-bandwidth floor ({m['weight_bytes'] / 1e9:.1f} GB at the copy "
                       "rate)", "a step (ms)", 1e3 * m["weight_bytes"] / bw) for bw in m["bws"] if not math.isnan(bw)]
        if m["prefill"]:
            times, flops, peak = m["prefill"]
            out += [Sample(table, f"{name}: feature prefill of {2 * n} prompts + {new} tokens",
                           "% of bf16 peak", 100 * flops / s / peak) for s in times]
    return out


def part_eagle3(ctx: Ctx, repeats: int) -> list[Sample]:
    """The EAGLE-3 rows (bench_eagle3.py) beside the DFlash payload part's seeds row on this run's checkpoint."""
    from remote_payload.tools import bench_eagle3
    _rows, drafter, head = bench.bench_load(ctx.ddir, ctx.tdir, ctx.cfg, ctx.dev, ctx.dtype)
    name, prompts, blocks, plen, comp = bench.SCENARIOS[ctx.preset][0]
    batch = 128 if ctx.dev.type == "cuda" else 32

    def dflash():
        r = bench.bench_eval(name, drafter, head, ctx.cfg, ctx.dev, ctx.dtype, prompts, blocks, plen, comp, batch)
        return r.rounds, r.seconds, r.flops
    return bench_eagle3.part_eagle3(ctx.dev, ctx.dtype, repeats, bench.measure_peak(ctx.dev), dflash)


def measure_all(parts: list[str], repeats: int, env: dict, json_path: str | None, workdir: str | None) -> list:
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        t = time.perf_counter()
        ctx = Ctx(Path(tmp))
        print(f"benchdoc: {env['gpu']}; random checkpoint written and read in {time.perf_counter() - t:.0f}s",
              flush=True)
        for part in parts:
            t = time.perf_counter()
            if part == "payload":
                samples += part_payload(ctx, repeats)
            elif part in ("process", "process-2k"):
                samples += part_process(ctx, repeats, "seeds" if part == "process" else "2k")
            elif part == "extract":
                samples += part_extract(ctx, repeats)
            elif part == "decode":
                samples += part_decode(ctx, repeats)
            elif part == "decode-512":
                samples += part_decode(ctx, repeats, new=512)
            elif part == "sampled":
                samples += bench_serving.part_sampled(ctx.dev, ctx.dtype, repeats)
            elif part == "projection":
                samples += bench_serving.part_projection(ctx.dev, repeats)
            elif part == "eagle3":
                samples += part_eagle3(ctx, repeats)
            elif part == "latency-table":
                samples += bench_serving.part_latency(ctx.dev, ctx.dtype, repeats)
            if ctx.dev.type == "cuda":
                torch.cuda.empty_cache()
            print(f"  done: {part} in {time.perf_counter() - t:.0f}s", flush=True)
            if json_path:
                Path(json_path).write_text(json.dumps({"env": env, "samples": [list(s.__dict__.values())
                                                                               for s in samples]}, indent=1))
    return samples
