"""Issue 19: faults of a run's machinery, each with real components (real processes, a real sshd in the private
netns, a real full filesystem): a SIGKILLed controller whose ssh master died uncleanly too (item 12)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import transport

REPO = Path(__file__).resolve().parents[1]


# --- item 12: a dead controller's control folder whose master died uncleanly ----------------------------------
CONTROLLER = """
import os, signal, sys
from orchestrator import transport
from orchestrator.inventory import load_inventory
t = transport.SSHTransport(load_inventory(sys.argv[1]).get("ssh1"))
t.run("true", timeout_s=60)                     # opens a ControlMaster (ControlPersist: it outlives us)
print(t._control, flush=True)
os.kill(os.getpid(), signal.SIGKILL)            # a controller that cannot clean up
"""


def _master_pid(host, control: str) -> int:
    t = transport.SSHTransport(host)
    t._control = control  # ask that master, through its own socket
    p = subprocess.run(["ssh", *t.ssh_options(), "-O", "check", host.address], capture_output=True, text=True,
                       timeout=30, check=False, stdin=subprocess.DEVNULL)
    transport._OPEN.pop(control, None)  # not ours to close
    m = re.search(r"pid=(\d+)", p.stderr)
    assert m, p.stderr
    return int(m.group(1))


def test_a_dead_controllers_folder_with_a_stale_master_socket_is_removed(ssh_hosts, monkeypatch):
    from orchestrator.inventory import load_inventory
    cluster = ssh_hosts(1)
    root = Path(os.environ["REVAL_CONTROL_ROOT"]) / "i12"  # short: a socket path has ~100 bytes
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "REVAL_CONTROL_ROOT": str(root)}
    p = subprocess.run([sys.executable, "-c", CONTROLLER, str(cluster.inventory_path)], env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr
    control = p.stdout.strip()
    folder = os.path.dirname(control)
    assert os.listdir(folder) == [os.path.basename(control)]
    host = load_inventory(cluster.inventory_path).get("ssh1")
    master = _master_pid(host, control)
    try:
        assert transport.master_listens(control)
        assert transport.remove_stale_control_dirs(str(root)) == []  # a master lives on there: kept
        assert os.path.exists(control)
    finally:
        os.kill(master, signal.SIGKILL)  # the master dies uncleanly too: its socket file stays
    for _ in range(200):  # gone (or a zombie: its socket is closed either way)
        try:
            if Path(f"/proc/{master}/stat").read_text().rsplit(") ", 1)[1][0] == "Z":
                break
        except OSError:
            break
        time.sleep(0.05)
    assert os.path.exists(control) and not transport.master_listens(control)
    # the next controller's first transport sweeps it (it used to keep that folder forever)
    monkeypatch.setattr(transport, "_CONTROL_DIR", None)
    monkeypatch.setenv("REVAL_CONTROL_ROOT", str(root))
    try:
        mine = transport._control_dir()
        assert sorted(os.listdir(root)) == [os.path.basename(mine)]
    finally:
        transport.close_all()
        monkeypatch.setattr(transport, "_CONTROL_DIR", None)
        shutil.rmtree(root, ignore_errors=True)
