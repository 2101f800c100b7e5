"""Issue 10, break 1: names from a listing are data, never options. A checkpoint folder that also holds
directories named `-delete`, `--help`, `-exec`, or with spaces, quotes and newlines: a sweep over it (on a real
sshd host and on this machine) lists and evaluates only the real checkpoints, names what it skipped, and every
file is still there afterwards (the old listing ran `find "$p"`, and find took `-delete` as its action)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrator import sweep
from orchestrator.hosts.inventory import load_inventory
from orchestrator.sweep import ledger
from tests.sweeptools import local_inventory, make_checkpoints, opts

HOSTILE = ["-delete", "--help", "-exec", "-newer", "a b", "it's", 'say "hi"', "semi;colon", "$(touch pwned)",
           "new\nline", ".hidden", "x" * 70]


def hostile_folder(root: Path) -> tuple[Path, dict[str, bytes]]:
    """Real checkpoints step-100/200 plus hostile siblings, each holding a file; every file's bytes."""
    ck = make_checkpoints(root, [100, 200])
    for name in HOSTILE:
        d = ck / name
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"not a checkpoint " + name.encode())
    return ck, snapshot(ck)


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def check_sweep(rep, log, ck: Path, before: dict[str, bytes], workdirs: list[Path]) -> None:
    assert snapshot(ck) == before, "a file of the checkpoint folder changed or vanished"
    assert [o.checkpoint for o in rep.outcomes] == ["step-100", "step-200"]
    assert all(o.state == "succeeded" for o in rep.outcomes), log
    skip = [line for line in log if line.startswith("skip")]
    # (a shell's `*` does not match .hidden, Python's glob does: it is skipped either way)
    assert len(skip) == 1 and "'-delete'" in skip[0] and "'--help'" in skip[0], log
    assert any(f"{n} name(s)" in skip[0] for n in (len(HOSTILE), len(HOSTILE) - 1)), skip
    assert not (ck / "pwned").exists() and not Path("pwned").exists()
    runs = [d.name for w in workdirs for d in (w / "runs").glob("*")]
    assert sorted(r.rsplit("-", 1)[0] for r in runs) == ["step-100", "step-200"]


def test_local_sweep_over_hostile_names_deletes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck, before = hostile_folder(tmp_path)
    inv = local_inventory(tmp_path, 1)
    log: list[str] = []
    rep = sweep.Sweep(opts(f"{ck}/*", ["locs"], tmp_path), inv, log=log.append).run()
    check_sweep(rep, log, ck, before, [tmp_path / "loc1"])


@pytest.mark.ssh
def test_remote_sweep_over_hostile_names_deletes_nothing(ssh_hosts, tmp_path, monkeypatch):
    cluster = ssh_hosts(1)
    monkeypatch.chdir(tmp_path)
    ck, before = hostile_folder(tmp_path)
    inv = load_inventory(cluster.inventory_path)
    log: list[str] = []
    rep = sweep.Sweep(opts(f"ssh1:{ck}/*", ["cluster"], tmp_path), inv, log=log.append).run()
    check_sweep(rep, log, ck, before, [cluster.hosts[0].workdir])
    # and the listing itself, twice more: nothing it runs touches a file (no cache: it lists and hashes again)
    from orchestrator.hosts.transport import get_transport
    t = get_transport(inv.get("ssh1"))
    skipped: list[str] = []
    hasher = sweep.HostPool(opts(f"ssh1:{ck}/*", ["cluster"], tmp_path), inv).remote_hashes  # as a sweep hashes
    found = sweep.discover([f"ssh1:{ck}/*"], inv, ledger.Ledger(tmp_path / "fresh-ledger.json"), {"ssh1": t},
                           skipped, hasher)
    assert [c.name for c in found] == ["step-100", "step-200"] and len(skipped) >= len(HOSTILE) - 1
    assert snapshot(ck) == before
    # the remote and local hashes of the real checkpoints agree (the listing's paths are the real ones)
    assert [c.content_hash for c in found] == [sweep.local_content_hash(ck / n) for n in ("step-100", "step-200")]
    assert json.dumps(skipped)  # plain strings
    assert os.path.isdir(ck / "-delete")
