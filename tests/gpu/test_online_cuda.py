"""`eval --online` on CUDA: the online decoder (real speculative decoding with the whole target) against the
offline walk of the same eval process — every round equal in fp32; in bf16 the agreement is reported (near-ties
may differ) and must be most of the rounds."""
from __future__ import annotations

import json

import pytest
import torch

from remote_payload.__main__ import main as payload_main

assert torch.cuda.is_available(), "tests/gpu needs a CUDA device"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eval_online_on_cuda_equals_the_offline_walk(trained_fixtures, tmp_path, dtype):
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    p = {k: trained_fixtures / v for k, v in meta["paths"].items() if isinstance(v, str)}
    run = tmp_path / "runs" / dtype
    assert payload_main(["eval", "--drafter", str(p["drafter_good"]), "--target", str(p["target"]), "--cache",
                         str(p["cache"]), "--device", "cuda", "--dtype", dtype, "--num-prompts", "6",
                         "--max-blocks", "8", "--online", "6", "--speedup", "--run-dir", str(run)]) == 0
    res = json.loads((run / "results.json").read_text())
    on, sp = res["online"], res["speedup"]
    assert on["prompts"] == 6 and on["rounds"] > 0 and on["spec_s"] > 0 and on["target_only_s"] > 0
    if dtype == "fp32":
        assert on["rounds_agreeing"] == on["rounds"] and on["prompts_agreeing"] == 6
    else:
        assert on["rounds_agreeing"] >= 0.9 * on["rounds"], on
    assert sp["regime"] == "cuda-graphs" and sp["projected"]["block"] > 0 and on["projected_speedup"] > 0
