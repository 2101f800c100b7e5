"""The `process` rows of `python -m remote_payload bench`: the eval as users run it, against its floor.

`python -m remote_payload eval` runs as a subprocess on the seeds' run (the random checkpoint of bench.py plus
a cache of 10 prompts x 540 tokens at the checkpoint's sizes; `SHAPES` has a 2k-context one too) and its wall
time is set against the floor measured in the same run, page cache warm:
  init      a bare interpreter that imports torch and makes the CUDA context (`python -c ...`), one run just
            before each round of eval processes
  raw read  the weight files read once into host memory (bench.raw_read_s)
  warm eval the eval stage of `evaluate` in this process, after one untimed evaluate (kernels, allocator warm)
floor = init + raw read + warm eval. The process's own eval stage (results.json timing.eval_s) is set
against the warm eval, so first-call costs and host stalls inside the stage show as a ratio.
Each eval process is stamped (`timeline`): the parent's clock at the spawn and at the exit, the child's at its
first line of Python, after `import torch`, after the eval's imports; the events it writes (each step, the
load's end, the eval's start, done), results.json's mtime: where the seconds from spawn to exit go.
On CUDA, a round runs: the init, the first eval with empty kernel caches (every variable of runtime/kcache.py
and its root, REVAL_KERNEL_CACHES, in a fresh folder: a fresh node, whatever the venv's caches hold), again
with the caches it filled, a fresh node whose empty caches `warm --only eval` filled first (untimed: what
`reval sync --warm` does ahead of the first run), the shipped default (the venv's caches, warm), and each knob's
other value (`VARIANTS`), interleaved so a machine whose speed drifts moves them all alike. What it measured:
docs/benchmarks.md.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from remote_payload.contract.drafterconfig import DrafterConfig
from remote_payload.extract.writer import CacheWriter

# each knob's other value: the warm-up (anchors.warmup_mode) off; the CUDA C passes (rtc.py) off; the GPU's
# context and the cubin not started beside torch's import (eval/early.py); torch's attention kernel (kernels.sdpa)
VARIANTS = [("REVAL_WARMUP=off", {"REVAL_WARMUP": "off"}), ("REVAL_RTC=0", {"REVAL_RTC": "0"}),
            ("REVAL_EARLY=0", {"REVAL_EARLY": "0"}), ("REVAL_SDPA=torch", {"REVAL_SDPA": "torch"})]
REPEATS = 5  # rounds in `bench`'s rows (benchdoc passes its own count)
SHAPES = {"seeds": {"prompts": 10, "prompt_len": 60, "completion": 480, "max_blocks": 30},
          "2k": {"prompts": 8, "prompt_len": 2000, "completion": 512, "max_blocks": 32}}
SEEDS_RUN = SHAPES["seeds"]
# the eval process, stamped: what `python -m remote_payload eval ...` runs (the kernel caches set and the early
# thread started before torch), its imports timed on the way
STAMPED = ("import json, os, sys, time\n"
           "T = {'main': time.time()}\n"
           "from remote_payload.runtime import kcache\n"
           "kcache.setup()\n"
           "from remote_payload.eval import early\n"
           "early.start(sys.argv[2:])\n"
           "import torch\n"
           "T['torch'] = time.time()\n"
           "import remote_payload.__main__ as m\n"
           "import remote_payload.eval.run\n"
           "T['imports'] = time.time()\n"
           "with open(os.environ['REVAL_BENCH_STAMPS'], 'w') as f:\n"
           "    json.dump(T, f)\n"
           "m.fast_exit(m.main())\n")
# (label, from, to) over the stamps `timeline` collects
SEGMENTS = [("interpreter start", "spawn", "main"), ("import torch", "main", "torch"),
            ("import the eval", "torch", "imports"), ("device, tokenizer helper", "imports", "step1"),
            ("cache + features (steps 1-3)", "step1", "step4"), ("load + warm-up left (step 4)", "step4", "loaded"),
            ("eval stage + walks + summary", "loaded", "done"), ("results.json written", "done", "written"),
            ("exit path", "written", "exit"), ("whole process", "spawn", "exit")]


def write_cache(cfg: DrafterConfig, root: Path, dev: torch.device, dtype: torch.dtype,
                shape: dict | None = None, name: str = "cache") -> Path:
    """A run's cache (`shape`, default the seeds'): random ids and features for every tapped layer, in `dtype`."""
    from remote_payload.tools.benchrows import synthetic_prompt
    shape = shape or SEEDS_RUN
    n_layers, H = len(cfg.target_layer_ids), cfg.hidden_size
    out = root / name
    with CacheWriter(out, layer_ids=list(cfg.target_layer_ids), hidden_size=H) as w:
        for s in range(shape["prompts"]):
            ids, _ = synthetic_prompt(cfg, shape["prompt_len"], shape["completion"], dev, dtype, s)
            g = torch.Generator(device=dev).manual_seed(1000 + s)
            feats = torch.randn(ids.shape[0], n_layers, H, generator=g, device=dev, dtype=dtype)
            w.add(f"prompt-{s:03d}", shape["prompt_len"], ids.cpu(), feats.cpu())
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


def eval_argv(ddir: Path, tdir: Path, cache: Path, dev: torch.device, shape: dict | None = None) -> list[str]:
    return ["--drafter", str(ddir), "--target", str(tdir), "--cache", str(cache),
            "--max-blocks", str((shape or SEEDS_RUN)["max_blocks"]), "--device", str(dev)]


def warm_eval_s(argv: list[str], repeats: int = 1) -> list[float]:
    """The eval stage of `evaluate` in this process: one untimed run (warming it up), then `repeats` runs."""
    import argparse

    from remote_payload.eval import evalopts, run, steps
    p = argparse.ArgumentParser()
    evalopts.add_arguments(p)
    secs = []
    for k in range(repeats + 1):
        args = p.parse_args([*argv, "--name", f"warm{k}"])
        with contextlib.redirect_stdout(io.StringIO()):
            results = run.evaluate(evalopts.options_from_args(args), steps.Reporter(None))
        secs.append(results["timing"]["eval_s"])
    return secs[1:]


def timeline(spawn: float, exit_: float, stamps: dict, events: list[dict], written: float | None) -> dict:
    """Wall-clock stamps of one eval process (time.time() seconds): the parent's `spawn` and `exit_`, the child's
    `stamps` (main, torch, imports), its events (step 1, step 4, the load's end, done), results.json's mtime."""
    t = {"spawn": spawn, "exit": exit_, **stamps}
    for e in events:
        msg = str(e.get("message", ""))
        if e.get("step") == 1 and "step1" not in t:
            t["step1"] = e["t"]
        elif e.get("stage") == "load_drafter" and msg.startswith("Loading drafter"):
            t["step4"] = e["t"]
        elif e.get("stage") == "load_drafter" and msg.startswith("loaded in"):
            t["loaded"] = e["t"]
        elif e.get("stage") == "done":
            t["done"] = e["t"]
    if written is not None:
        t["written"] = written
    return t


def segments(t: dict) -> dict[str, float]:
    """`SEGMENTS`' seconds from a `timeline` (a segment whose ends are missing is left out)."""
    return {label: t[b] - t[a] for label, a, b in SEGMENTS if a in t and b in t}


def process_runs(argv: list[str], root: Path, runs: int = 2, env: dict | None = None) -> list[tuple[float, dict]]:
    """The stamped eval (`STAMPED`) as a subprocess: [(wall seconds, results.json timing + `warm_up`, the log's
    warm-up words, + `segments`, where its seconds went)]."""
    from remote_payload.contract import protocol
    out = []
    for _ in range(runs):
        run_dir = root / f"run-proc{len(list(root.glob('run-proc*')))}"
        stamps_file = root / f"{run_dir.name}.stamps.json"
        a = [*argv, "--run-dir", str(run_dir)]
        spawn, t = time.time(), time.perf_counter()
        p = subprocess.run([sys.executable, "-c", STAMPED, "eval", *a], check=False,
                           env={**_env(), **(env or {}), "REVAL_BENCH_STAMPS": str(stamps_file)},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall, exit_ = time.perf_counter() - t, time.time()
        if p.returncode != 0:
            raise RuntimeError(f"eval exited {p.returncode}:\n{p.stdout[-3000:]}")
        res = run_dir / protocol.RESULTS_JSON
        timing = json.loads(res.read_text())["timing"]
        tl = timeline(spawn, exit_, json.loads(stamps_file.read_text()),
                      protocol.read_events(run_dir / protocol.EVENTS_JSONL), res.stat().st_mtime_ns / 1e9)
        warmed = re.search(r"warmed up after it in ([0-9.]+)s: ([^)]*)\)", p.stdout)
        out.append((wall, {**timing, "warm_up": warmed.group(0)[10:-1] if warmed else None,
                           "warm_up_s": float(warmed.group(1)) if warmed else 0.0, "segments": segments(tl)}))
    return out


def rounds(argv: list[str], dev: torch.device, root: Path, repeats: int, variants=VARIANTS, fresh: bool = True):
    """`repeats` rounds, each: the bare init, then (CUDA) the fresh host and its rerun and a fresh host after `warm`
    (those three with `fresh`), the default, each variant, the order rotated by one each round (a run after an eval
    process's exit starts slower than one after the bare init: each row takes each place). Yields (round, label,
    wall seconds, timing), "init" (timing None) first."""
    from remote_payload.tools.benchrows import AGAIN_ROW, FRESH_ROW, WARMED_ROW
    units = [[("default", None, {})]]
    if dev.type == "cuda":
        units = ([[(FRESH_ROW, "fresh", {}), (AGAIN_ROW, "again", {})], [(WARMED_ROW, "warmed", {})]]
                 if fresh else []) + units + [[(label, None, env)] for label, env in variants]
    root.mkdir(parents=True, exist_ok=True)
    for r in range(repeats):
        yield r, "init", init_once(dev), None
        k = r % len(units)
        for label, kind, env in [run for unit in units[k:] + units[:k] for run in unit]:
            if kind:
                env = fresh_caches(root / f"kernel-caches-{r}{'-warmed' if kind == 'warmed' else ''}")
            if kind == "warmed":
                warm_caches(argv, env)
            (w, t), = process_runs(argv, root, runs=1, env=env)
            yield r, label, w, t


def fresh_caches(folder: Path) -> dict[str, str]:
    """The environment of a fresh node: every kernel cache (runtime/kcache.py) and their root in `folder`, set
    explicitly (a value the bench's own environment holds would win over a root alone)."""
    from remote_payload.runtime import kcache
    return {kcache.ROOT_ENV: str(folder), **kcache.paths(folder)}


def warm_caches(argv: list[str], env: dict[str, str]) -> None:
    """`python -m remote_payload warm --only eval` for the eval's drafter and device into `env`'s caches (what
    `reval sync --warm` does on a fresh node), untimed."""
    a = ["--only", "eval", "--drafter", argv[argv.index("--drafter") + 1], "--device", argv[argv.index("--device") + 1]]
    p = subprocess.run([sys.executable, "-m", "remote_payload", "warm", *a], check=False, env={**_env(), **env},
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"warm exited {p.returncode}:\n{p.stdout[-3000:]}")


def bench_process(ddir: Path, tdir: Path, cfg: DrafterConfig, dev: torch.device, dtype: torch.dtype,
                  raw_s: float, root: Path) -> list:
    from remote_payload.tools.benchrows import Row
    cache = write_cache(cfg, root, dev, dtype)
    argv = eval_argv(ddir, tdir, cache, dev)
    init_once(dev)  # the interpreter's files into the page cache, as the eval runs will find them
    warm = warm_eval_s(argv)[0]
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    seen: dict[str, list] = {}
    for _r, label, w, t in rounds(argv, dev, root, REPEATS):
        seen.setdefault(label, []).append((w, t))
    inits = [w for w, _ in seen.pop("init")]
    init = statistics.median(inits)
    floor = init + raw_s + warm
    rows = [Row("process: torch + CUDA init", 0, init, 0, f"bare interpreter, median of {len(inits)} runs "
                f"between the evals ({', '.join(f'{x:.2f}' for x in inits)}s)"),
            Row("process: warm eval stage in-process", 0, warm, 0, "evaluate()'s eval stage, 2nd of 2 runs"),
            Row("process: floor", 0, floor, 0, f"init + raw read {raw_s:.2f}s + warm eval")]
    for label, runs in seen.items():
        runs.sort(key=lambda r: r[0])
        wall, t = runs[len(runs) // 2]  # the median run: one lucky run is no claim
        walls = ", ".join(f"{w:.2f}" for w, _ in runs)
        rows.append(Row(f"process: `eval` wall, {label}, median of {len(runs)}", 0, wall, 0,
                        f"= {wall / floor:.2f}x floor (runs {walls}s); load {t['load_s']:.2f}s, eval stage "
                        f"{t['eval_s']:.2f}s = {t['eval_s'] / warm:.2f}x warm in-process, warm-up "
                        f"{t['warm_up'] or 'none'}"))
    return rows
