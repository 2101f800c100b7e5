"""Runs: where they live (remote run dirs, the local registry `runs/<host>/<run>/`), which host a RUN
reference means, and what state a run is in — including `lost` (status.json says running but its
process group is gone), which is the controller's verdict and never written on the server."""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from remote_payload import protocol

from .errors import ConfigError, HostUnreachable, RevalError, RunNotFound
from .inventory import Host
from .transport import Transport, q, resolve_workdir

FOLLOW_JSON = ".follow.json"

# Shell helper shared by the remote probes: is any process of group $1 still running? The same rule as
# protocol.group_alive (the stream's test): scan /proc/<pid>/stat, where after comm's closing ")" come state,
# ppid and pgrp, and skip zombies (Z/X: `kill -0` counts them, and they linger where PID 1 does not reap);
# without /proc, `kill -0` on the group.
_ALIVE_SH = ('alive() { _g=$1; '
             # a group recorded in another boot (status.json boot_id) is not ours, whatever holds that id now
             'if [ -n "$2" ] && [ -r /proc/sys/kernel/random/boot_id ] && '
             '[ "$(cat /proc/sys/kernel/random/boot_id)" != "$2" ]; then return 1; fi; '
             'if [ -r /proc/self/stat ]; then '
             'for _f in /proc/[0-9]*/stat; do read -r _s 2>/dev/null < "$_f" || continue; '
             '_s=${_s##*")"}; set -- $_s; '
             '[ "$3" = "$_g" ] && [ "$1" != Z ] && [ "$1" != X ] && return 0; done; return 1; fi; '
             'kill -s 0 -- "-$_g" 2>/dev/null; }\n'
             'pgid_of() { sed -n \'s/^ *"pgid": *\\([0-9][0-9]*\\).*/\\1/p\' "$1" 2>/dev/null | head -n 1; }\n'
             'boot_of() { sed -n \'s/^ *"boot_id": *"\\([0-9a-f-]*\\)".*/\\1/p\' "$1" 2>/dev/null | head -n 1; }\n')


@dataclass
class RunState:
    host: str
    name: str
    state: str                 # running | succeeded | failed | cancelled | lost
    status: dict = field(default_factory=dict)
    alive: bool = False
    last_event: dict = field(default_factory=dict)  # the last line of events.jsonl

    @property
    def terminal(self) -> bool:
        return self.state != protocol.RUNNING


def verdict(status: dict, alive: bool) -> str:
    """The state to report: status.json's, except `running` with no live process group is `lost`."""
    state = status.get("state", protocol.RUNNING)
    if state == protocol.RUNNING and not alive:
        return protocol.LOST
    return state


# -- paths ------------------------------------------------------------------------------------------------
def local_runs_root() -> Path:
    return Path(os.environ.get("REVAL_RUNS_DIR", "runs"))


def local_run_dir(host_name: str, run: str) -> Path:
    try:
        return protocol.safe_join(local_runs_root(), protocol.validate_run_name(host_name),
                                  protocol.validate_run_name(run))
    except protocol.ProtocolError as e:
        raise ConfigError(f"cannot keep a local copy of {host_name}/{run}: {e}") from None


def is_run_name(name: str) -> bool:
    try:
        protocol.validate_run_name(name)
        return True
    except protocol.ProtocolError:
        return False


def remote_run_dir(workdir: str, run: str) -> str:
    return f"{workdir.rstrip('/')}/runs/{protocol.validate_run_name(run)}"


# -- the follow state kept per run (offset into eval.log, what is needed to re-attach) ------------------
def load_follow_state(host_name: str, run: str) -> dict:
    try:
        return json.loads((local_run_dir(host_name, run) / FOLLOW_JSON).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def save_follow_state(host_name: str, run: str, **fields) -> None:
    d = local_run_dir(host_name, run)
    d.mkdir(parents=True, exist_ok=True)
    protocol.atomic_write_json(d / FOLLOW_JSON, {**load_follow_state(host_name, run), **fields})


def local_registry() -> list[tuple[str, str]]:
    """(host, run) pairs known locally: launched from here or pulled."""
    root = local_runs_root()
    if not root.is_dir():
        return []
    return sorted((h.name, r.name) for h in root.iterdir() if h.is_dir()
                  for r in h.iterdir() if r.is_dir() and is_run_name(r.name) and is_run_name(h.name))


# -- remote probes ------------------------------------------------------------------------------------------
def parse_probe(text: str, host: str) -> list[RunState]:
    """Parse `@@RUN name` / `@@ALIVE 0|1` / status.json blocks (pure)."""
    out, name, alive, body, event = [], None, False, [], {}

    def flush():
        if name is None:
            return
        try:
            st = json.loads("\n".join(body)) if "".join(body).strip() else {}
        except ValueError:
            st = {}
        out.append(RunState(host, name, verdict(st, alive) if st else "unknown", st, alive, event))

    for line in text.splitlines():
        if line.startswith("@@RUN "):
            flush()
            name, alive, body, event = line[6:], False, [], {}
        elif line.startswith("@@ALIVE "):
            alive = line.strip().endswith("1")
        elif line.startswith("@@EVENT"):
            try:
                event = json.loads(line[7:]) if line[7:].strip() else {}
            except ValueError:
                event = {}  # a line still being written
        else:
            body.append(line)
    flush()
    return [s for s in out if is_run_name(s.name)]  # a directory reval did not make is not a run


def _probe_sh(run_expr: str) -> str:
    """Shell printing one probe block for run directory `$d` named `$n`."""
    return (f'{run_expr}; echo "@@RUN $n"; pg=$(pgid_of "$d/status.json"); bt=$(boot_of "$d/status.json"); '
            'if [ -n "$pg" ] && alive "$pg" "$bt"; then echo "@@ALIVE 1"; else echo "@@ALIVE 0"; fi; '
            'echo "@@EVENT $(tail -n 1 "$d/events.jsonl" 2>/dev/null)"; '
            'cat "$d/status.json" 2>/dev/null; echo\n')


def run_state(transport: Transport, run: str) -> RunState | None:
    """The run's state on its host, or None when the host has no such run."""
    d = remote_run_dir(resolve_workdir(transport), run)
    script = (_ALIVE_SH + f"d={q(d)}; n={q(run)}\n"
              '[ -d "$d" ] || exit 0\n' + _probe_sh(":"))
    states = parse_probe(transport.run(script, timeout_s=60).stdout, transport.host.name)
    return states[0] if states else None


def list_runs(transport: Transport) -> list[RunState]:
    runs_dir = f"{resolve_workdir(transport)}/runs"
    script = (_ALIVE_SH + f'cd {q(runs_dir)} 2>/dev/null || exit 0\n'
              'for d in */; do [ -d "$d" ] || continue; ' + _probe_sh('d=${d%/}; n=$d').rstrip("\n") + '; done\n')
    return parse_probe(transport.run(script, timeout_s=60).stdout, transport.host.name)


def kill_run(transport: Transport, run: str, *, grace_s: float = 10.0) -> RunState:
    """TERM the run's process group, wait up to grace_s, then KILL; confirm it is gone; status cancelled."""
    state = run_state(transport, run)
    if state is None:
        raise RunNotFound(f"no run {run!r} on {transport.host.name}", hint=f"list them: reval ls {transport.host.name}")
    pgid = state.status.get("pgid")
    if state.alive and pgid:
        ticks = max(1, int(grace_s * 10))
        script = (_ALIVE_SH + f"pg={int(pgid)}; bt={q(str(state.status.get('boot_id') or ''))}\n"
                  'kill -s TERM -- "-$pg" 2>/dev/null\n'
                  f'i=0; while alive "$pg" "$bt" && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done\n'
                  'if alive "$pg" "$bt"; then kill -s KILL -- "-$pg" 2>/dev/null; echo "@@KILLED"; '
                  'i=0; while alive "$pg" "$bt" && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; fi\n'
                  'if alive "$pg" "$bt"; then echo "@@STILL_ALIVE"; fi\n')
        out = transport.run(script, timeout_s=grace_s + 60).stdout
        if "@@STILL_ALIVE" in out:
            raise RevalError(f"{transport.host.name}: run {run!r} (process group {pgid}) survived SIGKILL",
                             hint="check the host: the processes may be stuck in the kernel (D state)",
                             exit_code=1)
        state = run_state(transport, run)
    if state is not None and state.status.get("state") == protocol.RUNNING:
        # The wrapper was KILLed (or died) before it could record the end: record it for it.
        st = {**state.status, "state": protocol.CANCELLED, "finished_at": protocol.now_iso(),
              "exit_code": 137, "cancelled_by": "reval kill"}
        d = remote_run_dir(resolve_workdir(transport), run)
        tmp = f"{d}/.status.json.kill.tmp"
        transport.run(f"cat > {q(tmp)} && mv -f {q(tmp)} {q(d + '/status.json')}",
                      input=json.dumps(st, indent=2) + "\n", timeout_s=60)
        state = RunState(transport.host.name, run, protocol.CANCELLED, st, False)
    return state


# -- which host a RUN reference means ----------------------------------------------------------------------
def resolve_run(inventory, ref: str, host_opt: str | None = None, *, search_hosts: bool = True) -> tuple[Host, str]:
    """`host/name` or `name` (+ --host) -> (Host, name). A bare name is looked up in the local registry,
    then on every inventory host; found on several => an error naming them; nowhere => RunNotFound."""
    if "/" in ref:
        host_name, name = ref.split("/", 1)
    else:
        host_name, name = host_opt, ref
    try:
        protocol.validate_run_name(name)
    except protocol.ProtocolError as e:
        raise ConfigError(str(e)) from None
    if host_name:
        return inventory.get(host_name), name
    local = sorted({h for h, r in local_registry() if r == name and h in inventory.hosts})
    if len(local) == 1:
        return inventory.get(local[0]), name
    candidates = local
    if not candidates and search_hosts:
        hosts = list(inventory.hosts.values())

        def has(h: Host) -> bool:
            from .transport import get_transport
            try:
                return run_state(get_transport(h), name) is not None
            except HostUnreachable:
                return False
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as ex:
            candidates = [h.name for h, ok in zip(hosts, ex.map(has, hosts)) if ok]
    if not candidates:
        raise RunNotFound(f"no run named {name!r} here (runs/) or on any inventory host",
                          hint="list runs: reval ls ; or name the host: reval status HOST/NAME")
    if len(candidates) > 1:
        raise ConfigError(f"run name {name!r} exists on several hosts: {', '.join(candidates)}",
                          hint=f"say which: {candidates[0]}/{name} (or --host {candidates[0]})")
    return inventory.get(candidates[0]), name


def progress_text(event: dict) -> str:
    """`[3/5] eval 6/10` from an events.jsonl entry (pure)."""
    parts = []
    if "step" in event and "steps" in event:
        parts.append(f"[{event['step']}/{event['steps']}]")
    if event.get("stage"):
        parts.append(str(event["stage"]))
    if isinstance(event.get("i"), int) and isinstance(event.get("n"), int):
        parts.append(f"{event['i']}/{event['n']}")
    return " ".join(parts)
