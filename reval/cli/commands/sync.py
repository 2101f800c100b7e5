"""`reval sync HOST|GROUP [--no-venv] [--warm]`: push the payload (only what changed) and provision its venv,
on every host of a group in parallel; one failed host does not stop the others (exit 2, named). --warm then
fills each host's kernel caches (in the venv), its progress shown line by line, prefixed by the host."""
from __future__ import annotations

import argparse
import threading

import reval
from orchestrator.render.formats import listing_console

from ..argparsing import positive_int
from .hosts import failure_lines


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sync", help="push the payload (only what changed) and provision its venv",
                       description="Push remote_payload/ to HOST or every host of GROUP (content-hash manifest: "
                                   "only changed files travel; deleted files are removed) and build or reuse "
                                   "the venv keyed by the requirements hash.")
    p.add_argument("target", metavar="HOST|GROUP", help="an inventory host, or a group of them")
    p.add_argument("--no-venv", action="store_true", help="only push the payload")
    p.add_argument("--warm", action="store_true",
                   help="then compile the GPU kernels into the caches in the host's venv (python -m remote_payload "
                        "warm), so the first run on a fresh node finds them; a CPU-only host has nothing to warm")
    p.add_argument("--jobs", type=positive_int, default=8, metavar="N", help="hosts synced at once (default 8)")
    p.set_defaults(func=main)


def _kb(n: int) -> str:
    return f"{n / 1024:.0f} KB" if n >= 1024 else f"{n} B"


def sync_line(r: reval.HostSync) -> str:
    """One line per host (pure)."""
    if not r.ok:
        return f"{r.host}  FAILED  {r.error}"
    s = r.sync
    if s.method == "none":
        payload = f"payload: up to date ({s.files_total} files)"
    else:
        payload = (f"payload: {s.files_changed} of {s.files_total} files changed ({_kb(s.bytes)}, {s.method})"
                   + (f", {s.files_deleted} deleted" if s.files_deleted else ""))
    if r.env is None:
        env = "venv: skipped"
    elif r.env.method == "existing" and r.env.key.startswith("python-"):
        env = f"python: {r.env.python} (as is)"
    else:
        env = f"venv: {'reused' if r.env.reused else 'built with ' + r.env.method} ({r.env.key[:8]})"
    warm = f" · warm: {r.warm}" if r.warm else ""
    return f"{r.host}  {payload} · {env}{warm}  {r.elapsed_s:.1f}s"


def main(args: argparse.Namespace) -> int:
    con = listing_console()
    lock = threading.Lock()

    def progress(host: str, line: str) -> None:  # hosts warm at once: one whole line at a time
        with lock:
            con.print(reval.printable(f"{host}: {line}"), highlight=False, markup=False)
    results = reval.sync(args.target, venv=not args.no_venv, warm=args.warm, max_workers=args.jobs,
                         on_line=progress if args.warm else None, inventory=args.inventory)
    for r in results:
        con.print(reval.printable(sync_line(r)), highlight=False, markup=False)
    failed = [r for r in results if not r.ok]
    if failed and len(results) > 1:
        con.print(f"synced {len(results) - len(failed)} of {len(results)} hosts · failed: "
                  + ", ".join(r.host for r in failed), highlight=False, markup=False)
    for line in failure_lines([r for r in failed if r.hint]):
        if line.startswith("  fix:"):
            con.print(reval.printable(line), highlight=False, markup=False)
    return reval.hosts_exit_code(results)
