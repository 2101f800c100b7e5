"""remote_payload.extract: extraction on a tiny random Qwen3 target vs a direct forward."""
from __future__ import annotations

import json

import pytest
import torch

from remote_payload.__main__ import main as payload_main
from remote_payload.eval.cache import open_cache
from remote_payload.tools import fixtures
from tests.tiny_models import fixture_recipe_target

LAYERS = [0, 2, 4]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A random-init tiny Qwen3 (5 layers, H=64) saved in shards, with a trained WordLevel tokenizer."""
    path, tok, model = fixture_recipe_target(tmp_path_factory.mktemp("target") / "target")
    return path, tok, model.eval()


def _reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy without a KV cache: argmax of a full forward each step."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def test_extract_matches_direct_forward(tiny_target, tmp_path, capsys):
    target, tok, model = tiny_target
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"name": n, "prompt": p}) for n, p in fixtures.PROMPTS[:3]) + "\n")
    out = tmp_path / "cache"
    rc = payload_main(["extract", "--target", str(target), "--prompts", str(prompts), "--out", str(out),
                       "--max-new-tokens", "12", "--layers", ",".join(map(str, LAYERS)), "--device", "cpu",
                       "--num-prompts", "2"])
    assert rc == 0
    assert "[2/2] count-07: 15 tokens" in capsys.readouterr().out
    c = open_cache(out)
    assert c.layer_ids == LAYERS and c.hidden_size == 64 and c.dtype == "float32" and len(c) == 2
    assert c.meta["target"]["path"] == str(target.resolve())
    for i, (name, text) in enumerate(fixtures.PROMPTS[:2]):
        p_ids = tok.encode(text).ids
        ids, feats = c.load(i)
        assert c.prompts[i].name == name and c.prompts[i].prompt_len == len(p_ids)
        assert ids.tolist() == _reference_greedy(model, p_ids, 12)
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
        assert len(hs) == 6  # embeddings + 5 blocks: hs[l+1] is block l's output
        want = torch.cat([hs[l + 1][0] for l in LAYERS], -1)
        torch.testing.assert_close(feats, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(feats[:, :64], hs[0][0])  # not the embeddings (the +1 offset)


def test_extract_stops_at_eos(tiny_target, tmp_path):
    target, tok, model = tiny_target
    p_ids = tok.encode("count n07 n08").ids
    first = _reference_greedy(model, p_ids, 1)[-1]
    t2 = tmp_path / "t2"
    t2.mkdir()
    for f in target.iterdir():
        (t2 / f.name).symlink_to(f)
    (t2 / "generation_config.json").unlink()
    (t2 / "generation_config.json").write_text(json.dumps({"eos_token_id": [first, 999]}))
    (tmp_path / "p.txt").write_text("count n07 n08\n")
    c = payload_main(["extract", "--target", str(t2), "--prompts", str(tmp_path / "p.txt"), "--out",
                      str(tmp_path / "c"), "--max-new-tokens", "30", "--layers", "1", "--device", "cpu"])
    assert c == 0
    cache = open_cache(tmp_path / "c")
    assert cache.prompts[0].name == "prompt-000"
    assert cache.load(0)[0].tolist() == p_ids + [first]


@pytest.mark.parametrize("case, match", [
    ("empty_prompts", "holds no prompts"),
    ("bad_layer", "layer ids [5] >= the target's 5 layers"),
    ("no_tokenizer", "no tokenizer.json"),
    ("no_weights", "no weights"),
    ("no_config", "no config.json"),
    ("bad_layers_arg", "expected comma-separated layer ids"),
    ("out_exists", "already exists"),
    ("zero_prompts", "--num-prompts 0: need at least 1"),
])
def test_extract_bad_input_one_line_exit_3(tiny_target, tmp_path, capsys, case, match):
    target, _, _ = tiny_target
    t = tmp_path / "t"
    t.mkdir()
    for f in target.iterdir():
        drop = {"no_tokenizer": "tokenizer.json", "no_config": "config.json"}.get(case)
        if f.name == drop or (case == "no_weights" and f.name.startswith("model")):
            continue
        (t / f.name).symlink_to(f)
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n\n" if case == "empty_prompts" else "count n01\n")
    layers = {"bad_layer": "1,5", "bad_layers_arg": "1,x"}.get(case, "1,2")
    if case == "out_exists":
        (tmp_path / "c").mkdir()
        (tmp_path / "c" / "keep").write_text("x")
    rc = payload_main(["extract", "--target", str(t), "--prompts", str(prompts), "--out", str(tmp_path / "c"),
                       "--max-new-tokens", "4", "--layers", layers, "--device", "cpu"]
                      + (["--num-prompts", "0"] if case == "zero_prompts" else []))
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 3
    assert len(out) == 1 and out[0].startswith("error: ") and match in out[0]  # one line: nothing was loaded
    if case == "out_exists":
        assert [f.name for f in (tmp_path / "c").iterdir()] == ["keep"]
    else:
        assert not (tmp_path / "c").exists()
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []  # no temp dir left


def test_greedy_complete_on_a_hybrid_linear_attention_target():
    """Qwen3.5/3.6 targets (the seeds' 27B) mix linear and full attention: their KV cache needs the config.
    Incremental greedy decoding must equal a full recompute at every step."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from remote_payload.target.forward import greedy_complete
    cfg = Qwen3_5TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, vocab_size=64)
    assert "linear_attention" in cfg.layer_types
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).eval()
    ids = torch.tensor([1, 2, 3, 4, 5])
    ref = ids.tolist()
    with torch.no_grad():
        for _ in range(8):
            ref.append(int(model(torch.tensor([ref])).logits[0, -1].argmax()))
    assert greedy_complete(model, ids, 8, set()).tolist() == ref


def _extract(target, prompts, out, *extra, log=lambda line: None):
    from remote_payload.extract.command import extract
    kw = {"max_new_tokens": 10, **dict(extra)}
    return extract(target, prompts, out, layer_ids=LAYERS, device="cpu", log=log, **kw)


def _same_cache(a, b):
    assert [vars(p) for p in a.prompts] == [vars(p) for p in b.prompts]
    for i in range(len(a)):
        (ia, fa), (ib, fb) = a.load(i), b.load(i)
        assert ia.tolist() == ib.tolist()
        torch.testing.assert_close(fa, fb, rtol=1e-5, atol=1e-5)


def test_batched_extraction_writes_the_batch_1_cache(tiny_target, tmp_path):
    """Prompts of different lengths in one batch (left-padded generation, right-padded prefill) and split
    over batches by the token budget: the same ids and features as one prompt at a time."""
    target, tok, _ = tiny_target
    prompts = tmp_path / "p.jsonl"
    chosen = fixtures.PROMPTS[:6]
    assert len({len(tok.encode(t).ids) for _, t in chosen}) > 1  # lengths differ: padding is exercised
    prompts.write_text("".join(json.dumps({"name": n, "prompt": t}) + "\n" for n, t in chosen))
    one = _extract(target, prompts, tmp_path / "one", ("batch_size", 1))
    many = _extract(target, prompts, tmp_path / "many", ("batch_size", 8))
    split = _extract(target, prompts, tmp_path / "split", ("batch_size", 8), ("batch_tokens", 60))
    assert [c.prompts[0].name for c in (one, many, split)] == [chosen[0][0]] * 3  # prompt order, not batch order
    _same_cache(one, many)
    _same_cache(one, split)


def test_interrupted_extraction_resumes_and_never_reads_half_written(tiny_target, tmp_path):
    target, _, _ = tiny_target
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"name": n, "prompt": t}) + "\n" for n, t in fixtures.PROMPTS[:5]))
    out = tmp_path / "cache"

    def stop_after_3(line):
        if line.startswith("[3/5]"):
            raise KeyboardInterrupt  # as if the run were killed after its 3rd prompt
    with pytest.raises(KeyboardInterrupt):
        _extract(target, prompts, out, ("batch_size", 2), log=stop_after_3)
    partial = tmp_path / ".cache.partial"
    assert not out.exists() and partial.is_dir()  # nothing that open_cache would read as a cache
    state = json.loads((partial / "partial.json").read_text())
    assert len(state["prompts"]) == 3
    # a file cut short after it was listed, and a stray half-written one: both are extracted again
    victim = partial / state["prompts"][0]["file"]
    victim.write_bytes(victim.read_bytes()[:100])
    (partial / "p0004.safetensors.part").write_bytes(b"half")
    lines = []
    c = _extract(target, prompts, out, ("batch_size", 2), log=lines.append)
    assert lines[0].startswith(f"resuming {partial}: 2 of 5 prompts already extracted")
    assert sum(line.startswith("[") for line in lines) == 3  # the 3 not done, nothing twice
    assert not partial.exists()
    _same_cache(c, _extract(target, prompts, tmp_path / "fresh", ("batch_size", 5)))
    # the same --out with other options refuses to mix two runs' prompts
    with pytest.raises(KeyboardInterrupt):
        _extract(target, prompts, tmp_path / "c2", log=stop_after_3)
    from remote_payload.contract.errors import PayloadError
    with pytest.raises(PayloadError, match="started with other inputs"):
        _extract(target, prompts, tmp_path / "c2", ("max_new_tokens", 11))


def test_batched_greedy_on_a_hybrid_linear_attention_target_equals_batch_1():
    """Left padding must not leak into the linear-attention (recurrent) layers of Qwen3.5/3.6 targets."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from remote_payload.extract.decode import greedy_complete_batch
    from remote_payload.target.forward import greedy_complete
    cfg = Qwen3_5TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, vocab_size=64)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3, 1, 4, 1]]
    got = greedy_complete_batch(model, prompts, 8, set())
    assert got == [greedy_complete(model, torch.tensor(p), 8, set()).tolist() for p in prompts]


@pytest.mark.parametrize("layout", ["zlab", "pt"])
def test_extract_layers_default_to_the_drafters_target_layer_ids(tiny_target, tmp_path, capsys, layout):
    from tests.tiny_models import random_drafter, tiny_drafter_config, write_pt_drafter, write_zlab_drafter
    target, _, _ = tiny_target
    cfg = tiny_drafter_config(target_layer_ids=[0, 2, 4])
    sd = random_drafter(cfg).state_dict()
    drafter = (write_zlab_drafter(tmp_path / "d", cfg, sd) if layout == "zlab"
               else write_pt_drafter(tmp_path / "d.pt", cfg, sd, wrap="model"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("count n01\n")
    base = ["extract", "--target", str(target), "--prompts", str(prompts), "--max-new-tokens", "4", "--device", "cpu"]
    rc = payload_main([*base, "--out", str(tmp_path / "c"), "--for-drafter", str(drafter)])
    assert rc == 0, capsys.readouterr().out
    assert open_cache(tmp_path / "c").layer_ids == [0, 2, 4]
    capsys.readouterr()
    rc = payload_main([*base, "--out", str(tmp_path / "c2")])  # neither --layers nor --for-drafter
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 3 and len(out) == 1 and "--for-drafter PATH" in out[0] and not (tmp_path / "c2").exists()


def test_an_interrupted_extract_resumed_with_another_target_of_same_config_is_refused(tiny_target, tmp_path,
                                                                                       capsys):
    """Issue 32 item 8: the resume is keyed on the recipe (the target's content, not its config.json): another
    target with the same config.json and tokenizer but other weights is refused, the message naming the field
    that differs, and nothing of the first run's prompts is mixed into a cache."""
    import shutil

    from safetensors.torch import load_file, save_file
    target, _, _ = tiny_target
    other = tmp_path / "other"
    shutil.copytree(target, other)
    shard = min(other.glob("*.safetensors"))
    save_file({k: v + 0.01 for k, v in load_file(shard).items()}, str(shard), metadata={"format": "pt"})
    assert (other / "config.json").read_bytes() == (target / "config.json").read_bytes()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"name": n, "prompt": t}) + "\n" for n, t in fixtures.PROMPTS[:5]))
    out = tmp_path / "cache"

    def stop_after_2(line):
        if line.startswith("[2/5]"):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        _extract(target, prompts, out, ("batch_size", 1), log=stop_after_2)
    argv = ["extract", "--target", str(other), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "10", "--layers", ",".join(map(str, LAYERS)), "--device", "cpu"]
    capsys.readouterr()
    rc = payload_main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 3 and len(lines) == 1, lines
    assert "started with other inputs (target: sha256-64MiB-t" in lines[0], lines
    assert "tokenizer" not in lines[0]  # the one field that differs
    assert "remove" in lines[0] and not out.exists()
    # the same target resumes; the finished cache records the recipe it was made by, and its key
    c = _extract(target, prompts, out, ("batch_size", 1))
    meta = json.loads((out / "cache.json").read_text())
    from remote_payload.contract.contenthash import content_hash
    from remote_payload.extract.recipe import Recipe
    assert meta["recipe"]["target"] == content_hash(target) and len(c) == 5
    assert Recipe.from_dict(meta["recipe"]).key == meta["recipe"]["key"]
    assert meta["recipe"]["options"] == {"layers": LAYERS, "max_new_tokens": 10, "dtype": "fp32"}
