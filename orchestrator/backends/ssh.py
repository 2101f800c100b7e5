"""The SSH backend (also the `local` host: a folder, no SSH): a host that runs its runs itself, behind the
seam of base.py, with one of its optional abilities, WAIT_THEN_SUBMIT (below), and not the batch ones (one run
per submit, one probe per state). Its transport is hosts/transport.py (OpenSSH + ControlMaster, or the local
shell). This module starts runs (below) and probes them (status / ls / kill: the payload's
remote_payload/contract/runstate.py fed to the host's python, one round trip each).

Start a run detached on a host: one remote shell script (one SSH round trip) that claims the run name
(`mkdir` is atomic, so a used name is refused), stages run.json, and starts the payload's wrapper with
`setsid nohup ... &` (no PTY; it survives the SSH connection), then waits for the wrapper's status.json.

GPU choice happens on the host, inside the wrapper (remote_payload/runtime/wrapper.py): nvidia-smi, idle GPUs
only, an flock per GPU under <workdir>/locks/ holding the run name + pid. Choosing and locking in the
same process on the same machine is what makes two concurrent launches unable to share a GPU.

WAIT_THEN_SUBMIT (the sweep's slots): one remote script long-polls a run (runstate.py `wait-over`) and, only
when that exits EXIT_OVER (status.json says the run ended, its group gone), runs the next run's launch script
(run.json inline in it, since stdin carries runstate.py): a run's end and the next launch in one round trip.
Asked to (`pull=True`, the sweep), the same answer then carries the ended run's contract files (a base64 tar,
up to PULL_MAX_BYTES; a larger run is pulled on its own, streamed): one SSH session a run fewer.
"""
from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

from remote_payload.contract import protocol, runstate

from ..errors import ConfigError, HostUnreachable, RemoteCommandError, RevalError, RunExists, RunNotFound
from ..hosts.gpuspec import normalize_gpus
from ..hosts.inventory import Host
from ..hosts.transport import Transport, q, resolve_workdir
from ..rundir.pull import Pulled, install_pulled
from ..rundir.registry import (
    UNKNOWN,
    RunState,
    check_local_runs_root,
    check_run_name,
    clean_status,
    is_run_name,
    remote_run_dir,
    reported_state,
    save_follow_state,
    symlink_refused,
)
from .base import WAIT_THEN_SUBMIT, Backend, Folded, JobHandle, Launch, NoFreeGpu, Submission

STARTUP_WAIT_S = 15.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def wrapper_argv(python: str, run_dir: str, locks_dir: str, gpus: str, payload_argv: list[str], *,
                 job_id_env: str | None = None) -> list[str]:
    """The wrapper command line: `wrap ... -- python -m remote_payload <payload_argv> --run-dir <run_dir>` (pure).
    `job_id_env`: the variable holding a scheduler's job id (recorded in run.json's handle)."""
    return [python, "-m", "remote_payload", "wrap", "--run-dir", run_dir, "--run-json", f"{run_dir}/.run.json.in",
            "--gpus", gpus, "--locks-dir", locks_dir, *(["--job-id-env", job_id_env] if job_id_env else []), "--",
            python, "-m", "remote_payload", *payload_argv, "--run-dir", run_dir]


def launch_script(workdir: str, name: str, argv: list[str], env: dict, wait_s: float = STARTUP_WAIT_S,
                  preflight: list[str] | None = None, run_json_text: str | None = None) -> str:
    """The remote shell script (pure; every dynamic part shlex-quoted). Reads run.json on stdin, or writes
    `run_json_text` (a literal in the script: nothing read). `preflight`: a command run in the payload folder
    first; its exit 3 ends the script (@@PREFLIGHT + its stderr) before anything is created."""
    for k in env:
        if not _ENV_NAME.match(str(k)):
            raise ConfigError(f"environment variable name {k!r} in hosts.yaml is not valid",
                              hint="use letters, digits and _ (not starting with a digit)")
    d = remote_run_dir(workdir, name)
    env_words = " ".join(q(f"{k}={v}") for k, v in {**env, "PYTHONUNBUFFERED": "1"}.items())
    ticks = int(wait_s / 0.02)
    check = preflight_sh(env_words, preflight)
    return "\n".join([
        f"wd={q(workdir)}; d={q(d)}",
        *check,
        'mkdir -p "$wd/runs" "$wd/locks" || exit 1',
        'if ! mkdir "$d" 2>/dev/null; then echo "@@EXISTS"; exit 0; fi',
        ('cat > "$d/.run.json.in" || exit 1' if run_json_text is None else
         f'printf \'%s\' {q(run_json_text)} > "$d/.run.json.in" || {{ rm -rf "$d"; exit 1; }}'),
        # stdin cut short (the controller was killed mid-launch): start nothing, leave nothing
        '[ -s "$d/.run.json.in" ] || { rm -rf "$d"; echo "@@NOINPUT"; exit 0; }',
        'cd "$wd/payload" || { rm -rf "$d"; echo "@@NOPAYLOAD"; exit 0; }',
        # setsid: a new session, no controlling terminal; nohup: HUP ignored where setsid is missing
        'if command -v setsid >/dev/null 2>&1; then det=setsid; else det=; fi',
        f"env {env_words} $det nohup {' '.join(q(a) for a in argv)} >/dev/null 2>&1 </dev/null &",
        f'i=0; while [ ! -s "$d/status.json" ] && [ $i -lt {ticks} ]; do sleep 0.02; i=$((i+1)); done',
        'echo "@@STATUS"; cat "$d/status.json" 2>/dev/null; exit 0',
    ])


def preflight_sh(env_words: str, preflight: list[str] | None) -> list[str]:
    """Shell lines (need $wd) running `preflight` in the payload folder; its failure prints @@PREFLIGHT + its
    stderr and ends the script before anything is created (pure)."""
    if not preflight:
        return []
    pf_cmd = f"env {env_words} {' '.join(q(a) for a in preflight)}"
    return [f'if [ -d "$wd/payload" ] && ! pf=$(cd "$wd/payload" && {pf_cmd} 2>&1 >/dev/null); then',
            '  echo "@@PREFLIGHT"; printf \'%s\\n\' "$pf"; exit 0; fi']


def script_refusal(host: str, out: str, *, workdir: str, name: str, what: str) -> RevalError | None:
    """The one-line error for a launch or submission script's refusal (both backends' scripts answer alike), or
    None: @@PREFLIGHT (the eval's inputs), @@EXISTS [name] (a used run name), @@NOINPUT (the script arrived
    cut short: nothing ran), @@NOPAYLOAD. `what`: "launch" | "submission"."""
    if "@@PREFLIGHT" in out:
        lines = [ln for ln in out.split("@@PREFLIGHT", 1)[1].strip().splitlines() if ln.strip()]
        why = next((ln.removeprefix("error: ") for ln in reversed(lines) if ln.startswith("error: ")),
                   lines[-1] if lines else "the eval's inputs were refused")
        return ConfigError(f"{host}: {why}",
                           hint="nothing was started; fix it (the path on the host, or the option) and run again")
    if "@@EXISTS" in out:
        used = (out.split("@@EXISTS", 1)[1].split() or [name])[0]
        return RunExists(f"run name {used!r} is already used on {host}",
                         hint=f"follow it: reval logs {used} -f --host {host} ; or pick another with --name "
                              f"(e.g. --name {used}-2), or leave --name out for a timestamped one")
    if "@@NOINPUT" in out:  # a transport failure: safe to retry under the same name
        return HostUnreachable(f"{host}: the {what} lost its connection before it was complete; nothing was started",
                               hint=f"retry; check: reval hosts check {host}")
    if "@@NOPAYLOAD" in out:
        return ConfigError(f"{host}: no payload in {workdir}/payload", hint=f"run: reval sync {host}")
    return None


def launch(host: Host, transport: Transport, *, name: str, payload_argv: list[str], gpus: str = "auto",
           run_json: dict, python: str, preflight: list[str] | None = None) -> Launch:
    """Start `python -m remote_payload <payload_argv> --run-dir <run dir>` detached under the wrapper.

    Refuses an invalid or already-used name (exit 3). On a start failure (no free GPU, ...) the run dir is
    removed again, so nothing half-written stays behind."""
    workdir, d, script, staged = _launch_parts(host, transport, name=name, payload_argv=payload_argv, gpus=gpus,
                                               run_json=run_json, python=python, preflight=preflight)
    out = transport.run(script, input=staged, timeout_s=STARTUP_WAIT_S + 60).stdout
    return _launched(host, transport, out, workdir=workdir, name=name, d=d, python=python, run_json=run_json,
                     gpus=normalize_gpus(gpus))


def _launch_parts(host: Host, transport: Transport, *, name: str, payload_argv: list[str], gpus: str, run_json: dict,
                  python: str, preflight: list[str] | None, inline: bool = False) -> tuple[str, str, str, str]:
    """(workdir, run dir, the launch script, the run.json it stages); `inline`: the script carries run.json
    itself (reads nothing on stdin)."""
    check_run_name(name)
    gpus = normalize_gpus(gpus)
    workdir = resolve_workdir(transport)
    d = remote_run_dir(workdir, name)
    argv = wrapper_argv(python, d, f"{workdir}/locks", gpus, payload_argv)
    staged = json.dumps({**run_json, "run": name, "host": host.name, "python": python, "backend": "ssh"},
                        default=str)
    script = launch_script(workdir, name, argv, host.env,
                           preflight=[python, "-m", "remote_payload", *preflight] if preflight else None,
                           run_json_text=staged if inline else None)
    return workdir, d, script, staged


def _launched(host: Host, transport: Transport, out: str, *, workdir: str, name: str, d: str, python: str,
              run_json: dict, gpus: str) -> Launch:
    """The launch script's answer `out` -> the Launch (its follow state saved), or the refusal raised."""
    refused = script_refusal(host.name, out, workdir=workdir, name=name, what="launch")
    if refused:
        raise refused
    body = out.split("@@STATUS", 1)[-1].strip()
    try:
        status = json.loads(body) if body else {}
    except ValueError:
        status = {}
    if not status:
        raise RevalError(f"{host.name}: the run wrapper did not start within {STARTUP_WAIT_S:.0f}s",
                         hint=f"look at {d}/eval.log on the host; check: reval hosts check {host.name}",
                         exit_code=1)
    if status.get("state") == protocol.FAILED and status.get("error"):
        transport.run(f"rm -rf {q(d)}", check=False, timeout_s=60)
        err = NoFreeGpu if status["error"].startswith("no free GPU") else ConfigError  # wrapper.acquire_gpus
        raise err(f"{host.name}: {status['error']}")
    save_follow_state(host.name, name, run_dir=d, python=python, log_offset=0, launched_at=protocol.now_iso(),
                      identity=run_json.get("identity"))  # at once: a controller killed now still re-attaches
    pgid = int(status.get("pgid", 0))
    return Launch(host=host.name, name=name, run_dir=d, handle=JobHandle("ssh", str(pgid)),
                  pid=int(status.get("pid", 0)), pgid=pgid, device=status.get("device", "cpu"),
                  gpus=list(status.get("gpus", [])), gpu_info=list(status.get("gpu_info", [])), status=status,
                  requested_gpus=gpus)


# -- probes: status / ls / kill, one remote script each (remote_payload/contract/runstate.py) ---------------
# The host-side half of status/ls/kill: a stdlib-only script fed to the host's python on stdin (so it works
# whatever payload version is synced there). It parses status.json as JSON and counts a process group as the
# run's only when a live member proves it (remote_payload/contract/runstate.py); it prints one JSON object a line.
_RUNSTATE_SRC = Path(runstate.__file__).read_text(encoding="utf-8")


def _host_python(transport: Transport) -> str:
    return transport.host.python or "python3"


def _runstate(transport: Transport, *args: str, timeout_s: float = 60) -> list[dict]:
    """Run remote_payload/contract/runstate.py on the host with `args`; its JSON lines (pure parse, damage skipped)."""
    cmd = f"{q(_host_python(transport))} - {' '.join(q(a) for a in args)}"
    return _records(transport.run(cmd, input=_RUNSTATE_SRC, timeout_s=timeout_s).stdout)


# -- remote probes ------------------------------------------------------------------------------------------
def state_from_probe(rec: dict, host: str) -> RunState | None:
    """One probe record (runstate.probe) -> RunState; `unknown` when status.json is missing or damaged (pure)."""
    name = rec.get("name")
    if not isinstance(name, str) or not is_run_name(name):
        return None  # a directory reval did not make is not a run
    st = clean_status(rec.get("status"))  # damaged: a list, a number, fields of the wrong type
    alive = rec.get("alive") is True
    event = rec.get("last_event") if isinstance(rec.get("last_event"), dict) else {}
    now = rec.get("now")  # the host's clock, read with its status.json
    now = float(now) if isinstance(now, (int, float)) and not isinstance(now, bool) and math.isfinite(now) else None
    kind = rec.get("kind") if isinstance(rec.get("kind"), str) and is_run_name(rec["kind"]) else "eval"
    if "state" not in st:
        return RunState(host, name, UNKNOWN, {}, alive, event, host_now=now, kind=kind)
    return RunState(host, name, reported_state(st, alive), st, alive, event, host_now=now, kind=kind)


def run_state(transport: Transport, run: str, *, wait_s: float = 0) -> RunState | None:
    """The run's state on its host, or None when the host has no such run. With wait_s: a long poll that
    answers as soon as the run is no longer running, at the latest after wait_s."""
    runs_dir = f"{resolve_workdir(transport)}/runs"
    protocol.validate_run_name(run)
    args = ("wait", runs_dir, run, str(float(wait_s))) if wait_s > 0 else ("probe", runs_dir, run)
    return _probe_state(transport, run, _runstate(transport, *args, timeout_s=wait_s + 60))


def _probe_state(transport: Transport, run: str, recs: list[dict]) -> RunState | None:
    if any("refused" in r for r in recs):  # the run folder is a symbolic link: no run, and not "no run" either
        raise symlink_refused(remote_run_dir(resolve_workdir(transport), run), host=transport.host.name)
    states = [s for s in (state_from_probe(r, transport.host.name) for r in recs) if s]
    return states[0] if states else None


def _records(out: str) -> list[dict]:
    recs = []
    for line in out.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            recs.append(rec)
    return recs


OVER = "@@OVER"  # the folded script's line between the long poll's records and the launch script's answer
PULL, PULLED = "@@PULL", "@@PULLED"  # around the ended run's files (a base64 tar) after the launch's answer
PULL_MAX_BYTES = 4 << 20  # a run whose contract files are larger is pulled on its own (a streamed tar)


def wait_then_launch_script(python: str, runs_dir: str, run: str, wait_s: float, start: str,
                            pull_max: int = 0) -> str:
    """The folded script (pure): runstate.py (on stdin) long-polls `run`; only its exit EXIT_OVER (status.json
    says the run ended: succeeded, failed, cancelled) lets `start` (a launch script that reads nothing on stdin)
    run, after the records and OVER. Anything else (still running, lost, missing, damaged, a runstate cut short
    or failing, an answer nobody reads) starts nothing. `pull_max` > 0: after the launch's answer, the ended
    run's contract files (regular files, not links, of a run folder that is not a link) as a base64 tar between
    `PULL <names>` and PULLED, when they come to at most pull_max bytes (else nothing: it is pulled on its own);
    the script's exit status stays the launch part's."""
    lines = [
        f"out=$({q(python)} - wait-over {q(runs_dir)} {q(run)} {q(str(float(wait_s)))}); rc=$?",
        'printf \'%s\\n\' "$out" || exit 0',  # nobody reads the answer any more (the connection is gone): stop
        f'[ "$rc" -eq {runstate.EXIT_OVER} ] || exit 0',
        f"echo {OVER} || exit 0",
    ]
    if pull_max <= 0:
        return "\n".join([*lines, start])
    pull_sh = pull_part(f"{runs_dir}/{protocol.validate_run_name(run)}", pull_max)
    return "\n".join([*lines, f"( {start}\n)", "lrc=$?", pull_sh, 'exit "$lrc"'])


def pull_part(run_dir: str, max_bytes: int) -> str:
    """Shell lines printing the run's contract files as PULL <names>, their tar in base64, PULLED; nothing when
    the folder is a link or missing, the files come to more than max_bytes, or base64 is missing (pure). The
    names let the controller check that the tar holds each of them (a file tar could not read is left out)."""
    names = " ".join(protocol.RUN_FILES)
    return "\n".join([
        f'd={q(run_dir)}',
        'if [ ! -L "$d" ] && cd "$d" 2>/dev/null && command -v base64 >/dev/null 2>&1; then',
        f'  set --; n=0; for f in {names}; do',
        '    if [ -f "$f" ] && [ ! -L "$f" ]; then set -- "$@" "$f"; n=$((n + $(wc -c < "$f"))); fi; done',
        f'  if [ $# -gt 0 ] && [ "$n" -le {int(max_bytes)} ]; then',
        f'    printf \'\\n{PULL} %s\\n\' "$*"; tar cf - "$@" 2>/dev/null | base64; echo {PULLED}; fi',
        'fi',
    ])


def _pulled_part(host: str, run: str, answer: str) -> tuple[str, Pulled | None]:
    """The launch's answer without the pull part, and the ended run's files from it, put in runs/<host>/<run>/
    (None when there are none, or they are incomplete or damaged: the caller pulls the run on its own)."""
    head, sep, rest = answer.rpartition(f"\n{PULL} ")  # the last: base64 has no "@" or " "
    if not sep:
        return answer, None
    names_line, _, body = rest.partition("\n")
    b64, sep, _ = body.rpartition(PULLED)
    if not sep:
        return head, None
    try:
        tar_bytes = base64.b64decode(b64, validate=False)
    except ValueError:
        return head, None
    return head, install_pulled(host, run, tar_bytes, names_line.split())


def wait_then_launch(host: Host, transport: Transport, run: str, sub: Submission | None, *,
                     wait_s: float, pull: bool = False) -> Folded:
    """Backend.wait_then_submit over SSH: one round trip (see wait_then_launch_script). A refusal of the
    launch is returned, not raised; a transport error is raised (HostUnreachable): the launch may have
    happened or not, and the same call again is safe (the second claim of the name answers RunExists).
    `pull`: the ended run's files come back in the same answer (up to PULL_MAX_BYTES), put in
    runs/<host>/<run>/ (Folded.pulled; None when they did not come: pull it on its own). `sub` None: nothing to
    start (a slot's last run: the long poll that sees its end brings its files)."""
    protocol.validate_run_name(run)
    if sub is None:
        workdir, d, start = resolve_workdir(transport), "", ":"
    else:
        workdir, d, start, _ = _launch_parts(host, transport, name=sub.name, payload_argv=sub.payload_argv,
                                             gpus=sub.gpus, run_json=sub.run_json, python=sub.python,
                                             preflight=sub.preflight, inline=True)
    script = wait_then_launch_script(_host_python(transport), f"{workdir}/runs", run, wait_s, start,
                                     PULL_MAX_BYTES if pull else 0)
    p = transport.run(script, input=_RUNSTATE_SRC, timeout_s=wait_s + STARTUP_WAIT_S + 120, check=False)
    polled, over, answer = p.stdout.partition(f"\n{OVER}\n")
    if not over and p.returncode != 0:  # the poll's own failure, as a probe's
        raise RemoteCommandError(host.name, script, p.returncode, p.stderr, p.stdout)
    st = _probe_state(transport, run, _records(polled))
    if not over:
        return Folded(st, None)
    answer, pulled = _pulled_part(host.name, run, answer) if pull else (answer, None)
    if sub is None:
        return Folded(st, None, pulled)
    try:
        if p.returncode != 0:  # the launch part failed (its run folder could not be made): the launch's failure
            raise RemoteCommandError(host.name, script, p.returncode, p.stderr, answer)
        return Folded(st, _launched(host, transport, answer, workdir=workdir, name=sub.name, d=d,
                                    python=sub.python, run_json=sub.run_json, gpus=normalize_gpus(sub.gpus)),
                      pulled)
    except HostUnreachable:
        raise
    except RevalError as e:
        return Folded(st, e, pulled)


def list_runs(transport: Transport) -> list[RunState]:
    runs_dir = f"{resolve_workdir(transport)}/runs"
    return [s for s in (state_from_probe(r, transport.host.name) for r in _runstate(transport, "probe", runs_dir))
            if s]


def kill_run(transport: Transport, run: str, *, grace_s: float = 10.0, known: RunState | None = None) -> RunState:
    """TERM the run's process group, wait up to grace_s, then KILL; confirm it is gone; status cancelled.
    Only a group that proves, on the host and right before each signal, that it is the run's is signalled
    (remote_payload/contract/runstate.py): a damaged status.json or a reused pgid gets no signal. `known`: the state the
    caller just probed (saves a round trip; the kill script reads status.json again on the host)."""
    state = known if known is not None else run_state(transport, run)
    if state is None:
        raise RunNotFound(f"no run {run!r} on {transport.host.name}", hint=f"list them: reval ls {transport.host.name}")
    if not state.status:
        raise RevalError(f"{transport.host.name}: run {run!r} has no readable status.json; nothing was signalled",
                         hint=f"look at it: reval logs {transport.host.name}/{run}", exit_code=3)
    d = remote_run_dir(resolve_workdir(transport), run)
    recs = _runstate(transport, "kill", d, str(float(grace_s)), timeout_s=grace_s + 60)
    rec = recs[-1] if recs else {}
    if "refused" in rec:
        raise symlink_refused(d, host=transport.host.name)
    if rec.get("alive") is True:
        raise RevalError(f"{transport.host.name}: run {run!r} (process group {state.status.get('pgid')}) survived "
                         "SIGKILL", hint="check the host: the processes may be stuck in the kernel (D state)",
                         exit_code=1)
    st = rec.get("status") if isinstance(rec.get("status"), dict) else state.status
    return RunState(transport.host.name, run, reported_state(st, False), st, False)



class SSHBackend(Backend):
    """A host reached over SSH, or the `local` folder: the wrapper runs detached (setsid nohup), its
    process group is the job (handle `ssh`, job id = pgid); state/list/cancel are one remote script each."""

    kind = "ssh"
    abilities = frozenset({WAIT_THEN_SUBMIT})

    def submit(self, sub: Submission) -> Launch:
        check_local_runs_root(self.host.name)  # the follow state goes there the moment the run exists
        return launch(self.host, self.transport, name=sub.name, payload_argv=sub.payload_argv, gpus=sub.gpus,
                      run_json=sub.run_json, python=sub.python, preflight=sub.preflight)

    def state(self, name: str, *, wait_s: float = 0.0) -> RunState | None:
        return run_state(self.transport, name, wait_s=wait_s)

    def list_runs(self) -> list[RunState]:
        return list_runs(self.transport)

    def cancel(self, name: str, *, grace_s: float = 10.0, known: RunState | None = None) -> RunState:
        return kill_run(self.transport, name, grace_s=grace_s, known=known)

    def wait_then_submit(self, name: str, sub: Submission | None, *, wait_s: float, pull: bool = False) -> Folded:
        check_local_runs_root(self.host.name)  # the follow state goes there the moment the run exists
        return wait_then_launch(self.host, self.transport, name, sub, wait_s=wait_s, pull=pull)
