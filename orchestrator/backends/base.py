"""The backend seam: what differs between "a host over SSH / the local folder" (ssh.py, today) and "a
cluster scheduler" (a Slurm backend: next), behind one small interface. Everything above it — the run
lifecycle (lifecycle.py), `reval run/sweep/demo`, the `reval` API — talks to a `Backend` only.

A backend knows, for one inventory host:
  - `transport`: how commands and files reach the machine where the run directories live (the host
    itself; for a scheduler, its login node on the shared filesystem). Sync, venv and pulls ride on it.
  - `submit(Submission)`: start `python -m remote_payload <argv> --run-dir <run dir>` under the payload's
    wrapper; returns a `Launch` whose `handle` (backend kind + job id) is recorded in run.json (the wrapper
    writes it); the local .follow.json is written the moment the run exists. A used name raises RunExists;
    nothing started -> nothing left.
  - `state(name, wait_s=)` / `list_runs()`: a `RunState` (runs.py) — `queued` (with `reason`, e.g. the scheduler's
    pending reason) | running | succeeded | failed | cancelled | lost; None when there is no such run.
  - `cancel(name, grace_s=, known=)`: stop it (TERM, wait, KILL for a process group; scancel for a job),
    each only after the host proves it is the run's, and record `cancelled`; returns the final RunState.
  - `stream_command(...)`: the remote command whose stdout is the framed live stream of a run's files
    (remote_payload/runtime/stream.py), resumable at byte offsets; `pull(name)`: copy the contract files to
    runs/<host>/<run>/.

The run directory contract (remote_payload/contract/protocol.py) is the same for every backend: the wrapper owns
status.json wherever it runs, so following, pulling and the state vocabulary never depend on the backend.
A scheduler backend runs the wrapper with `--gpus scheduler`: the GPUs the scheduler assigned
(CUDA_VISIBLE_DEVICES already set) are kept as they are, never chosen, locked or blanked.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ..inventory import Host
from ..runs import RunState
from ..transport import Transport, resolve_workdir

# `--gpus` value for the wrapper when a scheduler assigned the GPUs (CUDA_VISIBLE_DEVICES kept as is)
GPUS_SCHEDULER = "scheduler"


@dataclass(frozen=True)
class JobHandle:
    """What a backend needs to find a run's process again: `ssh` + the wrapper's process group id, or
    e.g. `slurm` + the job id. Recorded in run.json (`handle`, written by the wrapper on the host)."""
    backend: str
    job_id: str

    def to_json(self) -> dict:
        return {"backend": self.backend, "job_id": self.job_id}

    @classmethod
    def from_json(cls, d) -> JobHandle | None:
        if not isinstance(d, dict) or not isinstance(d.get("backend"), str) or d.get("job_id") in (None, ""):
            return None
        return cls(d["backend"], str(d["job_id"]))


@dataclass
class Submission:
    """One run to start (what `reval run`, the sweep and the API hand to `Backend.submit`)."""
    name: str                      # validated run name (protocol.validate_run_name)
    payload_argv: list[str]        # `python -m remote_payload <payload_argv>`, without --run-dir
    python: str                    # the host's interpreter for the payload (environment.provision)
    gpus: str = "auto"             # auto | none | 0,1 (ssh); a scheduler backend passes GPUS_SCHEDULER
    run_json: dict = field(default_factory=dict)  # what was asked (argv, hashes, paths): staged to run.json
    # `python -m remote_payload <preflight>` run on the host before the name is claimed (exit 3: nothing is
    # created, the submit raises ConfigError with its line); None: no check
    preflight: list[str] | None = None


@dataclass
class Launch:
    """A started run (submit's answer)."""
    host: str
    name: str
    run_dir: str                   # on the host (or the shared filesystem)
    handle: JobHandle
    pid: int = 0
    pgid: int = 0
    device: str = "cpu"            # cuda | cpu (unknown while queued: "")
    gpus: list = field(default_factory=list)
    gpu_info: list[dict] = field(default_factory=list)
    status: dict = field(default_factory=dict)
    queued: bool = False           # accepted by a scheduler, not started yet


class Backend(ABC):
    """One host's way of running runs. Subclasses: ssh.SSHBackend (the host or the local folder)."""

    kind: str = ""
    queues: bool = False  # a scheduler: a submitted run may wait (`queued`, with a reason) before it starts

    def __init__(self, host: Host, transport: Transport):
        self.host = host
        self.transport = transport

    def workdir(self) -> str:
        """The absolute workdir where runs/, payload/, venvs/ live (resolved once)."""
        return resolve_workdir(self.transport)

    def run_dir(self, name: str) -> str:
        from ..runs import remote_run_dir
        return remote_run_dir(self.workdir(), name)

    @abstractmethod
    def submit(self, sub: Submission) -> Launch:
        """Start the run (see the module doc). Raises RunExists, NoFreeGpu, ConfigError, HostUnreachable."""

    @abstractmethod
    def state(self, name: str, *, wait_s: float = 0.0) -> RunState | None:
        """The run's state now; None when the host has no such run. With wait_s: a long poll that answers as
        soon as the run has left queued/running, at the latest after wait_s (one round trip)."""

    @abstractmethod
    def list_runs(self) -> list[RunState]:
        """Every run on the host."""

    @abstractmethod
    def cancel(self, name: str, *, grace_s: float = 10.0, known: RunState | None = None) -> RunState:
        """Stop the run and record `cancelled`; RunNotFound when there is no such run. `known`: its state as the
        caller just probed it (one probe, not two; the host still proves the job is the run's before a signal)."""

    def stream_command(self, name: str, *, python: str, log_offset: int, events_offset: int) -> str:
        """The remote command streaming the run's files (framed; remote_payload/runtime/stream.py)."""
        from ..follow import stream_command
        return stream_command(self.workdir(), python, self.run_dir(name), log_offset, events_offset)

    def pull(self, name: str):
        """Copy the run's contract files to runs/<host>/<name>/; a pull.PullResult."""
        from ..pull import pull
        return pull(self.transport, name, workdir=self.workdir())

    def remove(self, name: str) -> None:
        """Delete the run's directory where it lives (a run that must leave nothing behind: bad input)."""
        from ..transport import q
        self.transport.run(f"rm -rf -- {q(self.run_dir(name))}", check=False, timeout_s=60)

    def close(self) -> None:
        self.transport.close()
