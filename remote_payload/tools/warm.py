"""`python -m remote_payload warm [--drafter DIR]... [--target DIR]... [--only eval|extract]`: fill this host's kernel
caches (runtime/kcache.py: in the payload's venv) ahead of the first run, so that the first `eval` or `extract` on
a fresh node finds its kernels compiled (`reval sync HOST --warm` runs it after the sync).

On a GPU it runs, each once: the eval's CUDA C passes (NVRTC, eval/rtc.py); the eval's drafting path on a
miniature of each drafter shape class (anchors.prime: its layer types, heads, head size, block size and
vocabulary; cuDNN's run-time compiled attention, CUDA's JIT, cuBLAS); extract's decode (fastgen.greedy_static:
the static cache, the CUDA graph, the fused Triton passes and split-KV attention) on a one-layer random target
of each target shape class (its hidden size, heads, head size, MLP width; a small vocabulary), batch 32 x 64 new
tokens. The shape classes: the drafters and targets given (their config.json, no weights read), else the
built-in ones (the Qwen3.6-27B-DFlash drafter; Qwen3-8B- and 27B-class targets). Without a GPU there is nothing
to warm: it says so and exits 0. Exit 3: a --drafter/--target whose config cannot be read; 1: a step failed.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from remote_payload.contract import protocol
from remote_payload.contract.errors import PayloadError
from remote_payload.runtime import kcache

WARM_BATCH, WARM_PROMPT, WARM_NEW = 32, 48, 64  # extract's step: 32 prompts padded to 64 tokens, 64 new tokens
WARM_VOCAB = 4096  # the warm target's vocabulary (the lm_head's GEMM needs no compiling)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", action="append", default=[], metavar="DIR",
                   help="a drafter checkpoint whose shapes the eval's kernels are warmed for (repeatable; its "
                        "config.json only; default: the Qwen3.6-27B-DFlash sizes)")
    p.add_argument("--target", action="append", default=[], metavar="DIR",
                   help="a target model whose shapes extract's decode kernels are warmed for (repeatable; its "
                        "config.json only; default: the Qwen3-8B and 27B classes)")
    p.add_argument("--only", choices=("eval", "extract"), help="warm one command's kernels (default: both)")
    p.add_argument("--device", default="cuda", help="the GPU to warm on (default: cuda, the current one)")


def _drafter_classes(dirs: list[str]) -> list[tuple[str, object]]:
    from remote_payload.contract.drafterconfig import DrafterConfig
    from remote_payload.eval.checkpoint import peek_config
    if not dirs:
        from remote_payload.tools.bench import PRESETS
        return [("Qwen3.6-27B-DFlash sizes", DrafterConfig.from_dict(PRESETS["27b"], source="warm"))]
    out = []
    for d in dirs:
        cfg = peek_config(d)
        if cfg is None:
            raise FileNotFoundError(f"--drafter {d}: no config.json beside its weights (a .pt drafter: give "
                                    "the checkpoint's folder with its config.json)")
        out.append((d, cfg))
    return out


def _target_classes(dirs: list[str]) -> list[tuple[str, dict]]:
    if not dirs:
        from remote_payload.tools.bench_decode import QWEN3_27B
        from remote_payload.tools.bench_extract import QWEN3_8B
        return [("Qwen3-8B class", QWEN3_8B), ("Qwen3-27B class", QWEN3_27B)]
    out = []
    for d in dirs:
        try:
            cfg = json.loads((Path(d) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise FileNotFoundError(f"--target {d}: cannot read its config.json ({e})") from None
        out.append((d, cfg.get("text_config") or cfg))
    return out


def _warm_eval(name: str, cfg, device) -> str:
    import torch

    from remote_payload.eval import anchors, evalopts
    s = anchors._prime_run(cfg, device, torch.bfloat16, batch_size=128, budgets=list(evalopts.DEFAULT_BUDGETS),
                           widths=list(evalopts.DEFAULT_WIDTHS))
    torch.cuda.synchronize(device)
    return f"{s:.2f}s"


def _warm_extract(name: str, cfg: dict, device) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from remote_payload.extract.fastgen import greedy_static
    d = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "quantization_config")}
    d.update(num_hidden_layers=1, vocab_size=WARM_VOCAB)
    d.pop("layer_types", None)  # one per layer: the one layer left takes the model's default
    conf = AutoConfig.for_model(d.pop("model_type", "qwen3"), **d)
    t = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, WARM_VOCAB, (WARM_BATCH, WARM_PROMPT), generator=g).tolist()
    greedy_static(model, prompts, WARM_NEW, set())
    torch.cuda.synchronize(device)
    del model
    torch.cuda.empty_cache()
    return f"{time.perf_counter() - t:.2f}s"


def main(args: argparse.Namespace) -> int:
    print("kernel caches:", flush=True)
    for line in kcache.describe():
        print(f"  {line}", flush=True)
    try:
        drafters = _drafter_classes(args.drafter) if args.only != "extract" else []
        targets = _target_classes(args.target) if args.only != "eval" else []
    except (OSError, ValueError, PayloadError) as e:
        print(f"error: {' '.join(str(e).split())}", flush=True)
        return protocol.EXIT_BAD_INPUT
    import torch
    if not torch.cuda.is_available() or not args.device.startswith("cuda"):
        print("no CUDA GPU here (the kernels are compiled on a GPU host, by its first run or by this command "
              "there)", flush=True)
        print("nothing to warm", flush=True)  # the last line: `reval sync --warm`'s word for the host
        return 0
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or (device.index or 0) >= torch.cuda.device_count():
        print(f"error: --device {args.device}: not a GPU of this host ({torch.cuda.device_count()} GPU(s): "
              "cuda:0 ...)", flush=True)
        return protocol.EXIT_BAD_INPUT
    if device.index is not None:
        torch.cuda.set_device(device)
    steps = [] if args.only == "extract" else [("reval's CUDA C passes", None, _warm_rtc)]
    steps += [(f"eval's drafting path, {n}", c, _warm_eval) for n, c in drafters]
    steps += [(f"extract's decode, {n}", c, _warm_extract) for n, c in targets]
    failed = 0
    t0 = time.perf_counter()
    print(f"warming {torch.cuda.get_device_name(device)} ({len(steps)} steps)", flush=True)
    for i, (what, cfg, fn) in enumerate(steps, 1):
        try:
            how = fn(what, cfg, device)
        except Exception as e:  # noqa: BLE001 - one line per failed step; the others still run
            failed += 1
            how = "failed: " + " ".join(f"{type(e).__name__}: {e}".split())[:300]
        print(f"[{i}/{len(steps)}] {what}: {how}", flush=True)
    print(f"warmed in {time.perf_counter() - t0:.1f}s" + (f"; {failed} step(s) failed" if failed else ""), flush=True)
    return protocol.EXIT_FAILED if failed else 0


def _warm_rtc(_what: str, _cfg, device) -> str:
    from remote_payload.eval import rtc
    why = rtc.available(device)
    if why is not None:
        return f"not used here ({why})"
    return rtc.how(device)
