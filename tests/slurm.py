"""A real single-node Slurm (Debian's slurmctld, slurmd, munge) for tests, inside the private network
namespace that scripts/netns-run creates (REVAL_NETNS=1).

Everything lives in one temp dir: munged on a private socket and key, a slurm.conf bound to 127.0.0.1 only
(`CommunicationParameters=NoInAddrAny,NoCtldInAddrAny`), state/spool/logs, and fake GPUs declared through
gres (character devices made with mknod, major/minor of /dev/null: harmless, but Slurm sets
CUDA_VISIBLE_DEVICES from them). `jobcomp/filetxt` keeps finished jobs queryable (`sacct -c`),
`batch_sched_delay=0` starts a job as soon as it is submitted, and `config_overrides` lets the node declare
more CPUs than the machine has so that several 1-CPU jobs run at once on 2 cores.

Client commands find this cluster through SLURM_CONF only (`SlurmCluster.env`; the login node's sshd gets it
with `SetEnv`, see `sshd_extra()`); the daemons read a copy that differs only in MessageTimeout (see
CLIENT_MSG_TIMEOUT_S). Every daemon is started in the foreground and ended by pid in close(),
after the cluster's jobs are cancelled; job processes still alive then (found by SLURM_CONF in their
environment) are killed by pid.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.hosts.slurmjobs import JobInfo, _job_rows, _reason, _state_word
from tests.workers import extra_lo_byte, first_sshd_address, port_offset

BINARIES = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch", "/usr/bin/sacct")
CTLD_PORT, SLURMD_PORT = 6817, 6818
NODE = "node1"
# glibc's getaddrinfo(AI_ADDRCONFIG), which Slurm uses even for "127.0.0.1", answers "no such name" while
# 127.0.0.1 is the only IPv4 address up (it does not count loopback's own address). A second loopback address
# in the namespace makes IPv4 "configured"; it is removed again in close().
EXTRA_LO_ADDR = "127.0.0.{}/32"  # the last byte: tests/workers.extra_lo_byte() (250 in one process)
# MessageTimeout is also how long a Slurm program keeps retrying (once a second) to reach a slurmctld that is
# gone. The login node's client commands (SLURM_CONF: `conf`) get a short one: with slurmctld stopped, a query
# says "Unable to contact slurm controller" after CLIENT_MSG_TIMEOUT_S instead of the default 10 s. The daemons
# (`daemon_conf`, identical but for this line) get a long one: slurmstepd's job-complete message for a job that
# ends while slurmctld is gone keeps retrying that long before it sleeps 15 s (fixed in Slurm) and tries again,
# so the job's end reaches a slurmctld that is back within DAEMON_MSG_TIMEOUT_S at once. The client's stays
# twice the follow's stall_s (3 s): a stream that sent nothing while its squeue retried still shows as silence.
CLIENT_MSG_TIMEOUT_S, DAEMON_MSG_TIMEOUT_S = 6, 30


def slurm_skip_reason() -> str | None:
    """Why a real Slurm cannot run here, or None when it can."""
    if os.environ.get("REVAL_NETNS") != "1":
        return "needs the private network namespace: run under scripts/netns-run (make test does)"
    if os.geteuid() != 0:
        return "needs root to run slurmd and munged"
    for tool in BINARIES:
        if not os.path.exists(tool):
            return f"{tool} is missing (apt-get install slurmctld slurmd munge slurm-client; .ci/run does)"
    return None


def _conf(root: Path, *, cpus: int, gpus: int, mem_mb: int, extra: list[str], msg_timeout_s: int) -> str:
    return "\n".join([
        "ClusterName=revaltest", f"MessageTimeout={msg_timeout_s}",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={CTLD_PORT + port_offset()}", f"SlurmdPort={SLURMD_PORT + port_offset()}",
        "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={root / 'munge' / 'sock'}",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt", f"JobCompLoc={root / 'log' / 'jobcomp.txt'}",
        "SchedulerParameters=batch_sched_delay=0", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory", "DefMemPerCPU=100", "SlurmdParameters=config_overrides",
        "GresTypes=gpu", "MpiDefault=none", "ReturnToService=2", "KillWait=2",
        # the time-limit check runs every PERIODIC_TIMEOUT; OverTimeLimit 0: a job ends at its limit
        "OverTimeLimit=0", "MinJobAge=600",
        f"NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={NODE} CPUs={cpus} RealMemory={mem_mb} "
        + (f"Gres=gpu:{gpus} " if gpus else "") + "State=UNKNOWN",
        f"PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
        *extra, "",
    ])


@dataclass
class SlurmCluster:
    root: Path
    conf: Path          # the client commands' slurm.conf (SLURM_CONF)
    daemon_conf: Path   # the daemons' (-f): the same but for MessageTimeout (CLIENT_MSG_TIMEOUT_S above)
    gpus: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _added_addr: bool = False

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands of this cluster (and nothing else)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def sshd_extra(self) -> list[str]:
        """sshd_config lines for a login node: its sessions see this cluster's SLURM_CONF."""
        return [f"SetEnv SLURM_CONF={self.conf}"]

    def cmd(self, *argv: str, check: bool = True, timeout_s: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout_s)

    def log(self, name: str) -> str:
        p = self.root / "log" / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    # -- daemons ----------------------------------------------------------------------------------------
    def _start(self, name: str, argv: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "ab") as out:
            self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                                env=self.env)

    def _wait(self, what: str, ready, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited {p.returncode} while waiting for {what}: "
                                       f"{(self.root / 'log' / f'{name}.out').read_text()[-800:]}"
                                       f"{self.log(name)[-800:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurm test cluster: timed out waiting for {what}: "
                                   f"{self.log('slurmctld')[-600:]} {self.log('slurmd')[-600:]}")
            time.sleep(0.05)

    def start(self) -> None:
        self._lo_addr = EXTRA_LO_ADDR.format(extra_lo_byte())
        r = subprocess.run(["ip", "addr", "add", self._lo_addr, "dev", "lo"], check=False,
                           capture_output=True, text=True)
        self._added_addr = r.returncode == 0
        m = self.root / "munge"
        self._start("munged", ["/usr/sbin/munged", "-F", "-f", f"--socket={m / 'sock'}",
                               f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                               f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait("munged's socket", (m / "sock").exists)
        self._start("slurmctld", ["/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.daemon_conf)])
        self._start("slurmd", ["/usr/sbin/slurmd", "-D", "-N", NODE, "-f", str(self.daemon_conf)])

        def node_idle() -> bool:
            r = self.cmd("sinfo", "-h", "-n", NODE, "-o", "%T", check=False, timeout_s=10)
            return r.returncode == 0 and r.stdout.strip() == "idle"
        self._wait("the node to register idle", node_idle)

    def stop_controller(self) -> None:
        """End slurmctld (its state saved; jobs go on under slurmd): client commands fail until it is back."""
        p = self.procs.pop("slurmctld")
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)

    def start_controller(self) -> None:
        """slurmctld again, from its saved state (the jobs it had, and what slurmd reports since)."""
        self._start("slurmctld", ["/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.daemon_conf)])
        self._wait("slurmctld to answer",
                   lambda: self.cmd("squeue", "-h", check=False, timeout_s=10).returncode == 0, timeout_s=60)

    def job_pids(self) -> list[int]:
        """Live processes (job steps, slurmstepd) whose environment names this cluster's slurm.conf (a job's:
        the daemons' copy, which slurmd puts in its environment; slurmstepd's: the one slurmd inherited)."""
        markers = {f"SLURM_CONF={c}".encode() for c in (self.conf, self.daemon_conf)}
        daemons = {p.pid for p in self.procs.values()}
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) in daemons or int(d) == os.getpid():
                continue
            try:
                env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if markers.intersection(env):
                out.append(int(d))
        return out

    def close(self) -> None:
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.cmd("scancel", "--full", "--quiet", "-u", "root", check=False, timeout_s=10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                r = self.cmd("squeue", "-h", "-o", "%i", check=False, timeout_s=10)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.1)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for pid in self.job_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._added_addr:
            subprocess.run(["ip", "addr", "del", self._lo_addr, "dev", "lo"], check=False, capture_output=True)
            self._added_addr = False


def make_slurm(root: Path, *, cpus: int = 8, gpus: int = 2, mem_mb: int = 4000,
               extra: list[str] | None = None) -> SlurmCluster:
    """Write the config into `root` and start munged, slurmctld and slurmd (about 1 s)."""
    for d in ("munge", "state", "spool", "log", "dev"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    for i in range(gpus):  # fake GPUs: character devices 1:3 (what /dev/null is)
        os.mknod(root / "dev" / f"gpu{i}", 0o666 | 0o020000, os.makedev(1, 3))
    conf, daemon_conf = root / "slurm.conf", root / "slurm-daemons.conf"
    for path, msg_timeout_s in ((conf, CLIENT_MSG_TIMEOUT_S), (daemon_conf, DAEMON_MSG_TIMEOUT_S)):
        path.write_text(_conf(root, cpus=cpus, gpus=gpus, mem_mb=mem_mb, extra=list(extra or []),
                              msg_timeout_s=msg_timeout_s))
    if gpus:
        (root / "gres.conf").write_text(f"NodeName={NODE} Name=gpu File={root / 'dev'}/gpu[0-{gpus - 1}]\n")
    cluster = SlurmCluster(root, conf, daemon_conf, gpus)
    try:
        cluster.start()
    except BaseException:
        cluster.close()
        raise
    return cluster


def wait_state(cluster: SlurmCluster, job: str, states: set[str], timeout_s: float = 60) -> str:
    """Poll `scontrol show job` until the job's JobState is in `states` (returns it)."""
    deadline = time.monotonic() + timeout_s
    state = "?"
    while time.monotonic() < deadline:
        r = cluster.cmd("scontrol", "-o", "show", "job", job, check=False)
        for word in r.stdout.split():
            if word.startswith("JobState="):
                state = word.split("=", 1)[1]
        if state in states:
            return state
        time.sleep(0.05)
    raise AssertionError(f"job {job} still {state} after {timeout_s}s (wanted {states})")


def add_cluster_host(inventory_path: Path, login: str, workdir: Path, *, name: str = "hpc",
                     slurm: dict | None = None, group: list[str] | None = None) -> None:
    """Add a cluster entry to an ssh_hosts inventory: host `name` reaches the login node the way host
    `login` is reached, runs in `workdir` (the "shared filesystem"), with job settings `slurm`."""
    import yaml

    inv = yaml.safe_load(inventory_path.read_text())
    entry = {k: v for k, v in inv["hosts"][login].items() if k != "gpus"}
    inv["hosts"][name] = {**entry, "workdir": str(workdir), "slurm": slurm or {}}
    if group:
        inv.setdefault("groups", {})["mixed"] = group
    workdir.mkdir(parents=True, exist_ok=True)
    inventory_path.write_text(yaml.safe_dump(inv, sort_keys=False))


class Cluster:
    """The module's cluster: `slurm` (the daemons), `login` (sshd: ssh1 = the login node, ssh2 = a plain SSH
    box), `inv` (hosts.yaml: hpc, hpc1min (time: 1), group mixed = [ssh2, hpc]), `shared` (hpc's workdir)."""

    def __init__(self, root: Path):
        from tests import sshd
        self.root = root
        self.slurm = make_slurm(root / "slurm")
        try:
            self.login = sshd.make_ssh_hosts(root / "sshd", 2, first_address=first_sshd_address(),
                                             sshd_extra=self.slurm.sshd_extra())
        except BaseException:
            self.slurm.close()
            raise
        self.shared = root / "shared"
        self.inv = str(self.login.inventory_path)
        add_cluster_host(self.login.inventory_path, "ssh1", self.shared,
                                   slurm={"gres": "gpu:1", "max_running": 2}, group=["ssh2", "hpc"])
        add_cluster_host(self.login.inventory_path, "ssh1", self.shared, name="hpc1min",
                                   slurm={"time": "1"})
        self.here = root / "here"
        self.here.mkdir()

    def run_dir(self, name: str) -> Path:
        return self.shared / "runs" / name

    def job_id(self, name: str) -> str:
        return json.loads((self.run_dir(name) / ".slurm.json").read_text())["job_id"]

    def scontrol(self, job: str) -> dict:
        out = self.slurm.cmd("scontrol", "-o", "show", "job", job).stdout
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def close(self) -> None:
        from orchestrator.hosts import transport
        transport.close_all()
        self.login.close()
        self.slurm.close()


@contextlib.contextmanager
def cluster_here(root: Path):
    """A Cluster at `root`, the working directory its `here` while it lives (reval writes runs/ there); closed,
    and the directory restored, after. A test module's fixture: `with cluster_here(tmp) as c: yield c`; skips
    (with the reason) where Slurm or the private network namespace is missing, which tests/whole.py fails."""
    import pytest

    from tests import sshd
    reason = slurm_skip_reason() or sshd.netns_skip_reason()
    if reason:
        pytest.skip(reason)
    c = Cluster(root)
    old = os.getcwd()
    os.chdir(c.here)
    try:
        yield c
    finally:
        os.chdir(old)
        c.close()


def parse_squeue(text: str) -> dict[str, JobInfo]:
    """`squeue -h -r -t all -o '%i|%T|%r|%N'` -> {job id: JobInfo} (exit codes: not in squeue). reval reads
    scontrol and sacct; squeue is read here, to check the states against what a third Slurm command says."""
    return {p[0]: JobInfo(p[0], _state_word(p[1]), _reason(p[2]), node=p[3] if len(p) > 3 else "")
            for p in _job_rows(text)}
