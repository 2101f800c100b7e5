"""The runs on hosts through the API: ls (-> Listing), pull_all (-> PulledAll), and removing runs
(plan_rm / plan_prune -> RemovalPlan, .apply(); rm / prune do both)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.backends import get_backend
from orchestrator.errors import ConfigError
from orchestrator.hosts.inventory import Inventory
from orchestrator.rundir import registry as _runs
from orchestrator.rundir.pull import Pulled
from orchestrator.rundir.registry import RunState
from orchestrator.runs import locate as _locate
from orchestrator.runs import remove as _remove
from orchestrator.runs.remove import Removal

from .hosts import as_inventory, hosts_of, per_host


@dataclass
class Listing:
    """Runs as their hosts report them now, oldest first; `unreachable`: {host: why}."""
    runs: list[RunState] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> list[dict]:
        """What `--json` prints: one object per run, then one per unreachable host."""
        return ([s.to_json() for s in self.runs]
                + [{"host": h, "state": "unreachable", "error": why} for h, why in self.unreachable.items()])


def ls(target: str | None = None, *, here: bool = False, inventory: Inventory | str | Path | None = None) -> Listing:
    """The runs on a host or group (default: every inventory host), as the hosts report them now (`reval ls`);
    here=True: only the runs in runs/ here (launched or pulled from this folder) that their hosts still have
    (`reval status` without RUN)."""
    inv = as_inventory(inventory)
    hosts = hosts_of(inv, target)
    known = set(_runs.local_registry()) if here else set()
    if here:
        names = {h for h, _ in known}
        hosts = sorted((h for h in hosts if h.name in names), key=lambda h: h.name)
    found, unreachable = per_host(hosts, lambda be: be.list_runs())
    states = [s for h in hosts for s in found.get(h.name, []) if not here or (s.host, s.name) in known]
    return Listing(_runs.by_start_time(states), unreachable)


def local_runs() -> list[tuple[str, str]]:
    """(host, name) of every run kept here in runs/ (launched or pulled from this folder), sorted; no host is
    asked (`reval ls --names`)."""
    return _runs.local_registry()


@dataclass
class PulledAll:
    """pull_all's answer: every run pulled, host by host; `unreachable`: {host: why}."""
    runs: list[Pulled] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)


def pull_all(target: str | None = None, *, inventory: Inventory | str | Path | None = None) -> PulledAll:
    """Pull every run of a host or group (default: every inventory host) (`reval pull --all`)."""
    hosts = hosts_of(as_inventory(inventory), target)

    def every(be):
        pulled = []
        for s in be.list_runs():
            res = be.pull(s.name)
            res.state = s.state
            pulled.append(res)
        return pulled
    found, unreachable = per_host(hosts, every)
    return PulledAll([p for h in hosts for p in found.get(h.name, [])], unreachable)


@dataclass
class RemovalPlan:
    """What rm/prune would remove (`runs`: host/name, its state, on the host and/or here), the runs prune
    left alone because their age cannot be trusted (`skipped`: (RunState, why)), hosts that could not be
    asked (`unreachable`). Nothing is removed until `apply()`."""
    runs: list[Removal] = field(default_factory=list)
    skipped: list[tuple[RunState, str]] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    _backends: list = field(default_factory=list, init=False, repr=False, compare=False)

    def _add(self, backend, removal: Removal) -> None:
        self._backends.append(backend)
        self.runs.append(removal)

    def apply(self) -> list[Removal]:
        """Remove them (each on its host first, then the copy here); the removals done."""
        for be, r in zip(self._backends, self.runs):
            _remove.remove(be, r)
        return self.runs


def plan_rm(runs: list[str] | str, *, host: str | None = None, local_only: bool = False,
            inventory: Inventory | str | Path | None = None) -> RemovalPlan:
    """Plan removing runs (RUN references) from their hosts and runs/ here (`reval rm`); every run is checked
    first: a running one (exit_code 3) or one that is nowhere (102) refuses them all."""
    inv = as_inventory(inventory)
    plan = RemovalPlan()
    for ref in [runs] if isinstance(runs, str) else runs:
        h, name = _locate.locate_run(inv, ref, host)
        be = get_backend(h)
        plan._add(be, _remove.plan(be, name, local_only=local_only))
    return plan


def plan_prune(target: str | None = None, *, failed: bool = False, older_than_s: float | None = None,
               local_only: bool = False, inventory: Inventory | str | Path | None = None) -> RemovalPlan:
    """Plan removing the runs of a host or group (default: every host) that did not succeed (`failed`) and/or
    ended more than `older_than_s` ago by their host's clock (`reval prune`); never a running run."""
    if not (failed or older_than_s is not None):
        raise ConfigError("reval prune: say which runs: --failed and/or --older-than AGE",
                          hint="e.g. reval prune --failed ; reval prune gpu1 --older-than 14d")
    hosts = hosts_of(as_inventory(inventory), target)
    found, unreachable = per_host(hosts, lambda be: (be, be.list_runs()))
    plan = RemovalPlan(unreachable=unreachable)
    for h in hosts:
        if h.name not in found:
            continue
        be, states = found[h.name]
        picked, distrusted = _remove.select_for_prune(states, failed=failed, older_than_s=older_than_s)
        for s in picked:
            plan._add(be, _remove.plan(be, s.name, local_only=local_only, state=s))
        plan.skipped += distrusted
    return plan


def rm(runs: list[str] | str, **kw) -> RemovalPlan:
    """plan_rm(...).apply(): remove the runs now (no question asked)."""
    plan = plan_rm(runs, **kw)
    plan.apply()
    return plan


def prune(target: str | None = None, **kw) -> RemovalPlan:
    """plan_prune(...).apply(): remove the matching runs now (no question asked)."""
    plan = plan_prune(target, **kw)
    plan.apply()
    return plan
