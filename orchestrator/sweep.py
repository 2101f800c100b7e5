"""Nightly checkpoint sweeps: discover checkpoints, skip what the ledger already has, schedule one run per
free GPU (one at a time on a CPU host) over a group's hosts, follow, pull, and report every checkpoint
against the baseline and the previous checkpoint.

Survives the controller: the ledger (ledger.py) records each run when it is launched, with its host and
its deterministic name, so a re-run re-attaches to runs still going, pulls finished ones and launches only
what is missing (it finds its own runs by checkpoint, not by ledger key: the key moves when the payload
changed in between). A host that fails or goes away never stops the others: its queued checkpoints go to the
remaining hosts, a run in flight there is reported `unreachable` (exit 2) and re-attached next time.
Only transport errors are retried (with backoff); a failed eval is reported, never retried blindly.

GPUs: nvidia-smi only counts a host's slots; each slot launches with `--gpus auto` and the wrapper on the
host picks a free GPU and flocks it (launch.py). A launch the wrapper refuses for "no free GPU" is put
back in the queue and retried with backoff, never recorded as a failure.
"""
from __future__ import annotations

import calendar
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from remote_payload import protocol

from . import compare, hostcheck, launch, pull, runs
from .environment import provision
from .errors import (
    EXIT_EVAL_FAILED,
    EXIT_OK,
    EXIT_PARTIAL,
    ConfigError,
    HostUnreachable,
    RevalError,
    RunExists,
)
from .inventory import Host, Inventory
from .ledger import LAUNCHED, Ledger, LedgerEntry, ledger_key
from .sync import local_manifest_hash
from .transport import LocalTransport, Transport, get_transport, q, resolve_workdir

# outcome states beyond the run states: checkpoints that were not evaluated in this sweep
SKIPPED = "skipped"            # the ledger already has it (from an earlier sweep)
UNREACHABLE = "unreachable"    # its host went away (launched there: re-attached next time)
NOT_RUN = "not-run"            # no reachable host was left to run it

_PATTERN = re.compile(r"^[A-Za-z0-9._*?\[\]-]+$")


# ---------------------------------------------------------------------------------------------------------
# checkpoints

@dataclass
class Checkpoint:
    name: str
    path: str                 # absolute path on `host` (None: on this machine)
    host: str | None
    size: int
    mtime: int
    step: int | None = None
    content_hash: str = ""

    @property
    def location(self) -> str:
        return f"{self.host}:{self.path}" if self.host else self.path


def parse_checkpoint_spec(spec: str, inventory: Inventory) -> tuple[str | None, str, str]:
    """'HOST:/dir/ckpt-*' or a local '/dir/step-*' (or a folder) -> (host or None, dir, basename pattern)."""
    host = None
    if ":" in spec and not spec.startswith(("/", ".")):
        host, spec = spec.split(":", 1)
        inventory.get(host)  # unknown host: error with did-you-mean
        if not spec.startswith("/"):
            raise ConfigError(f"--checkpoints {host}:{spec}: use an absolute path on {host}",
                              hint=f"e.g. --checkpoints '{host}:/root/ckpt/step-*'")
    spec = spec.rstrip("/")
    d, pattern = os.path.split(spec)
    if not pattern or not _PATTERN.match(pattern) or any(c in d for c in "*?["):
        raise ConfigError(f"--checkpoints {spec!r}: the glob may only be in the last part and use "
                          "letters, digits, . _ - * ? [ ]", hint="e.g. --checkpoints 'ct129:/root/ckpt/step-*'")
    return host, d or ".", pattern


# A checkpoint's name becomes its run's name, a file name on the host and an argument of remote commands: a
# sweep takes only names that are plain words of the run-name alphabet, never starting with '-' (an option to
# find/stat/rsync) or '.' (hidden; '..'). Others (`-delete`, `--help`, `a b`, `it's`) are skipped and named.
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,54}$")


def list_script(d: str, pattern: str) -> str:
    """Remote shell: one line per match, `path<TAB>total bytes<TAB>newest mtime`, and `@@SKIP<TAB>name` (its
    unsafe characters as '?') for a name a sweep refuses (pure; GNU find). Every name from the listing reaches
    find/stat only as `./name`, so none is ever parsed as an option or an expression."""
    return (f"cd {q(d)} 2>/dev/null || {{ echo @@NODIR; exit 0; }}; D=$(pwd -P)\n"
            f'for p in ./{pattern}; do [ -e "$p" ] || continue; n=${{p#./}}\n'
            '  case "$n" in [!A-Za-z0-9_]*|*[!A-Za-z0-9._-]*) '
            "printf '@@SKIP\\t%s\\n' \"$(printf '%s' \"$n\" | tr -c 'A-Za-z0-9._ -' '?')\"; continue;; esac\n"
            '  if [ -d "$p" ]; then s=$(find "$p" -type f -printf \'%s %T@\\n\' | '
            "awk '{s+=$1; t=int($2); if (t>m) m=t} END {printf \"%d\\t%d\", s, m}')\n"
            "  else s=$(stat -c '%s\t%Y' -- \"$p\"); fi\n"
            '  printf \'%s\\t%s\\n\' "$D/$n" "$s"\ndone\n')


def hash_script(paths: list[str]) -> str:
    """Remote shell: `sha256<TAB>path` per path; a folder hashes the sha256sum listing of its files (sorted
    bytewise), a file its content (pure). `local_content_hash` computes the same."""
    return ("for p in " + " ".join(q(p) for p in paths) + "; do\n"
            '  if [ -d "$p" ]; then h=$(cd "$p" && find . -type f -print0 | LC_ALL=C sort -z | '
            "xargs -0 -r sha256sum | sha256sum | cut -c1-64)\n"
            '  else h=$(sha256sum < "$p" | cut -c1-64); fi\n'
            '  printf \'%s\\t%s\\n\' "$h" "$p"\ndone\n')


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def local_content_hash(path: str | Path) -> str:
    """The checkpoint content hash, computed here (agrees with `hash_script` on a host)."""
    path = Path(path)
    if not path.is_dir():
        return "sha256:" + _file_sha256(str(path))
    rels = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for f in files:
            full = os.path.join(root, f)
            if os.path.isfile(full) and not os.path.islink(full):
                rels.append("./" + os.path.relpath(full, path))
    listing = "".join(f"{_file_sha256(str(path / r))}  {r}\n" for r in sorted(rels, key=os.fsencode))
    return "sha256:" + hashlib.sha256(listing.encode()).hexdigest()


def _local_matches(d: str, pattern: str, skipped: list[str] | None = None) -> list[Checkpoint]:
    out = []
    for p in sorted(Path(d).glob(pattern)):
        if not CHECKPOINT_NAME.match(p.name):
            if skipped is not None:
                skipped.append(p.name)
            continue
        p = p.resolve()
        files = [f for f in p.rglob("*") if f.is_file() and not f.is_symlink()] if p.is_dir() else [p]
        stats = [f.stat() for f in files]
        out.append(Checkpoint(p.name, str(p), None, sum(s.st_size for s in stats),
                              max((int(s.st_mtime) for s in stats), default=0)))
    return out


def discover(specs: list[str], inventory: Inventory, ledger: Ledger, transports: dict[str, Transport],
             skipped: list[str] | None = None) -> list[Checkpoint]:
    """Every checkpoint matching the specs, with its content hash (cached in the ledger by size+mtime).
    Names a sweep refuses (CHECKPOINT_NAME) are left out and appended to `skipped`."""
    found: list[Checkpoint] = []
    skipped = [] if skipped is None else skipped
    for spec in specs:
        host, d, pattern = parse_checkpoint_spec(spec, inventory)
        bad: list[str] = []
        if host is None:
            cks = _local_matches(d, pattern, bad)
        else:
            t = transports.get(host) or get_transport(inventory.get(host))
            out = t.run(list_script(d, pattern), timeout_s=300).stdout
            if out.startswith("@@NODIR"):
                raise ConfigError(f"--checkpoints {spec}: no folder {d} on {host}")
            cks = []
            for line in out.splitlines():
                if line.startswith("@@SKIP\t"):
                    bad.append(line[7:])
                    continue
                try:
                    path, size, mtime = line.rsplit("\t", 2)
                    if not CHECKPOINT_NAME.match(os.path.basename(path)):  # too long for a run name
                        bad.append(os.path.basename(path))
                        continue
                    cks.append(Checkpoint(os.path.basename(path), path, host, int(size), int(mtime)))
                except ValueError:
                    raise RevalError(f"--checkpoints {spec}: unexpected listing line from {host}: {line[:120]!r}",
                                     hint=f"check the folder: reval hosts check {host}", exit_code=3) from None
        skipped += bad
        if not cks:
            raise ConfigError(f"--checkpoints {spec}: nothing matches", hint="check the path and the glob")
        todo = []
        for c in cks:
            c.step = compare.checkpoint_step(None, c.name)
            c.content_hash = ledger.cached_hash(c.location, c.size, c.mtime) or ""
            if not c.content_hash:
                todo.append(c)
        if host is None:
            for c in todo:
                c.content_hash = local_content_hash(c.path)
        elif todo:
            t = transports.get(host) or get_transport(inventory.get(host))
            hashes = dict(line.split("\t", 1)[::-1] for line in t.run(hash_script([c.path for c in todo]),
                                                                       timeout_s=3600).stdout.splitlines())
            for c in todo:
                c.content_hash = "sha256:" + hashes[c.path]
        for c in todo:
            ledger.remember_hash(c.location, c.size, c.mtime, c.content_hash)
        found += cks
    return found


def parse_since(text: str | None, now: float | None = None) -> float | None:
    """'36h', '7d', '90m' (ago) or an ISO date/time (UTC) -> epoch seconds."""
    if not text:
        return None
    now = time.time() if now is None else now
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m:
        return now - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d"):
        try:
            return float(calendar.timegm(time.strptime(text.strip(), fmt)))
        except ValueError:
            continue
    raise ConfigError(f"--since {text!r}: not a duration or a date", hint="e.g. --since 36h, or --since 2026-11-30")


def select(checkpoints: list[Checkpoint], latest: int | None = None, since: float | None = None
           ) -> list[Checkpoint]:
    """Order by training step (then mtime), keep those modified since `since`, then the last `latest` (pure)."""
    cks = sorted(checkpoints, key=lambda c: (c.step is None, c.step or 0, c.mtime, c.name))
    if since is not None:
        cks = [c for c in cks if c.mtime >= since]
    if latest is not None:
        cks = cks[-latest:] if latest > 0 else []
    return cks


# ---------------------------------------------------------------------------------------------------------
# options, jobs, outcomes

@dataclass
class SweepOptions:
    checkpoints: list[str]
    hosts: list[str]
    target: str | None = None
    cache: str | None = None
    num_prompts: int | None = None
    max_blocks: int | None = None
    eval_args: list[str] = field(default_factory=list)
    latest: int | None = None
    since: str | None = None
    baseline: str | None = None
    threshold: float = 0.1        # tau difference that counts as improved/regressed
    force: bool = False
    sweep_dir: str = "sweeps"
    max_ssh: int = 8              # concurrent SSH operations, all hosts together
    poll_s: float = 10.0          # longest single wait (a long poll) on a running run's status
    retries: int = 3              # attempts per transport operation
    backoff_s: float = 1.0
    payload: str = "eval"         # eval | dummy (the torch-free stand-in: tests, bench)

    def eval_options(self) -> dict:
        """What changes the numbers (part of the ledger key)."""
        return {"payload": self.payload, "target": self.target, "cache": self.cache,
                "num_prompts": self.num_prompts, "max_blocks": self.max_blocks, "eval_args": self.eval_args}

    def payload_argv(self, drafter: str) -> list[str]:
        if self.payload == "dummy":
            return ["dummy", *self.eval_args]
        argv = ["eval", "--drafter", drafter, "--target", self.target or "", "--cache", self.cache or ""]
        if self.num_prompts is not None:
            argv += ["--num-prompts", str(self.num_prompts)]
        if self.max_blocks is not None:
            argv += ["--max-blocks", str(self.max_blocks)]
        return argv + list(self.eval_args)

    def identity(self) -> str:
        """Same command line (what is swept, where, how) = same sweep, for resuming after a kill."""
        blob = json.dumps({"checkpoints": self.checkpoints, "hosts": self.hosts, "latest": self.latest,
                           "since": self.since, "force": self.force, **self.eval_options()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Job:
    ckpt: Checkpoint
    key: str
    config: str
    run: str
    host: str | None = None   # affinity: a re-attach job must run where its run is
    staged: tuple[str, str] | None = None  # (host, path) once its checkpoint was copied there ahead of time


@dataclass
class Outcome:
    checkpoint: str
    step: int | None
    state: str                  # succeeded | failed | cancelled | lost | skipped | unreachable | not-run
    host: str | None = None
    run: str | None = None
    tau: float | None = None
    suspect: bool = False
    error: str | None = None
    local_path: str | None = None
    earlier: bool = False       # from an earlier sweep (skipped by the ledger)
    # filled by the report
    prev_checkpoint: str | None = None
    prev_tau: float | None = None
    base_ratio: float | None = None
    base_note: str | None = None
    verdict: str = ""


def run_name_for(ckpt: Checkpoint, key: str, suffix: str = "") -> str:
    """Deterministic (re-launching after a crash finds its own run): <checkpoint>-<8 hex of the key>."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", ckpt.name).lstrip(".") or "ckpt"
    tail = f"-{key.split(':')[-1][:8]}{suffix}"
    return protocol.validate_run_name(base[: 64 - len(tail)] + tail)


def outcome_from_entry(e: LedgerEntry, earlier: bool) -> Outcome:
    return Outcome(e.checkpoint, e.step, e.state, e.host, e.run, e.tau, e.suspect, e.error, e.local_path, earlier)


# ---------------------------------------------------------------------------------------------------------
# hosts

@dataclass
class HostSession:
    host: Host
    transport: Transport
    python: str = ""
    workdir: str = ""
    cache_fingerprint: str = ""
    slots: list[str] = field(default_factory=lambda: ["none"])  # --gpus of each run slot; ["none"]: CPU
    down: str | None = None                          # why it is out of the sweep
    down_unreachable: bool = False

    @property
    def on_gpu(self) -> bool:
        return self.slots != ["none"]


_FINGERPRINT_PY = ("import sys; from remote_payload.cache import open_cache; "
                   "print(open_cache(sys.argv[1]).fingerprint)")
_GPU_LIST_SH = (f"command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi {' '.join(hostcheck.NVIDIA_SMI_QUERY)} "
                "2>/dev/null; true")


def gpu_slots(nvidia_smi_csv: str, spec: str) -> list[str]:
    """The --gpus each run slot of a host launches with (pure): "auto" once per GPU nvidia-smi lists (the
    wrapper on the host picks a free, unlocked one), each index of an explicit `gpus: 0,1`, or ["none"]
    (no GPU: CPU, one run at a time)."""
    if spec == "none":
        return ["none"]
    if spec != "auto":
        return spec.split(",")
    return ["auto"] * len(hostcheck.parse_nvidia_smi(nvidia_smi_csv)) or ["none"]


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
# the sweep

def load_baseline(spec: str | None) -> compare.RunRecord | None:
    """The --baseline run, loaded before anything runs: a wrong name fails at once (exit 102 or 3), not
    after a night of evals."""
    if not spec:
        return None
    try:
        rec = compare.load_run(compare.resolve_run(spec, runs.local_runs_root()))
    except protocol.ProtocolError as e:
        raise ConfigError(f"--baseline {spec!r}: {e}") from None
    except RevalError as e:
        raise type(e)(f"--baseline: {e}", hint=e.hint, exit_code=e.exit_code) from None
    if rec.results is None:
        raise ConfigError(f"--baseline {spec!r}: {rec.path} has no results.json (state {rec.state})",
                          hint="pick a finished run (reval ls), or pull it again: reval pull HOST/NAME")
    return rec


class Sweep:
    def __init__(self, opts: SweepOptions, inventory: Inventory, *, log=None,
                 baseline: compare.RunRecord | None = None):
        self.opts = opts
        self.inventory = inventory
        self.log = log or (lambda line: None)
        self.baseline = baseline or load_baseline(opts.baseline)
        self.root = Path(opts.sweep_dir)
        self.ledger = Ledger(self.root / "ledger.json")
        self.ssh = threading.BoundedSemaphore(max(1, opts.max_ssh))
        self.lock = threading.Lock()
        self.queue: list[Job] = []
        self.outcomes: dict[str, Outcome] = {}   # key -> outcome
        self.sessions: dict[str, HostSession] = {}
        self.sources: dict[str, HostSession] = {}  # checkpoint hosts that are not sweep hosts (relay only)
        self.stage_locks: dict[str, threading.Lock] = {}  # per checkpoint content: staged once at a time
        self.active = 0                            # runs being followed now (all slots)
        self.sweep_id = ""
        self.dir = self.root
        self.config = ""

    # -- state dir ------------------------------------------------------------------------------------------
    def open_sweep_dir(self) -> None:
        """Resume the newest unfinished sweep of the same command line, else start a new one."""
        ident = self.opts.identity()
        for d in sorted(self.root.glob("*/sweep.json"), reverse=True):
            try:
                st = protocol.read_json(d)
            except (OSError, ValueError):
                continue
            if st.get("identity") == ident and not st.get("complete"):
                self.sweep_id, self.dir = st["id"], d.parent
                self.log(f"resume  sweep {self.sweep_id} (started {st.get('created_at')})")
                return
        self.sweep_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.dir = self.root / self.sweep_id
        n = 1
        while self.dir.exists():
            n += 1
            self.dir = self.root / f"{self.sweep_id}-{n}"
        self.sweep_id = self.dir.name
        self.dir.mkdir(parents=True)
        self._write_state(False)

    def _write_state(self, complete: bool) -> None:
        protocol.atomic_write_json(self.dir / "sweep.json", {
            "id": self.sweep_id, "identity": self.opts.identity(), "created_at": protocol.now_iso(),
            "complete": complete, "options": asdict(self.opts)})

    # -- hosts ----------------------------------------------------------------------------------------------
    def prepare_host(self, hs: HostSession) -> None:
        """Sync the payload and check the interpreter (one round trip), read the cache fingerprint, count GPUs."""
        t, h = hs.transport, hs.host
        r = self.opts.retries

        def step(what, fn):
            with self.ssh:
                return retrying(fn, retries=r, backoff_s=self.opts.backoff_s, what=f"{h.name}: {what}",
                                on_retry=self.log)
        hs.python = step("sync", lambda: provision(t, h))[1].python
        hs.workdir = step("workdir", lambda: resolve_workdir(t))
        if self.opts.payload == "dummy":
            hs.cache_fingerprint = "dummy"
        else:
            cmd = f"cd {q(hs.workdir + '/payload')} && {q(hs.python)} -c {q(_FINGERPRINT_PY)} {q(self.opts.cache)}"
            p = step("cache", lambda: t.run(cmd, check=False, timeout_s=600))
            if p.returncode != 0:
                tail = (p.stderr.strip().splitlines() or ["?"])[-1]
                raise ConfigError(f"{h.name}: cannot read the cache {self.opts.cache}: {tail}")
            hs.cache_fingerprint = p.stdout.strip().splitlines()[-1]
        spec = launch.normalize_gpus(h.gpus)
        hs.slots = gpu_slots(step("gpus", lambda: t.run(_GPU_LIST_SH)).stdout if spec == "auto" else "", spec)

    def prepare_hosts(self) -> None:
        hosts: list[Host] = []
        for name in self.opts.hosts:
            hosts += [h for h in self.inventory.resolve(name) if h.name not in {x.name for x in hosts}]
        self.sessions = {h.name: HostSession(h, get_transport(h)) for h in hosts}
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
            raise ConfigError(f"the cache {self.opts.cache} differs between hosts ({which})",
                              hint="results would not be comparable: copy one cache to every host, "
                                   "or sweep on the hosts that share it (--hosts)")

    def _prepare_one(self, hs: HostSession) -> None:
        try:
            self.prepare_host(hs)
            where = f"{len(hs.slots)} GPU slot(s)" if hs.on_gpu else "CPU, one run at a time"
            self.log(f"host    {hs.host.name}: ready · {where}")
        except Exception as e:  # noqa: BLE001 - one host's trouble, whatever it is, must not stop the others
            why = str(e).splitlines()[0] if isinstance(e, RevalError) else f"{type(e).__name__}: {e}"
            hs.down, hs.down_unreachable = why, isinstance(e, HostUnreachable)
            self.log(f"host    {hs.host.name}: left out ({hs.down})")

    # -- planning -------------------------------------------------------------------------------------------
    def plan(self, checkpoints: list[Checkpoint]) -> None:
        fp = next(hs.cache_fingerprint for hs in self.sessions.values() if not hs.down)
        version = local_manifest_hash()
        config = ledger_key("", fp, version, self.opts.eval_options())
        ours = self.ledger.of_sweep(self.sweep_id)  # what this sweep launched before it was killed
        kept = 0
        for c in checkpoints:
            key = ledger_key(c.content_hash, fp, version, self.opts.eval_options())
            # this sweep's own run of the checkpoint first, whatever its key: the payload (or the cache) may
            # have changed since it was launched, and a resumed sweep must not launch it a second time
            e = ours.get((c.location, c.content_hash)) or self.ledger.get(key)
            mine = e is not None and e.sweep == self.sweep_id
            if e is not None and e.state == LAUNCHED:
                kept += e.key != key
                self.queue.append(Job(c, e.key, e.config or config, e.run, host=e.host))  # re-attach
            elif e is not None and e.state != protocol.LOST and (mine or not self.opts.force):
                kept += mine and e.key != key
                self.outcomes[e.key] = outcome_from_entry(e, earlier=not mine)
                if not mine:
                    self.outcomes[e.key].state = SKIPPED if e.state == protocol.SUCCEEDED else e.state
            else:
                suffix = "" if e is None else time.strftime("-%m%dT%H%M%S", time.gmtime())
                self.queue.append(Job(c, key, config, run_name_for(c, key, suffix)))
        if kept:
            self.log(f"resume  {kept} run(s) kept from before a payload/cache change (not run again)")
        self.config = config

    # -- workers --------------------------------------------------------------------------------------------
    def _op(self, hs: HostSession, what: str, fn, bounded: bool = True):
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

    def _take(self, hs: HostSession, reattach_only: bool = False) -> Job | None:
        with self.lock:
            for i, j in enumerate(self.queue):
                if j.host == hs.host.name or (j.host is None and not reattach_only):
                    return self.queue.pop(i)
        return None

    def worker(self, hs: HostSession, gpu: str, reattach_only: bool = False) -> None:
        held: list[Job] = []  # the next job, taken (and staged) while the current run goes on
        try:
            self._work(hs, gpu, reattach_only, held)
        finally:
            for job in held:
                job.staged = None
                self._requeue(job)

    def _work(self, hs: HostSession, gpu: str, reattach_only: bool, held: list[Job]) -> None:
        refused = 0  # launches in a row the host refused for want of a free GPU
        while not hs.down:
            job = held.pop() if held else self._take(hs, reattach_only)
            if job is None:
                return
            try:
                self.run_job(hs, job, gpu, held if not reattach_only else None)
                refused = 0
            except HostUnreachable:
                return
            except launch.NoFreeGpu as e:
                refused += 1
                with self.lock:
                    idle = self.active == 0
                if refused >= self.opts.retries and idle:  # nothing of ours will free a GPU: give up this round
                    self.log(f"busy    {hs.host.name}: {str(e).split(': ', 1)[-1]}; slot stops")
                    return
                wait_s = min(self.opts.backoff_s * 2 ** (refused - 1), 60.0)
                self.log(f"busy    {job.ckpt.name}: no free GPU on {hs.host.name}; requeued, retry in {wait_s:.0f}s")
                time.sleep(wait_s)
            except RevalError as e:  # bad input for this checkpoint (staging, name): reported, not retried
                self._record(job, hs, protocol.FAILED, error=str(e).splitlines()[0])
            except Exception as e:  # noqa: BLE001 - a bug must not silently drop the job or stop other hosts
                self.log(f"error   {job.ckpt.name} on {hs.host.name}: {type(e).__name__}: {e}")
                self._record(job, hs, protocol.FAILED, error=f"internal error: {type(e).__name__}: {e}")

    def _source(self, name: str) -> HostSession:
        """The session of a checkpoint's host (a sweep host, or one only read from)."""
        with self.lock:
            if name not in self.sessions and name not in self.sources:
                h = self.inventory.get(name)
                self.sources[name] = HostSession(h, get_transport(h))
            return self.sessions.get(name) or self.sources[name]

    def stage_checkpoint(self, hs: HostSession, ckpt: Checkpoint) -> str:
        """The checkpoint's path on hs: as is when it lives there, else copied into
        <workdir>/checkpoints/<hash>/ (once: a marker file is written last; kept for later sweeps) from here,
        relaying through sweeps/relay/<hash>/ (deleted once staged) from another host. A dead source host
        raises HostUnreachable with hs still up."""
        if ckpt.host == hs.host.name or (ckpt.host is None and isinstance(hs.transport, LocalTransport)):
            return ckpt.path
        h16 = ckpt.content_hash.split(":")[-1][:16]
        with self.lock:
            lock = self.stage_locks.setdefault(h16, threading.Lock())
        with lock:
            dest = f"{hs.workdir}/checkpoints/{h16}/{ckpt.name}"
            marker = f"{dest}.complete"
            probe = f"test -e {q(marker)} && echo @@STAGED; mkdir -p {q(os.path.dirname(dest))}"
            if "@@STAGED" in self._op(hs, "stage", lambda: hs.transport.run(probe)).stdout:
                return dest
            src, relay = ckpt.path, None
            if ckpt.host is not None:  # relay: the source host -> here -> hs
                src_hs = self._source(ckpt.host)
                gone = f"{ckpt.host} (holding {ckpt.name}) is unreachable"
                if src_hs.down:
                    raise HostUnreachable(f"{gone}: {src_hs.down}")
                relay = self.root / "relay" / h16
                relay.mkdir(parents=True, exist_ok=True)
                try:
                    self._op(src_hs, "relay", lambda: self._rsync(src_hs.transport.rsync_rsh(),
                                                                  src_hs.transport.rsync_target(ckpt.path),
                                                                  str(relay), ckpt.host))
                except HostUnreachable as e:
                    with contextlib.suppress(OSError):  # an empty relay dir; a partial copy stays to resume
                        relay.rmdir()
                    raise HostUnreachable(f"{gone}: {str(e).splitlines()[0]}") from e
                src = str(relay / ckpt.name)
            self._op(hs, "stage", lambda: self._rsync(hs.transport.rsync_rsh(), src,
                                                     hs.transport.rsync_target(os.path.dirname(dest) + "/"),
                                                     hs.host.name))
            self._op(hs, "stage", lambda: hs.transport.run(f"touch {q(marker)}"))
            if relay is not None:
                shutil.rmtree(relay, ignore_errors=True)
            return dest

    def _rsync(self, rsh, src: str, dest: str, host: str) -> None:
        argv = ["rsync", "-a", "--partial"] + (["-e", shlex.join(rsh)] if rsh else []) + [src, dest]
        p = subprocess.run(argv, check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if p.returncode in (12, 30, 35, 255):  # rsync: protocol/timeout/connection errors
            raise HostUnreachable(f"{host}: rsync failed (exit {p.returncode}): "
                                  f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")
        if p.returncode != 0:
            raise ConfigError(f"{host}: copying the checkpoint failed (rsync exit {p.returncode}): "
                              f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")

    def prefetch(self, hs: HostSession, held: list[Job]) -> None:
        """Take this slot's next job now and copy its checkpoint while the current run goes on (the copy
        then costs nothing on the critical path). Trouble here is left to the job itself."""
        nxt = self._take(hs)
        if nxt is None:
            return
        held.append(nxt)
        if nxt.host is None:
            try:
                nxt.staged = (hs.host.name, self.stage_checkpoint(hs, nxt.ckpt))
            except RevalError:
                nxt.staged = None

    def run_job(self, hs: HostSession, job: Job, gpu: str, held: list[Job] | None = None) -> None:
        c = job.ckpt
        entry = LedgerEntry(job.key, c.name, c.location, c.content_hash, c.step, hs.host.name, job.run,
                            LAUNCHED, self.sweep_id, config=job.config)
        if job.host is None:  # a fresh launch
            try:
                path = job.staged[1] if job.staged and job.staged[0] == hs.host.name else \
                    self.stage_checkpoint(hs, c)
            except HostUnreachable as e:
                if hs.down:  # this host went away: another one takes the job
                    self._requeue(job)
                    raise
                # the checkpoint's own host went away: no host can get it; the next sweep tries again
                self.outcomes[job.key] = Outcome(c.name, c.step, NOT_RUN, c.host, job.run,
                                                 error=str(e).splitlines()[0])
                self.log(f"skip    {c.name}: {str(e).splitlines()[0]}")
                return
            before = self.ledger.get(job.key)
            self.ledger.put(entry)  # before launching: a killed controller finds it and re-attaches
            run_json = {"sweep": self.sweep_id, "checkpoint": c.location, "checkpoint_hash": c.content_hash,
                        "ledger_key": job.key, "drafter": path, "argv": self.opts.payload_argv(path)}
            try:
                info = self._op(hs, "launch", lambda: launch.launch(
                    hs.host, hs.transport, name=job.run, payload_argv=self.opts.payload_argv(path), gpus=gpu,
                    run_json=run_json, python=hs.python))
                self.log(f"launch  {c.name} on {hs.host.name}"
                         + "".join(f" · GPU {g}" for g in info.gpus) + f" · run {job.run}")
            except HostUnreachable:
                # Did it start before the connection broke? The next sweep re-attaches (the ledger says launched).
                self._record(job, hs, UNREACHABLE, error=hs.down)
                raise
            except launch.NoFreeGpu:  # nothing started: not a result; back in the queue (the worker backs off)
                self.ledger.restore(job.key, before)
                self._requeue(job)
                raise
            except RunExists:
                self.log(f"attach  {c.name}: run {job.run} already on {hs.host.name}")
        else:
            self.log(f"attach  {c.name}: run {job.run} on {hs.host.name}")
        if held is not None and not held:
            self.prefetch(hs, held)
        self.wait_and_pull(hs, job)

    def wait_and_pull(self, hs: HostSession, job: Job) -> None:
        with self.lock:
            self.active += 1
        try:
            self._wait_and_pull(hs, job)
        finally:
            with self.lock:
                self.active -= 1

    def _wait_and_pull(self, hs: HostSession, job: Job) -> None:
        try:
            wait_s = 0.0
            while True:
                # after the first look, a long poll: one SSH command that returns as soon as the run is no longer
                # running (or after poll_s), so its end is seen within ~0.1 s without a round trip per 0.1 s
                st = self._op(hs, "status", lambda w=wait_s: runs.run_state(hs.transport, job.run, wait_s=w),
                              bounded=wait_s == 0)
                wait_s = self.opts.poll_s
                if st is None:  # recorded as launched, but the run never started: launch it now
                    self.log(f"missing {job.ckpt.name}: run {job.run} is not on {hs.host.name}; launching")
                    job.host = None
                    return self.run_job(hs, job, "auto" if hs.on_gpu else "none")
                if st.terminal:
                    break
            res = self._op(hs, "pull", lambda: pull.pull(hs.transport, job.run, workdir=hs.workdir))
        except HostUnreachable:
            self._record(job, hs, UNREACHABLE, error=hs.down)
            raise
        run = compare.load_run(res.path)
        if st.state == protocol.SUCCEEDED and run.results is not None:
            m = run.results.get("metrics") or {}
            self._record(job, hs, protocol.SUCCEEDED, tau=m.get("tau"), suspect=run.suspect, local=res.path)
            self.log(f"done    {job.ckpt.name} on {hs.host.name} · tau {m.get('tau', float('nan')):.2f}"
                     + (" · SUSPECT" if run.suspect else ""))
        else:
            err = failure_line(st.status, res.path)
            self._record(job, hs, st.state if st.state != protocol.SUCCEEDED else protocol.FAILED,
                         error=err, local=res.path, exit_code=st.status.get("exit_code"))
            self.log(f"FAILED  {job.ckpt.name} on {hs.host.name} ({err}) — log {res.path}/eval.log")

    def _requeue(self, job: Job) -> None:
        with self.lock:
            self.queue.insert(0, job)

    def _record(self, job: Job, hs: HostSession, state: str, *, tau=None, suspect=False, error=None,
                local=None, exit_code=None) -> None:
        c = job.ckpt
        self.outcomes[job.key] = Outcome(c.name, c.step, state, hs.host.name, job.run, tau, suspect, error,
                                         str(local) if local else None)
        if state != UNREACHABLE:  # unreachable: the ledger keeps `launched`, the next sweep re-attaches
            self.ledger.put(LedgerEntry(job.key, c.name, c.location, c.content_hash, c.step, hs.host.name,
                                        job.run, state, self.sweep_id, exit_code=exit_code, error=error, tau=tau,
                                        suspect=suspect, local_path=str(local) if local else None,
                                        config=job.config))

    def execute(self) -> None:
        """Workers per host slot until the queue is empty or no host is left. Re-attach jobs get a thread of
        their own (their run already holds its GPU); a CPU host launches new runs only after those end."""
        why = "no reachable host left"
        last = None
        while True:
            with self.lock:
                for job in [j for j in self.queue if j.host and (j.host not in self.sessions
                                                                 or self.sessions[j.host].down)]:
                    self.queue.remove(job)
                    self.outcomes[job.key] = Outcome(job.ckpt.name, job.ckpt.step, UNREACHABLE, job.host, job.run,
                                                     error=f"{job.host} is unreachable; re-attached next time")
            up = [hs for hs in self.sessions.values() if not hs.down]
            if not self.queue or not up:
                break
            if last == (len(self.outcomes), len(up)):  # a whole round ended nothing: every GPU is busy
                why = "no free GPU (all busy or locked by other runs); the next sweep tries again"
                break
            last = (len(self.outcomes), len(up))
            threads = []
            for hs in up:
                n_attach = sum(1 for j in self.queue if j.host == hs.host.name)
                threads += [threading.Thread(target=self.worker, args=(hs, "none", True)) for _ in range(n_attach)]
                if hs.on_gpu or not n_attach:
                    threads += [threading.Thread(target=self.worker, args=(hs, g)) for g in hs.slots]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        for job in self.queue:  # no host left for these
            self.outcomes[job.key] = Outcome(job.ckpt.name, job.ckpt.step, NOT_RUN, job.host, job.run, error=why)
        self.queue.clear()

    def run(self) -> SweepReport:
        self.ledger.lock()
        try:
            self.open_sweep_dir()
            self.prepare_hosts()
            up = {n: hs.transport for n, hs in self.sessions.items() if not hs.down}
            skipped: list[str] = []
            found = discover(self.opts.checkpoints, self.inventory, self.ledger, up, skipped)
            if skipped:
                shown = ", ".join(repr(n) for n in skipped[:8]) + (f" and {len(skipped) - 8} more"
                                                                   if len(skipped) > 8 else "")
                self.log(f"skip    {len(skipped)} name(s) that are not checkpoint names (letters, digits, . _ -; "
                         f"not starting with - or .): {shown}")
            chosen = select(found, self.opts.latest, parse_since(self.opts.since))
            self.plan(chosen)
            n_skip = sum(1 for o in self.outcomes.values() if o.earlier)
            free = sum(len(hs.slots) for hs in self.sessions.values() if not hs.down)
            n_up = sum(1 for hs in self.sessions.values() if not hs.down)
            self.log(f"{len(chosen)} checkpoints · {n_skip} already evaluated (skipped) · {len(self.queue)} to run "
                     f"on {n_up} host(s), {free} slot(s)")
            self.execute()
            report = build_report(self, chosen)
            self._write_state(complete=not any(o.state in (UNREACHABLE, NOT_RUN) for o in report.outcomes))
            return report
        finally:
            self.ledger.unlock()


def failure_line(status: dict, run_dir: Path) -> str:
    """'exit 1: CUDA out of memory' — the exit code and the wrapper's error or the log's last line."""
    last = ""
    try:
        lines = (run_dir / protocol.EVAL_LOG).read_text(errors="replace").splitlines()
        last = next((ln.strip() for ln in reversed(lines) if ln.strip() and not ln.startswith("[reval]")), "")
    except OSError:
        pass
    why = (status.get("error") or last)[:160]
    head = f"exit {status['exit_code']}" if status.get("exit_code") is not None else status.get("state", "?")
    return f"{head}: {why}" if why else head


# ---------------------------------------------------------------------------------------------------------
# the report

@dataclass
class SweepReport:
    sweep_id: str
    sweep_dir: Path
    outcomes: list[Outcome]
    baseline: str | None
    hosts_down: dict[str, str]
    threshold: float
    exit_code: int = 0
    files: dict[str, str] = field(default_factory=dict)
    baseline_run: compare.RunRecord | None = None


def verdict(o: Outcome, threshold: float) -> str:
    """improved | regressed | within noise | new (nothing earlier to compare) | suspect | failed | ... (pure)."""
    if o.state in (protocol.FAILED, protocol.CANCELLED, protocol.LOST):
        return "failed" if o.state == protocol.FAILED else o.state
    if o.state in (UNREACHABLE, NOT_RUN):
        return o.state
    if o.suspect:
        return "suspect"
    if o.tau is None or o.prev_tau is None:
        return "new"
    d = o.tau - o.prev_tau
    return "improved" if d > threshold else "regressed" if d < -threshold else "within noise"


def sweep_exit_code(outcomes: list[Outcome], hosts_down: dict[str, str]) -> int:
    """1 when an eval of this sweep failed; else 2 when something was not evaluated (host gone); else 0."""
    mine = [o for o in outcomes if not o.earlier]
    if any(o.state in (protocol.FAILED, protocol.CANCELLED, protocol.LOST) for o in mine):
        return EXIT_EVAL_FAILED
    if hosts_down or any(o.state in (UNREACHABLE, NOT_RUN) for o in mine):
        return EXIT_PARTIAL
    return EXIT_OK


def attach_comparisons(outcomes: list[Outcome], series: list[LedgerEntry], baseline: compare.RunRecord | None,
                       threshold: float) -> None:
    """Fill prev_* (the closest earlier finished, non-suspect checkpoint of the same configuration),
    base_ratio and the verdict of every outcome (pure, given the loaded baseline)."""
    done = [e for e in series if e.state == protocol.SUCCEEDED and e.tau is not None and not e.suspect]
    base_tau = ((baseline.results or {}).get("metrics") or {}).get("tau") if baseline else None
    for o in outcomes:
        earlier = [e for e in done if e.checkpoint != o.checkpoint and
                   (e.step, e.checkpoint) < (o.step, o.checkpoint)] if o.step is not None else \
            [e for e in done if e.checkpoint < o.checkpoint]
        if earlier:
            o.prev_checkpoint, o.prev_tau = earlier[-1].checkpoint, earlier[-1].tau
        if base_tau and o.tau is not None:
            o.base_ratio = o.tau / base_tau
            if o.local_path and baseline is not None:
                try:
                    cmp = compare.build_comparison([compare.load_run(o.local_path)], baseline)
                    if cmp.differences:
                        o.base_note = "not comparable: " + ", ".join(
                            compare.FIELD_WORDS.get(d.field, d.field) for d in cmp.differences)
                except RevalError:
                    pass
        o.verdict = verdict(o, threshold)


def build_report(sw: Sweep, chosen: list[Checkpoint]) -> SweepReport:
    order = {c.name: i for i, c in enumerate(chosen)}
    outcomes = sorted(sw.outcomes.values(), key=lambda o: order.get(o.checkpoint, 1 << 30))
    attach_comparisons(outcomes, sw.ledger.series(sw.config), sw.baseline, sw.opts.threshold)
    down = {n: hs.down for n, hs in {**sw.sources, **sw.sessions}.items() if hs.down}
    rep = SweepReport(sw.sweep_id, sw.dir, outcomes, sw.opts.baseline, down, sw.opts.threshold,
                      baseline_run=sw.baseline)
    rep.exit_code = sweep_exit_code(outcomes, down)
    return rep


def outcome_text(o: Outcome) -> str:
    """'step-5000  tau 5.02 (+0.69 vs step-4000) · 0.60x baseline   improved' (pure)."""
    if o.tau is None:
        where = f" on {o.host}" if o.host else ""
        return f"{o.checkpoint}  {o.state.upper()}{where}" + (f" ({o.error})" if o.error else "")
    parts = [f"tau {o.tau:.2f}" + (f" ({o.tau - o.prev_tau:+.2f} vs {o.prev_checkpoint})"
                                   if o.prev_tau is not None else "")]
    if o.base_ratio is not None:
        parts.append(f"{o.base_ratio:.2f}x baseline" + (f" ({o.base_note})" if o.base_note else ""))
    return f"{o.checkpoint}  " + " · ".join(parts) + f"   {o.verdict}" + (" (earlier sweep)" if o.earlier else "")


def report_table(rep: SweepReport) -> compare.Table:
    cols = [compare.Column("checkpoint", "checkpoint", digits=None), compare.Column("step", "step", digits=None),
            compare.Column("host", "host", digits=None), compare.Column("tau", "tau", ranked=True),
            compare.Column("vs_prev", "vs previous", digits=None),
            compare.Column("vs_base", "vs " + (rep.baseline or "baseline"), digits=None),
            compare.Column("verdict", "verdict", digits=None)]
    rows = []
    for o in rep.outcomes:
        cells = {
            "checkpoint": compare.Cell(o.checkpoint, o.checkpoint),
            "step": compare.Cell(o.step, "" if o.step is None else str(o.step)),
            "host": compare.Cell(o.host, o.host or ""),
            "tau": compare.Cell(o.tau, "" if o.tau is None else f"{o.tau:.2f}"),
            "vs_prev": compare.Cell(None if o.prev_tau is None or o.tau is None else o.tau - o.prev_tau,
                                    "" if o.prev_tau is None or o.tau is None
                                    else f"{o.tau - o.prev_tau:+.2f} vs {o.prev_checkpoint}"),
            "vs_base": compare.Cell(o.base_ratio, "" if o.base_ratio is None else f"{o.base_ratio:.2f}x"
                                    + (f" ({o.base_note})" if o.base_note else "")),
            "verdict": compare.Cell(o.verdict, o.verdict + (f": {o.error}" if o.error else "")
                                    + (" (earlier sweep)" if o.earlier else "")),
        }
        rows.append(compare.Row(cells, [], rankable=o.tau is not None and not o.suspect))
    notes = [f"threshold ±{rep.threshold:.2f} tau"] + [f"host {h} left out: {why}" for h, why in rep.hosts_down.items()]
    return compare.mark_best(compare.Table(f"sweep {rep.sweep_id}", cols, rows, notes=notes))


def report_json(rep: SweepReport) -> dict:
    return {"sweep": rep.sweep_id, "dir": str(rep.sweep_dir), "baseline": rep.baseline, "threshold": rep.threshold,
            "exit_code": rep.exit_code, "hosts_down": rep.hosts_down,
            "checkpoints": [asdict(o) for o in rep.outcomes], "files": rep.files}


def write_report_files(rep: SweepReport) -> None:
    """report.md, report.json and plots.png (when there are results) in the sweep dir."""
    from . import plots, report
    md = report.render_markdown([report_table(rep)])
    md += "\n" + "\n".join(f"- {outcome_text(o)}" for o in rep.outcomes) + "\n"
    protocol.atomic_write_text(rep.sweep_dir / "report.md", md)
    rep.files["markdown"] = str(rep.sweep_dir / "report.md")
    paths = [o.local_path for o in rep.outcomes if o.local_path and o.state == protocol.SUCCEEDED]
    if paths:
        recs = [compare.load_run(p) for p in paths]
        rep.files["plot"] = str(plots.save_comparison_plot(compare.build_comparison(recs, rep.baseline_run),
                                                           rep.sweep_dir / "plots.png"))
    rep.files["json"] = str(rep.sweep_dir / "report.json")
    protocol.atomic_write_json(rep.sweep_dir / "report.json", report_json(rep))
