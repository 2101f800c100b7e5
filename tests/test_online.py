"""remote_payload/eval/online.py: real greedy speculative decoding with the real target, next to the offline walk.

On the trained CPU fixtures in fp32 the online per-round acceptance lengths must EQUAL the eval's results.json
(offline walk over cached features) round by round, for a good and for an untrained drafter; the target's
tokens must be its cached greedy completion; a sliding-window target (window exceeded) must roll back too;
hybrid linear-attention targets are refused in one line.
"""
from __future__ import annotations

import json

import pytest
import torch

from remote_payload.__main__ import main as payload_main
from remote_payload.eval.online import OnlinePrompt, online_check, refusal, summarize

MAX_BLOCKS = 8
NUM_PROMPTS = 4


def _paths(root):
    meta = json.loads((root / "fixtures.json").read_text())
    return {k: root / v for k, v in meta["paths"].items() if isinstance(v, str)}


def _offline(tmp_path, drafter, p, name) -> list[dict]:
    """results.json per_prompt of `eval --device cpu --max-blocks 8` (the offline walk over cached features)."""
    run_dir = tmp_path / name
    rc = payload_main(["eval", "--drafter", str(drafter), "--target", str(p["target"]), "--cache", str(p["cache"]),
                       "--run-dir", str(run_dir), "--name", name, "--device", "cpu", "--max-blocks", str(MAX_BLOCKS),
                       "--num-prompts", str(NUM_PROMPTS)])
    assert rc == 0
    return json.loads((run_dir / "results.json").read_text())["per_prompt"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls, one thread


@pytest.fixture(scope="module")
def setup(trained_fixtures, tmp_path_factory, one_thread):
    """The fixture target (fp32, CPU), the cache, and the offline per-prompt records of two drafters."""
    from remote_payload.eval.cache import open_cache
    from remote_payload.target.load import load_target
    p = _paths(trained_fixtures)
    tmp = tmp_path_factory.mktemp("online")
    return {"p": p, "target": load_target(p["target"], torch.device("cpu"), torch.float32),
            "cache": open_cache(p["cache"]),
            "good": _offline(tmp, p["drafter_good"], p, "good"),
            "untrained": _offline(tmp, trained_fixtures / "drafters/step-0000", p, "untrained")}


def _drafter_and_head(path, target_dir):
    from remote_payload.eval.checkpoint import load_drafter, load_target_head
    drafter, _ = load_drafter(path)
    head, _ = load_target_head(target_dir, vocab_size=drafter.cfg.vocab_size, hidden_size=drafter.cfg.hidden_size)
    return drafter, head


def _prompts(cache, records) -> list[tuple[str, list[int], int, list[int]]]:
    out = []
    for i, rec in enumerate(records):
        ids, _ = cache.load(i, layer_ids=cache.layer_ids[:1])
        assert cache.prompts[i].name == rec["name"]
        out.append((rec["name"], ids.tolist(), rec["prompt_len"], rec["acceptance_lengths"]))
    return out


def _check_consistent(results: list[OnlinePrompt], prompts) -> None:
    """Each prompt: agrees with the offline walk round by round; the target's tokens are the cached ones;
    both timings positive; tokens = the walk's sum."""
    assert len(results) == len(prompts) >= 3
    for r, (name, ids, P, offline) in zip(results, prompts):
        assert r.name == name and r.prompt_len == P and r.seq_len == len(ids)
        assert r.acceptance_lengths == offline, (name, r.acceptance_lengths, offline)
        assert r.agree and r.first_disagreement is None and r.rounds == len(offline)
        assert r.first_mismatch is None and r.target_only_mismatch is None and r.notes == [], r.notes
        assert r.tokens == sum(offline) and r.spec_s > 0 and r.target_only_s > 0 and r.speedup > 0


@pytest.mark.slow
def test_online_decoding_equals_the_offline_walk_for_the_trained_drafter(setup):
    p, cache = setup["p"], setup["cache"]
    drafter, head = _drafter_and_head(p["drafter_good"], p["target"])
    prompts = _prompts(cache, setup["good"])
    results = online_check(setup["target"], drafter, head, cache.layer_ids, prompts, MAX_BLOCKS)
    _check_consistent(results, prompts)
    assert max(x for r in results for x in r.acceptance_lengths) >= 8  # real multi-token acceptance happened
    s = summarize(results)
    assert s["prompts_agreeing"] == s["prompts"] == NUM_PROMPTS and s["rounds_agreeing"] == s["rounds"]
    assert s["tau_pooled_online"] == s["tau_pooled_offline"] > 1 and s["prompts_with_cache_mismatch"] == 0


@pytest.mark.slow
def test_an_untrained_drafter_is_short_online_and_still_equals_its_offline_walk(setup):
    p, cache = setup["p"], setup["cache"]
    drafter, head = _drafter_and_head(p["target"].parent / "drafters" / "step-0000", p["target"])
    prompts = _prompts(cache, setup["untrained"])
    results = online_check(setup["target"], drafter, head, drafter.cfg.fc_layer_ids, prompts, MAX_BLOCKS,
                           rehearse=False)
    _check_consistent(results, prompts)
    lengths = [x for r in results for x in r.acceptance_lengths]
    assert len(lengths) == NUM_PROMPTS * MAX_BLOCKS and sum(lengths) / len(lengths) < 1.5


@pytest.mark.slow
def test_a_cache_that_is_not_the_targets_greedy_output_is_recorded_not_raised(setup):
    p, cache = setup["p"], setup["cache"]
    drafter, head = _drafter_and_head(p["drafter_good"], p["target"])
    name, ids, P, offline = _prompts(cache, setup["good"])[0]
    bad = list(ids)
    bad[P + 2] = (bad[P + 2] + 1) % drafter.cfg.vocab_size  # a token the target did not produce
    (r,) = online_check(setup["target"], drafter, head, None, [(name, bad, P, offline)], MAX_BLOCKS, rehearse=False)
    assert r.first_mismatch == P + 2 and r.target_only_mismatch == P + 2
    assert any(f"position {P + 2}" in n and "not this target's greedy output" in n for n in r.notes), r.notes
    assert r.rounds >= 1 and r.spec_s > 0 and r.target_only_s > 0


@pytest.mark.slow
def test_a_sliding_window_target_rolls_back_past_its_window(setup):
    """The fixture target with every layer sliding (window 8, completions of ~60 tokens): the rejected drafts
    are cropped away after the window filled (needs the cache's past recording), and the online lengths equal
    a walk over that target's own cached features (extract's code: greedy_complete + tapped_features)."""
    import transformers

    from remote_payload.target.forward import greedy_complete, tapped_features
    p, cache = setup["p"], setup["cache"]
    cfg = transformers.AutoConfig.from_pretrained(p["target"], local_files_only=True)
    cfg.layer_types, cfg.sliding_window, cfg.use_sliding_window = ["sliding_attention"] * cfg.num_hidden_layers, 8, True
    target = transformers.AutoModelForCausalLM.from_pretrained(p["target"], config=cfg, local_files_only=True).eval()
    assert refusal(target) is None
    drafter, head = _drafter_and_head(p["drafter_good"], p["target"])
    bs, prompts = drafter.cfg.block_size, []
    for i in range(3):
        ids, _ = cache.load(i, layer_ids=cache.layer_ids[:1])
        P = cache.prompts[i].prompt_len
        g = greedy_complete(target, ids[:P], 60, {1})  # [T]
        feats = tapped_features(target, g, drafter.cfg.fc_layer_ids).flatten(1)  # [T, n_fc*H]
        g, a, lengths = g.tolist(), P, []
        with torch.no_grad():
            while a < len(g) - 1 and len(lengths) < 12:
                draft = drafter.naive_block(feats, g[a], a, head).argmax(-1).tolist()  # positions a+1..a+bs-1
                acc = 0
                while acc < bs - 1 and a + 1 + acc < len(g) and draft[acc] == g[a + 1 + acc]:
                    acc += 1
                lengths.append(acc + 1)
                a += acc + 1
        assert len(g) > 4 * cfg.sliding_window
        prompts.append((cache.prompts[i].name, g, P, lengths))
    results = online_check(target, drafter, head, None, prompts, 12, rehearse=False)
    _check_consistent(results, prompts)
    assert any(1 < x < bs for r in results for x in r.acceptance_lengths)  # partial acceptance: a real crop


def test_hybrid_linear_attention_targets_are_refused_in_one_line():
    import transformers
    cfg_json = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 4,
                "layer_types": ["linear_attention"] * 3 + ["full_attention"]}}
    line = refusal(cfg_json)
    assert line and "\n" not in line and "3 of 4 layers" in line and "linear_attention" in line
    assert refusal(transformers.Qwen3_5Config()) is not None  # the real Qwen3.5/3.6 config class
    tiny = transformers.Qwen3NextConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, vocab_size=64, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8)
    model = transformers.Qwen3NextForCausalLM(tiny).eval()
    line = refusal(model)
    assert line and "\n" not in line and "cannot be rolled back" in line
    with pytest.raises(ValueError, match="cannot be rolled back"):
        online_check(model, None, None, None, [], 4)
    assert refusal({"model_type": "qwen3", "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2}) is None
    assert refusal({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*"}) is not None


@pytest.mark.slow
def test_plain_targets_pass_and_fc_layers_must_be_among_the_offline_layers(setup):
    p = setup["p"]
    assert refusal(setup["target"]) is None
    drafter, head = _drafter_and_head(p["drafter_good"], p["target"])
    prompts = _prompts(setup["cache"], setup["good"])[:1]
    fc = list(drafter.cfg.fc_layer_ids)
    with pytest.raises(ValueError, match=f"missing \\[{fc[-1]}\\]"):
        online_check(setup["target"], drafter, head, fc[:-1], prompts, MAX_BLOCKS)


def test_eval_online_records_the_spot_check_and_refuses_hybrid_targets(trained_fixtures, tmp_path, capsys):
    """`eval --online N`: results.json's online section equals the offline walk round by round (fp32, CPU);
    a target with linear-attention layers is refused in one line before anything is evaluated."""
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    p = {k: trained_fixtures / v for k, v in meta["paths"].items() if isinstance(v, str)}
    run = tmp_path / "runs" / "on"
    argv = ["eval", "--drafter", str(p["drafter_good"]), "--target", str(p["target"]), "--cache", str(p["cache"]),
            "--device", "cpu", "--num-prompts", "4", "--max-blocks", "6", "--online", "3"]
    assert payload_main([*argv, "--run-dir", str(run)]) == 0
    res = json.loads((run / "results.json").read_text())
    on = res["online"]
    assert on["prompts"] == 3 and on["rounds"] == on["rounds_agreeing"] == 18 and on["prompts_agreeing"] == 3
    assert [q["acceptance_lengths"] for q in on["per_prompt"]] == \
        [q["acceptance_lengths"] for q in res["per_prompt"][:3]]
    assert on["measured_speedup"] == pytest.approx(on["target_only_s"] / on["spec_s"], rel=2e-2)  # times rounded
    assert "online (block)" in capsys.readouterr().out
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    cfg = json.loads((p["target"] / "config.json").read_text())
    cfg["layer_types"] = ["linear_attention"] * (cfg["num_hidden_layers"] - 1) + ["full_attention"]
    (hybrid / "config.json").write_text(json.dumps(cfg))
    argv[argv.index(str(p["target"]))] = str(hybrid)
    assert payload_main([*argv, "--run-dir", str(tmp_path / "runs" / "hy")]) == 3
    err = capsys.readouterr().err
    assert "--online:" in err and "linear_attention" in err and err.count("\n") == 1
    assert not (tmp_path / "runs" / "hy" / "results.json").exists()
