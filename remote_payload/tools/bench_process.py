"""The `process` rows of `python -m remote_payload bench`: the eval as users run it, against its floor.

`python -m remote_payload eval` runs as a subprocess on the seeds' run (the random checkpoint of bench.py plus
a cache of 10 prompts x 540 tokens at the checkpoint's sizes) and its wall time is set against the floor
measured in the same run, page cache warm:
  init      a bare interpreter that imports torch and makes the CUDA context (`python -c ...`), the median
            of five, each run just before one of the five eval runs
  raw read  the weight files read once into host memory (bench.raw_read_s)
  warm eval the eval stage of `evaluate` in this process, after one untimed evaluate (kernels, allocator warm)
floor = init + raw read + warm eval. The process's own eval stage (results.json timing.eval_s) is set
against the warm eval, so first-call costs and host stalls inside the stage show as a ratio.
On CUDA, before the median runs: the first eval with empty kernel caches (CUDA_CACHE_PATH, TRITON_CACHE_DIR,
TORCHINDUCTOR_CACHE_DIR, REVAL_KERNEL_CACHE in a fresh folder: a fresh host), again with the caches it filled, and with the CUDA
driver's cache off.
What it measured (and why the prime runs beside the load): docs/benchmarks.md.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from remote_payload.contract.drafterconfig import DrafterConfig
from remote_payload.extract.writer import CacheWriter

# the knobs' effect, one run each: each warm-up mode (anchors.warmup_mode); without the CUDA C passes (rtc.py)
VARIANTS = [("REVAL_WARMUP=off", {"REVAL_WARMUP": "off"}), ("REVAL_RTC=0", {"REVAL_RTC": "0"})]
REPEATS = 5  # runs of the shipped default; the row reports the median (torch's import time varies run to run)
SEEDS_RUN = {"prompts": 10, "prompt_len": 60, "completion": 480, "max_blocks": 30}


def write_cache(cfg: DrafterConfig, root: Path, dev: torch.device, dtype: torch.dtype) -> Path:
    """The seeds' run as a reval cache: random ids and features for every tapped layer, in `dtype`."""
    from remote_payload.tools.benchrows import synthetic_prompt
    n_layers, H = len(cfg.target_layer_ids), cfg.hidden_size
    out = root / "cache"
    with CacheWriter(out, layer_ids=list(cfg.target_layer_ids), hidden_size=H) as w:
        for s in range(SEEDS_RUN["prompts"]):
            ids, _ = synthetic_prompt(cfg, SEEDS_RUN["prompt_len"], SEEDS_RUN["completion"], dev, dtype, s)
            g = torch.Generator(device=dev).manual_seed(1000 + s)
            feats = torch.randn(ids.shape[0], n_layers, H, generator=g, device=dev, dtype=dtype)
            w.add(f"prompt-{s:03d}", SEEDS_RUN["prompt_len"], ids.cpu(), feats.cpu())
    return out


def _env() -> dict:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def init_once(dev: torch.device) -> float:
    """Wall time of a bare interpreter that imports torch (and makes the CUDA context on CUDA)."""
    code = "import torch" + ("; torch.ones(1, device='cuda').sum().item()" if dev.type == "cuda" else "")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())
    return time.perf_counter() - t


def eval_argv(ddir: Path, tdir: Path, cache: Path, dev: torch.device) -> list[str]:
    return ["--drafter", str(ddir), "--target", str(tdir), "--cache", str(cache), "--max-blocks", str(SEEDS_RUN["max_blocks"]), "--device", str(dev)]


def warm_eval_s(argv: list[str]) -> float:
    """The eval stage of `evaluate` in this process, second of two runs (the first warms it up)."""
    import argparse

    from remote_payload.eval import evalopts, run, steps
    p = argparse.ArgumentParser()
    evalopts.add_arguments(p)
    secs = []
    for k in range(2):
        args = p.parse_args([*argv, "--name", f"warm{k}"])
        with contextlib.redirect_stdout(io.StringIO()):
            results = run.evaluate(evalopts.options_from_args(args), steps.Reporter(None))
        secs.append(results["timing"]["eval_s"])
    return secs[-1]


def process_runs(argv: list[str], root: Path, runs: int = 2, env: dict | None = None) -> list[tuple[float, dict]]:
    """`python -m remote_payload eval ...` as a subprocess: [(wall seconds, results.json timing)]."""
    out = []
    for _ in range(runs):
        run_dir = root / f"run-proc{len(list(root.glob('run-proc*')))}"
        a = [*argv, "--run-dir", str(run_dir)]
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "remote_payload", "eval", *a], check=False,
                           env={**_env(), **(env or {})},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - t
        if p.returncode != 0:
            raise RuntimeError(f"eval exited {p.returncode}:\n{p.stdout[-3000:]}")
        timing = json.loads((run_dir / "results.json").read_text())["timing"]
        warmed = re.search(r"warmed up after it in ([0-9.]+)s: ([^)]*)\)", p.stdout)
        out.append((wall, {**timing, "warm_up": warmed.group(0)[10:-1] if warmed else None}))
    return out


def bench_process(ddir: Path, tdir: Path, cfg: DrafterConfig, dev: torch.device, dtype: torch.dtype,
                  raw_s: float, root: Path) -> list:
    from remote_payload.tools.benchrows import Row
    cache = write_cache(cfg, root, dev, dtype)
    argv = eval_argv(ddir, tdir, cache, dev)
    init_once(dev)  # the interpreter's files into the page cache, as the eval runs will find them
    warm = warm_eval_s(argv)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    cold = []  # empty kernel caches (the CUDA driver's JIT cache, Triton's, inductor's): a fresh host's 1st eval
    cold_variants = [("first on a fresh host (empty kernel caches)", "a", {}), ("again, same caches", "a", {}),
                     ("CUDA_CACHE_DISABLE=1", "b", {"CUDA_CACHE_DISABLE": "1"})]
    for label, caches, extra in cold_variants if dev.type == "cuda" else ():
        fresh = root / f"kernel-caches-{caches}"
        (w, t), = process_runs(argv, root, runs=1, env={"CUDA_CACHE_PATH": str(fresh / "cuda"), **extra,
                                                          "TRITON_CACHE_DIR": str(fresh / "triton"),
                                                          "TORCHINDUCTOR_CACHE_DIR": str(fresh / "inductor"),
                                                          "REVAL_KERNEL_CACHE": str(fresh / "reval")})
        cold.append((label, w, t))
    # the bare inits interleaved with the eval runs: a machine whose speed drifts (torch's import time differs
    # between hosts and moves within a run) moves both the same way
    inits, runs = [], []
    for _ in range(REPEATS):
        inits.append(init_once(dev))
        runs += process_runs(argv, root, runs=1)
    runs.sort(key=lambda r: r[0])
    wall, timing = runs[len(runs) // 2]  # the median run: one lucky run is no claim
    init = sorted(inits)[len(inits) // 2]
    floor = init + raw_s + warm
    walls = ", ".join(f"{w:.2f}" for w, _ in runs)
    variants = []
    for label, w, t in cold:
        warmed = f", warm-up {t['warm_up']}" if t["warm_up"] else ""
        variants.append(Row(f"process: `eval` wall, {label}", 0, w, 0,
                            f"= {w / floor:.2f}x floor; load {t['load_s']:.2f}s, eval stage {t['eval_s']:.2f}s"
                            + warmed))
    for label, env in VARIANTS if dev.type == "cuda" else ():
        (w, t), = process_runs(argv, root, runs=1, env=env)
        warmed = f", warm-up {t['warm_up']}" if t["warm_up"] else ""
        variants.append(Row(f"process: `eval` wall, {label}", 0, w, 0,
                            f"= {w / floor:.2f}x floor; load {t['load_s']:.2f}s, eval stage {t['eval_s']:.2f}s"
                            + warmed))
    return [
        Row("process: torch + CUDA init", 0, init, 0, f"bare interpreter, median of {REPEATS} run between the evals "
            f"({', '.join(f'{x:.2f}' for x in inits)}s)"),
        Row("process: warm eval stage in-process", 0, warm, 0, "evaluate()'s eval stage, 2nd of 2 runs"),
        Row("process: floor", 0, floor, 0, f"init + raw read {raw_s:.2f}s + warm eval"),
        Row(f"process: `eval` subprocess wall, median of {len(runs)}", 0, wall, 0,
            f"= {wall / floor:.2f}x floor (runs {walls}s); its load {timing['load_s']:.2f}s = "
            f"{raw_s / timing['load_s']:.2f}x raw read speed, warm-up {timing['warm_up'] or 'none'}, "
            f"eval stage {timing['eval_s']:.2f}s = "
            f"{timing['eval_s'] / warm:.2f}x warm in-process"),
        *variants,
    ]
