"""`reval extract` / `reval caches` over a real sshd host (issue 30): the cache equals the payload's own extract
byte for byte, a second request builds nothing, a damaged store entry is one line and never used, a kill leaves
no cache visible; the prompt files travel by content (only what the host lacks)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from remote_payload.__main__ import main as payload_main
from remote_payload.tools import fixtures
from reval import cli
from tests.tiny_models import fixture_recipe_target, write_prompts

pytestmark = pytest.mark.ssh


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return fixture_recipe_target(tmp_path_factory.mktemp("reval-extract-target") / "target")[0]


_prompts = write_prompts


def _extract(inv, target, *suites, extra=()):
    argv = ["-i", str(inv), "extract", "ssh1", "--target", str(target), "--layers", "0,2",
            "--max-new-tokens", "6", *[a for s in suites for a in ("--prompts", s)], *extra]
    return cli.main(argv)


def _pulled(tmp_path) -> list[dict]:
    newest = max((tmp_path / "runs" / "ssh1").iterdir(), key=lambda p: p.stat().st_mtime)
    return json.loads((newest / "caches.json").read_text())["caches"]


def test_reval_extract_builds_once_equal_to_the_payloads_own(ssh_hosts, target, tmp_path, monkeypatch, capsys):
    cluster = ssh_hosts(1)
    monkeypatch.chdir(tmp_path)
    inv, work = cluster.inventory_path, cluster.hosts[0].workdir
    a = _prompts(tmp_path / "a.jsonl", fixtures.PROMPTS[:3])
    b = _prompts(tmp_path / "b.txt", [("x", t) for _, t in fixtures.PROMPTS[3:5]])
    assert _extract(inv, target, f"gsm8k={a}", f"mt={b}") == 0
    out = capsys.readouterr().out
    assert "prompts: 2 of 2 files copied" in out and "gsm8k: built" in out and "mt: built" in out
    got = _pulled(tmp_path)
    assert [(c["suite"], c["built"]) for c in got] == [("gsm8k", True), ("mt", True)]
    assert sorted(p.name for p in (tmp_path / "runs" / "ssh1").iterdir()) and \
        not list((tmp_path / "runs" / "ssh1").glob("*/*.safetensors"))  # pulled: caches.json, never tensors
    # the payload's own extract of the same file: byte for byte
    assert payload_main(["extract", "--target", str(target), "--prompts", str(a), "--out", str(tmp_path / "own"),
                         "--layers", "0,2", "--max-new-tokens", "6", "--device", "cpu"]) == 0
    stored = Path(got[0]["path"])
    assert stored.parent == work / "caches"
    own = sorted((tmp_path / "own").glob("*.safetensors"))
    assert [f.name for f in own] == sorted(f.name for f in stored.glob("*.safetensors"))
    assert all((stored / f.name).read_bytes() == f.read_bytes() for f in own)
    # asked again: nothing copied, nothing built (the same files)
    inodes = {f.name: f.stat().st_ino for f in stored.iterdir()}
    capsys.readouterr()
    assert _extract(inv, target, f"gsm8k={a}", f"mt={b}") == 0
    out = capsys.readouterr().out
    assert "prompts: 0 of 2 files copied" in out and "built" not in out.split("done", 1)[1], out
    assert [c["built"] for c in _pulled(tmp_path)] == [False, False]
    assert {f.name: f.stat().st_ino for f in stored.iterdir()} == inodes
    # detached, then followed: `logs -f` ends with the caches, exit 0 (not an eval's "no results.json")
    assert _extract(inv, target, f"gsm8k={a}", extra=["--detach", "--name", "again"]) == 101
    capsys.readouterr()
    assert cli.main(["-i", str(inv), "logs", "again", "-f"]) == 0
    assert "gsm8k: reused" in capsys.readouterr().out
    # the listing: both caches, their suites and sizes
    assert cli.main(["-i", str(inv), "caches", "ssh1", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(c["suite"] for c in listed) == ["gsm8k", "mt"] and all(c["bytes"] > 0 for c in listed)
    # a damaged entry: one line in the listing, refused (exit 3, nothing started), removed by caches rm
    (stored / "cache.json").write_text("{")
    runs_before = len(list((work / "runs").iterdir()))
    assert cli.main(["-i", str(inv), "caches", "ssh1"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if stored.name[:12] in ln]
    assert len(lines) == 1 and "DAMAGED (cache.json unreadable" in lines[0]
    assert _extract(inv, target, f"gsm8k={a}") == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert "is damaged (cache.json unreadable" in err[0] and len(list((work / "runs").iterdir())) == runs_before
    assert cli.main(["-i", str(inv), "caches", "rm", "ssh1", stored.name[:12]]) == 0
    assert not stored.exists()


def test_a_killed_extract_leaves_no_cache_visible(ssh_hosts, target, tmp_path, monkeypatch, capsys):
    cluster = ssh_hosts(1)
    monkeypatch.chdir(tmp_path)
    inv, work = cluster.inventory_path, cluster.hosts[0].workdir
    many = _prompts(tmp_path / "many.jsonl", [(f"p{i}", t) for i, (_, t) in enumerate(fixtures.PROMPTS * 4)])
    assert _extract(inv, target, f"big={many}", extra=["--detach", "--name", "ex", "--max-new-tokens", "60"]) == 101
    events = work / "runs" / "ex" / "events.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and '"i": 1' not in (events.read_text() if events.exists() else ""):
        time.sleep(0.2)
    assert cli.main(["-i", str(inv), "kill", "ex"]) == 0
    assert [p.name for p in (work / "caches").iterdir() if not p.name.startswith(".")] == []
    assert list((work / "caches").glob(".*.partial"))  # cut mid-build: its work dir, hidden, resumable
    capsys.readouterr()
    assert cli.main(["-i", str(inv), "caches", "ssh1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_run_with_prompts_builds_then_evaluates_and_the_next_run_reuses(ssh_hosts, trained_fixtures, tmp_path,
                                                                        monkeypatch, capsys):
    """`reval run --prompts`: on a fresh host the suite's cache is built first (one extract run, the drafter's
    layers), then the eval runs on it; the next run finds it in the store and launches no extract."""
    root = Path(trained_fixtures)
    cluster = ssh_hosts(1)
    monkeypatch.chdir(tmp_path)
    inv, work = cluster.inventory_path, cluster.hosts[0].workdir
    a = _prompts(tmp_path / "a.jsonl", fixtures.PROMPTS[:3])

    def run(name: str) -> int:
        return cli.main(["-i", str(inv), "run", "ssh1", "--drafter", str(root / "drafter-good"), "--target",
                         str(root / "target"), "--prompts", f"gsm8k={a}", "--max-new-tokens", "24",
                         "--max-blocks", "3", "--name", name, "--", "--device", "cpu"])
    assert run("r1") == 0
    out = capsys.readouterr().out
    assert "cache   gsm8k: built" in out and "done    r1 succeeded" in out, out
    extracts = [p.name for p in (work / "runs").iterdir() if p.name.startswith("extract-")]
    assert len(extracts) == 1
    key = json.loads((tmp_path / "runs" / "ssh1" / "r1" / "run.json").read_text())["prompt_caches"]["gsm8k"]["key"]
    res = json.loads((tmp_path / "runs" / "ssh1" / "r1" / "results.json").read_text())
    assert [s["name"] for s in res["suites"]] == ["gsm8k"]
    assert res["suites"][0]["cache"]["path"] == f"{work}/caches/{key}"
    from orchestrator.hosts.transport import SSHTransport
    from orchestrator.runs import extracts as ex
    trips: list[str] = []
    real_resolve, real_run = ex.resolve_prompts, SSHTransport.run

    def counted(self, cmd, **kw):
        trips.append(cmd)
        return real_run(self, cmd, **kw)

    def resolve(*a, **kw):  # the round trips resolving the suites make (issue 30 item 6: one when all is there)
        monkeypatch.setattr(SSHTransport, "run", counted)
        try:
            return real_resolve(*a, **kw)
        finally:
            monkeypatch.setattr(SSHTransport, "run", real_run)
    monkeypatch.setattr(ex, "resolve_prompts", resolve)
    assert run("r2") == 0
    out = capsys.readouterr().out
    assert "cache   gsm8k: in the store" in out and "done    r2 succeeded" in out, out
    assert len(trips) == 1 and "--plan" in trips[0], trips  # the look and the plan in one command
    assert [p.name for p in (work / "runs").iterdir() if p.name.startswith("extract-")] == extracts
