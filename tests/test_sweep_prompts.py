"""`reval sweep --prompts NAME=FILE` over real sshd hosts (issue 30): each host resolves the suites to the caches of
its own store, builds what is missing once (one extract run, before that host's first eval), and the next night
builds nothing."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from remote_payload.tools import fixtures
from reval import cli
from tests.tiny_models import write_prompts


def _extract_runs(work: Path) -> list[Path]:
    return sorted(p for p in (work / "runs").iterdir() if json.loads((p / "run.json").read_text()).get("kind")
                  == "extract")


def _eval_runs(work: Path) -> list[Path]:
    return sorted(p for p in (work / "runs").iterdir() if p not in _extract_runs(work))


@pytest.mark.ssh
@pytest.mark.slow
def test_sweep_with_prompts_builds_each_hosts_caches_once(ssh_hosts, trained_fixtures, tmp_path, monkeypatch,
                                                          capsys):
    root = Path(trained_fixtures)
    cluster = ssh_hosts(2)
    monkeypatch.chdir(tmp_path)
    a = write_prompts(tmp_path / "a.jsonl", fixtures.PROMPTS[:3])
    works = [h.workdir for h in cluster.hosts]

    def night(*more: str) -> int:
        return cli.main(["-i", str(cluster.inventory_path), "sweep", "--checkpoints", f"{root}/drafters/step-*",
                         "--hosts", "cluster", "--target", str(root / "target"), "--prompts", f"gsm8k={a}",
                         "--max-new-tokens", "16", "--max-blocks", "3", "--poll-s", "1", *more,
                         "--", "--device", "cpu", "--dtype", "fp32"])
    assert night("--latest", "2") == 0
    err = capsys.readouterr().err
    assert err.count("gsm8k: built") == 2, err  # each host its own, once
    for w in works:
        [ex] = _extract_runs(w)
        [store] = [p for p in (w / "caches").iterdir() if not p.name.startswith(".")]
        [ev] = _eval_runs(w)
        info = json.loads((ev / "run.json").read_text())
        assert info["prompt_caches"]["gsm8k"]["key"] == store.name
        # no eval before its caches: the eval started after the extract ended
        ended = json.loads((ex / "status.json").read_text())["finished_at"]
        assert json.loads((ev / "status.json").read_text())["started_at"] >= ended
        res = json.loads((tmp_path / "runs" / cluster.hosts[works.index(w)].name / ev.name / "results.json")
                         .read_text())
        cache = res["suites"][0]["cache"]
        assert cache["path"] == str(store) and cache["key"] == store.name  # results.json: the key and its recipe
        assert cache["recipe"]["options"]["dtype"] == "fp32" and cache["recipe"]["prompts"]["count"] == 3
        assert cache["recipe"]["options"]["layers"] == res["drafter"]["target_layer_ids"]
    # the same recipe on both hosts (same target, prompts, layers, dtype): the same key
    assert len({p.name for w in works for p in (w / "caches").iterdir() if not p.name.startswith(".")}) == 1
    # `reval ls`: the job kind (run.json's), a column once an extract is among the runs
    assert cli.main(["-i", str(cluster.inventory_path), "ls", "--json"]) == 0
    kinds = sorted(r["kind"] for r in json.loads(capsys.readouterr().out))
    assert kinds == ["eval", "eval", "extract", "extract"]
    assert cli.main(["-i", str(cluster.inventory_path), "ls"]) == 0
    table = capsys.readouterr().out
    assert "kind" in table.splitlines()[0] and all(
        ln.split()[2] == "extract" for ln in table.splitlines() if "extract-" in ln), table
    # the next night: the new checkpoints evaluated on the caches there, nothing built
    assert night() == 0
    err = capsys.readouterr().err
    assert "built" not in err and err.count("gsm8k: in the store") >= 1, err
    assert [len(_extract_runs(w)) for w in works] == [1, 1]
    assert sum(len(_eval_runs(w)) for w in works) == len(list((root / "drafters").glob("step-*")))


def test_sweep_with_prompts_and_the_dummy_payload_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    a = write_prompts(tmp_path / "a.jsonl", fixtures.PROMPTS[:1])
    rc = cli.main(["sweep", "--checkpoints", f"{tmp_path}/step-*", "--hosts", "local", "--target", "/t",
                   "--prompts", f"gsm8k={a}", "--payload", "dummy"])
    assert rc == 3 and "--payload dummy reads none" in capsys.readouterr().err


def test_a_failed_cache_build_is_not_tried_again_on_that_host(monkeypatch, tmp_path):
    """The seam: runs/extracts.resolve_prompts (the real one: the sweep above). A build that failed on a host
    fails that checkpoint; the host's next checkpoints only look (a plan: their caches may be there) and fail
    in one line saying why, instead of one failing extract run each."""
    from orchestrator.errors import EvalFailed
    from orchestrator.hosts.inventory import Host
    from orchestrator.runs.lifecycle import EvalSpec
    from orchestrator.sweep import HostPool, HostSession, SweepOptions, stage

    asked = []

    def resolve(side, spec, *, synced, build, name, run_json):
        asked.append((spec.drafter, build))
        if build:
            raise EvalFailed("h/extract-1: building the caches of gsm8k failed; nothing was evaluated")
    monkeypatch.setattr(stage.extracts, "resolve_prompts", resolve)
    pool = HostPool(SweepOptions(checkpoints=[], hosts=["h"]), None)
    hs = HostSession(Host(name="h", local=True), None, None)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')  # a prompt file is read here: it must be one
    spec = EvalSpec(target="/t", prompts=[f"gsm8k={tmp_path / 'p.jsonl'}"])
    with pytest.raises(EvalFailed, match="building the caches of gsm8k failed"):
        pool.resolve_caches(hs, dataclasses.replace(spec, drafter="/c/1"), run="r1")
    with pytest.raises(EvalFailed, match="failed there before .* not tried again until the next sweep"):
        pool.resolve_caches(hs, dataclasses.replace(spec, drafter="/c/2"), run="r2")
    assert asked == [("/c/1", True), ("/c/2", False)]
