"""Sweep overhead per checkpoint beyond the eval itself (discover, hash, schedule, stage, launch, follow, pull,
ledger, report), over real sshd hosts on loopback with `python -m remote_payload dummy` as the eval.

    scripts/netns-run .venv/bin/python -m benchmarks.bench_sweep [--hosts 3] [--checkpoints 12] [--eval-s 3]
                                                                 [--login-rc skip|run|both]

Each host is a CPU host (one run at a time), so the ideal sweep takes ceil(checkpoints / hosts) x eval-s;
overhead per checkpoint = (wall x hosts - checkpoints x eval-s) / checkpoints, wall being the whole sweep as
`reval sweep` runs it (hosts made ready, payload synced to fresh hosts, discovery, every run, the report files).
Target: under 0.5 s, and under 10% of the total when each eval takes a minute. Needs root + the private netns
(sshd on 127.0.0.x). The split below the headline says where the overhead is: `start` (until the first
launch: hosts ready, payload sync, discovery, the first staging and launch), `per cycle` (on each slot, from
one launch to the next, beyond the eval's own time, which the dummy's events give), `end` (from the last run's
end to the report), `report` (report.md/.json/.html and plots.png).

The measurements so far, what each change gained and what was tried and dropped:
docs/benchmarks-laptop-history.md.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from orchestrator import sweep
from orchestrator.hosts.inventory import load_inventory
from orchestrator.hosts.transport import close_all
from orchestrator.runs.lifecycle import EvalSpec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--checkpoints", type=int, default=12)
    p.add_argument("--eval-s", type=float, default=3.0, help="how long each dummy eval runs")
    p.add_argument("--poll-s", type=float, default=10.0, help="the sweep's long-poll limit (CLI default 10)")
    p.add_argument("--login-rc", choices=("skip", "run", "both"), default="both",
                   help="whether the hosts' SSH sessions run the login shell's ~/.bashrc (root's here: pyenv init, "
                        "0.1 s a session): skip (reval's own overhead), run (as a plain sshd does), both (default)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests import sshd  # the same real-sshd harness as the tests

    why = sshd.netns_skip_reason()
    if why:
        print(f"bench_sweep: skipped: {why}", file=sys.stderr)
        return 3
    modes = {"skip": [False], "run": [True], "both": [False, True]}[args.login_rc]
    results = [measure(args, sshd, login_rc) for login_rc in modes]
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=2))
    else:
        for res in results:
            show(res)
    return 0 if all(r["succeeded"] == r["checkpoints"] for r in results) else 1


def measure(args, sshd, login_rc: bool) -> dict:
    """One whole sweep as `reval sweep` runs it (then again, all skipped), on fresh loopback sshd hosts whose
    sessions run the login shell's ~/.bashrc or not."""
    with tempfile.TemporaryDirectory(prefix="reval-bench-sweep-") as tmp:
        root = Path(tmp)
        cluster = sshd.make_ssh_hosts(root / "sshd", args.hosts, login_rc=login_rc)
        cwd = os.getcwd()
        try:
            os.chdir(root)
            for i in range(args.checkpoints):
                d = root / "ckpts" / f"step-{(i + 1) * 500}"
                d.mkdir(parents=True)
                (d / "config.json").write_text(json.dumps({"step": (i + 1) * 500}))
                (d / "model.safetensors").write_bytes(os.urandom(256 * 1024))
            lines = max(1, round(args.eval_s / 0.1))
            opts = sweep.SweepOptions(checkpoints=[str(root / "ckpts" / "step-*")], hosts=["cluster"],
                                      spec=EvalSpec(payload="dummy",
                                                    extra=["--lines", str(lines), "--interval-s", "0.1"]),
                                      sweep_dir=str(root / "sweeps"), poll_s=args.poll_s)
            lines_at: list[tuple[float, str]] = []
            t0, w0 = time.perf_counter(), time.time()
            rep = sweep.Sweep(opts, load_inventory(cluster.inventory_path),
                              log=lambda line: lines_at.append((time.time(), line))).run()
            w1 = time.time()
            sweep.write_report_files(rep)
            wall = time.perf_counter() - t0
            report_s = time.time() - w1
            t1 = time.perf_counter()
            rep2 = sweep.Sweep(opts, load_inventory(cluster.inventory_path)).run()  # all skipped
            rerun = time.perf_counter() - t1
            split = where_it_goes(lines_at, rep, w0, w1, report_s)  # reads the pulled runs' events
        finally:
            os.chdir(cwd)
            close_all()
            cluster.close()
    n, h, eval_s = args.checkpoints, args.hosts, lines * 0.1
    ok = sum(o.state == "succeeded" for o in rep.outcomes)
    overhead = (wall * h - n * eval_s) / n
    share_60 = overhead / (60 + overhead)
    return {"hosts": h, "checkpoints": n, "succeeded": ok, "eval_s": eval_s, "poll_s": args.poll_s,
            "login_rc": login_rc, "wall_s": round(wall, 2), "ideal_s": round(math.ceil(n / h) * eval_s, 2),
            "overhead_per_checkpoint_s": round(overhead, 3), "overhead_share_at_60s_eval": round(share_60, 4),
            "rerun_all_skipped_s": round(rerun, 2), "rerun_skipped": sum(o.state == "skipped" for o in rep2.outcomes),
            **{k: round(v, 3) for k, v in split.items()}}


def show(res: dict) -> None:
    n, h = res["checkpoints"], res["hosts"]
    rc = ("sessions run ~/.bashrc (as a plain sshd's do)" if res["login_rc"] else
          "sessions skip ~/.bashrc (sshd SetEnv SHLVL=1: reval's own overhead)")
    print(f"sweep   {n} checkpoints on {h} loopback sshd hosts · dummy eval {res['eval_s']:.1f}s · poll "
          f"{res['poll_s']}s · {rc}")
    print(f"wall    {res['wall_s']:.2f}s (ideal {res['ideal_s']:.1f}s) · {res['succeeded']}/{n} succeeded")
    print(f"overhead {res['overhead_per_checkpoint_s']:.2f}s per checkpoint (target < 0.5 s) · "
          f"{res['overhead_share_at_60s_eval']:.1%} of the total at 60 s evals (target < 10%)")
    print(f"split   start {res['start_s']:.2f}s · per cycle {res['cycle_s']:.2f}s (launch to launch beyond the "
          f"eval's own {res['eval_measured_s']:.2f}s; on the host {res['host_gap_s']:.2f}s from an eval's last event "
          f"to the next one's first) · end {res['end_s']:.2f}s · report {res['report_s']:.2f}s")
    print(f"re-run  {res['rerun_all_skipped_s']:.2f}s with all {res['rerun_skipped']} skipped by the ledger")


def where_it_goes(lines_at: list[tuple[float, str]], rep, w0: float, w1: float, report_s: float) -> dict:
    """The overhead's parts, from the sweep's own log lines (their times here) and the runs' events (the dummy's
    times on the host, this machine's clock): start = the sweep's start to its first launch; cycle = on each slot,
    launch to next launch less the eval's own time (its first to its last event), averaged; host gap = on each
    slot, one eval's last event to the next one's first (the part of a cycle on the host: the end noticed, the
    wrapper and the payload started), averaged; end = the last eval's last event to the sweep's return; report =
    the report files."""
    evals, ends, spans = {}, [], {}
    for o in rep.outcomes:
        try:
            ts = [e["t"] for e in map(json.loads, (Path(o.local_path) / "events.jsonl").read_text().splitlines())]
        except (OSError, TypeError, ValueError, KeyError, IndexError):
            continue
        evals[o.checkpoint], ends, spans[o.checkpoint] = ts[-1] - ts[0], ends + [ts[-1]], (ts[0], ts[-1])
    launches: dict[str, list[tuple[float, str]]] = {}
    for t, line in lines_at:
        if line.startswith("launch  "):
            name, _, rest = line[8:].partition(" on ")
            launches.setdefault(rest.split(" ", 1)[0], []).append((t, name))
    gaps = [b[0] - a[0] - evals.get(a[1], 0.0) for seq in launches.values() for a, b in itertools.pairwise(seq)]
    host = [spans[b[1]][0] - spans[a[1]][1] for seq in launches.values() for a, b in itertools.pairwise(seq)
            if a[1] in spans and b[1] in spans]
    first = min((t for seq in launches.values() for t, _ in seq), default=w0)
    return {"start_s": first - w0, "cycle_s": sum(gaps) / len(gaps) if gaps else 0.0,
            "host_gap_s": sum(host) / len(host) if host else 0.0,
            "eval_measured_s": sum(evals.values()) / len(evals) if evals else 0.0,
            "end_s": w1 - max(ends, default=w1), "report_s": report_s}


if __name__ == "__main__":
    sys.exit(main())
