"""Sweeps through the API: sweep(SweepOptions) -> SweepReport (`reval sweep`); Ctrl-C is SweepInterrupted."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from orchestrator import sweep as _sweep
from orchestrator.errors import ConfigError
from orchestrator.hosts.inventory import Host, Inventory
from orchestrator.sweep import SweepOptions, SweepReport
from orchestrator.sweep.ledger import LAUNCHED

from .hosts import as_inventory
from .runs import host_path


def sweep(options: SweepOptions, *, inventory: Inventory | str | Path | None = None,
          on_line: Callable[[str], None] | None = None) -> SweepReport:
    """Evaluate every new checkpoint over the hosts (`reval sweep`): discover, skip what the ledger has, run,
    pull, compare, and write the report files (report.md/.json/.html, plots) into the sweep's folder. Progress
    lines go to `on_line`; the report's `exit_code` is the CLI's. With --prompts each host resolves the suites
    to its store's caches (the missing ones built once, by one extract run, before that host's first eval)."""
    if [m for m in options.spec.missing() if m != "--drafter"]:  # the drafter is each checkpoint
        raise ConfigError("reval sweep needs --target and --cache (paths on the hosts) or --prompts NAME=FILE",
                          hint="e.g. --target /root/models/Qwen3.6-27B --cache /root/eval/cache")
    if options.spec.prompts and options.spec.payload != "eval":
        raise ConfigError("reval sweep --prompts builds caches for the eval payload; --payload dummy reads none",
                          hint="leave --prompts out with --payload dummy")
    inv = as_inventory(inventory)
    options = _sweep_paths(options, inv)
    baseline = _sweep.load_baseline(options.baseline)  # now, not after a night of evals
    sw = _sweep.Sweep(options, inv, log=on_line, baseline=baseline)
    try:
        rep = sw.run()
    except KeyboardInterrupt:  # the runs it launched go on on their hosts; the same sweep() resumes it
        mine = sw.ledger.of_sweep(sw.sweep_id).values() if sw.sweep_id else []
        going = [e for e in mine if e.state == LAUNCHED and e.host and e.run]
        in_flight = set(sw.record.in_flight)
        launched = sorted({(e.host, e.run) for e in going if e.key not in in_flight})
        maybe = sorted({(e.host, e.run) for e in going if e.key in in_flight})
        raise SweepInterrupted(sw.sweep_id or None, launched, maybe) from None
    _sweep.write_report_files(rep)
    return rep


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C (KeyboardInterrupt) during reval.sweep: `launched` lists the (host, run) pairs it had started that
    go on on their hosts (detached: the controller's end does not stop them); `maybe` those whose launch was
    under way (the long poll that starts a slot's next run once the current one ended: started or not, the
    host knows); `sweep_id` is the sweep (None
    when it had not begun). The same sweep() again resumes it: it re-attaches to those runs, pulls what
    finished and launches only what is missing."""

    def __init__(self, sweep_id: str | None, launched: list[tuple[str, str]],
                 maybe: list[tuple[str, str]] | None = None):
        super().__init__()
        self.sweep_id, self.launched, self.maybe = sweep_id, launched, list(maybe or [])


def _sweep_paths(options: SweepOptions, inventory: Inventory) -> SweepOptions:
    """The sweep's --target/--cache under run's path rule (check_spec): a relative path on local hosts means the
    current directory (made absolute here); with a remote host among --hosts it is refused (exit 3), naming it."""
    hosts = [h for name in options.hosts for h in inventory.resolve(name)]
    remote = next((h for h in hosts if not h.is_local), None)
    here = remote or Host(name="local", local=True)

    def fix(k: str, v: str | None) -> str | None:
        if v and not os.path.isabs(v) and remote is not None:
            raise ConfigError(f"reval sweep: --{k} {v!r} is relative; {remote.name} is a remote host: give the "
                              f"absolute path there", hint=f"e.g. --{k} /data/{v}")
        return host_path(k, v, here)

    return dataclasses.replace(options, spec=options.spec.with_paths(fix))
