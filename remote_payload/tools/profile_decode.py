"""`python -m remote_payload.tools.profile_decode`: where extract's decode call spends its time (issue 33 items 2, 4).

On a random-weight target of the 8B or 27B class (bf16; the tiny one on a CPU), batch --batch prompts, --new new
tokens: (1) the whole call's phases as extract runs it (prefill, warm-up + capture, decode; graphs on), each the
median of --repeats calls (`--compare`: before / after rows at each of --new 64,512);
(2) one profiled eager call's GPU kernels, grouped (GEMMs, attention, norms / SiLU /
RoPE passes, the sampler, copies, other), per decode step, against the graph step and the weights' floor (their
bytes at the device copy rate). What the graph step spends beyond the kernels' sum is launch and idle time the
graph did not remove; what the GEMMs spend beyond the floor is the GEMMs' own shortfall.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from remote_payload.extract.fastgen import greedy_static
from remote_payload.tools.bench_decode import QWEN3_27B, _prompts, copy_bandwidth
from remote_payload.tools.bench_extract import QWEN3_8B, TINY, random_target

GROUPS = (("gemm", ("gemm", "gemv", "cutlass", "cublas", "sm90_xmma", "sm80_xmma", "ampere", "hopper", "nvjet")),
          ("attention", ("attention", "attn", "flash", "split_decode", "softmax")),
          ("norm / SiLU / RoPE passes", ("rms", "norm", "silu", "rope", "fused", "triton")),
          ("argmax / sampler", ("argmax", "reduce", "max", "topk", "sort", "cumsum")),
          ("copies / index", ("copy", "index", "fill", "cat", "elementwise", "memcpy", "memset")))


def group_of(name: str) -> str:
    low = name.lower()
    for group, words in GROUPS:
        if any(w in low for w in words):
            return group
    return "other"


def phases(model, prompts, new: int, repeats: int, reuse: bool = True) -> dict[str, float]:
    """The median of `repeats` calls' phases after one warm-up call; reuse (extract's default): the calls after
    the first replay its captured graph (a later batch of the shape); False: each call captures its own."""
    runs: dict[str, list[float]] = defaultdict(list)
    greedy_static(model, prompts, new, set(), reuse=reuse)  # warm-up: kernels, allocator, the shape's capture
    for _ in range(repeats):
        ph: dict = {}
        greedy_static(model, prompts, new, set(), phases=ph, reuse=reuse)
        for k, v in ph.items():
            runs[k].append(float(v))
    return {k: statistics.median(v) for k, v in runs.items()}


def whole_line(label: str, ph: dict, new: int, floor_ms: float) -> str:
    whole = ph.get("prefill_s", 0) + ph.get("capture_s", 0) + ph.get("decode_s", 0)
    step_ms = 1e3 * ph["decode_s"] / ph["decode_steps"]
    return (f"{label:<44} {new:>4} new: whole {1e3 * whole:8.1f} ms = {new * floor_ms / (1e3 * whole):6.1%} of the "
            f"floor (prefill {1e3 * ph['prefill_s']:.1f}, capture {1e3 * ph['capture_s']:.1f}, decode "
            f"{1e3 * ph['decode_s']:.1f} ms); step {step_ms:.3f} ms = {floor_ms / step_ms:.1%}")


def compare(model, prompts, news: list[int], repeats: int, floor_ms: float) -> None:
    """Before (a capture per call, q/k/v and gate/up separate GEMMs: REVAL_DECODE_PROJ=separate) against
    extract's default (fused projections; a shape's first batch captures, later ones replay), per length."""
    import os
    for new in news:
        os.environ["REVAL_DECODE_PROJ"] = "separate"
        try:
            print(whole_line("before: capture per call, separate GEMMs", phases(model, prompts, new, repeats, False),
                             new, floor_ms), flush=True)
        finally:
            del os.environ["REVAL_DECODE_PROJ"]
        print(whole_line("fused GEMMs, a shape's first batch", phases(model, prompts, new, repeats, False), new,
                         floor_ms), flush=True)
        print(whole_line("fused GEMMs, later batches (graph reused)", phases(model, prompts, new, repeats), new,
                         floor_ms), flush=True)


def kernels(model, prompts, steps: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """ms per decode step by group and the top kernels, from one eager call of `steps` new tokens (the
    prefill's kernels left out: a profiled prefill-only call's totals are subtracted by name)."""
    from torch.profiler import ProfilerActivity, profile

    def totals(new: int) -> dict[str, float]:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            greedy_static(model, prompts, new, set(), graphs=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0
            if torch.cuda.is_available() and t and e.device_type.name == "CUDA":
                out[e.key] += t / 1e3  # ms
            elif not torch.cuda.is_available() and not e.cpu_children:
                out[e.key] += e.self_cpu_time_total / 1e3
        return out
    base, full = totals(1), totals(1 + steps)
    per = {k: max(0.0, full[k] - base.get(k, 0.0)) / steps for k in full}
    by_group: dict[str, float] = defaultdict(float)
    for k, v in per.items():
        by_group[group_of(k)] += v
    return dict(by_group), sorted(per.items(), key=lambda kv: -kv[1])[:12]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote_payload.tools.profile_decode",
                                description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("8b", "27b"), default="8b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new", default="64", help="new tokens; several comma-separated with --compare")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=16)
    p.add_argument("--compare", action="store_true",
                   help="before/after rows only: a capture per call with separate q/k/v, gate/up GEMMs against "
                        "extract's default (fused GEMMs, the graph reused by later batches of a shape)")
    args = p.parse_args(argv)
    news = [int(x) for x in args.new.split(",")]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = (QWEN3_8B if args.size == "8b" else QWEN3_27B) if dev.type == "cuda" else TINY
    model = random_target(cfg, dev, dtype)
    prompts = _prompts(cfg, args.batch)
    wb = sum(x.numel() * x.element_size() for x in model.parameters())
    floor_ms = 1e3 * wb / copy_bandwidth(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"{args.size} class on {name}: batch {args.batch}, weights {wb / 1e9:.1f} GB, floor {floor_ms:.2f} ms a "
          f"step (median of {args.repeats} calls)", flush=True)
    if args.compare:
        compare(model, prompts, news, args.repeats, floor_ms)
        return 0
    new = news[0]
    ph = phases(model, prompts, new, args.repeats)
    whole = ph.get("prefill_s", 0) + ph.get("capture_s", 0) + ph.get("decode_s", 0)
    step_ms = 1e3 * ph["decode_s"] / ph["decode_steps"]
    print(f"whole call {1e3 * whole:.1f} ms = {new * floor_ms / (1e3 * whole):.1%} of the decode floor, {new} new "
          "tokens (a later batch of the shape: its graph reused)")
    for k in ("prefill_s", "capture_s", "decode_s"):
        print(f"  {k[:-2]:<10} {1e3 * ph[k]:8.1f} ms  {ph[k] / whole:6.1%}")
    print(f"graph step {step_ms:.3f} ms = {floor_ms / step_ms:.1%} of the floor")
    groups, top = kernels(model, prompts, args.profile_steps)
    total = sum(groups.values())
    print(f"eager step's kernels ({args.profile_steps} steps profiled): {total:.3f} ms a step; the graph step "
          f"spends {step_ms - total:+.3f} ms beyond their sum")
    for g, v in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {g:<28} {v:8.3f} ms  {v / step_ms:6.1%} of the graph step")
    print("top kernels (ms a step):")
    for k, v in top:
        print(f"  {v:8.3f}  {k[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
