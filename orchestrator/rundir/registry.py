"""Runs: where they live (remote run dirs, the local registry `runs/<host>/<run>/`), their names, and the
state vocabulary — including `lost` (status.json says running but its process group is gone), `unknown` (no
readable status.json) and `no-answer` (its scheduler cannot answer now): the controller's words, never written
on the server.
The probes that ask a host (status / ls / kill) are the backends' (backends/); which host a RUN reference
means is runs/locate.py's."""
from __future__ import annotations

import calendar
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from remote_payload.contract import protocol, runstate

from ..errors import ConfigError

FOLLOW_JSON = ".follow.json"

# The controller's words beside protocol's states (never written on the server), one situation each:
# `unknown`: the run's own status.json is missing or damaged: nothing on the host says whether it goes on or
# how it ended (an end as far as waiting goes: nothing will tell; `reval status RUN` exits 1);
UNKNOWN = "unknown"
# `no-answer`: its scheduler cannot answer now (slurmctld unreachable, scontrol failing): not an end, never
# `lost`; asked again until the scheduler answers (`reval status RUN` exits 4, as for a host that cannot be
# reached; a follow, a wait and a sweep keep waiting and say so)
NO_ANSWER = "no-answer"


@dataclass
class RunState:
    host: str
    name: str
    state: str                 # queued | running | succeeded | failed | cancelled | lost; unknown | no-answer
    status: dict = field(default_factory=dict)
    alive: bool = False
    last_event: dict = field(default_factory=dict)  # the last line of events.jsonl
    reason: str = ""           # why it is queued (a scheduler's pending reason), lost, or has no answer
    # the host's clock (epoch seconds) when this was read, in the same round trip: the one clock that wrote
    # status.json's times, so a run's age is host_now - finished_at whatever this machine's clock says
    host_now: float | None = None
    kind: str = "eval"         # run.json's kind: eval, or extract (a cache build)

    @property
    def terminal(self) -> bool:
        return self.state not in (protocol.RUNNING, protocol.QUEUED, NO_ANSWER)

    @property
    def suspect(self) -> bool:
        """Succeeded, but results.json flags the result suspect (the wrapper copies that into status.json)."""
        return self.state == protocol.SUCCEEDED and self.status.get("suspect") is True

    @property
    def progress(self) -> str:
        """`[3/5] eval 6/10`: where its last progress event says it is (progress_text)."""
        return progress_text(self.last_event)

    def to_json(self) -> dict:
        """What `--json` prints for a run (pure)."""
        st = self.status
        return {"host": self.host, "name": self.name, "kind": self.kind, "state": self.state, "suspect": self.suspect,
                **({"suspect_reasons": st.get("suspect_reasons", [])} if self.suspect else {}),
                **{k: st.get(k) for k in ("started_at", "finished_at", "exit_code", "error", "gpus", "device")},
                "reason": self.reason or None,  # a scheduler's pending reason, why it is lost or has no answer
                "job_id": st.get("job_id") if isinstance(st.get("job_id"), str) and st.get("job_id") else None,
                "progress": progress_text(self.last_event) if self.state == protocol.RUNNING else None}


def by_start_time(states: list[RunState]) -> list[RunState]:
    """Oldest first; runs with no recorded start last (pure)."""
    return sorted(states, key=lambda s: (not s.status.get("started_at"), s.status.get("started_at") or "",
                                         s.host, s.name))


# status.json fields the controller reads, and their types: a damaged or hand-edited value is dropped, so
# that no listing, duration or exit code is computed from a list where a number belongs
_STATUS_TYPES = {"state": str, "pid": int, "pgid": int, "started_at": str, "finished_at": str, "exit_code": int,
                 "device": str, "error": str, "boot_id": str, "gpus": list, "suspect": bool,
                 "suspect_reasons": list}


def clean_status(st) -> dict:
    """status.json as read back, with every known field of the wrong type left out (pure)."""
    if not isinstance(st, dict):
        return {}
    out = {}
    for k, v in st.items():
        want = _STATUS_TYPES.get(k)
        if want is not None and (not isinstance(v, want) or want is int and isinstance(v, bool)):
            continue
        if k == "gpus" and not all(isinstance(g, int) and not isinstance(g, bool) for g in v):
            continue
        if k == "state" and v not in (protocol.RUNNING, *protocol.TERMINAL_STATES):
            continue
        out[k] = v
    return out


def reported_state(status: dict, alive: bool) -> str:
    """The state to report: status.json's, except `running` with no live process group is `lost`."""
    state = status.get("state", protocol.RUNNING)
    if state == protocol.RUNNING and not alive:
        return protocol.LOST
    return state


def iso_s(ts: str | None) -> float | None:
    """status.json's UTC time (`2026-11-30T12:00:00Z`, protocol.now_iso) -> epoch seconds; None when it is not
    one (pure)."""
    try:
        return float(calendar.timegm(time.strptime(ts, "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError):
        return None


# -- paths ------------------------------------------------------------------------------------------------
_RUNS_ROOT: ContextVar[Path | None] = ContextVar("reval_runs_root", default=None)


def local_runs_root() -> Path:
    """runs/ here: the folder of a runs_root() around the call, else $REVAL_RUNS_DIR, else ./runs."""
    return _RUNS_ROOT.get() or Path(os.environ.get("REVAL_RUNS_DIR", "runs"))


@contextmanager
def runs_root(path: str | Path | None) -> Iterator[None]:
    """Within it, local_runs_root() is `path` (None: as without it): the API's `runs_dir=`, given to one call
    instead of set in the environment."""
    if path is None:
        yield
        return
    token = _RUNS_ROOT.set(Path(path))
    try:
        yield
    finally:
        _RUNS_ROOT.reset(token)


def symlink_refused(path, *, host: str | None = None, what: str = "a run folder") -> ConfigError:
    """The one line for a run folder (or a run's file) that is a symbolic link: every command refuses it (exit
    3), as the host's probe does, instead of reading, pulling or removing whatever it points to."""
    return ConfigError(f"{host + ': ' if host else ''}{path} is a symbolic link, not {what}: refused",
                       hint="a link can lead anywhere: reval reads a run only from real folders and files under "
                            "runs/; remove the link, or copy what it points to there")


def local_run_dir(host_name: str, run: str) -> Path:
    """runs/<host>/<run> here (resolved); a folder there that is a symbolic link is refused (exit 3): what it
    points to is no copy of that run, and nothing is written or removed through it."""
    try:
        host_name, run = protocol.validate_run_name(host_name), protocol.validate_run_name(run)
    except protocol.ProtocolError as e:
        raise ConfigError(f"cannot keep a local copy of {host_name}/{run}: {e}") from None
    for p in (local_runs_root() / host_name, local_runs_root() / host_name / run):
        if p.is_symlink():
            raise symlink_refused(p)
    try:
        return protocol.safe_join(local_runs_root(), host_name, run)
    except protocol.ProtocolError as e:
        raise ConfigError(f"cannot keep a local copy of {host_name}/{run}: {e}") from None


def check_run_name(name: str) -> str:
    """`name` when it is a legal run name, else ConfigError (exit 3) with the rule: the one check of a
    user's run name (reval run --name, RUN references, the lifecycle, the launch)."""
    try:
        return protocol.validate_run_name(name)
    except protocol.ProtocolError as e:
        raise ConfigError(str(e)) from None


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
    """The saved follow state; a damaged file (not JSON, not an object, a bad offset) counts as none."""
    try:
        st = protocol.read_json(local_run_dir(host_name, run) / FOLLOW_JSON, runstate.MAX_STATUS_BYTES)
    except (OSError, ValueError):
        return {}
    if not isinstance(st, dict):
        return {}
    off = st.get("log_offset")
    if off is not None and (not isinstance(off, int) or isinstance(off, bool) or off < 0):
        st.pop("log_offset")  # follow from the start: lines twice rather than lost
    for k in ("python", "run_dir"):
        if k in st and not isinstance(st[k], str):
            st.pop(k)
    return st


def check_local_runs_root(host_name: str) -> None:
    """Refuse, before anything starts, a `runs` (or `runs/<host>`) that is a file or not writable; makes
    nothing (after an exit 3 nothing is left behind)."""
    root = local_runs_root()
    for p in (root, root / host_name):
        if p.exists() and (not p.is_dir() or not os.access(p, os.W_OK | os.X_OK)):
            raise ConfigError(f"cannot keep local run copies in {p}/: it is "
                              + ("not a folder" if not p.is_dir() else "not writable"),
                              hint=f"move {p} away, or point REVAL_RUNS_DIR at another folder")


def ensure_local_run_dir(host_name: str, run: str) -> Path:
    """runs/<host>/<run>/, made now: a `runs` that is a file (or unwritable) is one line before anything
    starts, not a traceback after the run was launched."""
    d = local_run_dir(host_name, run)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot keep local run copies in {d}: {e.strerror}",
                          hint=f"{local_runs_root()}/ must be a writable folder: move what is there away, or "
                               "point REVAL_RUNS_DIR at another folder") from None
    return d


def save_follow_state(host_name: str, run: str, **fields) -> None:
    d = ensure_local_run_dir(host_name, run)
    protocol.atomic_write_json(d / FOLLOW_JSON, {**load_follow_state(host_name, run), **fields})


def local_registry() -> list[tuple[str, str]]:
    """(host, run) pairs known locally: launched from here or pulled."""
    root = local_runs_root()
    if not root.is_dir():
        return []
    return sorted((h.name, r.name) for h in root.iterdir() if h.is_dir()
                  for r in h.iterdir() if r.is_dir() and is_run_name(r.name) and is_run_name(h.name))


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
