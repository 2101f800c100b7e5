"""The GPU paths, run on a CUDA machine with `make test-gpu` (CI has no GPU; `make test` does not collect
this folder, see tests/conftest.py). Each compares the CUDA path with the CPU reference."""
from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import load_file

from remote_payload import metrics as m
from remote_payload.__main__ import main as payload_main
from remote_payload.safetensors_io import read_header, read_tensors
from tests.test_metrics import random_targets, sorted_logprobs
from tests.test_safetensors_io import st_file  # noqa: F401 (fixture)

assert torch.cuda.is_available(), "tests/gpu needs a CUDA device (run it with make test-gpu on a GPU host)"


def test_ddtree_vectorised_on_cuda_equals_heap():
    rng = np.random.default_rng(6)
    n, depth, k = 64, 15, 128
    lp = torch.tensor(sorted_logprobs(rng, (n, depth, k)), dtype=torch.float32).to(torch.bfloat16).float()
    ranks = random_targets(rng, n, depth, k)
    got = m.ddtree_accept_lengths(lp.cuda(), torch.tensor(ranks).cuda(), [1, 16, 128])
    for b in (1, 16, 128):
        assert got[b].tolist() == [m.ddtree_accept_heap(lp[j].numpy(), ranks[j], b) for j in range(n)], b


def test_cuda_reader_equals_load_file(st_file):  # noqa: F811
    ref = load_file(st_file)
    for staging_bytes in (100, 1 << 20):
        got = read_tensors(read_header(st_file), list(ref), device="cuda", staging_bytes=staging_bytes)
        for k, v in ref.items():
            assert got[k].is_cuda and torch.equal(got[k].cpu(), v), k
    bf = read_tensors(read_header(st_file), ["bf16"], device="cuda", dtype=torch.float32)["bf16"]
    assert bf.dtype == torch.float32 and torch.equal(bf.cpu(), ref["bf16"].float())


def test_eval_on_cuda_fp32_equals_cpu_and_bf16_is_close(trained_fixtures, tmp_path):
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    p = {k: str(trained_fixtures / v) for k, v in meta["paths"].items() if isinstance(v, str)}
    res = {}
    for dev, dt in (("cpu", "fp32"), ("cuda", "fp32"), ("cuda", "bf16")):
        out = tmp_path / f"{dev}-{dt}"
        assert payload_main(["eval", "--drafter", p["drafter_good"], "--target", p["target"], "--cache", p["cache"],
                             "--run-dir", str(out), "--device", dev, "--dtype", dt]) == 0
        res[dev, dt] = json.loads((out / "results.json").read_text())
    cpu, gpu, bf = res["cpu", "fp32"], res["cuda", "fp32"], res["cuda", "bf16"]
    assert [p["acceptance_lengths"] for p in gpu["per_prompt"]] == [p["acceptance_lengths"] for p in cpu["per_prompt"]]
    assert gpu["metrics"]["ddtree_tau"] == cpu["metrics"]["ddtree_tau"]
    assert abs(bf["metrics"]["tau"] - cpu["metrics"]["tau"]) < 0.1 * cpu["metrics"]["tau"]
    assert abs(bf["metrics"]["position_1_accuracy"] - cpu["metrics"]["position_1_accuracy"]) < 0.02
