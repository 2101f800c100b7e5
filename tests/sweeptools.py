"""Helpers for the sweep tests (test_sweep, test_sweep_report, test_hostile_names, the Slurm sweeps): fake
checkpoint folders, an inventory of local hosts, and the options of a dummy-payload sweep."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from orchestrator import sweep
from orchestrator.hosts.inventory import Host, Inventory, VenvSpec
from orchestrator.runs.lifecycle import EvalSpec
from orchestrator.sweep.ledger import LedgerEntry

DUMMY = ["--lines", "4", "--interval-s", "0.1"]


def make_checkpoints(root: Path, steps) -> Path:
    """<root>/ckpts/step-<s> for each step: config.json, a model.safetensors of random bytes (a content hash of
    its own) and sub/extra.bin. Returns <root>/ckpts."""
    d = root / "ckpts"
    for s in steps:
        c = d / f"step-{s}"
        (c / "sub").mkdir(parents=True)
        (c / "config.json").write_text(json.dumps({"step": s}))
        (c / "model.safetensors").write_bytes(os.urandom(2048) + s.to_bytes(4, "little"))
        (c / "sub" / "extra.bin").write_bytes(b"x" * s)
    return d


def local_inventory(root: Path, n: int) -> Inventory:
    hosts = {f"loc{i}": Host(name=f"loc{i}", local=True, workdir=str(root / f"loc{i}"), python=sys.executable,
                             venv=VenvSpec(mode="python"), gpus="none") for i in range(1, n + 1)}
    return Inventory(path=None, hosts=hosts, groups={"locs": list(hosts)})


def opts(ckpt_glob: str, hosts: list[str], tmp: Path, **kw) -> sweep.SweepOptions:
    """The dummy payload's sweep; keywords that are EvalSpec fields (target, cache, ...) go to its spec."""
    names = {f.name for f in dataclasses.fields(EvalSpec)}
    spec = EvalSpec(**{"payload": "dummy", "extra": DUMMY, **{k: v for k, v in kw.items() if k in names}})
    return sweep.SweepOptions(checkpoints=[ckpt_glob], hosts=hosts, spec=spec, sweep_dir=str(tmp / "sweeps"),
                              poll_s=0.2, backoff_s=0.2, **{k: v for k, v in kw.items() if k not in names})


def entry_from(entry: LedgerEntry, **changes) -> LedgerEntry:
    """A copy of a ledger entry with `changes` (a ledger as an earlier sweep left it)."""
    return LedgerEntry(**{**asdict(entry), **changes})
