"""`python -m remote_payload wrap --run-dir D [--run-json F] [--gpus auto|none|0,1] -- CMD...`

The detached-safe parent of one run (stdlib only). The controller starts it with
`setsid nohup ... >/dev/null 2>&1 </dev/null &`, so no PTY and no SSH session keeps it alive. It:
  1. becomes a process-group leader (the controller cancels the run with one `kill -TERM -PGID`),
  2. writes run.json (from --run-json) before anything starts,
  3. takes a GPU lock per chosen GPU (flock on <locks-dir>/gpu<N>.lock, holding run name + pid; the kernel
     drops a lock when its last holder dies, so a lock of a dead run is reclaimed without any sweeping),
  4. writes status.json `running` {pid, pgid, leader_start, run_id, started_at, host, gpus, device},
  5. runs CMD with PYTHONUNBUFFERED=1, stdout+stderr appended to eval.log, forwarding TERM/INT,
  6. writes the final state (succeeded | failed | cancelled) with finished_at and exit_code exactly once.
A full disk cannot keep it from that last write: at the start it fills a reserve file (RESERVE_NAME,
RESERVE_BYTES of its own blocks) and the final status.json is written into those blocks and renamed into place;
a run that failed with its run directory's filesystem full (one of our writes got ENOSPC, or less than
LOW_SPACE_BYTES left) says so in status.json (`no_space`: the run directory, and `error`).
Its own exit code: the child's, or 103 when cancelled, or 3 when it could not start (no free GPU, bad CMD, no
room for the reserve).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

from remote_payload.contract import gpus, protocol, runstate
from remote_payload.contract.gpus import gpu_indices
from remote_payload.runtime import cause, kcache

# A GPU counts as free when our locks don't hold it and it is idle by nvidia-smi's numbers.
FREE_MEMORY_MIB = 1024
FREE_UTILIZATION_PCT = 10
# Room kept for the final status.json (a few KB) whatever fills the disk meanwhile; not a contract file (never
# pulled). Random bytes: a compressing filesystem would store zeros in nothing.
RESERVE_NAME = ".status.reserve"
RESERVE_BYTES = 64 << 10
LOW_SPACE_BYTES = 1 << 20  # a failed run whose filesystem has less than this left failed for want of space
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NVIDIA_SMI_ARGV = ["nvidia-smi", "--query-gpu=index,memory.used,memory.total,utilization.gpu",
                   "--format=csv,noheader,nounits"]


def add_arguments(p) -> None:
    p.add_argument("--run-dir", required=True, help="the run directory (created by the controller)")
    p.add_argument("--run-json", help="a JSON file with what was asked; written to run.json before start")
    p.add_argument("--gpus", default="none", help="auto (one free GPU, CPU when the host has none) | none | 0,1 | "
                                                  "scheduler (a scheduler assigned them: CUDA_VISIBLE_DEVICES "
                                                  "is kept as it is, nothing is chosen or locked)")
    p.add_argument("--job-id-env", metavar="VAR", help="record this environment variable (e.g. SLURM_JOB_ID) as "
                                                       "the run's job id in run.json's handle (default: the pgid)")
    p.add_argument("--locks-dir", help="where gpu<N>.lock files live (default: <run-dir>/../../locks)")
    p.add_argument("cmd", nargs="+", help="the command to run (after --)")


class StartError(Exception):
    """The run could not start (recorded as failed, exit 3)."""


def is_idle(g: gpus.Gpu) -> bool:
    return g.memory_used_mib < FREE_MEMORY_MIB and g.utilization_pct < FREE_UTILIZATION_PCT


def query_gpus() -> list[gpus.Gpu]:
    try:
        p = subprocess.run(NVIDIA_SMI_ARGV, capture_output=True, text=True, timeout=30, check=False)
    except (FileNotFoundError, PermissionError, subprocess.TimeoutExpired):
        return []
    return gpus.usage(p.stdout) if p.returncode == 0 else []


def _try_lock(locks_dir: Path, index: int, run: str) -> int | None:
    """flock gpu<index>.lock without blocking; return the fd (kept open for the run's life) or None if held."""
    locks_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks_dir / f"gpu{index}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"run": run, "pid": os.getpid(), "locked_at": protocol.now_iso()}).encode() + b"\n")
    return fd


def _lock_holder(locks_dir: Path, index: int) -> str:
    try:
        info = json.loads((locks_dir / f"gpu{index}.lock").read_text() or "{}")
        return f"run {info.get('run')!r} (pid {info.get('pid')})"
    except (OSError, ValueError):
        return "another run"


def scheduler_gpus(visible: str | None) -> list[gpus.Gpu]:
    """The GPUs a scheduler assigned, as CUDA_VISIBLE_DEVICES names them (indices, or UUIDs kept as text)."""
    names = [x.strip() for x in (visible or "").split(",") if x.strip()]
    return [gpus.Gpu(int(x) if x.isdigit() else x, 0, 0, 0) for x in names]


def acquire_gpus(spec: str, locks_dir: Path, run: str) -> tuple[list[gpus.Gpu], list[int]]:
    """Choose and lock GPUs for `spec` (auto | none | '0,1'); return (gpus, lock fds). Raises StartError.
    `scheduler`: the GPUs CUDA_VISIBLE_DEVICES already names, neither chosen nor locked here."""
    spec = (spec or "none").strip()
    if spec in ("none", "cpu", ""):
        return [], []
    if spec == "scheduler":
        return scheduler_gpus(os.environ.get("CUDA_VISIBLE_DEVICES")), []
    gpus = query_gpus()
    by_index = {g.index: g for g in gpus}
    fds: list[int] = []
    if spec == "auto":
        for g in sorted(gpus, key=lambda g: (g.memory_used_mib, g.index)):
            if is_idle(g) and (fd := _try_lock(locks_dir, g.index, run)) is not None:
                return [g], [fd]
        if not gpus:
            return [], []  # a host without GPUs runs on CPU (status says device cpu)
        busy = ", ".join(f"GPU {g.index}: {g.memory_used_mib} MiB used, {g.utilization_pct}%" for g in gpus)
        raise StartError(f"no free GPU ({busy}); wait for a run to finish, or pass --gpus N to choose one")
    try:  # ASCII indices, each once (int() would read '٣' as 3, and 0,0 would lock GPU 0 twice)
        wanted = gpu_indices(",".join(x for x in spec.split(",") if x.strip()))
    except ValueError as e:
        raise StartError(f"--gpus {spec!r}: {e}; use auto, none, or GPU indices like 0,1") from None
    chosen = []
    for idx in wanted:
        if idx not in by_index:
            for fd in fds:
                os.close(fd)
            if not by_index:  # no GPU at all: the choices are CPU or let reval decide
                raise StartError(f"GPU {idx} does not exist: this host has no GPU; run on its CPU with --gpus none "
                                 "(or --gpus auto, which uses the CPU where there is no GPU)")
            have = ", ".join(str(i) for i in sorted(by_index))
            raise StartError(f"GPU {idx} does not exist on this host (GPUs: {have}); pass --gpus with one of them")
        fd = _try_lock(locks_dir, idx, run)
        if fd is None:
            for f in fds:
                os.close(f)
            raise StartError(f"GPU {idx} is in use by {_lock_holder(locks_dir, idx)}; choose another with --gpus")
        fds.append(fd)
        chosen.append(by_index[idx])
    return chosen, fds


class Wrapper:
    def __init__(self, run_dir: Path, cmd: list[str]):
        self.run_dir = run_dir
        self.cmd = cmd
        self.child: subprocess.Popen | None = None
        self.cancel_signal: int | None = None
        self.base: dict = {}
        self.finished = False
        self.no_space = False  # one of our writes found the filesystem full
        self.reserve = make_reserve(run_dir)

    def on_signal(self, signum, _frame) -> None:
        # TERM/INT from `reval kill` (sent to the whole group, so the child has it too); forward in case
        # it was sent to us alone. Only remember it: the final status is written once, in finish().
        self.cancel_signal = self.cancel_signal or signum
        if self.child and self.child.poll() is None:
            try:
                self.child.send_signal(signum)
            except ProcessLookupError:
                pass

    def write_status(self, **fields) -> None:
        protocol.atomic_write_json(self.run_dir / protocol.STATUS_JSON, {**self.base, **fields})

    def log(self, line: str) -> None:
        """Best effort: a line that cannot be written (a full disk) must not keep the final status from us."""
        try:
            with open(self.run_dir / protocol.EVAL_LOG, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as e:
            self.no_space = self.no_space or e.errno in NO_SPACE_ERRNOS

    def finish(self, state: str, exit_code: int, t0: float, **extra) -> None:
        if self.finished:  # exactly once
            return
        self.finished = True
        self.log(f"[reval] {state} · exit {exit_code} · {time.time() - t0:.1f}s · {protocol.now_iso()}")
        if state == protocol.FAILED and "error" not in extra:
            free = free_bytes(self.run_dir)
            if self.no_space or (free is not None and free < LOW_SPACE_BYTES):
                where = str(self.run_dir)
                extra.update(no_space=where, error=f"no space left on device: {where} ({free} bytes free)")
            else:  # the payload's own word for it (its error event, its traceback's last line), when it said one
                why = cause.failure_cause(self.run_dir)
                if why:
                    extra["error"] = why
        final = {**self.base, "state": state, "finished_at": protocol.now_iso(), "exit_code": exit_code, **extra}
        if not (self.reserve and write_into_reserve(self.run_dir, final)):
            (self.run_dir / RESERVE_NAME).unlink(missing_ok=True)  # its room is the disk's again
            protocol.atomic_write_json(self.run_dir / protocol.STATUS_JSON, final)


def _child_env(run_id: str, run_dir: Path) -> tuple[dict, str]:
    """(the child's environment, a line for the log or ""). REVAL_WRAPPED: the payload leaves status.json to us
    (it writes its own only when run standalone); REVAL_LATENCY_TABLE: eval --speedup's table, the workdir's
    (shared by every run and sweep on this host); the kernel caches (kcache: the venv's) set before the child,
    whatever it is, starts, the line saying so when they fell back to the per-user ones."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "REVAL_WRAPPED": "1", runstate.RUN_ID_ENV: run_id,
           "REVAL_LATENCY_TABLE": str(run_dir.resolve().parent.parent / "latency.json")}
    note = kcache.setup(env)
    return env, f"\n[reval] {note}" if note else ""


def main(args) -> int:
    try:
        os.setsid()  # a fresh session + process group (a no-op error when `setsid` already made us leader)
    except OSError:
        pass
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    run_dir = Path(args.run_dir).resolve()
    run = run_dir.name
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    w = Wrapper(run_dir, cmd)
    signal.signal(signal.SIGTERM, w.on_signal)
    signal.signal(signal.SIGINT, w.on_signal)
    t0 = time.time()
    pid = os.getpid()
    # pid/pgid with what proves them ours later (runstate.proven_group): our start time in this boot, and a
    # random run id that every process of the payload carries in its environment
    w.base = {"state": protocol.RUNNING, "run": run, "pid": pid, "pgid": os.getpgid(0),
              "leader_start": runstate.start_time(pid), "run_id": secrets.token_hex(16),
              "started_at": protocol.now_iso(), "host": socket.gethostname(), "boot_id": protocol.boot_id(),
              "cmd": cmd}

    if not w.reserve:  # a run that could not record its end would be `lost`: start none
        where = str(run_dir)
        msg = (f"no space left on device: {where} ({free_bytes(run_dir)} bytes free; a run keeps {RESERVE_BYTES} "
               "to record its end)")
        w.log(f"[reval] could not start: {msg}")
        w.finish(protocol.FAILED, protocol.EXIT_BAD_INPUT, t0, error=msg, no_space=where)
        return protocol.EXIT_BAD_INPUT

    run_info: dict = {}
    if args.run_json:
        try:
            run_info = json.loads(Path(args.run_json).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            w.finish(protocol.FAILED, protocol.EXIT_BAD_INPUT, t0, error=f"--run-json {args.run_json}: {e}")
            return protocol.EXIT_BAD_INPUT

    locks_dir = Path(args.locks_dir) if args.locks_dir else run_dir.parent.parent / "locks"
    try:
        if not cmd:
            raise StartError("no command to run (give it after --)")
        gpus, _lock_fds = acquire_gpus(args.gpus, locks_dir, run)
    except StartError as e:
        w.log(f"[reval] could not start: {e}")
        w.finish(protocol.FAILED, protocol.EXIT_BAD_INPUT, t0, error=str(e))
        return protocol.EXIT_BAD_INPUT
    visible = ",".join(str(g.index) for g in gpus)
    w.base.update(gpus=[g.index for g in gpus], device="cuda" if gpus else "cpu",
                  gpu_info=[vars(g) for g in gpus] if args.gpus != "scheduler" else [])
    run_info.update(gpus=w.base["gpus"], device=w.base["device"], wrapper_pid=pid)
    if run_info.get("backend"):  # the job handle: the scheduler's job id, else our process group
        job = os.environ.get(args.job_id_env) if getattr(args, "job_id_env", None) else None
        run_info["handle"] = {"backend": run_info["backend"], "job_id": str(job or w.base["pgid"])}
    protocol.atomic_write_json(run_dir / protocol.RUN_JSON, run_info)
    if args.run_json and Path(args.run_json).resolve().parent == run_dir:
        Path(args.run_json).unlink(missing_ok=True)  # the staged copy the controller uploaded

    env, cache_note = _child_env(w.base["run_id"], run_dir)
    if args.gpus != "scheduler":  # a scheduler's assignment is kept as it is (set, unset, never blanked)
        env["CUDA_VISIBLE_DEVICES"] = visible
    where = f"GPU {visible}" if gpus else "CPU (no GPU on this host)" if args.gpus == "auto" else "CPU"
    w.log(f"[reval] {run} started {w.base['started_at']} on {w.base['host']} · {where} · pid {pid}"
          f" · {shlex.join(cmd)}{cache_note}")
    if w.cancel_signal is not None:  # cancelled before the child existed: start nothing
        w.finish(protocol.CANCELLED, protocol.EXIT_CANCELLED, t0, cancelled_by=signal.Signals(w.cancel_signal).name)
        return protocol.EXIT_CANCELLED
    # running (pid/pgid = ours, the group leader) BEFORE the child starts: the controller waits for this file,
    # and the child must never see a run directory without it
    w.write_status()
    logf = open(run_dir / protocol.EVAL_LOG, "ab", buffering=0)  # noqa: SIM115 - closed once the child has it
    try:
        # The lock fds are inherited on purpose: the GPU stays locked while the child lives, even if we die.
        w.child = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, pass_fds=_lock_fds)
    except OSError as e:
        logf.close()
        w.log(f"[reval] could not start {cmd[0]!r}: {e}")
        w.finish(protocol.FAILED, 127, t0, error=f"could not start {cmd[0]!r}: {e}")
        return 127
    logf.close()
    while True:
        try:
            rc = w.child.wait()
            break
        except InterruptedError:
            continue
    signame = signal.Signals(-rc).name if rc < 0 else None
    exit_code = 128 - rc if rc < 0 else rc
    extra = {"signal": signame} if signame else {}
    if w.cancel_signal is not None:
        w.finish(protocol.CANCELLED, exit_code, t0, cancelled_by=signal.Signals(w.cancel_signal).name, **extra)
        return protocol.EXIT_CANCELLED
    if rc == 0:
        extra.update(suspect_fields(w.run_dir))
    w.finish(protocol.SUCCEEDED if rc == 0 else protocol.FAILED, exit_code, t0, **extra)
    return exit_code


def make_reserve(run_dir: Path) -> bool:
    """RESERVE_NAME in the run directory, RESERVE_BYTES written and synced (its blocks are ours); False when
    there is no room even for that (then the final status is written the ordinary way, and may fail)."""
    path = run_dir / RESERVE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return False
    try:
        data = os.urandom(RESERVE_BYTES)
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
        return True
    except OSError:
        path.unlink(missing_ok=True)
        return False
    finally:
        os.close(fd)


def write_into_reserve(run_dir: Path, status: dict) -> bool:
    """status.json written over the reserve's own blocks (no new block needed: it works on a full disk), then
    renamed into place atomically. False when that could not be done (the reserve is then left to the caller)."""
    body = (json.dumps(status, indent=2, default=str) + "\n").encode()
    path = run_dir / RESERVE_NAME
    if len(body) > RESERVE_BYTES:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))  # no O_TRUNC: keep the blocks
        try:
            view, off = memoryview(body), 0
            while off < len(body):
                off += os.pwrite(fd, view[off:], off)
            os.ftruncate(fd, len(body))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(path, run_dir / protocol.STATUS_JSON)
        return True
    except OSError:
        return False


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer can still use on `path`'s filesystem (None: cannot tell)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def suspect_fields(run_dir: Path) -> dict:
    """{"suspect": True, "suspect_reasons": [...]} when results.json flags the result suspect, else {}: recorded
    in status.json so that every listing (ls, status, a sweep) shows it without reading results.json."""
    try:
        health = protocol.read_json(run_dir / protocol.RESULTS_JSON).get("health") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(health, dict) or health.get("suspect") is not True:
        return {}
    reasons = health.get("reasons")
    return {"suspect": True, "suspect_reasons": [str(r) for r in reasons] if isinstance(reasons, list) else []}
