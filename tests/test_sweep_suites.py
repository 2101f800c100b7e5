"""Sweeps over benchmark suites (--cache NAME=PATH repeated), the sweep's path rule (relative --target/--cache as
`reval run` takes them), an incomparable --baseline refused before anything runs, a suspect checkpoint marked on
the tau-vs-step plot, and the sweep's terminal table at narrow widths."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import reval
from orchestrator import sweep
from orchestrator.inventory import Host, Inventory
from tests.sweeptools import local_inventory, make_checkpoints, opts


def test_relative_target_and_cache_mean_the_current_directory_on_a_local_host(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100])
    o = opts(f"{ck}/step-*", ["locs"], tmp_path, target="models/T", cache=["gsm=eval/gsm", "eval/mt"])
    rep = reval.sweep(o, inventory=local_inventory(tmp_path, 1))
    assert rep.exit_code == 0
    saved = json.loads((rep.sweep_dir / "sweep.json").read_text())["options"]
    assert saved["target"] == str(tmp_path / "models/T")
    assert saved["cache"] == [f"gsm={tmp_path}/eval/gsm", str(tmp_path / "eval/mt")]


def test_relative_cache_with_a_remote_host_is_refused_in_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [100])
    inv = local_inventory(tmp_path, 1)
    inv.hosts["far"] = Host(name="far", address="192.0.2.1", workdir="/w")
    inv.groups["mixed"] = ["loc1", "far"]
    with pytest.raises(reval.Error) as e:
        reval.sweep(opts(f"{ck}/step-*", ["mixed"], tmp_path, target="/m/T", cache="eval/cache"), inventory=inv)
    msg = str(e.value)
    assert e.value.exit_code == 3 and "--cache 'eval/cache' is relative" in msg and "far" in msg
    assert "local: local:" not in msg and "Error" not in msg.split(":")[0]
    assert not (tmp_path / "sweeps").exists()  # nothing launched, nothing kept
