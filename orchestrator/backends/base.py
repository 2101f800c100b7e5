"""The backend seam: what differs between "a host over SSH / the local folder" (ssh.py) and "a cluster
scheduler" (slurm.py: a Slurm cluster through its login node), behind one small interface. Everything above
it — the run lifecycle (runs/lifecycle.py), the sweep, `reval run/sweep/demo`, the `reval` API — talks to
a `Backend` only, and never asks which one it holds.

A backend knows, for one inventory host:
  - `transport`: how commands and files reach the machine where the run directories live (the host
    itself; for a scheduler, its login node on the shared filesystem). Sync, venv and pulls ride on it.
  - `submit(Submission)`: start `python -m remote_payload <argv> --run-dir <run dir>` under the payload's
    wrapper; returns a `Launch` whose `handle` (backend kind + job id) is recorded in run.json (the wrapper
    writes it); the local .follow.json is written the moment the run exists. A used name raises RunExists;
    nothing started -> nothing left.
  - `state(name, wait_s=)` / `list_runs()`: a `RunState` (rundir/registry.py) — `queued` (with `reason`,
    e.g. the scheduler's pending reason) | running | succeeded | failed | cancelled | lost, `unknown` (no readable
    status.json),
    `no-answer` (with `reason`: the scheduler cannot answer now; not an end); None when there is no such run.
  - `cancel(name, grace_s=, known=)`: stop it (TERM, wait, KILL for a process group; scancel for a job),
    each only after the host proves it is the run's, and record `cancelled`; returns the final RunState.
  - `stream_command(...)`: the remote command whose stdout is the framed live stream of a run's files
    (remote_payload/runtime/stream.py), resumable at byte offsets; `pull(name)`: copy the contract files to
    runs/<host>/<run>/.
  - `run_slots(list_gpus)`: how many runs the host takes at once, as the `--gpus` of each (a sweep's slots).

Optional abilities, as pyinfra's connectors have them: a backend lists what it can do beyond the above in
`abilities`; generic code asks `supports(...)` (never `host.slurm`), and the base method of an ability the
backend lacks raises Unsupported naming the host and the ability.
  - BATCH_SUBMIT, `submit_many(subs)`: several runs in one submission (Slurm: one job array, at most K running).
  - BATCH_STATE, `states(names)`: several runs' states in one look (Slurm: two round trips for all of them).
  - WAIT_THEN_SUBMIT, `wait_then_submit(name, sub, wait_s=, pull=)`: a long poll on a run and, once status.json
    says it ended, the next run started, in one round trip (SSH: a sweep slot's "run N over -> launch N+1"; with
    `pull`, run N's files come back in the same answer). Every backend answers the call (the base's: state, then
    submit: two round trips, nothing pulled); the ability says it is one.

The run directory contract (remote_payload/contract/protocol.py) is the same for every backend: the wrapper owns
status.json wherever it runs, so following, pulling and the state vocabulary never depend on the backend.
A scheduler backend runs the wrapper with `--gpus scheduler`: the GPUs the scheduler assigned
(CUDA_VISIBLE_DEVICES already set) are kept as they are, never chosen, locked or blanked.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from remote_payload.contract import protocol

from ..errors import ConfigError, HostUnreachable, RevalError
from ..hosts.gpuspec import gpu_slots, normalize_gpus
from ..hosts.inventory import Host
from ..hosts.transport import Transport, q, resolve_workdir
from ..rundir.follow import stream_command as follow_stream_command
from ..rundir.pull import Pulled
from ..rundir.pull import pull as pull_run
from ..rundir.registry import RunState, remote_run_dir

# optional abilities (Backend.abilities / supports)
BATCH_SUBMIT = "batch-submit"   # submit_many: several runs in one submission
BATCH_STATE = "batch-state"     # states: several runs' states in one look
WAIT_THEN_SUBMIT = "wait-then-submit"  # wait_then_submit natively: a run's end and the next start, one round trip


def ended(st: RunState | None) -> bool:
    """Whether a run ended by its status.json's own word (succeeded, failed, cancelled): the one condition on
    which wait_then_submit starts the next run (pure)."""
    return st is not None and st.state in protocol.TERMINAL_STATES and st.status.get("state") == st.state


class Folded(NamedTuple):
    """wait_then_submit's answer: the polled run's state; what the start gave (its Launch, the RevalError that
    refused it, or None: nothing was started); `pulled`: the polled run's files, pulled in the same round trip
    when asked and the backend could (None: pull it as usual)."""
    state: RunState | None
    started: Launch | RevalError | None
    pulled: Pulled | None = None


class NoFreeGpu(ConfigError):
    """The host found every GPU busy or locked (nothing was started; try again later or elsewhere)."""


class Unsupported(ConfigError):
    """An optional ability (BATCH_SUBMIT, BATCH_STATE) that the host's backend does not have (WAIT_THEN_SUBMIT
    never raises it: without the ability, wait_then_submit takes two round trips)."""


@dataclass(frozen=True)
class JobHandle:
    """What a backend needs to find a run's process again: `ssh` + the wrapper's process group id, or
    e.g. `slurm` + the job id. Recorded in run.json (`handle`, written by the wrapper on the host)."""
    backend: str
    job_id: str

    def to_json(self) -> dict:
        return {"backend": self.backend, "job_id": self.job_id}


@dataclass
class Submission:
    """One run to start (what `reval run`, the sweep and the API hand to `Backend.submit`)."""
    name: str                      # validated run name (protocol.validate_run_name)
    payload_argv: list[str]        # `python -m remote_payload <payload_argv>`, without --run-dir
    python: str                    # the host's interpreter for the payload (environment.provision)
    gpus: str = "auto"             # auto | none | 0,1 (ssh); a scheduler backend: gpuspec.GPUS_SCHEDULER
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
    requested_gpus: str = ""       # the --gpus it was started with (auto | none | 0,1; "" for a scheduler's)


class Backend(ABC):
    """One host's way of running runs. Subclasses: ssh.SSHBackend (the host or the local folder),
    slurm.SlurmBackend (a cluster through its login node)."""

    kind: str = ""
    queues: bool = False  # a scheduler: a submitted run may wait (`queued`, with a reason) before it starts
    # the optional abilities it has: BATCH_SUBMIT, BATCH_STATE, WAIT_THEN_SUBMIT
    abilities: frozenset[str] = frozenset()

    def __init__(self, host: Host, transport: Transport):
        self.host = host
        self.transport = transport

    def workdir(self) -> str:
        """The absolute workdir where runs/, payload/, venvs/ live (resolved once)."""
        return resolve_workdir(self.transport)

    def run_dir(self, name: str) -> str:
        return remote_run_dir(self.workdir(), name)

    def supports(self, ability: str) -> bool:
        """Whether it has the optional `ability` (BATCH_SUBMIT, BATCH_STATE, WAIT_THEN_SUBMIT)."""
        return ability in self.abilities

    def _unsupported(self, ability: str) -> Unsupported:
        return Unsupported(f"{self.host.name} ({self.kind or type(self).__name__} backend) has no {ability}",
                           hint="generic code asks backend.supports(...) first")

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

    # -- optional abilities (supports(...) says which; without BATCH_SUBMIT or BATCH_STATE their methods raise
    # Unsupported; without WAIT_THEN_SUBMIT, wait_then_submit is the two round trips below) ------------------
    def submit_many(self, subs: list[Submission], *, max_running: int | None = None) -> list[Launch]:
        """BATCH_SUBMIT: start all of `subs` in one submission, at most `max_running` at once (None: the
        backend's own cap); one Launch each, in order. A used name refuses every one (RunExists)."""
        raise self._unsupported(BATCH_SUBMIT)

    def states(self, names: list[str] | None) -> list[RunState]:
        """BATCH_STATE: the states of the named runs (None: every run) in one look; a name the host does not
        have is left out."""
        raise self._unsupported(BATCH_STATE)

    def wait_then_submit(self, name: str, sub: Submission | None, *, wait_s: float, pull: bool = False) -> Folded:
        """A long poll on run `name` (as state(wait_s=)); once it shows the run ended by its status.json's own
        word (succeeded, failed, cancelled; never lost, unknown or missing), `sub` started (None: nothing to
        start; with `pull`, a long poll that brings the ended run's files). Returns Folded(the
        run's state, what the start gave: its Launch, the RevalError that refused it (RunExists, NoFreeGpu,
        ConfigError, ...), or None when nothing was started, and with `pull` the ended run's files pulled in the
        same round trip when the backend can: None here). A transport error raises HostUnreachable: the
        start may or may not have happened, and the same call again is safe (a started run's name answers
        RunExists). WAIT_THEN_SUBMIT says a backend does it in one round trip; this one takes two."""
        st = self.state(name, wait_s=wait_s)
        if not ended(st) or sub is None:
            return Folded(st, None)
        try:
            return Folded(st, self.submit(sub))
        except HostUnreachable:
            raise
        except RevalError as e:
            return Folded(st, e)

    def describe_batch(self, launches: list[Launch]) -> str:
        """How the screen names one submit_many submission (Slurm: `job array 123 (at most 2 at once)`)."""
        return f"{len(launches)} run(s)"

    def job_device(self, gpus: str) -> str | None:
        """Where a run started with `gpus` will compute, when the machine that answers its pre-flight cannot
        tell (a scheduler's login node): "cuda" or "cpu"; None: the run's own host answers its pre-flight, so
        "auto" resolves the same in both (an SSH host). A cache's recipe names its dtype by it."""
        return None

    # -- the same for every backend, on the run directory contract ---------------------------------------
    def run_slots(self, list_gpus: Callable[[], str]) -> list[str]:
        """The `--gpus` of each run the host takes at once (a sweep's slots): "auto" once per GPU that
        `list_gpus()` (nvidia-smi's CSV; asked only when the host's `gpus` is auto) lists, each index of an
        explicit `gpus: 0,1`, or ["none"] (no GPU: one run at a time). A scheduler overrides it."""
        spec = normalize_gpus(self.host.gpus)
        return gpu_slots(list_gpus() if spec == "auto" else "", spec)

    def stream_command(self, name: str, *, python: str, log_offset: int, events_offset: int) -> str:
        """The remote command streaming the run's files (framed; remote_payload/runtime/stream.py)."""
        return follow_stream_command(self.workdir(), python, self.run_dir(name), log_offset, events_offset)

    def pull(self, name: str) -> Pulled:
        """Copy the run's contract files to runs/<host>/<name>/."""
        return pull_run(self.transport, name, workdir=self.workdir())

    def remove(self, name: str) -> None:
        """Delete the run's directory where it lives (a run that must leave nothing behind: bad input)."""
        self.transport.run(f"rm -rf -- {q(self.run_dir(name))}", check=False, timeout_s=60)

    def close(self) -> None:
        self.transport.close()
