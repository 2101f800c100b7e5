"""The `slurm:` section of a hosts.yaml entry: the cluster's job settings and their validation."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .yamlcheck import Checker


@dataclass
class SlurmSpec:
    """A cluster's job settings (`slurm:` in a host entry): the host is its login node, the workdir is on
    the shared filesystem, and every run is a Slurm job with these options."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None        # --time (Slurm's formats: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]])
    gpus: int | None = None        # --gpus=N per job
    gres: str | None = None        # --gres=gpu[:type]:N per job (instead of gpus)
    cpus: int | None = None        # --cpus-per-task
    mem: str | None = None         # --mem (e.g. 64G)
    max_running: int = 4           # a sweep's job array runs at most this many at once (--array=...%K)
    sbatch: list = field(default_factory=list)  # more `#SBATCH` options, one per item


_SLURM_KEYS = {
    "partition": ((str,), "a partition name"),
    "account": ((str,), "an account name"),
    "qos": ((str,), "a QOS name"),
    "time": ((str, int), "a time limit like 2:00:00, 90 (minutes) or 1-12:00:00"),
    "gpus": ((int,), "GPUs per job (a number)"),
    "gres": ((str,), "a gres spec like gpu:1 or gpu:a100:2"),
    "cpus": ((int,), "CPUs per job (a number)"),
    "mem": ((str, int), "memory per job like 64G or 16000M"),
    "max_running": ((int,), "how many of a sweep's array tasks may run at once (a number)"),
    "sbatch": ((list,), "a list of sbatch options like --constraint=h100"),
}
# Options reval sets itself in every batch script (a run's output, its array, its name and directory).
SBATCH_OWNED = ("--output", "--error", "--open-mode", "--array", "--job-name", "--chdir", "--parsable", "--wrap",
                "-o", "-e", "-a", "-J", "-D")
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.+-]{1,128}$")
_SLURM_TIME = re.compile(r"^(\d+-\d{1,2}(:\d{1,2}){0,2}|\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$", re.IGNORECASE)
_SLURM_MEM = re.compile(r"^\d+[KMGT]?$", re.IGNORECASE)
_SLURM_GRES = re.compile(r"^[A-Za-z0-9_]+(:[A-Za-z0-9_.-]+)*$")


def parse_slurm(c: Checker, name: str, node) -> SlurmSpec:
    spec = SlurmSpec()
    where = f"host {name!r}: slurm"
    for key, vn, val in c.section(node, name, "slurm", _SLURM_KEYS):
        if isinstance(val, int) and key in ("time", "mem"):
            val = str(val)
        if key in ("partition", "account", "qos") and not _SLURM_WORD.match(val):
            c.fail(vn, f"{where}.{key} {val!r} is not a {key} name (letters, digits, . _ + -)")
        elif key == "time" and not _SLURM_TIME.match(val):
            c.fail(vn, f"{where}.time {val!r} is not a Slurm time limit",
                   hint="e.g. time: '2:00:00' (h:m:s), 90 (minutes), '1-12:00:00' (days-h:m:s)")
        elif key == "mem" and not _SLURM_MEM.match(val):
            c.fail(vn, f"{where}.mem {val!r} is not a memory size", hint="e.g. mem: 64G or mem: 16000M")
        elif key == "gres" and not _SLURM_GRES.match(val):
            c.fail(vn, f"{where}.gres {val!r} is not a gres spec", hint="e.g. gres: 'gpu:1' or gres: 'gpu:a100:2'")
        elif key in ("gpus", "cpus", "max_running") and val < (0 if key == "gpus" else 1):
            c.fail(vn, f"{where}.{key} must be at least {0 if key == 'gpus' else 1}, got {val}")
        elif key == "sbatch":
            val = _parse_sbatch_lines(c, where, vn)
        setattr(spec, key, val)
    if spec.gpus is not None and spec.gres is not None:
        c.fail(node, f"{where}: give either gpus (--gpus=N) or gres (--gres=...), not both")
    return spec


def _parse_sbatch_lines(c: Checker, where: str, node) -> list[str]:
    out = []
    for item in node.value:
        line = c.value(item)
        if not isinstance(line, str) or not line.startswith("-") or any(ch in line for ch in "\n\r\0"):
            c.fail(item, f"{where}.sbatch: {line!r} is not an sbatch option", hint="e.g. sbatch: [--constraint=h100]")
        opt = line.split("=", 1)[0].split()[0]
        if opt in SBATCH_OWNED:
            c.fail(item, f"{where}.sbatch: reval sets {opt} itself (a run's log, array and directory)",
                   hint="remove it; partition, account, qos, time, gpus, cpus, mem have their own keys")
        out.append(line)
    return out
