"""An EAGLE-3 drafter's decoding (--chain K, --eagle-tree TOTAL,DEPTH,TOPK) as options of the one spec: checked once
(contract/spec.py, the parse the payload uses), `reval run` / `reval sweep` options, in the payload's argv and its
preflight, in a sweep's ledger key; refused for a DFlash drafter by the host's preflight in one line."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.runs.lifecycle import EvalSpec
from remote_payload.contract import spec as contract
from remote_payload.runtime import preflight
from reval import cli
from tests.runtools import reval

ROOT = Path(__file__).resolve().parents[1]


def _spec(**kw) -> EvalSpec:
    return EvalSpec(drafter="/d", target="/t", cache="/c", **kw)


def test_the_decoding_is_a_checked_field_of_the_one_spec():
    tree = _spec(eagle_tree="default")
    assert tree.eagle_tree == "60,7,10" and tree.chain is None  # written out: default and 60,7,10 are one spec
    assert tree.payload_argv()[-2:] == ["--eagle-tree", "60,7,10"]
    assert tree.preflight_argv()[-2:] == ["--eagle-tree", "60,7,10"]
    assert _spec(chain=3).payload_argv()[-2:] == ["--chain", "3"]
    assert _spec(eagle_tree=(20, 3, 4)).eagle_tree == "20,3,4"  # the API's three numbers
    assert "--chain" not in _spec().payload_argv() and "--eagle-tree" not in _spec().preflight_argv()
    keys = [_spec(**kw).numbers_key() for kw in ({}, {"chain": 3}, {"chain": 5}, {"eagle_tree": "20,3,4"},
                                                  {"eagle_tree": "default"})]
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == len(keys)
    assert "chain" not in keys[0] and "eagle_tree" not in keys[0]  # keys of sweeps made before stay the same
    assert _spec(eagle_tree="60, 7, 10").numbers_key() == keys[-1]
    assert _spec(eagle_tree="default").identity("h") == _spec(eagle_tree="60,7,10").identity("h")
    assert contract.parse_tree("default") == contract.TreeShape(60, 7, 10)


@pytest.mark.parametrize("kw, said", [
    ({"eagle_tree": "60,7"}, "--eagle-tree '60,7': expected TOTAL_TOKEN,DEPTH,TOP_K"),
    ({"eagle_tree": "1,3,2"}, "need total_token >= 2"),
    ({"eagle_tree": "30,1,2"}, "score only 6 candidates"),
    ({"eagle_tree": (7.0, 1, 2)}, "expected TOTAL_TOKEN,DEPTH,TOP_K"),
    ({"chain": 0}, "--chain must be a whole number of at least 1"),
    ({"chain": True}, "--chain must be a whole number"),
    ({"chain": 3, "eagle_tree": "6,4,1"}, "--chain 3 and --eagle-tree 6,4,1: one decoding per run"),
    ({"chain": 3, "payload": "dummy"}, "--chain is an option of the eval"),
    ({"extra": ["--eagle-tree", "6,4,1"]}, "--eagle-tree among the payload's extra arguments"),
    ({"extra": ["--chain=2"]}, "--chain among the payload's extra arguments"),
])
def test_a_bad_decoding_is_refused_when_the_spec_is_made(kw, said):
    with pytest.raises(ConfigError) as e:
        _spec(**kw)
    assert said in str(e.value) and e.value.exit_code == 3 and "\n" not in str(e.value)


def test_run_and_sweep_take_the_options_and_refuse_a_bad_one_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for cmd in ("run", "sweep"):
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        out = capsys.readouterr().out
        assert "--chain K" in out and "--eagle-tree TOTAL,DEPTH,TOPK" in out, cmd
    rc, _, err = reval(capsys, "run", "local", "--drafter", "/d", "--target", "/t", "--cache", "/c",
                         "--eagle-tree", "30,1,2")
    assert rc == 3 and "score only 6 candidates" in err and len(err.strip().splitlines()) <= 2, err
    assert not (tmp_path / ".reval").exists()  # refused before anything was synced or started
    rc, _, err = reval(capsys, "sweep", "--checkpoints", f"{tmp_path}/step-*", "--hosts", "local", "--target", "/t",
                       "--cache", "/c", "--chain", "2", "--eagle-tree", "default")
    assert rc == 3 and "one decoding per run" in err, err


def _preflight(*argv: str) -> int:
    p = argparse.ArgumentParser()
    preflight.add_arguments(p)
    return preflight.main(p.parse_args(list(argv)))


def test_the_hosts_preflight_refuses_a_dflash_drafter_with_an_eagle3_decoding(fx, capsys):
    common = ["--target", str(fx["target"]), "--cache", str(fx["cache"])]
    dflash = str(fx["drafter_good"])
    assert _preflight("--drafter", dflash, *common) == 0
    for opt, said in ((["--chain", "3"], "--chain 3: the chain length is for EAGLE-3 drafters"),
                      (["--eagle-tree", "6,4,1"], "--eagle-tree 6,4,1: EAGLE's draft tree is for EAGLE-3 drafters")):
        assert _preflight("--drafter", dflash, *common, *opt) == 3
        err = capsys.readouterr().err
        assert err.startswith("error: " + said) and "is a DFlash drafter" in err and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def e3():
    from remote_payload.tools import eagle3_fixtures
    root = ROOT / ".cache" / "eagle3-fixtures"
    eagle3_fixtures.build(root, log=lambda line: None)
    return root


def test_the_preflight_takes_the_decoding_of_an_eagle3_head(e3):
    common = ["--drafter", str(e3 / "eagle3"), "--target", str(e3 / "target"), "--cache", str(e3 / "cache")]
    assert _preflight(*common, "--eagle-tree", "6,4,1") == 0 and _preflight(*common, "--chain", "3") == 0


def _runs(work: Path) -> list[Path]:
    return sorted((work / "runs").iterdir()) if (work / "runs").is_dir() else []


@pytest.mark.ssh
@pytest.mark.slow
def test_sweeps_that_differ_only_in_the_tree_are_two_ledger_entries_over_sshd(ssh_hosts, e3, fx, tmp_path,
                                                                              monkeypatch, capsys):
    """`reval sweep --eagle-tree` over a real sshd: the tree reaches the payload (run.json, results.json), another
    tree is another ledger entry (evaluated), the same tree again is skipped; a DFlash drafter with --chain is
    refused by the host's preflight in one line and nothing is created there."""
    cluster = ssh_hosts(1)
    inv, work = str(cluster.inventory_path), cluster.hosts[0].workdir
    monkeypatch.chdir(tmp_path)

    def sweep(tree: str) -> tuple[int, str]:
        rc = cli.main(["-i", inv, "sweep", "--checkpoints", f"{e3}/eagle3", "--hosts", "ssh1", "--target",
                       str(e3 / "target"), "--cache", str(e3 / "cache"), "--num-prompts", "1", "--max-blocks", "2",
                       "--eagle-tree", tree, "--poll-s", "1", "--", "--device", "cpu", "--dtype", "fp32"])
        return rc, capsys.readouterr().err

    rc, err = sweep("20,3,4")
    assert rc == 0, err
    [first] = _runs(work)
    argv = json.loads((first / "run.json").read_text())["payload_argv"]
    assert argv[argv.index("--eagle-tree") + 1] == "20,3,4"
    res = json.loads(next((tmp_path / "runs" / "ssh1").glob(f"{first.name}/results.json")).read_text())
    assert res["drafter"]["eagle3"]["tree"] == {"total_token": 20, "depth": 3, "top_k": 4}
    assert res["options"]["block_size"] == 5  # depth + 2
    rc, err = sweep("6,4,1")
    assert rc == 0, err
    assert len(_runs(work)) == 2  # another tree: another ledger entry, evaluated
    rc, err = sweep("20,3,4")
    assert rc == 0 and "1 already evaluated (skipped)" in err, err
    assert len(_runs(work)) == 2
    rc, _, err = reval(capsys, "-i", inv, "run", "ssh1", "--drafter", str(fx["drafter_good"]), "--target",
                         str(fx["target"]), "--cache", str(fx["cache"]), "--chain", "3", "--name", "dflash-k3")
    assert rc == 3 and "ssh1: --chain 3: the chain length is for EAGLE-3 drafters" in err, err
    assert "Traceback" not in err and not (work / "runs" / "dflash-k3").exists()


def test_the_spec_refuses_the_tree_with_sampled_drafts_before_a_launch():
    """EAGLE's tree at T > 0 is not evaluated: reval's spec refuses --eagle-tree with --draft sampled when it is
    made (one line, the payload's own words), so nothing is launched to fail on the host."""
    from remote_payload.contract.spec import TREE_SAMPLED_REFUSED, EvalSpec, SpecError
    with pytest.raises(SpecError) as e:
        EvalSpec(drafter="/ckpt/e3", target="/t", cache="/c", eagle_tree="default", draft="sampled")
    assert str(e.value) == TREE_SAMPLED_REFUSED
    assert EvalSpec(drafter="/ckpt/e3", target="/t", cache="/c", chain=3, draft="sampled").chain == 3
    assert EvalSpec(drafter="/ckpt/e3", target="/t", cache="/c", eagle_tree="default").eagle_tree == "60,7,10"
