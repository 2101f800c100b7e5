"""`reval hosts check`: one round trip per host (a stdlib Python script on stdin prints one JSON blob:
python, disk free, GPUs from nvidia-smi, payload manifest hash, ready venvs), hosts checked in parallel,
each host's own result; an unreachable host is a row with the reason and the fix, never an abort."""
from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from remote_payload.contract import gpus

from ..errors import EXIT_OK, EXIT_PARTIAL, EXIT_UNREACHABLE, HostKeyError, HostUnreachable, RevalError
from .environment import module_names, venv_key
from .inventory import Host
from .sync import local_manifest_hash, payload_requirements
from .transport import get_transport, q, workdir_expr

NVIDIA_SMI_QUERY = ["--query-gpu=index,name,memory.total,memory.used,utilization.gpu",
                    "--format=csv,noheader,nounits"]

# A cluster's login node: partitions and GPUs (sinfo), partition limits, the user's association limits
SLURM_CHECK_CMDS = {
    "version": ["sinfo", "--version"],
    "sinfo": ["sinfo", "-h", "-o", "%P|%a|%l|%D|%G|%c|%m"],
    "partitions": ["scontrol", "-o", "show", "partition"],
    "assoc": ["sacctmgr", "-n", "-P", "show", "assoc", "where", "user=@USER@",
              "format=Account,Partition,QOS,MaxJobs,MaxSubmit,MaxWall,MaxTRES,GrpTRES"],
}

# Runs on the host under its own python (stdlib only, 3.6+). argv: workdir, venvs dir ('' = default), modules.
CHECK_SCRIPT = r"""
import importlib.util, json, os, platform, shutil, subprocess, sys
w, vd, mods = sys.argv[1], sys.argv[2] or os.path.join(sys.argv[1], "venvs"), sys.argv[3:]
out = {"python": platform.python_version(), "executable": sys.executable, "workdir": w}
p = w
while not os.path.exists(p):
    p = os.path.dirname(p)
st = os.statvfs(p)
out["disk_free_bytes"] = st.f_bavail * st.f_frsize
try:
    with open(os.path.join(w, "payload", "MANIFEST.json")) as f:
        out["manifest_hash"] = json.load(f).get("hash")
except Exception:
    out["manifest_hash"] = None
out["venvs_ready"] = sorted(d for d in os.listdir(vd) if os.path.exists(os.path.join(vd, d, ".reval-ready"))) \
    if os.path.isdir(vd) else []
out["missing"] = [m for m in mods if importlib.util.find_spec(m) is None]
out["rsync"], out["uv"] = shutil.which("rsync"), shutil.which("uv")
smi = shutil.which("nvidia-smi")
if os.environ.get("REVAL_CHECK_SLURM"):  # a cluster's login node: Slurm's view, not the login node's GPUs
    smi, out["slurm"] = None, {}
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or ""
    for k, argv in SLURM_CMDS.items():
        try:
            r = subprocess.run([a.replace("@USER@", user) for a in argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, timeout=30)
            out["slurm"][k] = {"rc": r.returncode, "out": r.stdout.decode(errors="replace")[-20000:],
                               "err": r.stderr.decode(errors="replace")[-300:]}
        except Exception as e:
            out["slurm"][k] = {"rc": 127, "out": "", "err": str(e)}
out["nvidia_smi"] = None
if smi:
    try:
        r = subprocess.run([smi] + QUERY, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
        out["nvidia_smi"] = {"rc": r.returncode, "out": r.stdout.decode(errors="replace"),
                             "err": r.stderr.decode(errors="replace")[-300:]}
    except Exception as e:
        out["nvidia_smi"] = {"rc": -1, "out": "", "err": str(e)}
print(json.dumps(out))
""".replace("QUERY", repr(NVIDIA_SMI_QUERY)).replace("SLURM_CMDS", repr(SLURM_CHECK_CMDS))


@dataclass
class HostCheck:
    """One host's `hosts check`: `ok`, `reachable`, or `error` (one line) and `hint` (the fix); what was found."""
    host: str
    address: str
    reachable: bool = False
    ok: bool = False
    error: str | None = None       # one line
    hint: str | None = None        # the fix
    python: str | None = None
    workdir: str | None = None
    disk_free_bytes: int | None = None
    gpus: list[dict] | None = None  # None: no nvidia-smi (CPU runs)
    gpu_error: str | None = None
    payload: str = "?"             # current | stale | absent
    venv: str = "?"                # ready <key> | absent <key> | existing (mode python)
    elapsed_s: float = 0.0
    extra: dict = field(default_factory=dict)
    cluster: dict | None = None    # a Slurm cluster's partitions and limits (slurmjobs.check_cluster)


def check_command(host: Host, modules: list[str]) -> str:
    return (("REVAL_CHECK_SLURM=1 " if host.slurm is not None else "")
            + f"{q(host.python)} - {workdir_expr(host)} {q(host.venv.path or '')} "
            + " ".join(q(m) for m in modules))


def interpret(host: Host, blob: dict, *, manifest_hash: str, requirements: list[str]) -> HostCheck:
    """The check script's JSON -> a HostCheck (pure)."""
    r = HostCheck(host.name, host.describe_address(), reachable=True, ok=True, python=blob.get("python"),
                  workdir=blob.get("workdir"), disk_free_bytes=blob.get("disk_free_bytes"))
    r.payload = ("absent" if not blob.get("manifest_hash") else
                 "current" if blob["manifest_hash"] == manifest_hash else "stale")
    if host.venv.mode == "python":
        r.venv = "existing"
        if blob.get("missing"):
            r.ok = False
            r.error = f"{host.python} cannot import {', '.join(blob['missing'])}"
            r.hint = f"install them there, or use venv: {{mode: managed}} for {host.name}"
    else:
        key = venv_key(requirements, blob.get("python", ""), host.venv.system_site_packages)
        r.venv = f"{'ready' if key in blob.get('venvs_ready', []) else 'absent'} {key[:8]}"
    smi = blob.get("nvidia_smi")
    if smi is not None:
        if smi.get("rc") == 0:
            r.gpus = gpus.inventory(smi.get("out", ""))
        else:
            r.gpus = []
            r.gpu_error = f"nvidia-smi failed (exit {smi.get('rc')}): {smi.get('err', '').strip()[-120:]}"
    r.extra = {"rsync": blob.get("rsync"), "uv": blob.get("uv")}
    if host.slurm is not None:
        from .slurmjobs import check_cluster
        check_cluster(r, host.slurm, blob.get("slurm") or {})
    return r


def check_host(host: Host, *, manifest_hash: str, requirements: list[str]) -> HostCheck:
    t0 = time.monotonic()
    transport = get_transport(host)
    modules = module_names(requirements) if host.venv.mode == "python" else []
    try:
        p = transport.run(check_command(host, modules), input=CHECK_SCRIPT, check=False, timeout_s=60)
        if p.returncode == 127:
            r = HostCheck(host.name, host.describe_address(), reachable=True,
                          error=f"python interpreter {host.python!r} not found",
                          hint=f"set `python:` for {host.name} in hosts.yaml")
        elif p.returncode != 0:
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
            r = HostCheck(host.name, host.describe_address(), reachable=True,
                          error=f"check script failed (exit {p.returncode}): {tail}")
        else:
            r = interpret(host, json.loads(p.stdout.strip().splitlines()[-1]), manifest_hash=manifest_hash,
                          requirements=requirements)
    except (HostUnreachable, HostKeyError) as e:
        r = HostCheck(host.name, host.describe_address(), error=str(e).split(": ", 1)[-1], hint=e.hint)
    except RevalError as e:
        r = HostCheck(host.name, host.describe_address(), reachable=True, error=str(e), hint=e.hint)
    r.elapsed_s = time.monotonic() - t0
    return r


def check_hosts(hosts: list[Host], *, accept_new: bool = False, max_workers: int = 16,
                requirements: list[str] | None = None) -> list[HostCheck]:
    """Check every host in parallel (bounded); results in the order given."""
    reqs = payload_requirements() if requirements is None else requirements
    manifest_hash = local_manifest_hash(reqs)
    if accept_new:
        hosts = [dataclasses.replace(h, host_key_policy="accept-new") for h in hosts]
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(hosts)))) as pool:
        return list(pool.map(lambda h: check_host(h, manifest_hash=manifest_hash, requirements=reqs), hosts))


def hosts_exit_code(results: list) -> int:
    """0 all ok · 4 all unreachable · 2 anything else failed (pure; works for check and sync results)."""
    if all(r.ok for r in results):
        return EXIT_OK
    if all(not r.reachable for r in results):
        return EXIT_UNREACHABLE
    return EXIT_PARTIAL
