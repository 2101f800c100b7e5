"""The host's cache store (remote_payload/extract/store.py, storecmd.py): caches keyed by their recipe, built
once (a second request reuses, a concurrent one waits and reuses), equal to the payload's own extract byte for
byte, a damaged entry reported in one line and never used, removal refused while a running eval reads it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from remote_payload.__main__ import main as payload_main
from remote_payload.extract import store, storecmd
from remote_payload.tools import fixtures
from tests.tiny_models import fixture_recipe_target, write_prompts

ROOT = Path(__file__).resolve().parents[1]
LAYERS = "0,2"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return fixture_recipe_target(tmp_path_factory.mktemp("store-target") / "target")[0]


_prompts = write_prompts


def _argv(target, store_dir, *suites, extra=()):
    return ["extract", "--store", str(store_dir), "--target", str(target),
            *[a for s in suites for a in ("--prompts", s)], "--layers", LAYERS, "--max-new-tokens", "6",
            "--device", "cpu", *extra]


def _plan(target, store_dir, *suites, capsys) -> dict:
    capsys.readouterr()
    assert payload_main(_argv(target, store_dir, *suites, extra=["--plan"])) == 0
    return json.loads(capsys.readouterr().out)


def test_a_store_builds_each_recipe_once_equal_to_the_payloads_own_extract(target, tmp_path, capsys):
    a = _prompts(tmp_path / "a.jsonl", fixtures.PROMPTS[:3])
    b = _prompts(tmp_path / "b.jsonl", fixtures.PROMPTS[3:5])
    caches = tmp_path / "caches"
    plan = _plan(target, caches, f"a={a}", f"b={b}", capsys=capsys)
    assert [c["state"] for c in plan["caches"]] == ["missing", "missing"]
    assert plan["needed_bytes"] == sum(c["estimated_bytes"] for c in plan["caches"]) > 0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert payload_main(_argv(target, caches, f"a={a}", f"b={b}", extra=["--run-dir", str(run_dir)])) == 0
    out = capsys.readouterr().out
    assert out.count("not in the store; extracting it") == 2
    got = json.loads((run_dir / "caches.json").read_text())["caches"]
    assert [(c["suite"], c["built"], c["key"]) for c in got] == [("a", True, plan["caches"][0]["key"]),
                                                                  ("b", True, plan["caches"][1]["key"])]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["i"] for e in events if e.get("suite") == "a"] == [1, 2, 3]
    # byte for byte the payload's own `extract --out` of the same recipe (cache.json: its label, time aside)
    own_argv = ["extract", "--target", str(target), "--prompts", str(a), "--out", str(tmp_path / "own"),
                "--layers", LAYERS, "--max-new-tokens", "6", "--device", "cpu"]
    assert payload_main(own_argv) == 0
    mine = Path(got[0]["path"])
    assert sorted(f.name for f in mine.iterdir()) == sorted(f.name for f in (tmp_path / "own").iterdir())
    for f in (tmp_path / "own").glob("*.safetensors"):
        assert (mine / f.name).read_bytes() == f.read_bytes(), f.name
    own, stored = (json.loads((d / "cache.json").read_text()) for d in (tmp_path / "own", mine))
    for m in (own, stored):
        m.pop("created_at")
    assert stored.pop("store") == {"suite": "a"} and stored == own
    # asked again (another run, another laptop): nothing is built, the files are the same ones
    before = {f: f.stat().st_ino for f in mine.iterdir()}
    capsys.readouterr()
    assert payload_main(_argv(target, caches, f"a={a}", f"b={b}")) == 0
    out = capsys.readouterr().out
    assert "extracting" not in out and out.count("reused") == 4  # the log's line and the summary's, per suite
    assert {f: f.stat().st_ino for f in mine.iterdir()} == before
    again = _plan(target, caches, f"a={a}", f"b={b}", capsys=capsys)["caches"]
    assert [c["state"] for c in again] == ["ready"] * 2
    # another target content, other layers, other prompts: other keys
    assert _plan(target, caches, f"a={b}", capsys=capsys)["caches"][0]["key"] == got[1]["key"]


def test_two_concurrent_requests_for_one_recipe_build_it_once(target, tmp_path):
    a = _prompts(tmp_path / "a.jsonl", fixtures.PROMPTS[:4])
    caches = tmp_path / "caches"
    cmd = [sys.executable, "-m", "remote_payload", *_argv(target, caches, f"a={a}")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    joined = "\n".join(outs)
    assert joined.count("extracting it") == 1, joined  # one built it
    assert joined.count("built a:") == 1 and joined.count("reused a:") == 1, joined
    assert len(store.entries(caches)) == 1 and not list(caches.glob(".*.partial"))


def test_a_damaged_entry_is_reported_in_one_line_and_never_used(target, tmp_path, capsys):
    a = _prompts(tmp_path / "a.jsonl", fixtures.PROMPTS[:2])
    caches = tmp_path / "caches"
    assert payload_main(_argv(target, caches, f"a={a}")) == 0
    (entry,) = store.entries(caches)
    victim = min(entry.glob("p*.safetensors"))
    victim.unlink()
    capsys.readouterr()
    assert payload_main(_argv(target, caches, f"a={a}", extra=["--plan"])) == 3  # the pre-flight refuses it
    got = capsys.readouterr()
    plan = json.loads(got.out)
    assert plan["caches"][0]["state"] == "damaged" and "prompt files missing" in plan["caches"][0]["damage"]
    assert got.err.strip().splitlines() == [got.err.strip()] and "is damaged" in got.err
    assert payload_main(_argv(target, caches, f"a={a}")) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "is damaged (1 of 2 prompt files missing" in lines[0]
    assert "reval caches rm" in lines[0]
    assert not victim.exists()  # nothing rebuilt over it, nothing read from it
    assert payload_main(["caches", "--store", str(caches)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "DAMAGED" in lines[0]
    (entry / "cache.json").write_text("{")
    assert store.entry_problem(entry) == "cache.json unreadable (JSONDecodeError)"
    assert payload_main(["caches", "--store", str(caches), "--rm", entry.name[:10]]) == 0
    assert not entry.exists() and store.entries(caches) == []


def test_removing_a_cache_a_running_eval_reads_is_refused(target, tmp_path, capsys):
    a = _prompts(tmp_path / "a.jsonl", fixtures.PROMPTS[:1])
    work = tmp_path / "work"
    caches = work / "caches"
    assert payload_main(_argv(target, caches, f"a={a}")) == 0
    (entry,) = store.entries(caches)
    run_dir = work / "runs" / "reader"
    run_dir.mkdir(parents=True)
    (tmp_path / "run.json").write_text(json.dumps({"payload_argv": ["eval", "--cache", f"gsm8k={entry}"]}))
    wrap = subprocess.Popen([sys.executable, "-m", "remote_payload", "wrap", "--run-dir", str(run_dir),
                             "--run-json", str(tmp_path / "run.json"), "--", "sleep", "60"],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while store.readers(caches, work / "runs") == {} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.readers(caches, work / "runs") == {entry.name: ["reader"]}
        capsys.readouterr()
        assert payload_main(["caches", "--store", str(caches), "--rm", entry.name]) == 3
        line = capsys.readouterr().out.strip()
        assert "is read by running run(s) reader" in line and entry.is_dir()
        listed = json.loads(_json_listing(caches, capsys))["caches"]
        assert listed[0]["readers"] == ["reader"]
    finally:
        os.killpg(wrap.pid, signal.SIGTERM)
        wrap.wait(timeout=30)
    assert payload_main(["caches", "--store", str(caches), "--rm", entry.name]) == 0
    assert not entry.exists()


def _json_listing(caches, capsys) -> str:
    capsys.readouterr()
    assert payload_main(["caches", "--store", str(caches), "--json"]) == 0
    return capsys.readouterr().out


def test_a_concurrent_build_waits_on_the_lock(tmp_path):
    """The lock itself: a second holder waits (and says so) until the first lets go."""
    said, order = [], []
    with store.building(tmp_path, "k" * 64, log=said.append):
        assert store.being_built(tmp_path, "k" * 64)

        def second():
            with store.building(tmp_path, "k" * 64, log=said.append):
                order.append("second")
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.5)
        order.append("first done")
    t.join(timeout=10)
    assert order == ["first done", "second"] and said[0].startswith("waiting: another extract is building")
    assert not store.being_built(tmp_path, "k" * 64)


def test_suites_and_dtype_are_parsed_once(tmp_path):
    from remote_payload.contract.errors import PayloadError
    assert storecmd.parse_suites(["a=x.jsonl", "b=y.txt"]) == [("a", "x.jsonl"), ("b", "y.txt")]
    for bad in (["x.jsonl"], ["a=x", "a=y"], ["-a=x"]):
        with pytest.raises(PayloadError):
            storecmd.parse_suites(bad)
    assert storecmd.dtype_name("auto", "cpu", None) == "fp32"
    assert storecmd.dtype_name("auto", "cuda:1", None) == "bf16"
    assert storecmd.dtype_name("auto", "auto", "0,1") == "bf16"
    assert storecmd.dtype_name("fp16", "cpu", None) == "fp16"
