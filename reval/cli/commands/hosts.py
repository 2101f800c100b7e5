"""`reval hosts` (the inventory as a table) and `reval hosts check [HOST|GROUP] [--accept-new] [--json]`."""
from __future__ import annotations

import argparse
import dataclasses
import json

from rich.table import Table
from rich.text import Text

import reval
from orchestrator.render.formats import listing_console

from ..argparsing import positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hosts", help="the inventory as a table; `hosts check` probes the hosts",
                       description="Show the inventory (hosts.yaml). `reval hosts check [HOST|GROUP]` checks each "
                                   "host in parallel: reachable, host key, python, disk, GPUs, payload and venv; "
                                   "for a Slurm cluster (slurm: in hosts.yaml) its partitions, GPUs and limits.")
    p.add_argument("--names", action="store_true", help="only the host and group names, one a line")
    p.add_argument("--json", action="store_true", help="the inventory as JSON: its file, hosts (every setting) and "
                                                       "groups")
    p.set_defaults(func=main_list)
    hsub = p.add_subparsers(dest="hosts_command", metavar="check")
    c = hsub.add_parser("check", help="check hosts in parallel (one SSH round trip each)",
                        description="Check each host in parallel, one SSH round trip each: reachable, host key, "
                                    "python, disk, GPUs, payload and venv state. Exit 0 all ok, 2 some failed, "
                                    "4 none reachable (or a refused host key).")
    c.add_argument("target", nargs="?", metavar="HOST|GROUP", help="default: every host in the inventory")
    c.add_argument("--accept-new", action="store_true",
                   help="record the host key of a host seen for the first time (a changed key is still refused)")
    c.add_argument("--json", action="store_true", help="print the results as JSON")
    c.add_argument("--jobs", type=positive_int, default=16, metavar="N", help="hosts checked at once (default 16)")
    c.set_defaults(func=main_check)


def inventory_table(inv: reval.Inventory) -> Table:
    t = Table(title=f"hosts ({inv.path or 'built-in'})", title_justify="left")
    for col in ("host", "address", "workdir", "python / venv", "gpus", "tags"):
        t.add_column(col)
    for h in inv.hosts.values():
        venv = h.venv.mode + (" +system-site" if h.venv.system_site_packages else "") + \
            (" +wheelhouse" if h.venv.wheelhouse else "")
        t.add_row(h.name, h.describe_address(), h.workdir, f"{h.python} ({venv})", gpus_cell(h), ", ".join(h.tags))
    return t


def inventory_json(inv: reval.Inventory) -> dict:
    """What `reval hosts --json` prints (pure): the file, every host with all its settings, the groups."""
    return {"inventory": inv.path, "hosts": [dataclasses.asdict(h) for h in inv.hosts.values()],
            "groups": {g: list(members) for g, members in inv.groups.items()}}


def gpus_cell(h) -> str:
    """The `gpus` column: the host's setting, or for a Slurm cluster what each job asks for (Slurm assigns them)."""
    s = h.slurm
    if s is None:
        return h.gpus
    ask = f"--gpus={s.gpus}" if s.gpus is not None else f"--gres={s.gres}" if s.gres else "no GPU asked"
    return f"Slurm, per job {ask}" + (f" on {s.partition}" if s.partition else "")


def gpu_summary(r: reval.HostCheck) -> str:
    if r.cluster is not None:  # a Slurm cluster: its partitions (GPUs per node from gres), not the login node
        return "\n".join(f"{p['name']}{'*' if p['default'] else ''} ({p['available']}): {p['nodes']} node(s) · "
                         f"{p['gres'] or 'no GPU'} · {p['cpus']} CPUs · limit {p['time_limit']}"
                         for p in r.cluster["partitions"])
    if r.gpus is None:
        return "no GPU (CPU runs)" if r.reachable and r.python else "-"
    if r.gpu_error:
        return r.gpu_error
    return "\n".join(f"{g['index']}: {g['name']} {_gb(g['memory_used_mib'])}/{_gb(g['memory_total_mib'])} GB "
                     f"{g['utilization_pct'] if g['utilization_pct'] is not None else '?'}%" for g in r.gpus)


def _gb(mib) -> str:
    return "?" if mib is None else f"{mib / 1024:.0f}"


def check_table(results: list[reval.HostCheck]) -> Table:
    """One row per host; what the host answered (its python, GPU names, errors) as text with its control
    characters escaped, never as markup or a terminal's command."""
    t = Table(title_justify="left")
    for col in ("host", "status", "python", "disk free", "GPUs", "payload", "venv", "time"):
        t.add_column(col)
    for r in results:
        status = "ok" if r.ok else ("UNREACHABLE" if not r.reachable else "FAILED")
        disk = f"{r.disk_free_bytes / 1e9:.0f} GB" if r.disk_free_bytes is not None else "-"
        cells = (r.host, status, r.python or "-", disk, gpu_summary(r), r.payload if r.reachable else "-",
                 r.venv if r.reachable else "-", f"{r.elapsed_s:.1f}s")
        t.add_row(*(Text(reval.printable(c, "\n")) for c in cells))
    return t


def cluster_lines(results) -> list[str]:
    """Below the table: each cluster's Slurm version and the user's limits (or why there are none)."""
    out = []
    for r in results:
        c = getattr(r, "cluster", None)
        if not c:
            continue
        out.append(f"{r.host}: {c['version'] or 'Slurm'} · partitions: "
                   + ", ".join(f"{p['name']} MaxTime={p['limits'].get('MaxTime') or '?'}" for p in c["partitions"]))
        for a in c["limits"] or []:
            out.append(f"  limits: account {a.get('account') or '-'} partition {a.get('partition') or 'any'} "
                       f"qos {a.get('qos') or '-'} · MaxJobs {a.get('max_jobs') or '-'} MaxSubmit "
                       f"{a.get('max_submit') or '-'} MaxWall {a.get('max_wall') or '-'} MaxTRES "
                       f"{a.get('max_tres') or '-'}")
        if c["limits_note"]:
            out.append(f"  limits: {c['limits_note']}")
    return out


def failure_lines(results) -> list[str]:
    out = []
    for r in results:
        if not r.ok:
            out.append(f"{r.host}: {r.error}")
            out += [f"  fix: {line}" for line in (r.hint or "").splitlines()]
    return out


def main_list(args: argparse.Namespace) -> int:
    inv = reval.Inventory.load(args.inventory)
    if args.names:  # for shell completion: host and group names, one a line
        print("\n".join([*inv.hosts, *inv.groups]))
        return 0
    if args.json:
        print(json.dumps(inventory_json(inv), indent=1, default=str))
        return 0
    con = listing_console()
    con.print(inventory_table(inv))
    for g, members in inv.groups.items():
        con.print(f"group {g}: {', '.join(members)}", highlight=False)
    return 0


def main_check(args: argparse.Namespace) -> int:
    results = reval.check_hosts(args.target, accept_new=args.accept_new, max_workers=args.jobs,
                                inventory=args.inventory)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    else:
        con = listing_console()
        con.print(check_table(results))
        for line in cluster_lines(results) + failure_lines(results):
            con.print(reval.printable(line), highlight=False, markup=False)
    return reval.hosts_exit_code(results)
