"""Slurm as text (pure functions): the batch script reval submits — one run, or one run per task of a job
array — and what Slurm says about jobs (`scontrol -o show job`, `squeue`, `sacct`, `sinfo`), mapped to
reval's run states. backends/slurm.py runs them over the login node's transport.

The batch script runs the payload's wrapper (remote_payload/runtime/wrapper.py) with `--gpus scheduler`: the GPUs
are the ones Slurm assigned (CUDA_VISIBLE_DEVICES from the job), never chosen or locked by reval. Slurm's
own output (and the wrapper's, and the payload's) is appended to the run's eval.log. A job that Slurm
requeues (preemption, node failure) starts over in the same run directory: the restart removes the earlier
attempt's status.json and results.json first, so nothing from a cut-short attempt is read as a result.

States:  PENDING (and requeued/held) -> queued (Slurm's reason) · RUNNING, COMPLETING, SUSPENDED -> running ·
COMPLETED -> succeeded · FAILED, OUT_OF_MEMORY, NODE_FAIL, TIMEOUT, PREEMPTED, BOOT_FAIL, DEADLINE -> failed
(with that reason and the exit code) · CANCELLED -> cancelled. A job Slurm no longer knows is judged by
the wrapper's status.json (a `running` one is `lost`). Slurm that cannot answer now (slurmctld unreachable:
scontrol fails other than "invalid job id") makes `no-answer` (backends/slurm.py): not an end, asked again.
"""
from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass

from remote_payload.contract import protocol

from .inventory import SlurmSpec

QUEUED_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}
RUNNING_STATES = {"CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING",
                  "STAGE_OUT"}
FAILED_STATES = {"FAILED", "OUT_OF_MEMORY", "NODE_FAIL", "TIMEOUT", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                 "SPECIAL_EXIT", "REVOKED"}
ACTIVE_STATES = QUEUED_STATES | RUNNING_STATES
JOB_FILE = ".slurm.json"       # in the run dir: {"job_id": "123" | "123_4", "script": ..., "submitted_at": ...}
STAGED_RUN_JSON = ".run.json.job"  # what was asked; copied for the wrapper at every (re)start
_JOB_ID = re.compile(r"^\d+(_\d+)?$")
QUEUED = protocol.QUEUED

JOB_ID_ENV = "REVAL_SLURM_JOB"  # the batch script exports the job id reval knows a run by (ARRAYJOB_TASK)


@dataclass
class Task:
    """One run of a submission: its name, run directory and the wrapper's argv."""
    name: str
    run_dir: str
    argv: list[str]


def is_job_id(text: str) -> bool:
    return bool(_JOB_ID.match(text or ""))


# --- the batch script -------------------------------------------------------------------------------------
def sbatch_options(spec: SlurmSpec, *, job_name: str, output: str, chdir: str, n_tasks: int = 1,
                   max_running: int | None = None) -> list[str]:
    """The `#SBATCH` options of a submission (pure). More than one task: a job array capped at K running."""
    opts = [f"--job-name={job_name}", f"--output={output}", "--open-mode=append", f"--chdir={chdir}"]
    for key, flag in (("partition", "--partition"), ("account", "--account"), ("qos", "--qos"),
                      ("time", "--time"), ("gres", "--gres"), ("gpus", "--gpus"), ("cpus", "--cpus-per-task"),
                      ("mem", "--mem")):
        val = getattr(spec, key)
        if val is not None and not (key == "gpus" and val == 0):
            opts.append(f"{flag}={val}")
    opts += list(spec.sbatch)
    if n_tasks > 1:
        k = max(1, min(max_running or spec.max_running, n_tasks))
        opts.append(f"--array=0-{n_tasks - 1}%{k}")
    return opts


def batch_script(spec: SlurmSpec, *, workdir: str, tasks: list[Task], env: dict, job_name: str, output: str,
                 max_running: int | None = None) -> str:
    """The batch script (pure; every dynamic part shlex-quoted). Task i of the array (or the only task)
    runs tasks[i]'s wrapper from <workdir>/payload; its output (`output`, Slurm's %a-patterns allowed)
    is appended to that run's eval.log."""
    if not tasks:
        raise ValueError("batch_script: no tasks")
    lines = ["#!/bin/sh"]
    lines += [f"#SBATCH {o}" for o in sbatch_options(spec, job_name=job_name, output=output, chdir=workdir,
                                                     n_tasks=len(tasks), max_running=max_running)]
    lines += ["# reval: one run per array task (the run directory, then the wrapper's command line)",
              'case "${SLURM_ARRAY_TASK_ID:-0}" in']
    for i, t in enumerate(tasks):
        lines.append(f"{i}) d={shlex.quote(t.run_dir)}; set -- {shlex.join(t.argv)} ;;")
    lines += ['*) echo "[reval] no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 3 ;;', "esac"]
    exports = {**env, "PYTHONUNBUFFERED": "1"}
    lines += [f"export {shlex.quote(f'{k}={v}')}" for k, v in exports.items()]
    lines += [
        # the job id reval knows the run by: ARRAYJOB_TASK for an array task, else the job id
        (f'if [ -n "${{SLURM_ARRAY_JOB_ID:-}}" ]; then '
         f'{JOB_ID_ENV}="${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}"; '
         f'else {JOB_ID_ENV}="${{SLURM_JOB_ID:-}}"; fi; export {JOB_ID_ENV}'),
        'n=${SLURM_RESTART_COUNT:-0}',
        # requeued: start over; what the cut-short attempt left (a status, a result) is not this run's outcome
        ('if [ "$n" -gt 0 ]; then echo "[reval] requeued by Slurm (restart $n): starting over" >> "$d/eval.log"; '
         'rm -f "$d/status.json" "$d/results.json" "$d/.run.json.in"; fi'),
        f'cp "$d/{STAGED_RUN_JSON}" "$d/.run.json.in" || exit 3',
        f"cd {shlex.quote(workdir.rstrip('/') + '/payload')} || exit 3",
        'exec "$@"', "",
    ]
    return "\n".join(lines)


# --- what Slurm says --------------------------------------------------------------------------------------
@dataclass
class JobInfo:
    job_id: str                    # "123", or "123_4" for an array task
    state: str                     # Slurm's state word (PENDING, RUNNING, TIMEOUT, CANCELLED, ...)
    reason: str = ""               # Slurm's reason (Priority, Resources, TimeLimit, ...); "" for None
    exit_code: int | None = None   # the batch script's exit code; 128+N when it was killed by signal N
    restarts: int = 0
    node: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


def _exit_code(text: str) -> int | None:
    """Slurm's `EXIT:SIGNAL` -> one exit code (the signal wins: 0:9 -> 137)."""
    m = re.fullmatch(r"(\d+):(\d+)", (text or "").strip())
    if not m:
        return None
    code, sig = int(m.group(1)), int(m.group(2))
    return 128 + sig if sig else code


def _state_word(text: str) -> str:
    # sacct says "CANCELLED by 1000"; squeue/scontrol may add "+" flags (e.g. "RUNNING+")
    return (text or "").split()[0].rstrip("+").upper() if (text or "").split() else ""


def _reason(text: str) -> str:
    return "" if text in ("", "None", "(null)", "N/A") else text


def parse_scontrol(text: str) -> dict[str, JobInfo]:
    """`scontrol -o show job [ID]` (one record a line) -> {job id: JobInfo}; array tasks as ARRAY_TASK."""
    out = {}
    for line in text.splitlines():
        fields = _kv(line)
        if "JobId" not in fields or "JobState" not in fields:
            continue
        ids = [fields["JobId"]]
        if fields.get("ArrayJobId"):  # a task, or the pending rest of an array as one record ("1-5%2")
            ids = [f"{fields['ArrayJobId']}_{t}" for t in _task_ids(fields.get("ArrayTaskId", ""))] or ids
        try:
            restarts = int(fields.get("Restarts", "0"))
        except ValueError:
            restarts = 0
        node = fields.get("BatchHost") or fields.get("NodeList", "")
        for jid in ids:
            out[jid] = JobInfo(jid, _state_word(fields["JobState"]), _reason(fields.get("Reason", "")),
                               _exit_code(fields.get("ExitCode", "")), restarts, "" if node == "(null)" else node)
    return out


def _task_ids(text: str, limit: int = 100_000) -> list[int]:
    """Slurm's task list `0-5%2`, `1,3,7-9` -> [0, 1, ...] (the %throttle dropped); [] if it is not one."""
    out: list[int] = []
    for part in text.split("%", 1)[0].split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?(?::(\d+))?", part)
        if not m:
            return []
        lo, hi, step = int(m.group(1)), int(m.group(2) or m.group(1)), int(m.group(3) or 1)
        out += range(lo, min(hi, lo + limit) + 1, max(step, 1))
    return out


def _job_rows(text: str):
    """The `|`-separated rows of at least 3 fields whose first field is a job id (damaged lines skipped)."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and is_job_id(parts[0]):
            yield parts


def parse_sacct(text: str) -> dict[str, JobInfo]:
    """`sacct -n -P -X -o JobID,State,ExitCode` (also `-c`: jobcomp) -> {job id: JobInfo}; steps skipped."""
    return {p[0]: JobInfo(p[0], _state_word(p[1]), exit_code=_exit_code(p[2])) for p in _job_rows(text)}


@dataclass
class SlurmRunState:
    """A run's state as Slurm's word on its job (and the wrapper's status.json) makes it."""
    state: str                     # queued | running | succeeded | failed | cancelled | lost | no-answer
    reason: str = ""               # Slurm's pending reason, or the failure (TIMEOUT, OUT_OF_MEMORY, exit 3)
    exit_code: int | None = None


def slurm_run_state(job: JobInfo | None, status: dict) -> SlurmRunState:
    """The run's state from Slurm's word on its job and the wrapper's status.json (pure). Slurm wins while
    the job is known: a TIMEOUT the wrapper recorded as `cancelled` (it only saw the TERM) is `failed`."""
    st_state = status.get("state")
    st_exit = status.get("exit_code") if isinstance(status.get("exit_code"), int) else None
    if job is None:  # Slurm no longer knows it (purged, no accounting): the wrapper's record is all there is
        if st_state in protocol.TERMINAL_STATES:
            return SlurmRunState(st_state, str(status.get("reason") or ""), st_exit)
        return SlurmRunState(protocol.LOST, "Slurm no longer knows the job and the run did not record its end")
    if job.state in QUEUED_STATES:
        return SlurmRunState(QUEUED, job.reason or job.state.lower())
    if job.state in RUNNING_STATES:
        return SlurmRunState(protocol.RUNNING, "suspended" if job.state == "SUSPENDED" else "")
    code = st_exit if st_exit is not None else job.exit_code
    if job.state == "COMPLETED":
        return SlurmRunState(protocol.SUCCEEDED, "", 0)
    if job.state == "CANCELLED":
        return SlurmRunState(protocol.CANCELLED, "", code)
    if job.state in FAILED_STATES:
        if job.state == "FAILED":
            code = job.exit_code if job.exit_code not in (None, 0) else code
            return SlurmRunState(protocol.FAILED, f"exit {code}" if code is not None else "FAILED", code)
        return SlurmRunState(protocol.FAILED, job.state, code)
    return SlurmRunState(protocol.FAILED, job.state or "unknown Slurm state", code)


def final_status(status: dict, v: SlurmRunState, job: JobInfo) -> dict | None:
    """The status.json to record once Slurm says the job is over: the wrapper's, with Slurm's state (and the
    run state it makes where they differ: a TIMEOUT, a job cancelled while queued or killed before the wrapper could
    write); None when that is already recorded."""
    if v.state not in protocol.TERMINAL_STATES:
        return None
    if status.get("state") == v.state and status.get("slurm_state") == job.state:
        return None  # recorded (a terminal job's record is final: later looks need not ask Slurm)
    out = {**status, "state": v.state, "slurm_state": job.state, "job_id": job.job_id}
    out.setdefault("finished_at", protocol.now_iso())
    if v.exit_code is not None:
        out["exit_code"] = v.exit_code
    if v.reason and v.state == protocol.FAILED:
        out["reason"] = v.reason
        if job.state != "FAILED":  # a plain non-zero exit says it all; a TIMEOUT, an OOM kill ... say why
            out.setdefault("error", f"Slurm: {job.state}" + (f" ({job.reason})" if job.reason else ""))
    return out


# --- the cluster, for `reval hosts check` -------------------------------------------------------------------
@dataclass
class Partition:
    name: str
    default: bool
    available: str                 # up | down | drain | inact
    time_limit: str
    nodes: int
    gres: str                      # e.g. gpu:a100:4 (per node), "(null)" -> ""
    cpus: str
    memory_mb: str


def parse_sinfo(text: str) -> list[Partition]:
    """`sinfo -h -o '%P|%a|%l|%D|%G|%c|%m'` -> partitions (one line per partition x node config)."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 7:
            continue
        name = parts[0]
        try:
            nodes = int(parts[3])
        except ValueError:
            nodes = 0
        out.append(Partition(name.rstrip("*"), name.endswith("*"), parts[1], parts[2], nodes,
                             "" if parts[4] in ("(null)", "") else parts[4], parts[5], parts[6]))
    return out


def _kv(line: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"(?:^|\s)([A-Za-z/:]+)=(\S*)", line))


def check_cluster(r, spec: SlurmSpec, out: dict) -> None:
    """`reval hosts check` of a cluster (pure): fill `r.cluster` (a hostcheck.HostCheck) from the login
    node's sinfo / scontrol / sacctmgr output; a missing Slurm or an unknown/down partition fails it."""
    def res(k):
        return out.get(k) or {"rc": 127, "out": "", "err": "not run"}
    si = res("sinfo")
    if si["rc"] != 0:
        r.ok = False
        r.error = f"sinfo failed (exit {si['rc']}): {(si['err'].strip().splitlines() or ['no output'])[-1]}"
        r.hint = "is this host a Slurm login node? sinfo, sbatch and squeue must be on its PATH"
        return
    limits = {kv.get("PartitionName"): {k: kv.get(k) for k in ("MaxTime", "DefaultTime", "MaxNodes", "QoS")}
              for kv in map(_kv, res("partitions")["out"].splitlines()) if kv.get("PartitionName")}
    parts = [{**vars(p), "limits": limits.get(p.name, {})} for p in parse_sinfo(si["out"])]
    assoc = res("assoc")
    r.cluster = {"version": res("version")["out"].strip(), "partitions": parts,
                 "limits": [dict(zip(("account", "partition", "qos", "max_jobs", "max_submit", "max_wall",
                                      "max_tres", "grp_tres"), line.split("|")))
                            for line in assoc["out"].splitlines() if line.strip()] if assoc["rc"] == 0 else None,
                 "limits_note": "" if assoc["rc"] == 0 else
                 f"no association limits (sacctmgr: {(assoc['err'].strip().splitlines() or ['failed'])[0]})"}
    names = sorted({p["name"] for p in parts})
    want = spec.partition or next((p["name"] for p in parts if p["default"]), None)
    if spec.partition and spec.partition not in names:
        close = difflib.get_close_matches(spec.partition, names, n=1)
        r.ok = False
        r.error = (f"partition {spec.partition!r} is not on this cluster"
                   + (f" — did you mean {close[0]!r}?" if close else ""))
        r.hint = f"partitions: {', '.join(names)} (hosts.yaml: slurm.partition)"
    elif want and all(p["available"] != "up" for p in parts if p["name"] == want):
        r.ok = False
        r.error = f"partition {want!r} is not up ({', '.join(p['available'] for p in parts if p['name'] == want)})"
        r.hint = "jobs would queue until it is back; choose another with slurm.partition"
