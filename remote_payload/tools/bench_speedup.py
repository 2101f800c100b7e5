"""`python -m remote_payload.tools.bench_speedup`: what `eval --speedup` costs and the latency table per batch.

Random weights at the 27B sizes on CUDA (the Qwen3.6-27B-DFlash drafter preset; a 64-layer, H 5120 Qwen3 target),
bf16; the tiny preset on the CPU. Rows, all from one run:
  measure (first run)   latency.measure over budgets 16..512 at --batches: what `--speedup` adds the first time
  reuse (later runs)    the latency table lookup that replaces it (the key computed, the JSON read)
  target hash           the content hash of a target this size, from its file sizes at the hash's measured speed
  decode / draft / verify(n) per batch: median [q1-q3] of n runs
The projected speedup at a few taus per method and batch shows where a bigger tree, or a bigger batch, stops
paying.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from remote_payload.contract.drafterconfig import DrafterConfig
from remote_payload.eval import latency
from remote_payload.eval.drafter import DFlashDrafter, TargetHead
from remote_payload.eval.latencytable import LatencyTable
from remote_payload.tools.bench import PRESETS
from remote_payload.tools.bench_decode import QWEN3_27B
from remote_payload.tools.bench_extract import TINY, random_target

BUDGETS = [16, 32, 64, 128, 256, 512]


def random_drafter(config: dict, dev, dtype, source: str) -> tuple[DFlashDrafter, TargetHead]:
    """A DFlash drafter of `config` with random weights and a random target head, fused, on dev in dtype."""
    cfg = DrafterConfig.from_dict(config, source=source)
    torch.manual_seed(0)
    with torch.device(dev):
        d = DFlashDrafter(cfg).to(dtype).eval()
        emb = (torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02).to(dtype)
        head = TargetHead(embed=emb, lm_head=(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02).to(dtype))
    return d.fuse_projections(), head


def measured_and_reused(target, drafter, head, kw: dict, root: Path):
    """latency.measure's entry the first time on a host, then the table lookup that replaces it later:
    (Latencies, seconds to measure, seconds to look it up), the entry checked to come back whole."""
    table = LatencyTable(root / "latency.json")
    t = time.perf_counter()
    lat = latency.measure(target, drafter, head, **kw)
    first_s = time.perf_counter() - t
    table.put(lat)
    t = time.perf_counter()
    again = table.get(latency.latency_key(target, drafter, **kw))
    reuse_s = time.perf_counter() - t
    if again is None or again.decode_s != lat.decode_s:
        raise RuntimeError("the latency table did not give back the entry just written")
    return lat, first_s, reuse_s


def hash_rate(dev_dir: Path, nbytes: int = 1 << 30) -> float:
    """Bytes per second of contenthash over a fresh file of nbytes (page-cache warm, as a target read twice)."""
    from remote_payload.contract.contenthash import sha256_files
    f = dev_dir / "blob.bin"
    with open(f, "wb") as fh:
        fh.write(torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy().tobytes())
    sha256_files([f])
    t = time.perf_counter()
    sha256_files([f])
    return nbytes / (time.perf_counter() - t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024, help="KV-cache length the steps are measured at")
    p.add_argument("--batches", default="1,4,16,64", help="batch sizes (default 1,4,16,64)")
    p.add_argument("--repeats", type=int, default=latency.DEFAULT_REPEATS, help="least timed runs per latency")
    args = p.parse_args(argv)
    batches = sorted({int(b) for b in args.batches.split(",")})
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    preset, tcfg = ("27b", {**QWEN3_27B, "vocab_size": 248320}) if dev.type == "cuda" else ("tiny", TINY)
    drafter, head = random_drafter(PRESETS[preset], dev, dtype, f"preset {preset}")
    target = random_target({**tcfg, "vocab_size": drafter.cfg.vocab_size}, dev, dtype)
    weight_bytes = sum(x.numel() * x.element_size() for x in target.parameters())
    budgets = BUDGETS if dev.type == "cuda" else [16, 64]
    bs = drafter.cfg.block_size
    kw = {"context_len": args.context, "budgets": budgets, "block_size": bs, "target_hash": "bench",
          "batches": batches, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        rate = hash_rate(Path(tmp))
        lat, first_s, reuse_s = measured_and_reused(target, drafter, head, kw, Path(tmp))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"--speedup at the {preset} sizes on {name} ({str(dtype).removeprefix('torch.')}), context {args.context}, "
          f"regime {lat.regime}{' (' + lat.note + ')' if lat.note else ''}, batches {batches}")
    print(f"{'row':<44} {'value':>12}")
    print(f"{'measure (first run on a host)':<44} {first_s:>11.1f}s")
    print(f"{'reuse (later runs: key + table lookup)':<44} {reuse_s * 1e3:>10.1f}ms")
    hash_label = f"target content hash ({weight_bytes / 1e9:.0f} GB at {rate / 1e9:.1f} GB/s)"
    print(f"{hash_label:<44} {weight_bytes / rate:>11.1f}s")
    ms = lambda s: f"{s.median * 1e3:.3f} [{s.q1 * 1e3:.3f}-{s.q3 * 1e3:.3f}] n{s.n}"
    for b in batches:
        print(f"batch {b}:")
        print(f"  {'decode step':<42} {ms(lat.decode[b])} ms")
        print(f"  {'drafter block (one anchor a sequence)':<42} {ms(lat.draft[b])} ms")
        for n, by in sorted(lat.verify.items()):
            what = "the block" if n == bs else f"DDTree-{n - 1}"
            print(f"  {'verify ' + str(n) + ' tokens (' + what + ')':<42} {ms(by[b])} ms")
    print("projected speedup = tau x t(decode) / (t(draft) + t(verify)) at sample taus, per batch:")
    for tau in (4.0, 6.0, 8.0):
        for b in batches:
            row = "  ".join(f"{('blk' if n == bs else 'B' + str(n - 1))} {lat.speedup(tau, block_size=n, batch=b):.2f}x"
                            for n in sorted(lat.verify))
            print(f"  tau {tau:.0f} batch {b:>3}: {row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
