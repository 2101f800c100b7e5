"""Sweep staging: the sweep's hosts (HostPool) made ready (payload synced, interpreter checked, cache
fingerprint read, run slots counted by their backend) and the checkpoints copied to the host that runs them
(relayed through this machine from another host), every SSH operation retried on transport errors."""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from remote_payload.contract import protocol
from remote_payload.contract.spec import joined_fingerprint

from ..backends import get_backend
from ..backends.base import Backend
from ..errors import ConfigError, EvalFailed, HostUnreachable, RevalError
from ..hosts import hostcheck
from ..hosts.environment import provision
from ..hosts.inventory import Host, Inventory
from ..hosts.sync import rsync, sync_payload
from ..hosts.transport import LocalTransport, Transport, get_transport, q, resolve_workdir
from ..rundir.pull import Pulled
from ..rundir.registry import save_follow_state
from ..runs import extracts, lifecycle
from ..runs.lifecycle import EvalSpec
from .discover import hash_command, parse_hashes
from .plan import Checkpoint, SweepOptions


@dataclass
class HostSession:
    host: Host
    transport: Transport
    backend: Backend               # runs start, are probed and pulled through it (lifecycle.py)
    python: str = ""
    workdir: str = ""
    cache_fingerprint: str = ""
    slots: list[str] = field(default_factory=lambda: ["none"])  # --gpus of each run slot; ["none"]: CPU
    down: str | None = None                          # why it is out of the sweep
    down_unreachable: bool = False
    prompt_files: list[tuple[str, str]] = field(default_factory=list)  # --prompts: (suite, the file's path here)
    caches: dict[str, tuple] = field(default_factory=dict)  # drafter path -> (its CacheRefs, what each suite was)
    caches_lock: threading.Lock = field(default_factory=threading.Lock)  # one cache build on this host at a time
    build_failed: str = ""  # why a cache build of this sweep failed on this host (then not tried again)

    @property
    def on_gpu(self) -> bool:
        return self.slots != ["none"]


_FINGERPRINT_PY = ("import sys; from remote_payload.eval.cache import open_cache; "
                   "[print(open_cache(a).fingerprint) for a in sys.argv[1:]]")


# rsync's remote command when a checkpoint is staged: `sh -c THIS sh PARENT MARKER --server ...` (rsync appends
# its own arguments). The receiving rsync runs whether mkdir succeeded or not (a folder it cannot make is then
# rsync's own error, not a lost connection); the marker is written only after it succeeded.
_COPY_AND_MARK_SH = 'mkdir -p -- "$1"; m=$2; shift 2; rsync "$@" && touch -- "$m"'
_GPU_LIST_SH = (f"command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi {' '.join(hostcheck.NVIDIA_SMI_QUERY)} "
                "2>/dev/null; true")


@dataclass(frozen=True)
class OnHost:
    """A sweep host as the cache functions (runs/extracts.py) take it: its name, backend, workdir, python."""
    host: str
    backend: Backend
    workdir: str
    python: str


def retrying(fn, *, retries: int, backoff_s: float, what: str, on_retry=None):
    """Call fn(); on a transport error (HostUnreachable) try again after backoff_s, 2x, 4x ... up to
    `retries` attempts. Anything else (a failed command, bad input) is not retried."""
    for attempt in range(1, retries + 1):
        try:
            return fn()
        except HostUnreachable as e:
            if attempt == retries:
                raise
            if on_retry:
                on_retry(f"{what}: {e} — retry {attempt}/{retries - 1} in {backoff_s * 2 ** (attempt - 1):.0f}s")
            time.sleep(backoff_s * 2 ** (attempt - 1))


# ---------------------------------------------------------------------------------------------------------


class HostPool:
    """The sweep's hosts (`sessions`, and `sources`: hosts only read checkpoints from): made ready
    (prepare), staged to (stage_checkpoint), hashed on (remote_hashes), pulled from (pull); every operation on
    them goes through `op` (retried on transport errors; a host that stays unreachable is taken out, `down`).

    Inputs: the sweep's options (hosts, cache, payload, retries, backoff_s, max_ssh, sweep_dir: relayed
    checkpoints wait in <sweep_dir>/relay/), the inventory, the log; `backend_for(host, transport)` makes a
    host's backend (backends.get_backend: the one place that picks one)."""

    def __init__(self, opts: SweepOptions, inventory: Inventory, *, log: Callable[[str], None] | None = None,
                 backend_for: Callable[[Host, Transport], Backend] = get_backend):
        self.opts = opts
        self.inventory = inventory
        self.log = log or (lambda line: None)
        self.backend_for = backend_for
        self.relay_root = Path(opts.sweep_dir) / "relay"
        self.sessions: dict[str, HostSession] = {}
        self.sources: dict[str, HostSession] = {}  # checkpoint hosts that are not sweep hosts (relay only)
        self.ssh = threading.BoundedSemaphore(max(1, opts.max_ssh))
        self.lock = threading.Lock()
        self.stage_locks: dict[str, threading.Lock] = {}  # per checkpoint content: staged once at a time

    def session(self, host: Host) -> HostSession:
        t = get_transport(host)
        return HostSession(host, t, self.backend_for(host, t))

    def up(self) -> list[HostSession]:
        """The sweep hosts still in the sweep."""
        return [hs for hs in self.sessions.values() if not hs.down]

    def down(self) -> dict[str, str]:
        """Every host that left the sweep (a sweep host or a checkpoint's host) and why."""
        return {n: hs.down for n, hs in {**self.sources, **self.sessions}.items() if hs.down}

    # -- hosts ----------------------------------------------------------------------------------------------
    def prepare_host(self, hs: HostSession) -> None:
        """Sync the payload and check the interpreter (one round trip), read the cache fingerprint, count the
        run slots (the backend's: one per GPU here, a scheduler's cap there)."""
        t, h = hs.transport, hs.host
        r = self.opts.retries

        def step(what, fn):
            with self.ssh:
                return retrying(fn, retries=r, backoff_s=self.opts.backoff_s, what=f"{h.name}: {what}",
                                on_retry=self.log)
        hs.python = step("sync", lambda: provision(t, h))[1].python
        hs.workdir = step("workdir", lambda: resolve_workdir(t))
        if self.opts.spec.payload == "dummy":
            hs.cache_fingerprint = "dummy"
        elif self.opts.spec.prompts:  # the suites' caches come from the host's store (resolve_caches)
            side = OnHost(h.name, hs.backend, hs.workdir, hs.python)
            hs.prompt_files = step("prompts", lambda: extracts.sync_prompts(side, self.opts.spec.prompts)).remote
            hs.cache_fingerprint = extracts.prompts_identity(self.opts.spec)
        else:
            suites = self.opts.spec.suites()
            paths = [c.path for c in self.opts.spec.cache]
            cmd = (f"cd {q(hs.workdir + '/payload')} && {q(hs.python)} -c {q(_FINGERPRINT_PY)} "
                   + " ".join(q(x) for x in paths))
            p = step("cache", lambda: t.run(cmd, check=False, timeout_s=600))
            if p.returncode != 0:
                tail = (p.stderr.strip().splitlines() or ["?"])[-1]
                raise ConfigError(f"{h.name}: cannot read the cache {' '.join(paths)}: {tail}")
            fps = p.stdout.strip().splitlines()[-len(paths):]
            hs.cache_fingerprint = (joined_fingerprint([(n, fp) for (n, _), fp in zip(suites, fps)]) if suites
                                    else fps[-1])
        hs.slots = hs.backend.run_slots(lambda: step("gpus", lambda: t.run(_GPU_LIST_SH)).stdout)

    def prepare(self) -> None:
        """Every host of --hosts made ready at once; none left (ConfigError / HostUnreachable, naming each
        one's trouble) or a cache that differs between them (ConfigError) ends the sweep here."""
        hosts: list[Host] = []
        for name in self.opts.hosts:
            hosts += [h for h in self.inventory.resolve(name) if h.name not in {x.name for x in hosts}]
        self.sessions = {h.name: self.session(h) for h in hosts}
        threads = [threading.Thread(target=self._prepare_one, args=(hs,)) for hs in self.sessions.values()]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        up = [hs for hs in self.sessions.values() if not hs.down]
        if not up:
            reasons = "; ".join(f"{hs.host.name}: {hs.down}" for hs in self.sessions.values())
            err = HostUnreachable if any(hs.down_unreachable for hs in self.sessions.values()) else ConfigError
            raise err(f"no host of {', '.join(self.opts.hosts)} can run the sweep ({reasons})",
                      hint="check them: reval hosts check " + " ".join(self.opts.hosts))
        fps = {hs.cache_fingerprint for hs in up}
        if len(fps) > 1:
            which = ", ".join(f"{hs.host.name}: {hs.cache_fingerprint[:19]}" for hs in up)
            raise ConfigError(f"the cache {self.opts.spec.cache_label()} differs between hosts ({which})",
                              hint="results would not be comparable: copy one cache to every host, "
                                   "or sweep on the hosts that share it (--hosts)")

    def resolve_caches(self, hs: HostSession, spec: EvalSpec, *, run: str, build: bool = True):
        """A checkpoint's spec with --prompts -> (the spec on the caches of hs's store, {suite: key, built,
        file, recipe}): asked once per drafter path (one round trip: the plan); what is missing is built by one
        extract run, one at a time on a host (a second slot waits, then finds them there). build=False: None
        when a cache is missing. Its trouble is the job's (EvalFailed, ConfigError)."""
        drafter = str(spec.drafter)
        with hs.caches_lock:
            if drafter not in hs.caches:
                side = OnHost(hs.host.name, hs.backend, hs.workdir, hs.python)
                again = build and not hs.build_failed  # a build that failed here is not tried again this sweep

                def resolve():
                    return extracts.resolve_prompts(side, spec, synced=hs.prompt_files, build=again,
                                                    name=protocol.default_run_name(f"extract-{run}"),
                                                    run_json={"for": "reval sweep --prompts", "run": run})
                try:
                    got = self.op(hs, "caches", resolve, bounded=False)
                except EvalFailed as e:
                    hs.build_failed = str(e).splitlines()[0]
                    raise
                if got is None and build:
                    raise EvalFailed(f"{hs.host.name}: building this sweep's caches failed there before "
                                     f"({hs.build_failed}); not tried again until the next sweep")
                if got is None:
                    return None
                resolved, info = got
                hs.caches[drafter] = (resolved.cache[len(spec.cache):], info)
                said = "; ".join(f"{n}: {'built' if i['built'] else 'in the store'} {i['key'][:12]}"
                                 for n, i in info.items())
                self.log(f"cache   {hs.host.name}: {said}")
            caches, info = hs.caches[drafter]
        return extracts.with_caches(spec, caches), info

    @staticmethod
    def known_caches(hs: HostSession, spec: EvalSpec):
        """resolve_caches' answer for spec's drafter when it was asked before (no SSH); None otherwise."""
        with hs.caches_lock:
            got = hs.caches.get(str(spec.drafter))
        return None if got is None else (extracts.with_caches(spec, got[0]), got[1])

    def _prepare_one(self, hs: HostSession) -> None:
        try:
            self.prepare_host(hs)
            where = f"{len(hs.slots)} GPU slot(s)" if hs.on_gpu else "CPU, one run at a time"
            self.log(f"host    {hs.host.name}: ready · {where}")
        except Exception as e:  # noqa: BLE001 - one host's trouble, whatever it is, must not stop the others
            why = str(e).splitlines()[0] if isinstance(e, RevalError) else f"{type(e).__name__}: {e}"
            hs.down, hs.down_unreachable = why, isinstance(e, HostUnreachable)
            self.log(f"host    {hs.host.name}: left out ({hs.down})")

    def op(self, hs: HostSession, what: str, fn, bounded: bool = True):
        """One SSH operation, retried on transport errors; exhausted retries take the host out. Short
        operations share `max_ssh` slots; the long polls on running runs (one per run) do not."""
        def call():
            if not bounded:
                return fn()
            with self.ssh:
                return fn()
        try:
            return retrying(call, retries=self.opts.retries, backoff_s=self.opts.backoff_s,
                            what=f"{hs.host.name}: {what}", on_retry=self.log)
        except HostUnreachable as e:
            with self.lock:
                if not hs.down:
                    hs.down = str(e).splitlines()[0]
                    self.log(f"host    {hs.host.name}: gone ({hs.down}); the other hosts carry on")
            raise

    def source(self, name: str) -> HostSession:
        """The session of a checkpoint's host (a sweep host, or one only read from)."""
        with self.lock:
            if name not in self.sessions and name not in self.sources:
                self.sources[name] = self.session(self.inventory.get(name))
            return self.sessions.get(name) or self.sources[name]

    def pull(self, hs: HostSession, run: str) -> Pulled:
        """Pull a run that is over to runs/<host>/<run>/ (its follow state marked finished)."""
        handle = lifecycle.attach(hs.backend, run, python=hs.python)
        return self.op(hs, "pull", lambda: handle.pull(finished=True))

    def pulled(self, hs: HostSession, run: str, res: Pulled) -> Pulled:
        """A run that is over whose files the long poll brought to runs/<host>/<run>/ already: as pull() leaves
        it (its follow state marked finished), no SSH session."""
        save_follow_state(hs.host.name, run, finished=True)  # as Run.pull(finished=True) marks it
        return res

    def stage_checkpoint(self, hs: HostSession, ckpt: Checkpoint) -> str:
        """The checkpoint's path on hs: as is when it lives there, else copied into
        <workdir>/checkpoints/<hash>/ (kept for later sweeps; a marker file written once a copy is complete)
        from here (one rsync, one round trip: its quick check skips what is there already), or relayed
        through sweeps/relay/<hash>/ (deleted once staged) from another host unless the marker says it is
        there. A dead source host raises HostUnreachable with hs still up."""
        if ckpt.host == hs.host.name or (ckpt.host is None and isinstance(hs.transport, LocalTransport)):
            return ckpt.path
        h16 = ckpt.content_hash.split(":")[-1][:16]
        with self.lock:
            lock = self.stage_locks.setdefault(h16, threading.Lock())
        with lock:
            dest = f"{hs.workdir}/checkpoints/{h16}/{ckpt.name}"
            marker = f"{dest}.complete"
            if ckpt.host is None:
                self._copy_and_mark(hs, ckpt.path, os.path.dirname(dest), marker)
                return dest
            probe = f"test -e {q(marker)} && echo @@STAGED; mkdir -p {q(os.path.dirname(dest))}"
            if "@@STAGED" in self.op(hs, "stage", lambda: hs.transport.run(probe)).stdout:
                return dest
            # relay: the source host -> here -> hs
            src_hs = self.source(ckpt.host)
            gone = f"{ckpt.host} (holding {ckpt.name}) is unreachable"
            if src_hs.down:
                raise HostUnreachable(f"{gone}: {src_hs.down}")
            relay = self.relay_root / h16
            relay.mkdir(parents=True, exist_ok=True)
            try:
                self.op(src_hs, "relay", lambda: self._rsync(src_hs.transport.rsync_rsh(),
                                                              src_hs.transport.rsync_target(ckpt.path),
                                                              str(relay), ckpt.host))
            except HostUnreachable as e:
                with contextlib.suppress(OSError):  # an empty relay dir; a partial copy stays to resume
                    relay.rmdir()
                raise HostUnreachable(f"{gone}: {str(e).splitlines()[0]}") from e
            self._copy_and_mark(hs, str(relay / ckpt.name), os.path.dirname(dest), marker)
            shutil.rmtree(relay, ignore_errors=True)
            return dest

    def _copy_and_mark(self, hs: HostSession, src: str, parent: str, marker: str) -> None:
        """rsync `src` (a path here) into `parent`/ on hs, then write `marker` there, only once the copy is
        complete. Over SSH one round trip: rsync's remote command makes `parent` and writes the marker after the
        receiving rsync succeeded (a failure there is rsync's own error, never mistaken for the connection's)."""
        rsh, target = hs.transport.rsync_rsh(), hs.transport.rsync_target(parent + "/")
        if rsh is None:  # a local folder: no round trips to save
            self.op(hs, "stage", lambda: self._rsync(None, src, target, hs.host.name))
            self.op(hs, "stage", lambda: hs.transport.run(f"touch {q(marker)}"))
            return
        remote = f"sh -c {q(_COPY_AND_MARK_SH)} sh {q(parent)} {q(marker)}"
        self.op(hs, "stage", lambda: self._rsync(rsh, src, target, hs.host.name, [f"--rsync-path={remote}"]))

    def remote_hashes(self, host: str, paths: list[str]) -> dict[str, str]:
        """Content hashes computed on `host` by the payload's `hash` (the scheme results.json records); a
        host that only holds checkpoints gets the payload synced first (the command is stdlib only)."""
        hs = self.source(host)
        if not hs.python:
            self.op(hs, "sync", lambda: sync_payload(hs.transport, hs.host))
            hs.workdir = self.op(hs, "workdir", lambda: resolve_workdir(hs.transport))
            hs.python = hs.host.python
        cmd = hash_command(f"{hs.workdir}/payload", hs.python, paths)
        p = self.op(hs, "hash", lambda: hs.transport.run(cmd, check=False, timeout_s=3600))
        if p.returncode not in (0, 3):
            raise ConfigError(f"{host}: hashing the checkpoints failed (exit {p.returncode}): "
                              f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")
        return parse_hashes(p.stdout)

    def _rsync(self, rsh, src: str, dest: str, host: str, more: tuple[str, ...] | list[str] = ()) -> None:
        rsync(rsh, src, dest, host=host, what="copying the checkpoint", options=["-a", "--partial", *more])
