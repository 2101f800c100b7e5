"""`python -m remote_payload bench`: how fast is the eval, against a naive loop timed in the same run.

Preset `27b` (default on a GPU): a random-weight drafter with the real Qwen3.6-27B-DFlash sizes (H=5120,
I=17408, 32/8 heads x 128, 5 layers = 4 sliding (2048) + 1 full, vocab 248320, 5 tapped layers), written
to disk as safetensors (drafter folder + a target folder with an index and the multimodal key variant), then:
  load      load_drafter + load_target_head (mmap) vs a raw read of the same bytes (both page-cache warm)
  seeds     10 prompts x 30 blocks (the seeds' run): the eval stage (drafting at every anchor + all walks)
  large     128 prompts x 64 blocks
  2k        32 prompts of a 2,000-token prompt + 512-token completion x 32 blocks; on CUDA again with one
            fast path off (ABLATIONS: REVAL_STREAMS=1; REVAL_RTC=0, Triton's passes instead of the CUDA C
            ones; REVAL_SDPA=torch, torch's attention kernel choice instead of the efficient one), so each
            run shows what they earn; seeds again with REVAL_RTC=0 (too short a run for
            `kernels.plan` to start Triton: torch's log-softmax and elementwise kernels)
  naive     one prompt, one round at a time, whole context recomputed (`naive_block`): the baseline
Prints drafter rounds/s (one round = one anchor's 16-token block), achieved TFLOP/s (useful FLOPs: block
GEMMs, attention, lm_head, context projections) against the measured bf16 peak (the median of 5 readings),
and the speed-up over naive.
Preset `tiny` (default on CPU): the same table at test sizes, so `make bench` runs anywhere.
On CUDA (or with --only): the `process` rows (bench_process.py: `eval` as a subprocess vs its floor) and the
`extract` rows (bench_extract.py: batched extraction vs the batch-1 loop on a random 8B-class Qwen3).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from remote_payload.contract.contenthash import sha256_files
from remote_payload.contract.drafterconfig import DrafterConfig
from remote_payload.eval import kernels, metrics
from remote_payload.eval.anchors import draft_all_anchors, enqueue_anchors
from remote_payload.eval.devices import resolve_device_dtype
from remote_payload.eval.drafter import DFlashDrafter
from remote_payload.eval.steps import load_weights
from remote_payload.tools.benchrows import Row, synthetic_prompt

PRESETS = {
    "27b": {"hidden_size": 5120, "intermediate_size": 17408, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "num_hidden_layers": 5, "num_target_layers": 64,
                "vocab_size": 248320, "block_size": 16,
                "rms_norm_eps": 1e-6, "rope_theta": 1e7, "rope_scaling": None, "max_position_embeddings": 262144,
                "sliding_window": 2048, "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
                "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "num_hidden_layers": 2, "num_target_layers": 8, "vocab_size": 512, "block_size": 16,
                 "rms_norm_eps": 1e-6, "rope_theta": 1e4, "rope_scaling": None, "max_position_embeddings": 4096,
                 "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"],
                 "dflash_config": {"mask_token_id": 511, "target_layer_ids": [1, 3, 5]}},
}
# (name, prompts, blocks, prompt_len, completion_len) per preset
SCENARIOS = {
    "27b": [("seeds 10x30", 10, 30, 60, 480), ("large 128x64", 128, 64, 100, 1024), ("2k 32x32", 32, 32, 2000, 512)],
    "tiny": [("seeds 10x30", 10, 30, 60, 480), ("large 8x64", 8, 64, 100, 1024), ("2k 4x32", 4, 32, 2000, 512)],
}
BUDGETS = [16, 32, 64, 128, 256, 512]
# the 2k row again with one fast path off (CUDA): one stream (anchors._Lanes), Triton's passes (kernels.plan)
# instead of the CUDA C ones (rtc.py)
ABLATIONS = [("REVAL_STREAMS", "1"), ("REVAL_RTC", "0"), ("REVAL_SDPA", "torch")]
# the seeds row again without the CUDA C passes (rtc.py): torch's log-softmax, RoPE and SiLU kernels then
SEEDS_ABLATIONS = [("REVAL_RTC", "0"), ("REVAL_SDPA", "torch")]


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def block_flops(cfg: DrafterConfig, ctx_len: float) -> float:
    """Useful FLOPs of one drafter round (one anchor) with `ctx_len` visible context positions (average)."""
    H, I, bs = cfg.hidden_size, cfg.intermediate_size, cfg.block_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_tok = 2 * (H * q + 2 * H * kv + q * H + 3 * H * I)
    attn = 2 * 2 * q * bs * (ctx_len + bs)  # QK^T and PV over context + block, all heads
    return cfg.num_hidden_layers * (bs * per_tok + attn) + 2 * (bs - 1) * H * cfg.vocab_size


def context_flops(cfg: DrafterConfig, T: int) -> float:
    H, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    return 2 * T * cfg.fc_in_features * H + cfg.num_hidden_layers * 2 * T * H * 2 * kv


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def peak_readings(dev: torch.device, readings: int = 5) -> list[float]:
    """bf16 TFLOP/s of an 8192^3 matmul on random data, `readings` times (each the mean of 10 products after a
    warm-up): the clock moves the rate between readings (683-794 seen in one run), so a ratio takes the median."""
    if dev.type != "cuda":
        return [float("nan")]
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    out = []
    for _ in range(readings):
        sync(dev)
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        sync(dev)
        out.append(10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12)
    return out


def measure_peak(dev: torch.device) -> float:
    """The bf16 matmul peak every "% of peak" is against: the median of `peak_readings`."""
    return statistics.median(peak_readings(dev))


def write_checkpoint(cfg: DrafterConfig, root: Path, dev: torch.device, dtype: torch.dtype) -> tuple[Path, Path]:
    """Random weights on disk: drafter folder (z-lab layout) + target folder (index, multimodal keys)."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    with torch.device(dev):
        model = DFlashDrafter(cfg).to(dtype)
    sd = {}
    for k, v in model.state_dict().items():
        # scaled so activations stay O(1) through 5 layers (random, but not degenerate)
        sd[k] = (torch.randn_like(v) * (v.shape[-1] ** -0.5) if v.dim() == 2 else torch.ones_like(v)).cpu()
    ddir, tdir = root / "drafter", root / "target"
    ddir.mkdir(parents=True, exist_ok=True)
    tdir.mkdir(parents=True, exist_ok=True)
    save_file(sd, ddir / "model.safetensors", metadata={"format": "pt"})
    (ddir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    del model, sd
    V, H = cfg.vocab_size, cfg.hidden_size
    g = torch.Generator(device=dev).manual_seed(1)
    head = {"model.language_model.embed_tokens.weight": torch.randn(V, H, generator=g, device=dev, dtype=dtype).cpu(),
            "lm_head.weight": (torch.randn(V, H, generator=g, device=dev, dtype=dtype) * H ** -0.5).cpu()}
    shard = "model-00001-of-00001.safetensors"
    save_file(head, tdir / shard, metadata={"format": "pt"})
    (tdir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard for k in head}}))
    (tdir / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    return ddir, tdir


def raw_read_s(paths: list[Path]) -> tuple[float, int]:
    total, t = 0, time.perf_counter()
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return time.perf_counter() - t, total


def safetensors_load_s(files: list[Path], dev: torch.device) -> float:
    """The safetensors library's own loader on the same files (the baseline our reader must beat)."""
    from safetensors.torch import load_file
    sync(dev)
    t = time.perf_counter()
    tensors = [load_file(f, device=str(dev)) for f in files]
    sync(dev)
    secs = time.perf_counter() - t
    del tensors
    return secs


def bench_load(ddir: Path, tdir: Path, cfg: DrafterConfig, dev: torch.device, dtype):
    files = [ddir / "model.safetensors", *sorted(tdir.glob("*.safetensors"))]
    raw_read_s(files)  # warm the page cache for both measurements
    raw_s, nbytes = raw_read_s(files)
    t = time.perf_counter()
    sha256_files(files[:1])
    hash_s = time.perf_counter() - t
    sync(dev)
    t = time.perf_counter()
    drafter, _, head, _ = load_weights(str(ddir), str(tdir), dev, dtype)  # what eval does (two readers)
    sync(dev)
    load_s = time.perf_counter() - t
    st_s = safetensors_load_s(files, dev)
    gb, dgb = nbytes / 1e9, files[0].stat().st_size / 1e9
    return [Row("raw read of the weight files", 0, raw_s, 0, f"{gb:.2f} GB at {gb / raw_s:.1f} GB/s"),
            Row("sha256 of the drafter file alone", 0, hash_s, 0, f"{dgb / hash_s:.1f} GB/s (runs beside the load)"),
            Row("load drafter + target head (eval's path)", 0, load_s, 0,
                f"{gb / load_s:.1f} GB/s = {raw_s / load_s:.2f}x raw read speed"),
            Row("safetensors load_file(device=...)", 0, st_s, 0,
                f"{gb / st_s:.1f} GB/s = {raw_s / st_s:.2f}x raw read; eval's path is {st_s / load_s:.2f}x faster"),
            ], drafter, head


def bench_eval(name, drafter, head, cfg, dev, dtype, prompts, blocks, prompt_len, completion, batch) -> Row:
    bs = cfg.block_size
    data = [synthetic_prompt(cfg, prompt_len, completion, dev, dtype, s) for s in range(prompts)]
    n = metrics.num_anchors(prompt_len, prompt_len + completion, blocks, bs)
    kernels.plan(prompts * n * (bs - 1) * cfg.vocab_size, dev)  # as eval decides for this run (Triton or not)
    # warm-up (kernels, allocator) on one prompt
    draft_all_anchors(drafter, head, data[0][1], data[0][0], prompt_len, min(n, batch), batch_size=batch,
                      budgets=BUDGETS)
    sync(dev)
    t = time.perf_counter()
    flops, pending, host = 0.0, None, {"queue": 0.0, "wait": 0.0, "walks": 0.0}
    for ids, feats in [*data, (None, None)]:  # as the eval does: the next prompt queued before this one's walks
        t0 = time.perf_counter()
        queued = None if ids is None else enqueue_anchors(drafter, head, feats, ids, prompt_len, n, batch_size=batch,
                                                          budgets=BUDGETS, widths=[4, 8])
        t1 = time.perf_counter()
        host["queue"] += t1 - t0
        if pending is not None:
            out = pending[1].result()
            t2 = time.perf_counter()
            metrics.prompt_metrics(out.drafts, out.target_rank, out.topk_logprobs, pending[0], prompt_len,
                                   blocks, bs, budgets=BUDGETS, widths=[4, 8], tree_acc=out.tree_acc)
            host["wait"] += t2 - t1
            host["walks"] += time.perf_counter() - t2
            flops += n * block_flops(cfg, prompt_len + n / 2) + context_flops(cfg, prompt_len + completion)
        pending = None if ids is None else (ids.cpu().numpy(), queued)
    sync(dev)
    secs = time.perf_counter() - t
    walk_rounds = prompts * blocks
    return Row(name, prompts * n, secs, flops,
               f"{prompts} prompts x {n} anchors; the walk's {walk_rounds} rounds take "
               f"{secs / walk_rounds * 1e3:.2f} ms each; host: queue {host['queue']:.2f}s, wait "
               f"{host['wait']:.2f}s, walks {host['walks']:.2f}s")


@torch.inference_mode()
def bench_naive(drafter, head, cfg, dev, dtype, prompt_len, completion, rounds: int) -> Row:
    ids, feats = synthetic_prompt(cfg, prompt_len, completion, dev, dtype, 99)
    drafter.naive_block(feats, int(ids[prompt_len]), prompt_len, head)  # warm-up
    sync(dev)
    t = time.perf_counter()
    flops = 0.0
    for r in range(rounds):
        a = prompt_len + r * (completion // rounds)
        drafter.naive_block(feats, int(ids[a]), a, head).argmax(-1).cpu()
        flops += block_flops(cfg, a) + context_flops(cfg, a)
    sync(dev)
    return Row("naive: 1 prompt, 1 round at a time", rounds, time.perf_counter() - t, flops,
               "context recomputed every round (the reference loop)")


def render(rows: list[Row], peak: float, naive_rate: float | None) -> str:
    head = (f"{'benchmark':<36} {'rounds':>8} {'seconds':>9} {'rounds/s':>10} {'TFLOP/s':>8} {'% peak':>7} "
            f"{'vs naive':>9}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        rate = r.rounds / r.seconds if r.rounds else None
        tf = r.flops / r.seconds / 1e12 if r.flops else None
        pct = f"{100 * tf / peak:6.1f}%" if tf and not math.isnan(peak) else "      -"
        vs = f"{rate / naive_rate:8.1f}x" if rate and naive_rate else "        -"
        lines.append(f"{r.name:<36} {r.rounds or '-':>8} {r.seconds:>9.3f} {f'{rate:,.0f}' if rate else '-':>10} "
                     f"{f'{tf:.1f}' if tf else '-':>8} {pct:>7} {vs}  {r.note}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="27b on CUDA, tiny on CPU by default")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-size", type=int, default=0, help="anchors per forward (default 128 GPU / 32 CPU)")
    p.add_argument("--naive-rounds", type=int, default=20)
    p.add_argument("--workdir", default=None, help="where the random checkpoint is written (default: a temp dir)")
    p.add_argument("--only", default=None, help="comma list of scenario names to run (default all)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")


def main(args: argparse.Namespace) -> int:
    dev, dtype = resolve_device_dtype(args.device, "auto")
    preset = args.preset or ("27b" if dev.type == "cuda" else "tiny")
    batch = args.batch_size or (128 if dev.type == "cuda" else 32)
    cfg = DrafterConfig.from_dict(PRESETS[preset], source=f"preset {preset}")
    peak = measure_peak(dev)
    print(f"bench: preset {preset} on {dev} ({str(dtype).removeprefix('torch.')}), batch {batch} anchors; "
          f"bf16 matmul peak measured {peak:.0f} TFLOP/s" if not math.isnan(peak) else
          f"bench: preset {preset} on {dev} ({str(dtype).removeprefix('torch.')}), batch {batch} anchors", flush=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        t = time.perf_counter()
        ddir, tdir = write_checkpoint(cfg, Path(tmp), dev, dtype)
        print(f"wrote random checkpoint in {time.perf_counter() - t:.1f}s", flush=True)
        rows, drafter, head = bench_load(ddir, tdir, cfg, dev, dtype)
        naive = bench_naive(drafter, head, cfg, dev, dtype, 100, 1024, args.naive_rounds)
        rows.append(naive)
        only = set(args.only.split(",")) if args.only else None
        if (only and "process" in only) or (not only and dev.type == "cuda"):  # minutes on a CPU
            from remote_payload.tools.bench_process import bench_process
            rows += bench_process(ddir, tdir, cfg, dev, dtype, rows[0].seconds, Path(tmp))
            print("  done: process", flush=True)
        if (only and "extract" in only) or (not only and dev.type == "cuda"):
            from remote_payload.tools.bench_extract import bench_extract
            rows += bench_extract(dev, dtype)
            print("  done: extract", flush=True)
        for name, prompts, blocks, plen, comp in SCENARIOS[preset]:
            if only and name.split()[0] not in only:
                continue
            rows.append(bench_eval(name, drafter, head, cfg, dev, dtype, prompts, blocks, plen, comp, batch))
            print(f"  done: {name}", flush=True)
            if dev.type == "cuda" and name.startswith(("2k", "seeds")):  # what streams and Triton earn, same run
                for knob, value in ABLATIONS if name.startswith("2k") else SEEDS_ABLATIONS:
                    with _env(knob, value):
                        rows.append(bench_eval(f"{name}, {knob}={value}", drafter, head, cfg, dev, dtype, prompts,
                                               blocks, plen, comp, batch))
    table = render(rows, peak, naive.rounds / naive.seconds)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": preset, "device": str(dev), "peak_tflops": peak,
                                               "rows": [r.__dict__ for r in rows]}, indent=2))
    return 0
