"""eval/early.py on a GPU: `python -m remote_payload eval` makes the device's context and reads or compiles the CUDA
C cubin beside torch's import; the eval then uses that cubin (the log says so), its numbers equal those of an eval
with REVAL_EARLY=0, and a fresh kernel cache is filled by the early thread."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from remote_payload.contract.drafterconfig import DrafterConfig
from remote_payload.runtime import kcache
from remote_payload.tools import bench, bench_process

assert torch.cuda.is_available(), "tests/gpu needs a CUDA device"
ROOT = Path(__file__).resolve().parents[2]


def _eval(tmp: Path, ddir, tdir, cache, name: str, env: dict) -> tuple[str, dict]:
    run_dir = tmp / name
    argv = [sys.executable, "-m", "remote_payload", "eval", "--drafter", str(ddir), "--target", str(tdir),
            "--cache", str(cache), "--max-blocks", "4", "--device", "cuda", "--run-dir", str(run_dir)]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode in (0, 1), p.stdout[-3000:] + p.stderr[-3000:]  # 1: random weights are a suspect result
    return p.stdout, json.loads((run_dir / "results.json").read_text())


def test_the_early_thread_compiles_the_cubin_the_eval_then_uses(tmp_path):
    cfg = DrafterConfig.from_dict(bench.PRESETS["tiny"], source="tiny")
    dev = torch.device("cuda")
    ddir, tdir = bench.write_checkpoint(cfg, tmp_path, dev, torch.bfloat16)
    cache = bench_process.write_cache(cfg, tmp_path, dev, torch.bfloat16,
                                      {"prompts": 2, "prompt_len": 16, "completion": 64, "max_blocks": 4})
    env = {k: v for k, v in os.environ.items() if k not in kcache.VARIABLES and k != "REVAL_EARLY"}
    env[kcache.ROOT_ENV] = str(tmp_path / "caches")
    first, r1 = _eval(tmp_path, ddir, tdir, cache, "first", env)
    assert "CUDA C kernels (compiled by NVRTC in " in first and "beside the imports" in first, first[-2000:]
    assert list((tmp_path / "caches" / "reval").glob("*.cubin"))
    again, r2 = _eval(tmp_path, ddir, tdir, cache, "again", env)
    assert "CUDA C kernels (from the kernel cache beside the imports)" in again, again[-2000:]
    off, r3 = _eval(tmp_path, ddir, tdir, cache, "off", {**env, "REVAL_EARLY": "0"})
    assert "CUDA C kernels (from the kernel cache)" in off, off[-2000:]
    lengths = [[p["acceptance_lengths"] for p in r["per_prompt"]] for r in (r1, r2, r3)]
    assert lengths[0] == lengths[1] == lengths[2] and r1["metrics"]["tau"] == r3["metrics"]["tau"]
