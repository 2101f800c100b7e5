"""`python -m remote_payload warm` on a GPU: every step runs (tiny drafter and target classes), the NVRTC cubin
and Triton's kernels land in the caches under REVAL_KERNEL_CACHES, and a second run reads the cubin back."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from remote_payload.runtime import kcache
from remote_payload.tools.bench import PRESETS
from remote_payload.tools.bench_extract import TINY

assert torch.cuda.is_available(), "tests/gpu needs a CUDA device"
ROOT = Path(__file__).resolve().parents[2]


def test_warm_fills_the_caches_it_names(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({**TINY, "model_type": "qwen3"}))
    caches = tmp_path / "caches"
    env = {k: v for k, v in os.environ.items() if k not in kcache.VARIABLES}
    env[kcache.ROOT_ENV] = str(caches)
    argv = [sys.executable, "-m", "remote_payload", "warm", "--drafter", str(tmp_path / "d"), "--target",
            str(tmp_path / "t")]
    first = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    lines = first.stdout.splitlines()
    assert lines[-1].startswith("warmed in ") and "failed" not in first.stdout, first.stdout
    assert any(x.startswith("[1/3] reval's CUDA C passes: compiled by NVRTC in ") for x in lines), first.stdout
    assert list((caches / "reval").glob("*.cubin")) and any(p.is_file() for p in (caches / "triton").rglob("*"))
    again = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert "[1/3] reval's CUDA C passes: from the kernel cache" in again.stdout, again.stdout
