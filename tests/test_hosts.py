"""`reval hosts` / `reval hosts check` through the CLI runner, against real sshd hosts."""
from __future__ import annotations

import io
import json
import re
import shlex
import subprocess

import pytest
from rich.console import Console

from orchestrator.hosts.hostcheck import HostCheck, hosts_exit_code, interpret
from orchestrator.hosts.inventory import Host, VenvSpec, load_inventory
from orchestrator.hosts.sync import sync_payload
from orchestrator.hosts.transport import close_all, get_transport
from remote_payload.contract.gpus import inventory as parse_nvidia_smi
from reval import cli
from reval.cli.commands.hosts import check_table


def run_cli(capsys, monkeypatch, *argv) -> tuple[int, str]:
    monkeypatch.setenv("COLUMNS", "220")
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def render(table) -> str:
    con = Console(width=160, record=True, color_system=None, file=io.StringIO())
    con.print(table)
    return con.export_text()


# --- pure ---------------------------------------------------------------------------------------------------
def test_parse_nvidia_smi_rows():
    text = "0, NVIDIA H100 80GB HBM3, 81559, 3, 0\n1, NVIDIA RTX PRO 6000, 97887, 52000, 97\n2, X, [N/A], 1, [N/A]\n"
    g = parse_nvidia_smi(text)
    assert g[0] == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "memory_used_mib": 3,
                    "utilization_pct": 0}
    assert g[1]["utilization_pct"] == 97 and g[2]["memory_total_mib"] is None
    assert parse_nvidia_smi("") == []


def test_interpret_payload_and_venv_state():
    h = Host(name="g", address="g", venv=VenvSpec(mode="managed"))
    from orchestrator.hosts.environment import venv_key
    key = venv_key(["numpy"], "3.11.7", False)
    blob = {"python": "3.11.7", "manifest_hash": "abc", "venvs_ready": [key], "missing": [],
            "nvidia_smi": {"rc": 0, "out": "0, H100, 81559, 3, 0\n", "err": ""}}
    r = interpret(h, blob, manifest_hash="abc", requirements=["numpy"])
    assert r.ok and r.payload == "current" and r.venv == f"ready {key[:8]}" and r.gpus[0]["name"] == "H100"
    r = interpret(h, {**blob, "manifest_hash": "old", "venvs_ready": []}, manifest_hash="abc",
                  requirements=["numpy"])
    assert r.payload == "stale" and r.venv.startswith("absent")
    r = interpret(h, {**blob, "nvidia_smi": {"rc": 9, "out": "", "err": "driver mismatch"}}, manifest_hash="abc",
                  requirements=["numpy"])
    assert r.gpus == [] and "driver mismatch" in r.gpu_error
    text = render(check_table([r]))
    assert "nvidia-smi failed (exit 9)" in text


def test_exit_code_rules():
    ok, down, bad = HostCheck("a", "", reachable=True, ok=True), HostCheck("b", ""), HostCheck("c", "", reachable=True)
    assert hosts_exit_code([ok, ok]) == 0 and hosts_exit_code([down, down]) == 4
    assert hosts_exit_code([ok, down]) == 2 and hosts_exit_code([bad, down]) == 2
    assert hosts_exit_code([bad]) == 2


def test_hosts_table_lists_inventory(tmp_path, capsys, monkeypatch):
    inv = tmp_path / "h.yaml"
    inv.write_text("hosts:\n  gpu1: {address: gpu1.example.internal, user: eval, port: 2200, tags: [h100]}\n"
                   "groups:\n  boxes: [gpu1]\n")
    rc, out = run_cli(capsys, monkeypatch, "-i", str(inv), "hosts")
    assert rc == 0
    assert "eval@gpu1.example.internal:2200" in out and "h100" in out and "group boxes: gpu1" in out
    assert "local" in out


def test_bad_inventory_exits_3_with_one_line(tmp_path, capsys, monkeypatch):
    inv = tmp_path / "h.yaml"
    inv.write_text("hosts:\n  gpu1:\n    adress: x\n")
    rc, out = run_cli(capsys, monkeypatch, "-i", str(inv), "hosts", "check")
    assert rc == 3
    assert f"error: {inv} line 3: unknown key 'adress' in host 'gpu1' — did you mean 'address'?" in out


def test_check_local_host(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out = run_cli(capsys, monkeypatch, "hosts", "check", "local", "--json")
    assert rc == 0
    [r] = json.loads(out)
    assert r["ok"] and r["payload"] == "absent" and r["venv"] == "existing" and r["gpus"] is None


# --- real sshd ----------------------------------------------------------------------------------------------
@pytest.mark.ssh
def test_check_three_hosts_one_refused_one_cut(ssh_hosts, capsys, monkeypatch):
    c = ssh_hosts(3, extra={"connect_timeout_s": 1})
    inv = load_inventory(c.inventory_path)
    h1 = inv.get("ssh1")
    sync_payload(get_transport(h1), h1)  # ssh1 has the current payload
    rc, out = run_cli(capsys, monkeypatch, "-i", str(c.inventory_path), "hosts", "check", "cluster")
    assert rc == 0, out
    assert "no GPU (CPU runs)" in out and "current" in out and "absent" in out

    # each `reval hosts check` is a process of its own, whose ssh masters end with it (atexit): so here too,
    # or ssh3's master from the check above would stall on the DROP until ServerAlive gives up (15 s) instead
    # of a new connection timing out after connect_timeout_s
    close_all()
    c.cut(1, "reject")
    c.cut(2, "drop")
    rc, out = run_cli(capsys, monkeypatch, "-i", str(c.inventory_path), "hosts", "check", "cluster", "--json")
    assert rc == 2
    r1, r2, r3 = json.loads(out)
    assert r1["ok"] and r1["payload"] == "current" and r1["python"]
    assert not r2["reachable"] and "Connection refused" in r2["error"]
    assert not r3["reachable"] and "timed out" in r3["error"]

    close_all()
    c.cut(0, "reject")
    rc, out = run_cli(capsys, monkeypatch, "-i", str(c.inventory_path), "hosts", "check", "cluster")
    assert rc == 4 and out.count("UNREACHABLE") == 3 and "fix:" in out


@pytest.mark.ssh
def test_host_keys_unknown_refused_accept_new_records_changed_refused(ssh_hosts, capsys, monkeypatch):
    c = ssh_hosts(2, known=False)
    inv = str(c.inventory_path)
    rc, out = run_cli(capsys, monkeypatch, "-i", inv, "hosts", "check", "ssh1")
    assert rc == 4 and "not known" in out and "reval hosts check ssh1 --accept-new" in out
    assert c.known_hosts.read_text() == ""

    rc, out = run_cli(capsys, monkeypatch, "-i", inv, "hosts", "check", "--accept-new", "cluster")
    assert rc == 0, out
    recorded = c.known_hosts.read_text().splitlines()
    assert len(recorded) == 2

    close_all()
    rc, out = run_cli(capsys, monkeypatch, "-i", inv, "hosts", "check", "cluster")  # strict: now known
    assert rc == 0, out

    close_all()
    c.regen_host_key(1)
    line = next(i for i, l in enumerate(recorded, 1) if l.startswith(f"[{c.hosts[1].address}]"))
    for extra in ([], ["--accept-new"]):
        rc, out = run_cli(capsys, monkeypatch, "-i", inv, "hosts", "check", "cluster", *extra)
        assert rc == 2, out
        assert "CHANGED" in out and f"{c.known_hosts}:{line}" in out and "ssh-keygen -R" in out
    assert c.known_hosts.read_text().splitlines() == recorded  # never rewritten
    # The printed fix works as printed on a non-22 port (the entry is [addr]:port, not addr)
    fix = re.search(r"(ssh-keygen -R .*?) ; then (reval hosts check \S+ --accept-new)", out)
    assert fix and f"'[{c.hosts[1].address}]:{c.hosts[1].port}'" in fix.group(1), out
    subprocess.run(shlex.split(fix.group(1)), check=True, capture_output=True, timeout=30)
    assert len(c.known_hosts.read_text().splitlines()) == 1
    close_all()
    rc, out = run_cli(capsys, monkeypatch, "-i", inv, *shlex.split(fix.group(2))[1:])
    assert rc == 0, out


@pytest.mark.ssh
def test_check_sixteen_hosts_parallel(ssh_hosts, capsys, monkeypatch):
    c = ssh_hosts(16)
    rc, out = run_cli(capsys, monkeypatch, "-i", str(c.inventory_path), "hosts", "check", "cluster", "--json")
    assert rc == 0
    rows = json.loads(out)
    assert [r["host"] for r in rows] == [f"ssh{i}" for i in range(1, 17)] and all(r["ok"] for r in rows)
