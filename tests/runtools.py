"""Helpers for the run tests (launch, follow, the run commands): a local host in a temp dir with the payload
synced, the wrapper run directly, a fake nvidia-smi (a seam: the GPU machine is not here), and process-group
inspection via /proc."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import remote_payload
from orchestrator.hosts.inventory import Host, VenvSpec, load_inventory
from orchestrator.hosts.sync import sync_payload
from orchestrator.hosts.transport import LocalTransport, SSHTransport, resolve_workdir
from remote_payload.contract import protocol

# the folder holding remote_payload/, where `python -m remote_payload` finds it
PAYLOAD_PARENT = str(Path(remote_payload.__file__).resolve().parents[1])


def local_host(workdir: Path, name: str = "local", **kw) -> Host:
    return Host(name=name, local=True, workdir=str(workdir), python=sys.executable, venv=VenvSpec(mode="python"),
                gpus="none", **kw)


def synced_local(workdir: Path, **kw) -> tuple[Host, LocalTransport, str]:
    host = local_host(workdir, **kw)
    t = LocalTransport(host)
    sync_payload(t, host)
    return host, t, resolve_workdir(t)


def synced_ssh(cluster, name: str = "ssh1") -> tuple[Host, SSHTransport, str]:
    """The ssh_hosts fixture's host `name`, its transport, the payload synced there, and its workdir."""
    host = load_inventory(cluster.inventory_path).get(name)
    t = SSHTransport(host)
    sync_payload(t, host)
    return host, t, resolve_workdir(t)


def fake_nvidia_smi(bin_dir: Path, rows: list[tuple[int, int, int, int]]) -> Path:
    """An `nvidia-smi` that prints `index, memory.used, memory.total, utilization.gpu` rows."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    body = "".join(f"echo '{i}, {u}, {t}, {p}'\n" for i, u, t, p in rows)
    path = bin_dir / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is `pgid`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(d))
    return out


def wrap(run_dir: Path, *cmd: str, gpus: str = "none", env: dict | None = None, run_json=None, extra=(),
         timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`python -m remote_payload wrap --run-dir RUN_DIR --gpus GPUS [EXTRA] -- CMD`, run to its end (text output
    captured). env: added to this environment less CUDA_VISIBLE_DEVICES (a run's GPUs come from --gpus or from
    env); run_json: the path of a run.json to merge, or a dict (written to <run_dir>/.run.json.in)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "remote_payload", "wrap", "--run-dir", str(run_dir), "--gpus", gpus, *extra]
    if isinstance(run_json, dict):
        (run_dir / ".run.json.in").write_text(json.dumps(run_json))
        run_json = run_dir / ".run.json.in"
    if run_json is not None:
        argv += ["--run-json", str(run_json)]
    base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run([*argv, "--", *cmd], capture_output=True, text=True, timeout=timeout_s, check=False,
                          env={**base, **(env or {})}, cwd=PAYLOAD_PARENT)


def wait_status(run_dir: Path, states=protocol.TERMINAL_STATES, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            st = protocol.read_json(run_dir / protocol.STATUS_JSON)
            if st.get("state") in states:
                return st
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"{run_dir} did not reach {states} within {timeout_s}s")


def wait_lines(path: Path, n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {n} lines within {timeout_s}s")


def reval(capsys, *argv) -> tuple[int, str, str]:
    """`reval ARGV` through the CLI runner: (exit code, stdout, stderr); argparse's own exits count too."""
    from reval import cli
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    o, e = capsys.readouterr()
    return rc, o, e


def stop_after(n: int, total: int):
    """An extract `log` that raises KeyboardInterrupt at its "[n/total]" line: as if the run were killed after
    its n-th prompt (entry)."""
    def log(line):
        if line.startswith(f"[{n}/{total}]"):
            raise KeyboardInterrupt
    return log


def cut_cache(src: Path, dst: Path, a: int, b: int) -> Path:
    """A cache of prompts [a, b) of the cache at src: its own cache.json, the prompt files linked (a suite that is
    not a copy of another: the payload refuses the same data given as two suites)."""
    index = json.loads((src / "cache.json").read_text())
    dst.mkdir(parents=True)
    sub = {**index, "prompts": index["prompts"][a:b]}
    (dst / "cache.json").write_text(json.dumps(sub))
    for p in sub["prompts"]:
        (dst / p["file"]).symlink_to(src / p["file"])
    return dst
