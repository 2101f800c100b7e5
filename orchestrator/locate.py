"""Which host a RUN reference means: `host/name`, or a bare `name` looked up in the local registry (runs/
here) and then on every inventory host, through its backend. It sits above runs.py (the registry, the
names) and backends/ (the probe), so neither imports the other back."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .backends import get_backend
from .errors import ConfigError, HostUnreachable, RunNotFound
from .inventory import Host, Inventory
from .runs import check_run_name, local_registry


def resolve_run(inventory: Inventory, ref: str, host_opt: str | None = None, *,
                search_hosts: bool = True) -> tuple[Host, str]:
    """`host/name` or `name` (+ --host) -> (Host, name). A bare name is looked up in the local registry,
    then on every inventory host; found on several => an error naming them; nowhere => RunNotFound."""
    if "/" in ref:
        host_name, name = ref.split("/", 1)
    else:
        host_name, name = host_opt, ref
    check_run_name(name)
    if host_name:
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
    if not candidates:
        raise RunNotFound(f"no run named {name!r} here (runs/) or on any inventory host",
                          hint="list runs: reval ls ; or name the host: reval status HOST/NAME")
    if len(candidates) > 1:
        raise ConfigError(f"run name {name!r} exists on several hosts: {', '.join(candidates)}",
                          hint=f"say which: {candidates[0]}/{name} (or --host {candidates[0]})")
    return inventory.get(candidates[0]), name
