"""Which host a RUN reference means: `host/name`, or a bare `name` looked up in the local registry (runs/
here) and then on every inventory host, through its backend. It sits above rundir/registry.py (the
registry, the names) and backends/ (the probe), so neither imports the other back."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from remote_payload.contract import protocol, runstate

from ..backends import get_backend
from ..errors import ConfigError, HostUnreachable, RevalError, RunNotFound
from ..hosts.inventory import Host, Inventory
from ..rundir.registry import check_run_name, local_registry, local_run_dir, local_runs_root


def locate_run(inventory: Inventory, ref: str, host_opt: str | None = None, *,
                search_hosts: bool = True) -> tuple[Host, str]:
    """`host/name` or `name` (+ --host) -> (Host, name). A bare name is looked up in the local registry,
    then on every inventory host; found on several => an error naming them; nowhere => RunNotFound."""
    if "/" in ref:
        host_name, name = ref.split("/", 1)
    else:
        host_name, name = host_opt, ref
    check_run_name(name)
    if host_name:
        if host_name not in inventory.hosts and (other := not_in_inventory(inventory, name, host_name)):
            raise other
        return inventory.get(host_name), name
    local = sorted({h for h, r in local_registry() if r == name and h in inventory.hosts})
    if len(local) == 1:
        return inventory.get(local[0]), name
    candidates = local
    if not candidates and search_hosts:
        hosts = list(inventory.hosts.values())

        def has(h: Host) -> bool:
            try:
                return get_backend(h).state(name) is not None
            except HostUnreachable:
                return False
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as ex:
            candidates = [h.name for h, ok in zip(hosts, ex.map(has, hosts)) if ok]
    if not candidates and (other := not_in_inventory(inventory, name)):
        raise other
    if not candidates:
        raise RunNotFound(f"no run named {name!r} here (runs/) or on any inventory host",
                          hint="list runs: reval ls ; or name the host: reval status HOST/NAME")
    if len(candidates) > 1:
        raise ConfigError(f"run name {name!r} exists on several hosts: {', '.join(candidates)}",
                          hint=f"say which: {candidates[0]}/{name} (or --host {candidates[0]})")
    return inventory.get(candidates[0]), name


def not_in_inventory(inventory: Inventory, name: str, host: str | None = None) -> ConfigError | None:
    """The one line for a run that is here (runs/<host>/<name>) for a host this inventory does not have (it
    was started with another hosts.yaml): which host, and that the inventory that has it is needed (-i FILE,
    the file its run.json recorded when there is one); None when there is no such copy."""
    hosts = sorted(h for h, r in local_registry() if r == name and h not in inventory.hosts and host in (None, h))
    if not hosts:
        return None
    files = [f for f in dict.fromkeys(recorded_inventory(h, name) for h in hosts) if f]
    flag = files[0] if len(files) == 1 else "FILE"
    where = f"{local_runs_root()}/{hosts[0]}/{name}" + (f" (and {len(hosts) - 1} more)" if len(hosts) > 1 else "")
    host_words = ", ".join(repr(h) for h in hosts)
    return ConfigError(f"run {name!r} is {where} here, but its host {host_words} is not in "
                       f"{inventory.path or 'the built-in inventory'}",
                       hint=f"give the inventory that has {hosts[0]!r}: -i {flag} (e.g. reval -i {flag} status "
                            f"{hosts[0]}/{name}), or REVAL_HOSTS={flag}")


def recorded_inventory(host: str, name: str) -> str | None:
    """The `-i FILE` of the command line that started the run, as its pulled run.json recorded it, or None."""
    try:
        argv = protocol.read_json(local_run_dir(host, name) / "run.json", runstate.MAX_STATUS_BYTES).get("argv")
    except (OSError, ValueError, AttributeError, RevalError):
        return None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return None
    for i, a in enumerate(argv):
        if a in ("-i", "--inventory") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--inventory="):
            return a.split("=", 1)[1]
        if a.startswith("-i") and len(a) > 2 and not a.startswith("--"):
            return a[2:].removeprefix("=")
    return None
