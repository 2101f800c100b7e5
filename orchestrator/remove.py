"""Removing runs: the run directory on its host and the copy here (runs/<host>/<run>/). A running run is
never removed (kill it first); once removed, its name is free again on that host. `prune` picks runs by
state and age (pure); the removal itself is the backend's (one `rm -rf` of a validated path on an SSH host)."""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass

from remote_payload import protocol

from .backends.base import Backend
from .compare import _iso_s
from .errors import ConfigError, RevalError, RunNotFound
from .runs import RunState, local_run_dir

# what `prune --failed` removes: every run seen to end without a result worth keeping. Not `unknown` (no
# readable status.json): a run that is starting, or one whose status was damaged, proves no end; `reval rm`
# removes it by name.
NOT_SUCCEEDED = (protocol.FAILED, protocol.LOST, protocol.CANCELLED)


@dataclass
class Removal:
    host: str
    name: str
    state: str                   # as the host reported it; "gone" when only the copy here was left
    remote: bool                 # the host's run directory is (to be) removed
    local: bool                  # the copy here is (to be) removed


def age_of(s: RunState, now: float) -> float | None:
    """Seconds since the run finished (or started, if it never finished); None when neither is known."""
    t = _iso_s(s.status.get("finished_at")) or _iso_s(s.status.get("started_at"))
    return None if t is None else now - t


def select_for_prune(states: list[RunState], *, failed: bool = False, older_than_s: float | None = None,
                     now: float | None = None) -> list[RunState]:
    """The runs `prune` removes: never a running, queued or live one; --failed: those that did not succeed;
    --older-than: those that ended longer ago; both: both conditions (pure)."""
    now = time.time() if now is None else now
    picked = []
    for s in states:
        if not s.terminal or s.alive:
            continue
        if failed and s.state not in NOT_SUCCEEDED:
            continue
        if older_than_s is not None:
            age = age_of(s, now)
            if age is None or age < older_than_s:
                continue
        picked.append(s)
    return picked


def plan(be: Backend, name: str, *, local_only: bool = False, state: RunState | None = None) -> Removal:
    """What removing `name` would do; refuses a running run (exit 3) and a run that is nowhere (102)."""
    host = be.host.name
    state = state or be.state(name)
    copy = local_run_dir(host, name).exists()
    if state is not None and not state.terminal:
        raise ConfigError(f"{host}/{name} is still running: not removed",
                          hint=f"stop it first: reval kill {host}/{name}")
    if state is None and not copy:
        raise RunNotFound(f"no run {name!r} on {host} or here", hint=f"list runs: reval ls {host}")
    return Removal(host, name, state.state if state else "gone", remote=state is not None and not local_only,
                   local=copy)


def remove(be: Backend, r: Removal) -> Removal:
    """Carry out a planned removal (host first: a copy here without its run is harmless, the reverse is not)."""
    if r.remote:
        be.remove(r.name)  # a validated name: never '', '..', '/' or '-x'
        if be.state(r.name) is not None:
            raise RevalError(f"{r.host}/{r.name}: its run directory is still there after rm -rf",
                             hint=f"look on the host: {be.run_dir(r.name)} (permissions?)", exit_code=1)
    if r.local:
        shutil.rmtree(local_run_dir(r.host, r.name), ignore_errors=False)
    return r


def describe(r: Removal) -> str:
    """One line of the plan (pure)."""
    where = " and ".join(w for w, on in (("on the host", r.remote), ("here", r.local)) if on) or "nothing"
    return f"{r.host}/{r.name} ({r.state}): {where}"
