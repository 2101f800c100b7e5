"""Removing runs: the run directory on its host and the copy here (runs/<host>/<run>/). A running run is
never removed (kill it first); once removed, its name is free again on that host. `prune` picks runs by
state and age (pure); the removal itself is the backend's (one `rm -rf` of a validated path on an SSH host).

Ages are the host's: its listing carries the host's clock (RunState.host_now), and a run's age is that minus
the times the same clock wrote into status.json. A copy here goes with its host's run; prune never ages a copy
by this machine's clock (its times are the host's), so a copy whose host cannot be reached stays."""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass

from remote_payload.contract import protocol

from ..backends.base import Backend
from ..errors import ConfigError, HostUnreachable, RevalError, RunNotFound
from ..rundir.registry import NO_ANSWER, RunState, iso_s, local_run_dir

# what `prune --failed` removes: every run seen to end without a result worth keeping. Not `unknown` (no
# readable status.json): a run that is starting, or one whose status was damaged, proves no end; `reval rm`
# removes it by name.
NOT_SUCCEEDED = (protocol.FAILED, protocol.LOST, protocol.CANCELLED)


@dataclass
class Removal:
    """One run to remove (remove.plan): where it goes from, the host's run directory and/or the copy here."""
    host: str
    name: str
    state: str                   # as the host reported it; "gone" when only the copy here was left
    remote: bool                 # the host's run directory is (to be) removed
    local: bool                  # the copy here is (to be) removed

    def describe(self) -> str:
        """One line of the plan (pure)."""
        where = " and ".join(w for w, on in (("on the host", self.remote), ("here", self.local)) if on)
        where = where or "nothing"
        return f"{self.host}/{self.name} ({self.state}): {where}"


# No reval run ended before this: an earlier finish time was written by a wrong clock (a host whose clock was
# years behind, since corrected), and its "age" says nothing about when the run ended.
PLAUSIBLE_SINCE = "2024-01-01T00:00:00Z"
_PLAUSIBLE_SINCE_S = iso_s(PLAUSIBLE_SINCE)
# how far a finish time may lie after the host's "now" and still count as "just ended" (a cluster's nodes and
# its login node may disagree by a little)
CLOCK_SLACK_S = 60.0


def age_of(s: RunState) -> tuple[float | None, str | None]:
    """(seconds since the run finished (or started, if it never finished), why its age cannot be trusted).

    One clock: status.json's times were written by the host's clock, so the age is the host's own "now" (read
    in the listing's round trip: s.host_now) minus them, never this machine's clock. A time after the host's
    now (its clock went back) or before PLAUSIBLE_SINCE (a wrong clock wrote it) gives no age, and says why;
    no recorded time gives (None, None) (pure)."""
    when = s.status.get("finished_at") or s.status.get("started_at")
    t = iso_s(when)
    if t is None:
        return None, None
    if s.host_now is None:
        return None, "its host did not say what time it is"
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.host_now))
    if t < _PLAUSIBLE_SINCE_S:
        return None, f"it ended at {when} by its host's clock, before {PLAUSIBLE_SINCE}: written by a wrong clock"
    if t > s.host_now + CLOCK_SLACK_S:
        return None, f"it ended at {when}, after the host's clock now ({now}): the host's clock went back"
    return max(0.0, s.host_now - t), None


def select_for_prune(states: list[RunState], *, failed: bool = False, older_than_s: float | None = None
                     ) -> tuple[list[RunState], list[tuple[RunState, str]]]:
    """(the runs `prune` removes, [(run, why its age is not trusted)]): never a running, queued or live run;
    --failed: those that did not succeed; --older-than: those that ended longer ago by their host's clock;
    both: both conditions. A run whose age cannot be trusted (age_of) is never removed by age (pure)."""
    picked, skipped = [], []
    for s in states:
        if not s.terminal or s.alive:
            continue
        if failed and s.state not in NOT_SUCCEEDED:
            continue
        if older_than_s is not None:
            age, distrust = age_of(s)
            if distrust:
                skipped.append((s, distrust))
            if age is None or age < older_than_s:
                continue
        picked.append(s)
    return picked, skipped


def plan(be: Backend, name: str, *, local_only: bool = False, state: RunState | None = None) -> Removal:
    """What removing `name` would do; refuses a running run (exit 3) and a run that is nowhere (102)."""
    host = be.host.name
    state = state or be.state(name)
    copy = local_run_dir(host, name).exists()
    if state is not None and state.state == NO_ANSWER:  # it may be running: nothing is removed (exit 4)
        raise HostUnreachable(f"{host}/{name}: {state.reason}: not removed (it may still be running)",
                              hint=f"ask again once it answers: reval status {host}/{name}")
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

