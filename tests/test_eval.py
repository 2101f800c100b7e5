"""The eval job (`python -m remote_payload eval`) end to end on real files: tiny random models for the
plumbing and every bad input; the trained fixtures for the seeds' scenario (real signal when loaded
right, a collapse flagged SUSPECT when the embeddings are not)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from remote_payload.__main__ import main as payload_main
from remote_payload.contract import protocol
from remote_payload.eval.metrics import DEFINITIONS
from remote_payload.extract.writer import CacheWriter
from remote_payload.target.forward import tapped_features
from tests.tiny_models import (
    random_drafter,
    tiny_drafter_config,
    write_pt_drafter,
    write_tiny_target,
    write_zlab_drafter,
)

LAYERS = [1, 3, 4]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A tiny random Qwen3 target (sharded + index), a 3-prompt cache of its real hidden states, a random
    z-lab drafter tapping all 3 cached layers and a .pt drafter whose fc takes the first 2."""
    from transformers import Qwen3ForCausalLM
    d = tmp_path_factory.mktemp("eval")
    cfg = tiny_drafter_config(target_layer_ids=LAYERS)
    write_tiny_target(d / "target", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size)
    model = Qwen3ForCausalLM.from_pretrained(d / "target")
    g = torch.Generator().manual_seed(0)
    with CacheWriter(d / "cache", layer_ids=LAYERS, hidden_size=cfg.hidden_size) as w:
        for i, T in enumerate((40, 57, 71)):
            ids = torch.randint(0, cfg.vocab_size - 1, (T,), generator=g)
            w.add(f"prompt-{i}", 9 + i, ids, tapped_features(model, ids, LAYERS))
    write_zlab_drafter(d / "drafter", cfg, random_drafter(cfg).state_dict())
    pt_cfg = tiny_drafter_config(target_layer_ids=LAYERS)
    pt_cfg.fc_layer_ids = LAYERS[:2]
    write_pt_drafter(d / "pt" / "step-0007.pt", pt_cfg, random_drafter(pt_cfg, seed=3).state_dict(), wrap="model",
                     step=7)
    return d


def run_eval(tmp_path, drafter, target, cache, *extra, name="r") -> tuple[int, Path]:
    run_dir = tmp_path / "runs" / name
    rc = payload_main(["eval", "--drafter", str(drafter), "--target", str(target), "--cache", str(cache),
                       "--run-dir", str(run_dir), "--name", name, "--device", "cpu", *extra])
    return rc, run_dir


def test_results_are_complete_consistent_and_defined(inputs, tmp_path, capsys):
    rc, run_dir = run_eval(tmp_path, inputs / "drafter", inputs / "target", inputs / "cache", "--max-blocks", "4")
    out = capsys.readouterr().out
    assert rc == 0
    for line in ("[1/5] Loading tokenizer", "[3/5] Loading cached hidden states", "[3/3] prompt-2: 71 tokens aux_mean=",
                 "first block, drafted:", "Summary: r"):
        assert line in out
    res = json.loads((run_dir / "results.json").read_text())
    m = res["metrics"]
    assert res["schema"] == protocol.RESULTS_SCHEMA and res["comparability"]["max_blocks"] == 4
    assert set(m) <= set(DEFINITIONS) and set(res["definitions"]) >= set(m)
    assert m["num_prompts"] == 3 and sum(m["acceptance_histogram"]) == m["num_rounds"]
    for p in res["per_prompt"]:  # the walk never runs past the sequence nor max_blocks
        assert len(p["acceptance_lengths"]) <= 4
        assert p["prompt_len"] + sum(p["acceptance_lengths"]) <= p["seq_len"] + 15
    assert m["tau"] == pytest.approx(sum(p["tau"] for p in res["per_prompt"]) / 3)
    assert m["streak"] == pytest.approx(m["tau"] - 1)
    assert set(m["ddtree_tau"]) == {"16", "32", "64", "128", "256", "512"} and set(m["tree_width_tau"]) == {"4", "8"}
    # a DDTree with more nodes never accepts less than a smaller one
    taus = [m["ddtree_tau"][b] for b in ("16", "32", "64", "128", "256", "512")]
    assert taus == sorted(taus) and m["tree_width_tau"]["8"] >= m["tree_width_tau"]["4"] >= m["tau"]
    assert res["drafter"]["layout"] == "zlab" and res["drafter"]["content_hash"].startswith("sha256")
    assert protocol.read_json(run_dir / "status.json")["state"] == "succeeded"  # standalone: the payload owns it
    stages = {e.get("stage") for e in protocol.read_events(run_dir / "events.jsonl")}
    assert {"load_cache", "load_drafter", "eval_prompt", "done"} <= stages


def test_random_drafter_is_suspect_and_strict_fails(inputs, tmp_path, capsys):
    rc, run_dir = run_eval(tmp_path, inputs / "drafter", inputs / "target", inputs / "cache", "--strict")
    assert rc == protocol.EXIT_FAILED
    assert "SUSPECT RESULT" in capsys.readouterr().out
    res = json.loads((run_dir / "results.json").read_text())
    assert res["health"]["suspect"] and any("position-1 accuracy" in r for r in res["health"]["reasons"])
    assert protocol.read_json(run_dir / "status.json")["state"] == "failed"  # never marked succeeded


def test_pt_layout_with_fc_on_a_subset_of_the_cached_layers(inputs, tmp_path):
    rc, run_dir = run_eval(tmp_path, inputs / "pt" / "step-0007.pt", inputs / "target", inputs / "cache",
                           "--max-blocks", "2", "--ddtree-budgets", "4,8")
    assert rc == 0
    res = json.loads((run_dir / "results.json").read_text())
    assert res["drafter"]["layout"] == "pt" and res["drafter"]["step"] == 7
    assert res["drafter"]["fc_layer_ids"] == LAYERS[:2] and set(res["metrics"]["ddtree_tau"]) == {"4", "8"}


def _bad(tmp_path, capsys, *args) -> str:
    rc, run_dir = run_eval(tmp_path, *args)
    err = capsys.readouterr().err
    assert rc == protocol.EXIT_BAD_INPUT, err
    assert not (run_dir / "results.json").exists()
    assert protocol.read_json(run_dir / "status.json")["state"] == "failed"
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, err  # one clear line, no traceback
    return lines[0]


def test_target_without_the_embedding_key_names_the_closest(inputs, tmp_path, capsys):
    bad = tmp_path / "target"
    shutil.copytree(inputs / "target", bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k.replace("model.embed_tokens", "model.embed_tokenz"): v
                           for k, v in index["weight_map"].items()}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    line = _bad(tmp_path, capsys, inputs / "drafter", bad, inputs / "cache")
    assert "model.embed_tokens.weight" in line and "Closest: 'model.embed_tokenz.weight'" in line


def test_drafter_tapping_an_uncached_layer_names_dims_and_layers(inputs, tmp_path, capsys):
    cfg = tiny_drafter_config(target_layer_ids=[1, 3, 5])
    write_zlab_drafter(tmp_path / "d5", cfg, random_drafter(cfg).state_dict())
    line = _bad(tmp_path, capsys, tmp_path / "d5", inputs / "target", inputs / "cache")
    assert "96 input features" in line and "[1, 3, 5]" in line and "[1, 3, 4]" in line and "--layers" in line


def test_missing_drafter_key_and_truncated_file(inputs, tmp_path, capsys):
    d = tmp_path / "dk"
    shutil.copytree(inputs / "drafter", d)
    sd = load_file(d / "model.safetensors")
    sd["layers.1.mlp.up_projj.weight"] = sd.pop("layers.1.mlp.up_proj.weight")
    save_file(sd, d / "model.safetensors")
    line = _bad(tmp_path, capsys, d, inputs / "target", inputs / "cache")
    assert "'layers.1.mlp.up_proj.weight'" in line and "Closest:" in line
    t = tmp_path / "dt"
    shutil.copytree(inputs / "drafter", t)
    data = (t / "model.safetensors").read_bytes()
    (t / "model.safetensors").write_bytes(data[: len(data) // 2])
    line = _bad(tmp_path, capsys, t, inputs / "target", inputs / "cache")
    assert "model.safetensors" in line and "truncated" in line


def test_nan_features_are_refused(inputs, tmp_path, capsys):
    c = tmp_path / "cache"
    shutil.copytree(inputs / "cache", c)
    f = sorted(c.glob("*.safetensors"))[1]
    t = load_file(f)
    t["features"][5, 0, 0] = float("nan")
    save_file(t, f)
    line = _bad(tmp_path, capsys, inputs / "drafter", inputs / "target", c)
    assert "NaN" in line and "prompt-1" in line


# ----------------------------------------------------------------------------- the seeds' scenario

@pytest.mark.slow
def test_trained_drafter_has_real_signal_and_the_seeds_bug_is_caught(trained_fixtures, tmp_path, capsys):
    fx = trained_fixtures
    meta = json.loads((fx / "fixtures.json").read_text())
    cache, target = fx / meta["paths"]["cache"], fx / meta["paths"]["target"]
    good = fx / meta["paths"]["drafter_good"]

    rc, run_dir = run_eval(tmp_path, good, target, cache, name="good")
    assert rc == 0
    res = json.loads((run_dir / "results.json").read_text())["metrics"]
    vocab = meta["vocab_size"]
    assert res["position_1_accuracy"] > 0.5 > 20 / vocab  # far above chance
    assert res["tau"] > 2.0 and not json.loads((run_dir / "results.json").read_text())["health"]["suspect"]

    # The multimodal key layout (model.language_model.*, top-level lm_head) loads the same weights.
    rc, run_mm = run_eval(tmp_path, good, fx / meta["paths"]["target_mm"], cache, name="mm")
    assert rc == 0
    res_mm = json.loads((run_mm / "results.json").read_text())
    assert res_mm["target"]["embed_key"] == "model.language_model.embed_tokens.weight"
    assert res_mm["metrics"]["tau"] == pytest.approx(res["tau"])
    assert json.loads((run_dir / "results.json").read_text())["target"]["config_matches_cache"] is True

    # A target whose config.json is not the one the cache was extracted with: said (warning), not refused.
    other = tmp_path / "target-other"
    shutil.copytree(target, other)
    conf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**conf, "_name_or_path": "somewhere-else"}))
    capsys.readouterr()
    rc, run_other = run_eval(tmp_path, good, other, cache, name="other")
    assert rc == 0 and "is not the config the cache was extracted with" in capsys.readouterr().out
    assert json.loads((run_other / "results.json").read_text())["target"]["config_matches_cache"] is False

    # What the seeds' harness did: embed_tokens and lm_head were looked up under the wrong keys, silently
    # skipped, and the drafter ran with uninitialised ones. Simulate that state (random tensors under the
    # right keys): the numbers collapse, and the run is flagged SUSPECT instead of reported as a result.
    broken = tmp_path / "target-uninit"
    shutil.copytree(target, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        shard = broken / index["weight_map"][key]
        sd = load_file(shard)
        sd[key] = torch.randn_like(sd[key]) * 0.02
        save_file(sd, shard, metadata={"format": "pt"})
    capsys.readouterr()
    rc, run_bad = run_eval(tmp_path, good, broken, cache, name="broken")
    out = capsys.readouterr().out
    bad = json.loads((run_bad / "results.json").read_text())
    assert bad["metrics"]["position_1_accuracy"] < 0.25 * res["position_1_accuracy"]
    assert bad["health"]["suspect"] and "SUSPECT RESULT" in out

    # And the fix: a key that does not resolve is an error, not a silent skip.
    index["weight_map"] = {k.replace("embed_tokens", "embed"): v for k, v in index["weight_map"].items()}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, run_err = run_eval(tmp_path, good, broken, cache, name="err")
    assert rc == protocol.EXIT_BAD_INPUT and not (run_err / "results.json").exists()
    assert "Closest:" in capsys.readouterr().err


def test_all_anchors_widens_position_accuracy_only(inputs, tmp_path):
    rc, walk_dir = run_eval(tmp_path, inputs / "drafter", inputs / "target", inputs / "cache", "--max-blocks", "1",
                            name="reach")
    rc2, all_dir = run_eval(tmp_path, inputs / "drafter", inputs / "target", inputs / "cache", "--max-blocks", "1",
                            "--all-anchors", name="all")
    assert rc == rc2 == 0
    reach, every = (json.loads((d / "results.json").read_text()) for d in (walk_dir, all_dir))
    assert ([p["acceptance_lengths"] for p in reach["per_prompt"]]
            == [p["acceptance_lengths"] for p in every["per_prompt"]])
    # 16 anchors per prompt reachable in one block vs every completion anchor (T - 1 - prompt_len)
    assert [p["num_anchors"] for p in reach["per_prompt"]] == [16, 16, 16]
    assert [p["num_anchors"] for p in every["per_prompt"]] == [40 - 1 - 9, 57 - 1 - 10, 71 - 1 - 11]
    assert every["options"]["position_accuracy_anchors"] == "all"
    assert every["comparability"]["metrics_version"] != reach["comparability"]["metrics_version"]


def test_cache_from_another_tokenizer_is_refused(inputs, tmp_path, capsys):
    c = tmp_path / "cache"
    shutil.copytree(inputs / "cache", c)
    f = min(c.glob("*.safetensors"))
    t = load_file(f)
    t["ids"][3] = 500  # vocab is 96
    save_file(t, f)
    line = _bad(tmp_path, capsys, inputs / "drafter", inputs / "target", c)
    assert "token id 500 outside the drafter's vocabulary (96)" in line


@pytest.mark.slow
def test_walk_equals_online_greedy_decoding_round_by_round(trained_fixtures, tmp_path):
    """results.json's per-prompt acceptance lengths (batched teacher-forced drafting + index-hopping walk) equal
    an online greedy speculative decoder run round by round with the naive drafter (context recomputed)."""
    from remote_payload.eval.cache import open_cache
    from remote_payload.eval.checkpoint import load_drafter, load_target_head
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    p = {k: trained_fixtures / v for k, v in meta["paths"].items() if isinstance(v, str)}
    rc, run_dir = run_eval(tmp_path, p["drafter_good"], p["target"], p["cache"], "--num-prompts", "3",
                           "--max-blocks", "12", name="online")
    assert rc == 0
    res = json.loads((run_dir / "results.json").read_text())
    drafter, _ = load_drafter(p["drafter_good"])
    head, _ = load_target_head(p["target"], vocab_size=drafter.cfg.vocab_size, hidden_size=drafter.cfg.hidden_size)
    cache = open_cache(p["cache"])
    bs = drafter.cfg.block_size
    for i, rec in enumerate(res["per_prompt"]):
        ids, feats = cache.load(i, layer_ids=drafter.cfg.fc_layer_ids)
        g, a, lengths = ids.tolist(), rec["prompt_len"], []
        with torch.no_grad():
            while a < len(g) - 1 and len(lengths) < 12:
                draft = drafter.naive_block(feats, g[a], a, head).argmax(-1).tolist()  # positions a+1..a+bs-1
                acc = 0
                while acc < bs - 1 and a + 1 + acc < len(g) and draft[acc] == g[a + 1 + acc]:
                    acc += 1
                lengths.append(acc + 1)
                a += acc + 1
        assert rec["acceptance_lengths"] == lengths, rec["name"]
    assert any(x > 1 for r in res["per_prompt"] for x in r["acceptance_lengths"])  # real acceptance happened


def test_num_prompts_beyond_the_cache_says_how_many_it_uses(inputs, tmp_path, capsys):
    rc, run_dir = run_eval(tmp_path, inputs / "drafter", inputs / "target", inputs / "cache", "--max-blocks", "2",
                           "--num-prompts", "99")
    out = capsys.readouterr().out
    assert rc == 0 and "warning: --num-prompts 99 is more than the cache holds: using all 3" in out
    assert json.loads((run_dir / "results.json").read_text())["metrics"]["num_prompts"] == 3


def test_ctrl_c_in_a_standalone_eval_is_one_line_exit_103_and_status_cancelled(inputs, tmp_path, capsys, monkeypatch):
    from remote_payload.eval import steps

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(steps, "feature_pass", interrupted)  # Ctrl-C while step 3 reads, the weights loading
    rc, run_dir = run_eval(tmp_path, inputs / "drafter", inputs / "target", inputs / "cache", name="int")
    err = capsys.readouterr().err
    assert rc == protocol.EXIT_CANCELLED and "Traceback" not in err
    assert err.strip().splitlines() == ["interrupted: nothing evaluated to the end, no results.json written"]
    assert protocol.read_json(run_dir / protocol.STATUS_JSON)["state"] == protocol.CANCELLED
    assert not (run_dir / protocol.RESULTS_JSON).exists()


def test_a_standalone_eval_whose_reader_goes_away_still_finishes(inputs, tmp_path):
    """`python -m remote_payload eval ... | head -1`: the eval goes on quietly and writes its results."""
    import subprocess
    import sys
    run_dir = tmp_path / "piped"
    p = subprocess.Popen([sys.executable, "-m", "remote_payload", "eval", "--drafter", str(inputs / "drafter"),
                          "--target", str(inputs / "target"), "--cache", str(inputs / "cache"), "--run-dir",
                          str(run_dir), "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=Path(__file__).resolve().parents[1],
                         env={**__import__("os").environ, "PYTHONUNBUFFERED": "1"})
    assert p.stdout.readline().startswith("DFlash drafter eval")
    p.stdout.close()  # the reader goes away
    err = p.stderr.read()
    assert p.wait(timeout=300) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
    assert protocol.read_json(run_dir / protocol.STATUS_JSON)["state"] == protocol.SUCCEEDED
    assert (run_dir / protocol.RESULTS_JSON).exists()


def test_eval_leaves_without_the_interpreters_teardown_and_loses_no_output(inputs, tmp_path):
    """`python -m remote_payload eval` ends by os._exit once results.json is written (the teardown cost an H200
    eval process 0.6-0.7 s): what it printed still arrives (stdout a pipe, block-buffered), its exit code is
    the eval's, and an atexit hook (the teardown) never runs — for a good run and for a bad input (exit 3)."""
    import subprocess
    import sys
    code = ("import atexit, runpy, sys; atexit.register(lambda: print('TEARDOWN RAN', file=sys.stderr)); "
            "runpy.run_module('remote_payload', run_name='__main__')")
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONUNBUFFERED"}

    def eval_(*extra):
        return subprocess.run([sys.executable, "-c", code, "eval", "--drafter", str(inputs / "drafter"),
                               "--target", str(inputs / "target"), "--cache", str(inputs / "cache"),
                               "--device", "cpu", *extra], capture_output=True, text=True, timeout=300, check=False,
                              cwd=Path(__file__).resolve().parents[1], env=env)
    ok = eval_("--run-dir", str(tmp_path / "ok"))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == f"results: {tmp_path / 'ok' / protocol.RESULTS_JSON}"
    assert "TEARDOWN RAN" not in ok.stderr and "Traceback" not in ok.stderr
    assert protocol.read_json(tmp_path / "ok" / protocol.STATUS_JSON)["state"] == protocol.SUCCEEDED
    bad = eval_("--run-dir", str(tmp_path / "bad"), "--max-blocks", "0")
    assert bad.returncode == protocol.EXIT_BAD_INPUT, bad.stderr
    assert bad.stderr.startswith("error: ") and "TEARDOWN RAN" not in bad.stderr


def test_the_feature_pass_takes_one_cpu_thread_while_the_weights_load(inputs, tmp_path, monkeypatch):
    """Beside the weight load the pass's torch ops run on one thread (the intra-op pool on every core slowed
    the load's readers on an H200 host); the pool comes back once the load is done, and after the pass."""
    from remote_payload.eval import cache as cache_mod
    from remote_payload.eval import steps
    from remote_payload.eval.evalopts import EvalOptions
    before = torch.get_num_threads()
    if before < 2:
        torch.set_num_threads(2)  # so that the one-thread phase can be told apart
    threads_seen, loading = [], iter([True, True, False])
    real_stats = steps._stats

    def stats(x):
        threads_seen.append(torch.get_num_threads())
        return real_stats(x)
    monkeypatch.setattr(steps, "_stats", stats)
    try:
        pool = torch.get_num_threads()
        c = cache_mod.open_cache(str(inputs / "cache"))
        opts = EvalOptions(drafter=str(inputs / "drafter"), target=str(inputs / "target"),
                           cache=str(inputs / "cache"), run_dir=str(tmp_path / "r"), name="r")
        out = steps.feature_pass(opts, c, c.prompts, steps.Reporter(None), loading=lambda: next(loading))
        assert threads_seen == [steps.FEATURE_THREADS_BESIDE_LOAD, steps.FEATURE_THREADS_BESIDE_LOAD, pool]
        assert torch.get_num_threads() == pool and sorted(out) == ["prompt-0", "prompt-1", "prompt-2"]
    finally:
        torch.set_num_threads(before)
