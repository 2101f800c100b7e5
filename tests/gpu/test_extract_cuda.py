"""extract on CUDA: greedy_static with its CUDA graph as the generator, the hooked prefill (bit for bit the
output_hidden_states prefill), the features copied to the host off the compute stream, the argmax agreement, and
`--gpus` (two processes: on GPUs 0 and 1 where there are two, else both on GPU 0) writing the one-process cache
byte for byte."""
from __future__ import annotations

import json

import pytest
import torch

from remote_payload.extract.command import extract
from remote_payload.extract.prefill import prefill_batch
from remote_payload.target.forward import greedy_complete
from remote_payload.target.load import eos_ids_of, load_target
from remote_payload.tools import fixtures
from remote_payload.tools.bench_extract import tapped_features_all_layers

assert torch.cuda.is_available(), "tests/gpu needs a CUDA device"
LAYERS = [1, 2, 4]  # 4: the last block of the fixture target (after the final norm)


def _prompts(path, n=6):
    path.write_text("".join(json.dumps({"name": name, "prompt": text}) + "\n" for name, text in fixtures.PROMPTS[:n]))
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hooked_prefill_on_cuda_is_the_output_hidden_states_path_bit_for_bit(trained_fixtures, dtype):
    model = load_target(trained_fixtures / "target", torch.device("cuda"), dtype)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, model.config.vocab_size, (n,), generator=g) for n in (30, 17, 90, 5)]
    for layers in ([1, 2, 3, 4], [0, 2], [4]):
        want = tapped_features_all_layers(model, seqs, layers)
        for got in (prefill_batch(model, seqs, layers), prefill_batch(model, seqs, layers, [3, 3, 3, 3])):
            assert all(torch.equal(a, b) for a, b in zip(got.rows(), want)), layers


def test_extract_on_cuda_fp32_equals_the_batch_1_references(trained_fixtures, tmp_path):
    t = trained_fixtures / "target"
    c = extract(t, _prompts(tmp_path / "p.jsonl"), tmp_path / "c", max_new_tokens=40, layer_ids=LAYERS,
                device="cuda", dtype="fp32", batch_size=4, log=print)
    gen = c.meta["generation"]
    assert gen["generator"] == "greedy_static" and gen["cuda_graphs"] is True and gen["device"] != "cuda"
    model = load_target(t, torch.device("cuda"), torch.float32)
    for i, p in enumerate(c.prompts):
        ids, feats = c.load(i)
        assert ids.tolist() == greedy_complete(model, ids[:p.prompt_len].cuda(), 40, eos_ids_of(t)).tolist()
        want = tapped_features_all_layers(model, [ids], LAYERS)[0].reshape(p.seq_len, -1).cpu()
        torch.testing.assert_close(feats, want, rtol=1e-4, atol=1e-4)
    assert c.argmax_agreement == 1.0


def test_two_processes_on_cuda_write_the_one_process_cache(trained_fixtures, tmp_path):
    t, prompts = trained_fixtures / "target", _prompts(tmp_path / "p.jsonl", 10)
    kw = {"max_new_tokens": 40, "layer_ids": LAYERS, "dtype": "bf16", "batch_size": 3, "log": print}
    extract(t, prompts, tmp_path / "one", device="cuda:0", **kw)
    extract(t, prompts, tmp_path / "two", gpus="0,1" if torch.cuda.device_count() > 1 else "cuda:0,cuda:0",
            **kw)  # --gpus 0,0 is refused as a duplicate; named devices may repeat
    a, b = tmp_path / "one", tmp_path / "two"
    files = sorted(f.name for f in a.iterdir())
    assert files == sorted(f.name for f in b.iterdir())
    ja, jb = json.loads((a / "cache.json").read_text()), json.loads((b / "cache.json").read_text())
    ja.pop("created_at"), jb.pop("created_at")
    assert ja == jb and ja["generation"]["dtype"] == "bfloat16" and ja["argmax_agreement"]["fraction"] > 0.95
    for f in files:
        if f != "cache.json":
            assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_extract_compile_on_cuda_fp32_equals_the_batch_1_references(trained_fixtures, tmp_path):
    """--compile: the CUDA graph's step traced through torch.compile; in fp32 the tokens are still the
    dynamic-cache decoder's, batch 1, and the record says compiled."""
    t = trained_fixtures / "target"
    c = extract(t, _prompts(tmp_path / "p.jsonl", n=4), tmp_path / "c", max_new_tokens=24, layer_ids=LAYERS,
                device="cuda", dtype="fp32", batch_size=4, compile=True, log=print)
    gen = c.meta["generation"]
    assert gen["compiled"] is True and gen["cuda_graphs"] is True
    assert gen["decode_attention"].startswith("reval_grouped_decode")
    model = load_target(t, torch.device("cuda"), torch.float32)
    eos = eos_ids_of(t)
    for i, p in enumerate(c.prompts):
        ids, _ = c.load(i)
        assert ids.tolist() == greedy_complete(model, ids[:p.prompt_len].cuda(), 24, eos).tolist()
