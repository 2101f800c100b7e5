"""Caches built through reval on the real single-node Slurm (tests/slurm.py; issue 30): `reval extract` is one
Slurm job; `reval run --prompts` builds only what the store lacks (one extract job), then evaluates; the next run
builds nothing. The plan runs on the login node, the job on a node with the GPU its gres asks for: the recipe's
dtype is the job's (bf16), never the login node's CPU fp32 (which keyed a cache the job never built, so every
run --prompts started one extract job too many)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from remote_payload.tools import fixtures
from reval import cli
from tests import slurm as slurm_mod
from tests.tiny_models import write_prompts

pytestmark = [pytest.mark.slurm, pytest.mark.ssh]


@pytest.fixture(scope="module")
def hpc(tmp_path_factory):
    with slurm_mod.cluster_here(tmp_path_factory.mktemp("hpc")) as c:
        yield c


def _extract_runs(c) -> list[str]:
    return sorted(p.name for p in (c.shared / "runs").iterdir()
                  if json.loads((p / "run.json").read_text()).get("kind") == "extract")


def test_extract_then_run_with_prompts_through_slurm(hpc, trained_fixtures, capsys):
    root = Path(trained_fixtures)
    target, drafter = str(root / "target"), str(root / "drafter-good")
    a = write_prompts(hpc.here / "a.jsonl", fixtures.PROMPTS[:3])
    b = write_prompts(hpc.here / "b.jsonl", fixtures.PROMPTS[3:5])
    assert cli.main(["-i", hpc.inv, "extract", "hpc", "--target", target, "--prompts", f"gsm8k={a}",
                     "--for-drafter", drafter, "--max-new-tokens", "16", "--name", "ex1"]) == 0
    out = capsys.readouterr().out
    assert "gsm8k: built" in out, out
    [made] = json.loads((hpc.here / "runs" / "hpc" / "ex1" / "caches.json").read_text())["caches"]
    # the job's device (gres gpu:1), not the login node's: the plan there keys the same cache
    assert made["cache"]["recipe"]["options"]["dtype"] == "bf16"
    assert cli.main(["-i", hpc.inv, "ls", "hpc", "--json"]) == 0
    assert [r["kind"] for r in json.loads(capsys.readouterr().out) if r["name"] == "ex1"] == ["extract"]

    def run(name: str) -> str:
        rc = cli.main(["-i", hpc.inv, "run", "hpc", "--drafter", drafter, "--target", target, "--prompts",
                       f"gsm8k={a}", "--prompts", f"mt={b}", "--max-new-tokens", "16", "--max-blocks", "3",
                       "--name", name, "--", "--device", "cpu", "--dtype", "fp32"])
        out = capsys.readouterr().out
        assert rc == 0, out
        return out
    out = run("r1")  # gsm8k from the store, mt built by one extract job, then the eval
    assert "cache   gsm8k: in the store" in out and "cache   mt: built" in out, out
    assert len(_extract_runs(hpc)) == 2
    res = json.loads((hpc.here / "runs" / "hpc" / "r1" / "results.json").read_text())
    keys = {s["name"]: s["cache"]["key"] for s in res["suites"]}
    assert keys["gsm8k"] == made["key"] and res["suites"][0]["cache"]["recipe"]["options"]["dtype"] == "bf16"
    out = run("r2")  # everything in the store: no extract job
    assert "cache   gsm8k: in the store" in out and "cache   mt: in the store" in out, out
    assert len(_extract_runs(hpc)) == 2


def test_sweep_with_prompts_on_slurm_builds_once_before_its_array(hpc, trained_fixtures, capsys):
    """`reval sweep --prompts` on the cluster: the missing cache is built by one extract job before the
    checkpoints' array is submitted; the next night's array finds it and no extract job starts."""
    root = Path(trained_fixtures)
    p = write_prompts(hpc.here / "sweep.jsonl", fixtures.PROMPTS[5:8])

    def night(*more: str) -> str:
        rc = cli.main(["-i", hpc.inv, "sweep", "--checkpoints", f"{root}/drafters/step-*", "--hosts", "hpc",
                       "--target", str(root / "target"), "--prompts", f"nightly={p}", "--max-new-tokens", "12",
                       "--max-blocks", "3", "--poll-s", "1", "--sweep-dir", str(hpc.here / "sweeps"), *more,
                       "--", "--device", "cpu", "--dtype", "fp32"])
        err = capsys.readouterr().err
        assert rc == 0, err
        return err
    before = len(_extract_runs(hpc))
    err = night("--latest", "2")
    assert err.count("nightly: built") == 1 and "submit  2 checkpoint(s) on hpc" in err, err
    assert len(_extract_runs(hpc)) == before + 1
    err = night("--latest", "3")  # one new checkpoint: its eval on the cache there
    assert "nightly: in the store" in err and "built" not in err and "submit  1 checkpoint(s)" in err, err
    assert len(_extract_runs(hpc)) == before + 1
