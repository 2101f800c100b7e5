"""`python -m benchmarks.bench` (under scripts/netns-run; `make bench` does): the orchestrator's speed
targets as ratios measured in one run, against real OpenSSH sshd on loopback.

BENCHES is a list of functions `bench(ctx) -> list[Row]`; add yours to it (the run path's are bench_run.py's
RUN_BENCHES). Each takes the shared BenchContext (harness.py: a scratch dir and a factory for sshd hosts) and
returns rows. Timings are medians of `repeat` runs, each from a cold SSH connection (ControlMaster closed),
as a user's `reval` invocation would see them.

Needs the repo checkout (it uses the tests' sshd harness, tests/sshd.py); dev-only.
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.bench_run import RUN_BENCHES
from benchmarks.harness import BenchContext, Row, format_table, median_s
from orchestrator.hosts import transport as transport_mod
from orchestrator.hosts.environment import provision
from orchestrator.hosts.hostcheck import check_hosts
from orchestrator.hosts.inventory import load_inventory
from orchestrator.hosts.sync import payload_source, sync_payload


def _bare_rsync(cluster, i: int, src: str, dest: str) -> list[str]:
    """A plain `rsync -a` over a plain ssh (its own connection, no multiplexing) to host i."""
    h = cluster.hosts[i]
    rsh = ["ssh", "-F", "/dev/null", "-p", str(h.port), "-i", str(cluster.client_key), "-o", "IdentitiesOnly=yes",
           "-o", f"UserKnownHostsFile={cluster.known_hosts}", "-o", "BatchMode=yes", "-l", "root"]
    return ["rsync", "-a", "-e", shlex.join(rsh), src, f"{h.address}:{dest}"]


def _make_wheel(wheelhouse: Path) -> None:
    from tests.samples import make_wheel  # the hand-built tiny wheel (no network)
    make_wheel(wheelhouse)


def bench_sync(ctx: BenchContext) -> list[Row]:
    wheels = ctx.root / "wheels"
    _make_wheel(wheels)
    reqs = ["revaltiny==1.0"]
    c = ctx.ssh_hosts(1, extra={"venv": {"mode": "managed", "wheelhouse": str(wheels)}})
    host = load_inventory(c.inventory_path).get("ssh1")
    workdir = c.hosts[0].workdir
    source = ctx.root / "src" / "remote_payload"  # a snapshot: the working tree may change meanwhile
    shutil.copytree(payload_source(), source, ignore=shutil.ignore_patterns("__pycache__"))

    def ours_noop():
        synced, env = provision(transport_mod.get_transport(host), host, requirements=reqs, source=source)
        assert synced.files_changed == 0 and env.reused, (synced, env)

    t = transport_mod.get_transport(host)
    provision(t, host, requirements=reqs, source=source)  # venv built once, outside the timing
    payload = str(ctx.root / "tree") + "/"  # a local copy of exactly the synced tree: the baseline's source
    shutil.copytree(workdir / "payload", payload, symlinks=True)
    noop_dest = str(workdir / "bare-copy") + "/"
    subprocess.run(_bare_rsync(c, 0, payload, noop_dest), check=True)
    rows = [Row("no-change re-sync (payload + venv)", median_s(ours_noop, ctx.repeat),
                median_s(lambda: subprocess.run(_bare_rsync(c, 0, payload, noop_dest), check=True), ctx.repeat),
                "bare rsync -a no-op", 1.2)]

    def fresh():
        shutil.rmtree(workdir / "payload", ignore_errors=True)
        shutil.rmtree(workdir / "bare-first", ignore_errors=True)

    def ours_first():
        assert sync_payload(transport_mod.get_transport(host), host, requirements=reqs,
                            source=source).method == "rsync"

    rows.append(Row("first sync (payload)", median_s(ours_first, ctx.repeat, setup=fresh),
                    median_s(lambda: subprocess.run(_bare_rsync(c, 0, payload, str(workdir / "bare-first") + "/"),
                                                    check=True),
                             ctx.repeat, setup=fresh),
                    "bare rsync -a to an empty dir", 1.5))
    return rows


def bench_hosts_check(ctx: BenchContext) -> list[Row]:
    """16 loopback servers share this machine's CPU with the client, so the ratio is bounded by CPU here;
    the second row has the test servers offer only curve25519 key exchange (the default post-quantum
    sntrup761 costs ~60 ms of CPU per handshake on each side on a small box) to show the client's own
    parallelism. The client's settings are the same in both rows."""
    def check(hs):
        assert all(r.ok for r in check_hosts(hs, requirements=[]))

    def bare_ssh(hs):  # the floor: the same handshakes with nothing of ours around them
        argvs = [["ssh", "-o", "ControlMaster=no", "-o", "ControlPath=none",
                  *transport_mod.SSHTransport(h).ssh_argv("true")[1:]]
                 for h in hs]
        procs = [subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for a in argvs]
        assert all(p.wait() == 0 for p in procs)

    rows = []
    for label, sshd_extra in (("", []), (", curve25519 servers", ["KexAlgorithms curve25519-sha256"])):
        hosts = list(load_inventory(ctx.ssh_hosts(16, sshd_extra=sshd_extra).inventory_path).resolve("cluster"))
        rows.append(Row(f"hosts check, 16 hosts{label}", median_s(lambda hs=hosts: check(hs), ctx.repeat),
                        median_s(lambda hs=hosts[:1]: check(hs), ctx.repeat), "1 host", 2.0))
        if not sshd_extra:
            rows.append(Row("bare `ssh true`, 16 hosts at once", median_s(lambda hs=hosts: bare_ssh(hs), ctx.repeat),
                            median_s(lambda hs=hosts[:1]: bare_ssh(hs), ctx.repeat), "1 host (floor on this box)",
                            2.0))
    return rows


BENCHES: list[Callable[[BenchContext], list[Row]]] = [bench_sync, bench_hosts_check]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("-k", metavar="WORD", help="only the benchmarks whose function name contains WORD")
    args = p.parse_args(argv)
    from tests.sshd import netns_skip_reason
    reason = netns_skip_reason()
    if reason:
        print(f"orchestrator bench skipped: {reason}", file=sys.stderr)
        return 3
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="reval-bench-") as root:
        ctx = BenchContext(Path(root), repeat=args.repeat)
        try:
            for bench in [*BENCHES, *RUN_BENCHES]:
                if not args.k or args.k in bench.__name__:
                    rows += bench(ctx)
        finally:
            ctx.close()
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
