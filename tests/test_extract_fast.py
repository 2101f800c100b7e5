"""extract's fast path (issue 20): the feature prefill by hooks on the tapped blocks only (prefill_batch), the argmax
agreement and the generation record in cache.json, extract over several processes (`--gpus cpu,cpu`: the merged
cache is the one-process cache byte for byte, resume included), and eval showing and judging the agreement.

On the trained tiny Qwen3 fixture target (5 blocks: layer 4 is the last, whose hs[5] HF returns after the final
norm), CPU, fp32. The reference for the features is the prefill extract ran before (output_hidden_states=True:
`bench_extract.tapped_features_all_layers`)."""
from __future__ import annotations

import json
import multiprocessing
import shutil

import pytest
import torch
from safetensors.torch import load_file

from remote_payload.__main__ import main as payload_main
from remote_payload.contract import results as R
from remote_payload.contract.errors import PayloadError
from remote_payload.eval.cache import open_cache
from remote_payload.extract import prefill as P
from remote_payload.extract.command import extract
from remote_payload.extract.decode import choose_generator, greedy_complete_batch, static_refusal
from remote_payload.extract.prefill import prefill_batch
from remote_payload.target.forward import greedy_complete
from remote_payload.target.load import eos_ids_of, load_target
from remote_payload.tools.bench_extract import tapped_features_all_layers
from tests.runtools import stop_after

LAYERS = [1, 2, 4]  # 4: the last block (after the final norm, as HF returns it)
# prompts of different lengths (so batches pad), in the fixture target's language
TEXTS = [("fizz", "fizzbuzz n01 n02"), ("count-long", "count n07 n08 n09 n10 n11 n12 n13 n14 n15"),
         ("skip", "skip n03 n06 n09"), ("pattern", "pattern p1 moon"),
         ("countdown-long", "countdown n15 n14 n13 n12 n11 n10"), ("skip-long", "skip n05 n09 n13 n17 n21 n25"),
         ("count", "count n22 n23")]
NEW = 16


@pytest.fixture(scope="module")
def fx(trained_fixtures):
    return trained_fixtures


@pytest.fixture(scope="module")
def model(fx):
    return load_target(fx / "target", torch.device("cpu"), torch.float32)


def _seqs(vocab: int, lengths, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g) for n in lengths]


def _prompts(path, texts=TEXTS):
    path.write_text("".join(json.dumps({"name": n, "prompt": t}) + "\n" for n, t in texts))
    return path


def _extract(fx, prompts, out, log=lambda line: None, **kw):
    return extract(fx / "target", prompts, out, **{"max_new_tokens": NEW, "layer_ids": LAYERS, "log": log,
                                                   **({} if "gpus" in kw else {"device": "cpu"}), **kw})



def _same_bytes(a, b, *, rounding: bool = False):
    """Two caches are one: every file byte for byte, cache.json field for field but its created_at. With
    `rounding`, for caches whose batches held other prompts (a resume batches what is left): the token ids byte
    for byte and the features equal up to fp32 rounding (rtol 1e-5), since a batch's padded shape changes how
    the CPU's matmuls block their sums."""
    files = sorted(f.name for f in a.iterdir())
    assert files == sorted(f.name for f in b.iterdir())
    ja, jb = json.loads((a / "cache.json").read_text()), json.loads((b / "cache.json").read_text())
    assert ja.pop("created_at") and jb.pop("created_at")
    assert ja == jb
    for f in files:
        if f == "cache.json":
            continue
        if not rounding:
            assert (a / f).read_bytes() == (b / f).read_bytes(), f
            continue
        ta, tb = load_file(a / f), load_file(b / f)
        assert ta.keys() == tb.keys() and torch.equal(ta["ids"], tb["ids"]), f
        torch.testing.assert_close(ta["features"], tb["features"], rtol=1e-5, atol=1e-6, msg=f)


# ---- the hooked prefill ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [[1, 2, 3, 4], [0, 2], [4], [3, 1], [0]])
def test_hooked_prefill_is_the_output_hidden_states_path_and_runs_only_what_it_needs(model, layers):
    seqs = _seqs(model.config.vocab_size, (30, 17, 44, 5))
    blocks, ran = model.model.layers, []
    hooks = [b.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, b in enumerate(blocks)]
    hooks.append(model.lm_head.register_forward_hook(lambda m, a, o: ran.append("lm_head")))
    try:
        got = prefill_batch(model, seqs, layers)
        first = list(ran)
        ran.clear()
        with_agreement = prefill_batch(model, seqs, layers, prompt_lens=[10, 5, 20, 2])
        second = list(ran)
    finally:
        for h in hooks:
            h.remove()
    want = tapped_features_all_layers(model, seqs, layers)
    for a, b, c in zip(got.rows(), with_agreement.rows(), want):
        assert torch.equal(a, c) and torch.equal(b, c)  # the same numbers, bit for bit, every layer
    # without the agreement, the blocks after the last tapped one never run (the last block: up to the final norm)
    assert first == list(range(max(layers) + 1))
    # the agreement needs the final norm: every block runs; the lm_head never runs over the whole sequence
    assert second[:5] == [0, 1, 2, 3, 4] and all(x == "lm_head" for x in second[5:])


def test_a_model_whose_blocks_are_not_found_gets_the_same_numbers(model, monkeypatch):
    seqs = _seqs(model.config.vocab_size, (12, 30))
    hooked = prefill_batch(model, seqs, LAYERS, prompt_lens=[4, 9])
    monkeypatch.setattr(P, "_decoder_stack", lambda m: None)  # the output_hidden_states fallback
    plain = prefill_batch(model, seqs, LAYERS, prompt_lens=[4, 9])
    assert torch.equal(hooked.features, plain.features) and torch.equal(hooked.agree, plain.agree)


def test_agreement_counts_the_positions_where_the_argmax_is_the_next_token(model):
    prompts = [s.tolist() for s in _seqs(model.config.vocab_size, (3, 9, 6), seed=1)]
    seqs = [torch.tensor(greedy_complete_batch(model, [p], 20, set())[0]) for p in prompts]
    exact = prefill_batch(model, seqs, [0], [len(p) for p in prompts])
    assert exact.agree.tolist() == [[20, 20]] * 3  # the target's own greedy tokens (fp32: no near-ties here)
    bad = [s.clone() for s in seqs]
    bad[0][len(prompts[0]) + 2] = (bad[0][len(prompts[0]) + 2] + 1) % model.config.vocab_size
    bad[2][-5:] = 7
    got = prefill_batch(model, bad, [0], [len(p) for p in prompts], chunk_logits=7 * model.config.vocab_size)
    for i, (s, p) in enumerate(zip(bad, prompts)):  # what a full forward's argmax says, position by position
        with torch.no_grad():
            pred = model(s[None]).logits[0, len(p) - 1:-1].argmax(-1)
        assert got.agree[i].tolist() == [int((pred == s[len(p):]).sum()), len(s) - len(p)]
    assert got.agree[0, 0] < 20 and got.agree[1, 0] == 20 and got.agree[2, 0] < 20


# ---- extract: batched + hooked == batch-1 == the old path; the record ------------------------------------------
def test_fast_extraction_equals_batch_1_and_the_old_path_and_records_how(fx, model, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl")
    one = _extract(fx, prompts, tmp_path / "one", batch_size=1)
    many = _extract(fx, prompts, tmp_path / "many", batch_size=4)  # 2 batches, each padded
    assert len({p.prompt_len for p in one.prompts}) > 2  # the batches pad
    eos = eos_ids_of(fx / "target")
    for i, p in enumerate(one.prompts):
        (ids, f1), (ids_m, fm) = one.load(i), many.load(i)
        assert ids.tolist() == ids_m.tolist() == \
            greedy_complete(model, ids[:p.prompt_len], NEW, eos).tolist()  # the dynamic-cache reference, batch 1
        old = tapped_features_all_layers(model, [ids], LAYERS)[0].reshape(p.seq_len, -1)
        assert torch.equal(f1, old)  # batch 1: the old prefill's numbers exactly
        torch.testing.assert_close(fm, old, rtol=1e-5, atol=1e-5)  # batched: padded shapes, fp32 rounding
    for c, bs in ((one, 1), (many, 4)):
        gen = c.meta["generation"]
        assert gen["generator"] == "greedy_static" and gen["cuda_graphs"] is False and gen["batch_size"] == bs
        assert gen["dtype"] == "float32" and gen["attn_implementation"] and gen["device"] == "cpu"
        assert gen["compiled"] is False and gen["decode_attention"].startswith("reval_grouped_decode")
        assert gen["torch"] == torch.__version__ and gen["transformers"] and gen["max_new_tokens"] == NEW
        positions = sum(p.seq_len - p.prompt_len for p in c.prompts)
        assert c.meta["argmax_agreement"] == {"fraction": 1.0, "matches": positions, "positions": positions}
        assert c.argmax_agreement == 1.0
        assert [q["argmax_agree"] for q in c.meta["prompts"]] == [[p.seq_len - p.prompt_len] * 2 for p in c.prompts]


def test_the_cli_logs_the_generator_and_the_agreement(fx, tmp_path, capsys):
    prompts = _prompts(tmp_path / "p.jsonl", TEXTS[:2])
    rc = payload_main(["extract", "--target", str(fx / "target"), "--prompts", str(prompts), "--out",
                       str(tmp_path / "c"), "--max-new-tokens", "8", "--layers", "1,4", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "generation: greedy_static, attention " in out and "prefill: the tapped layers only" in out
    assert "argmax agreement: the target's argmax is the cached next token at 16 of 16 completion positions" in out


def test_compile_on_the_cpu_is_said_unused_and_recorded_so(fx, tmp_path, capsys):
    """--compile applies to the CUDA graph's step: on the CPU the log says it was not used, the record says
    compiled false, and the cache is the one a run without it writes."""
    prompts = _prompts(tmp_path / "p.jsonl", TEXTS[:2])
    base = ["extract", "--target", str(fx / "target"), "--prompts", str(prompts), "--max-new-tokens", "6",
            "--layers", "1,4", "--device", "cpu"]
    assert payload_main([*base, "--out", str(tmp_path / "a"), "--compile"]) == 0
    assert "(--compile: CUDA graphs only, not used here)" in capsys.readouterr().out
    assert payload_main([*base, "--out", str(tmp_path / "b")]) == 0
    a, b = open_cache(tmp_path / "a"), open_cache(tmp_path / "b")
    assert a.meta["generation"]["compiled"] is False
    assert [a.load(i)[0].tolist() for i in range(2)] == [b.load(i)[0].tolist() for i in range(2)]


def test_a_resume_with_other_settings_keeps_the_earlier_generation_record(fx, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", TEXTS[:4])
    with pytest.raises(KeyboardInterrupt):
        _extract(fx, prompts, tmp_path / "c", batch_size=1, log=stop_after(2, 4))
    c = _extract(fx, prompts, tmp_path / "c", batch_size=4)
    gen = c.meta["generation"]
    assert gen["batch_size"] == 4 and [e["batch_size"] for e in gen["earlier"]] == [1]
    assert c.argmax_agreement == 1.0 and c.meta["argmax_agreement"]["positions"] == 4 * NEW


def test_the_generator_is_greedy_static_where_it_computes_the_same_else_the_reference(fx, tmp_path):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM
    qwen3 = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64))
    assert static_refusal(qwen3) is None and choose_generator(qwen3).name == "greedy_static"
    sliding = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                           use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert "sliding_attention" in static_refusal(sliding)
    # a hybrid (linear-attention) target, as the seeds' Qwen3.5/3.6: extract falls back to greedy_complete_batch
    cfg = Qwen3_5TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, vocab_size=64, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    hybrid = Qwen3_5ForCausalLM(cfg).eval()
    assert "linear_attention" in static_refusal(hybrid)
    hybrid.save_pretrained(tmp_path / "hybrid")
    shutil.copy(fx / "target" / "tokenizer.json", tmp_path / "hybrid" / "tokenizer.json")
    prompts = _prompts(tmp_path / "p.jsonl", TEXTS[:3])
    c = extract(tmp_path / "hybrid", prompts, tmp_path / "c", max_new_tokens=6, layer_ids=[0, 3], device="cpu",
                batch_size=4, log=lambda line: None)
    gen = c.meta["generation"]
    assert gen["generator"] == "greedy_complete_batch" and "linear_attention" in gen["why_not_greedy_static"]
    for i, p in enumerate(c.prompts):  # the hooked prefill on a hybrid equals output_hidden_states too
        ids, feats = c.load(i)
        torch.testing.assert_close(feats, tapped_features_all_layers(hybrid, [ids], [0, 3])[0].reshape(len(ids), -1),
                                   rtol=1e-5, atol=1e-5)
    assert c.argmax_agreement is not None and c.argmax_agreement > 0.9


# ---- several processes -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single(fx, tmp_path_factory):
    """The prompts and their one-process cache (batches of 2), which the multi-process runs must reproduce."""
    d = tmp_path_factory.mktemp("single")
    prompts = _prompts(d / "p.jsonl")
    _extract(fx, prompts, d / "cache", batch_size=2)
    return prompts, d / "cache"


@pytest.mark.slow
def test_two_processes_write_the_one_process_cache(fx, single, tmp_path):
    prompts, one = single
    lines = []
    _extract(fx, prompts, tmp_path / "two", batch_size=2, gpus="cpu,cpu", log=lines.append)
    assert any(line.startswith("loading target") and "2 processes (cpu, cpu" in line for line in lines)
    assert sum(line.startswith("[") for line in lines) == len(TEXTS)
    _same_bytes(one, tmp_path / "two")
    assert open_cache(tmp_path / "two").argmax_agreement == 1.0
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_extract_as_a_process_of_two_workers_ends_by_the_fast_exit_with_its_cache_whole(fx, single, tmp_path):
    """`python -m remote_payload extract --gpus cpu,cpu` leaves by os._exit (no interpreter teardown, no atexit
    hook) only after its workers are joined and the cache is written: the one-process cache byte for byte."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    prompts, one = single
    code = ("import atexit, runpy, sys; atexit.register(lambda: print('TEARDOWN RAN', file=sys.stderr)); "
            "runpy.run_module('remote_payload', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, "extract", "--target", str(fx / "target"), "--prompts",
                        str(prompts), "--out", str(tmp_path / "two"), "--max-new-tokens", str(NEW), "--layers",
                        ",".join(map(str, LAYERS)), "--batch-size", "2", "--gpus", "cpu,cpu"],
                       capture_output=True, text=True, timeout=600, check=False,
                       cwd=Path(__file__).resolve().parents[1],
                       env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert "TEARDOWN RAN" not in p.stderr and "Traceback" not in p.stderr
    assert sum(line.startswith("[") for line in p.stdout.splitlines()) == len(TEXTS)  # every line arrived
    _same_bytes(one, tmp_path / "two")


@pytest.mark.slow
@pytest.mark.parametrize("resume_gpus", ["cpu,cpu", None])
def test_an_interrupted_two_process_run_resumes_to_the_same_cache(fx, single, tmp_path, resume_gpus):
    """Killed after its 3rd prompt: the workers stop, the recorded prompts stay, a resume (by two processes or
    one) finishes the one-process cache."""
    prompts, one = single
    with pytest.raises(KeyboardInterrupt):
        _extract(fx, prompts, tmp_path / "c", batch_size=2, gpus="cpu,cpu", log=stop_after(3, len(TEXTS)))
    assert multiprocessing.active_children() == []  # no worker left behind
    partial = tmp_path / ".c.partial"
    assert not (tmp_path / "c").exists() and len(json.loads((partial / "partial.json").read_text())["prompts"]) == 3
    lines = []
    _extract(fx, prompts, tmp_path / "c", batch_size=2, log=lines.append, **({"gpus": resume_gpus} if resume_gpus
                                                                            else {}))
    assert lines[0].startswith(f"resuming {partial}: 3 of {len(TEXTS)} prompts already extracted")
    assert sum(line.startswith("[") for line in lines) == len(TEXTS) - 3
    _same_bytes(one, tmp_path / "c", rounding=True)  # which 3 prompts the two workers finished first varies


CHAT = ("{%- for m in messages -%}{{- '<|mask|> ' + m.role + ' ' + m.content + ' <|eos|> ' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|mask|> assistant ' -}}{%- endif -%}")


@pytest.mark.slow
def test_multi_turn_over_two_processes_is_the_one_process_cache(fx, tmp_path):
    chat = tmp_path / "chat"
    shutil.copytree(fx / "target", chat)
    (chat / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "<|eos|>", "pad_token": "<|pad|>",
                                                            "chat_template": CHAT}))
    mt = tmp_path / "mt.jsonl"
    mt.write_text("".join(json.dumps(r) + "\n" for r in [
        {"name": "a", "turns": ["count n01 n02", "skip n03 n06 n09"]}, {"name": "b", "turns": ["pattern p1 moon"]},
        {"name": "c", "turns": ["countdown n15 n14", "count n20 n21 n22 n23", "fizzbuzz n01 n02"]}]))
    kw = {"max_new_tokens": 8, "layer_ids": LAYERS, "log": lambda line: None, "batch_size": 2}
    one = extract(chat, mt, tmp_path / "one", device="cpu", **kw)
    extract(chat, mt, tmp_path / "two", gpus="cpu,cpu", **kw)
    assert [p.name for p in one.prompts] == ["a/t1", "a/t2", "b", "c/t1", "c/t2", "c/t3"]
    _same_bytes(tmp_path / "one", tmp_path / "two")


@pytest.mark.parametrize("args, match", [
    (["--gpus", "0"], "--gpus 0: no CUDA device is visible; GPU [0] do not exist"),
    (["--gpus", "0,x"], "expected GPU indices such as 0,1,2,3, or all"),
    (["--gpus", "\u00b2"], "--gpus '\u00b2': expected GPU indices such as 0,1,2,3, or all"),  # isdigit(), not int()
    (["--gpus", "\u0663"], "expected GPU indices such as 0,1,2,3"),  # int() reads Arabic-Indic 3 as 3
    (["--gpus", "0, 0"], "--gpus '0, 0': GPU 0 is given twice; name each GPU once"),
    (["--gpus", "all"], "--gpus all: no CUDA device is visible"),
    (["--gpus", "cuda:0,cuda:0"], "--gpus 'cuda:0,cuda:0': cuda:0 is not visible on this host (0 CUDA devices)"),
    (["--gpus", "cpu,cpu", "--device", "cpu"], "give one of them"),
    (["--shard"], "--shard spreads the target over several GPUs: name them, e.g. --gpus 0,1 --shard"),
    (["--gpus", "cpu,cpu", "--shard"], "--shard spreads the target over several GPUs"),
])
def test_bad_gpus_and_shard_are_one_line_before_loading(fx, tmp_path, capsys, monkeypatch, args, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the messages of a host without GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    prompts = _prompts(tmp_path / "p.jsonl", TEXTS[:1])
    rc = payload_main(["extract", "--target", str(fx / "target"), "--prompts", str(prompts), "--out",
                       str(tmp_path / "c"), "--max-new-tokens", "4", "--layers", "1", *args])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 3 and len(out) == 1 and out[0].startswith("error: ") and match in out[0], out
    assert not (tmp_path / "c").exists()
    with pytest.raises(PayloadError, match="expected GPU indices"):
        extract(fx / "target", prompts, tmp_path / "c", max_new_tokens=4, layer_ids=[1], gpus="")


# ---- eval shows the agreement, and marks a cache below 0.99 -------------------------------------------------------
def test_eval_shows_the_agreement_and_marks_a_cache_below_0_99(fx, tmp_path, capsys):
    meta = json.loads((fx / "fixtures.json").read_text())
    good = fx / meta["paths"]["drafter_good"]
    prompts = _prompts(tmp_path / "p.jsonl", TEXTS[:3])
    extract(fx / "target", prompts, tmp_path / "cache", max_new_tokens=48, layer_ids=meta["cache_layers"],
            device="cpu", log=lambda line: None)

    def run(cache, name):
        capsys.readouterr()
        rc = payload_main(["eval", "--drafter", str(good), "--target", str(fx / "target"), "--cache", str(cache),
                           "--run-dir", str(tmp_path / "runs" / name), "--name", name, "--device", "cpu",
                           "--max-blocks", "4"])
        res = R.Result.load(tmp_path / "runs" / name / "results.json")
        return rc, capsys.readouterr().out, res

    rc, out, res = run(tmp_path / "cache", "exact")
    assert rc == 0 and "cache: argmax agreement 1.0000: the target's argmax is the cached next token" in out
    assert "completions by greedy_static, float32" in out
    assert res.cache.argmax_agreement == 1.0 and not res.health.suspect

    crafted = tmp_path / "crafted"
    shutil.copytree(tmp_path / "cache", crafted)
    c = json.loads((crafted / "cache.json").read_text())
    c["argmax_agreement"]["fraction"] = 0.9
    (crafted / "cache.json").write_text(json.dumps(c))
    rc, out, res = run(crafted, "crafted")
    assert rc == 0 and "SUSPECT RESULT — cache argmax agreement 0.9000 < 0.99" in out
    assert res.cache.argmax_agreement == 0.9 and res.health.suspect
    assert res.health.reasons == [("cache argmax agreement 0.9000 < 0.99: its tokens are not what its hidden "
                                   "states predict")]

    # a cache from before the record: said, and null in results.json
    del c["argmax_agreement"]
    (crafted / "cache.json").write_text(json.dumps(c))
    rc, out, res = run(crafted, "older")
    assert rc == 0 and "cache: argmax agreement not recorded" in out
    assert res.cache.argmax_agreement is None and not res.health.suspect
