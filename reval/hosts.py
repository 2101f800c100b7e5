"""Hosts through the API: the inventory (a Host or its name, an Inventory or its file), `reval hosts check`
(check_hosts), `reval sync` (sync -> HostSync), a host made ready for runs (prepare -> Prepared) and the
tiny offline fixtures built on it (build_fixtures -> Fixtures)."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.backends import get_backend
from orchestrator.errors import ConfigError, EvalFailed, HostKeyError, HostUnreachable, RevalError
from orchestrator.hosts.environment import EnvInfo, provision
from orchestrator.hosts.hostcheck import HostCheck
from orchestrator.hosts.hostcheck import check_hosts as _check_hosts
from orchestrator.hosts.inventory import Host, Inventory, load_inventory
from orchestrator.hosts.sync import SyncResult
from orchestrator.hosts.transport import Transport, get_transport, q, resolve_workdir
from orchestrator.runs import lifecycle as _lifecycle
from orchestrator.runs.lifecycle import EvalSpec, Prepared


def as_inventory(inventory: Inventory | str | Path | None) -> Inventory:
    return inventory if isinstance(inventory, Inventory) else load_inventory(inventory)


def as_host(host: Host | str, inventory: Inventory | str | Path | None) -> Host:
    return host if isinstance(host, Host) else as_inventory(inventory).get(host)


def hosts_of(inv: Inventory, target: str | None) -> list[Host]:
    return inv.resolve(target) if target else list(inv.hosts.values())


def per_host(hosts: list[Host], fn) -> tuple[dict, dict[str, str]]:
    """fn(backend) on every host in parallel: ({host: result}, {host: why unreachable}), in host order."""
    def one(h):
        try:
            return h.name, fn(get_backend(h)), None
        except RevalError as e:
            return h.name, None, str(e)
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as ex:
        done = list(ex.map(one, hosts))
    return ({n: r for n, r, e in done if e is None}, {n: e for n, r, e in done if e is not None})


def prepare(host: Host | str, *, inventory: Inventory | str | Path | None = None) -> Prepared:
    """Sync the payload to `host` (only what changed) and check or build its venv: one probe round trip."""
    return _lifecycle.prepare(get_backend(as_host(host, inventory)))


def check_hosts(target: str | None = None, *, accept_new: bool = False, max_workers: int = 16,
                inventory: Inventory | str | Path | None = None) -> list[HostCheck]:
    """Check a host or group (default: every inventory host) in parallel, one round trip each (`reval hosts
    check`): reachable, host key, python, disk, GPUs, payload and venv; a Slurm cluster's partitions/limits.
    accept_new: record the key of a host seen for the first time (a changed key is still refused)."""
    return _check_hosts(hosts_of(as_inventory(inventory), target), accept_new=accept_new, max_workers=max_workers)


@dataclass
class HostSync:
    """One host's `sync`: `ok`, or `error` (one line) and `hint`; `reachable`; what changed (`sync`, `env`)."""
    host: str
    ok: bool = False
    reachable: bool = True
    sync: SyncResult | None = None
    env: EnvInfo | None = None
    error: str | None = None
    hint: str | None = None
    elapsed_s: float = 0.0
    warm: str | None = None  # `warm=True`: the warm command's last line ("warmed in 12.3s", "nothing to warm")


def _sync_host(host: Host, *, venv: bool = True, warm: bool = False,
               on_line: Callable[[str, str], None] | None = None) -> HostSync:
    t0 = time.monotonic()
    r = HostSync(host.name)
    try:
        t = get_transport(host)
        r.sync, r.env = provision(t, host, venv=venv)
        if warm:
            r.warm = warm_host(t, host.name, r.env.python, on_line=on_line)
        r.ok = True
    except (HostUnreachable, HostKeyError) as e:
        r.reachable, r.error, r.hint = False, str(e), e.hint
    except RevalError as e:
        r.error, r.hint = str(e).splitlines()[0], "\n".join(str(e).splitlines()[1:] + [e.hint or ""]).strip()
    r.elapsed_s = time.monotonic() - t0
    return r


def sync(target: str, *, venv: bool = True, warm: bool = False, max_workers: int = 8,
         on_line: Callable[[str, str], None] | None = None,
         inventory: Inventory | str | Path | None = None) -> list[HostSync]:
    """Push the payload (only what changed) and provision its venv on a host or every host of a group, in
    parallel (`reval sync`); one failed host does not stop the others. warm: then fill the host's kernel caches
    (`python -m remote_payload warm`, in the venv: on a cluster sharing it, once for every node); its output
    lines go to on_line(host, line) as they come. warm needs the venv (a ConfigError with venv=False)."""
    if warm and not venv:
        raise ConfigError("warm needs the payload's venv: the kernel caches live in it",
                          hint="drop --no-venv (the venv is reused when it is unchanged)")
    hosts = as_inventory(inventory).resolve(target)
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(hosts)))) as pool:
        return list(pool.map(lambda h: _sync_host(h, venv=venv, warm=warm, on_line=on_line), hosts))


def warm_host(t: Transport, host: str, python: str, *, on_line: Callable[[str, str], None] | None = None) -> str:
    """`python -m remote_payload warm` on the host (after a sync: `t.workdir` known), its lines streamed to
    on_line(host, line); returns its last line. A failure raises EvalFailed naming the host and the last line."""
    payload = q(resolve_workdir(t) + "/payload")
    proc = t.popen(f"cd {payload} && PYTHONUNBUFFERED=1 {q(python)} -m remote_payload warm 2>&1")
    last = ""
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        last = line or last
        if on_line:
            on_line(host, line)
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    rc = proc.wait()
    if rc:
        err = t.connection_error(rc, stderr)
        if err is not None:
            raise err
        raise EvalFailed(f"warming the kernel caches on {host} failed (exit {rc}): {last or stderr.strip()[-300:]}",
                         hint="see the lines above; on the host: python -m remote_payload warm")
    return last


@dataclass
class Fixtures:
    """The tiny offline fixtures built on a host (build_fixtures): `dir` on the host; `target`, `cache`,
    `drafters` (saved steps, in training order), `drafter_good` relative to it; `prompts_text`: the prompt file
    the cache was extracted from (its content, brought here: what --prompts takes) and `max_new_tokens`, its
    completion cap."""
    host: str
    dir: str
    target: str
    cache: str
    drafters: list[str]
    drafter_good: str
    prompts_text: str = field(default="", repr=False)
    max_new_tokens: int | None = None

    def spec(self, drafter: str, **options) -> EvalSpec:
        """An EvalSpec of `drafter` (relative to `dir`) against the fixtures' target and cache."""
        return EvalSpec(drafter=f"{self.dir}/{drafter}", target=f"{self.dir}/{self.target}",
                        cache=f"{self.dir}/{self.cache}", **options)


def build_fixtures(host: Host | str, *, out: str | None = None, prepared: Prepared | None = None,
                   on_line: Callable[[str], None] | None = None,
                   inventory: Inventory | str | Path | None = None) -> Fixtures:
    """Build the tiny offline fixtures on `host` into `out` (default <workdir>/fixtures): a synthetic language,
    a tiny Qwen3 target, a hidden-state cache, DFlash drafters; kept there and reused while their recipe is
    unchanged. The build's output lines go to `on_line`; a failed build raises reval.Error with `.stderr`
    (the last of it)."""
    h = as_host(host, inventory)
    prep = prepared or prepare(h)
    t = prep.backend.transport
    fixtures = out or f"{prep.workdir}/fixtures"
    proc = t.popen(f"cd {q(prep.workdir + '/payload')} && PYTHONUNBUFFERED=1 {q(prep.python)} -m remote_payload "
                   f"fixtures --out {q(fixtures)} 2>&1")
    for line in iter(proc.stdout.readline, b""):
        if on_line:
            on_line(line.decode(errors="replace").rstrip())
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    rc = proc.wait()
    if rc:
        e = EvalFailed(f"building the fixtures on {h.name} failed (exit {rc})",
                       hint="see the output above; rerun with: python -m remote_payload fixtures --out DIR")
        e.stderr = stderr[-2000:]
        raise e
    sep = "@@reval-fixtures-prompts@@"  # fixtures.json, then the prompt file: one round trip
    meta, _, prompts = t.run(f"cat {q(fixtures + '/fixtures.json')} && echo {sep} && "
                             f"cat {q(fixtures + '/prompts.jsonl')}").stdout.partition(f"\n{sep}\n")
    meta = json.loads(meta)
    paths = meta["paths"]
    return Fixtures(h.name, fixtures, paths["target"], paths["cache"], list(paths["drafters"]), paths["drafter_good"],
                    prompts_text=prompts, max_new_tokens=meta["recipe"]["max_new_tokens"])
