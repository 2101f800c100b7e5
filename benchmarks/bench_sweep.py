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

History (defaults: 3 hosts, 12 checkpoints, 3 s evals). Measured on a 2-core machine with other test suites
running beside it: +-25% from run to run, so each row is a range over interleaved runs of the two versions.
Every SSH session there paid root's ~/.bashrc (`pyenv init`: an `ssh host true` 0.12 s, 0.009 s without it);
since 2026-12-02 06:00 the bench runs the sweep twice, on hosts whose sessions skip it (`SetEnv SHLVL=1`, what
tests/sshd.py now gives every test: reval's own overhead, the headline) and on hosts whose sessions run it
(`login rc`, as a plain sshd here does; every row before the 32f3c97 rows measured only this, most at load
2-3.5: the 32f3c97 rows are the same code at load ~1). `--login-rc skip|run` runs one of the two.

| version | overhead / checkpoint | split (start · per cycle · end · report) |
|---|---|---|
| a turn before issue 19 item 26 | 1.2 s (as reported) | |
| issue 19 item 26 reported | 2.20 s | |
| before (8d2e010), 2026-12-02 | 2.3-3.3 s (9 runs) | |
| after | 1.4-2.1 s (8 runs; one more at load 3.7: 2.85 s) | 1.3-2.1 s · 0.5-0.8 s · 0.4-0.6 s · 1.4-2.0 s |
| f316c9c, 2026-12-02 (load 1.1-1.6) | 1.54-1.69 s (4 runs) | 1.6-2.0 s · 0.43-0.48 s · 0.48-0.58 s · 1.66-2.12 s |
| + plot worker (f4f29c6), interleaved with the row above | 1.30-1.53 s (4 runs) | 1.7-2.0 s · 0.40-0.54 s · 0.38-0.63 s · 0.76-1.04 s |
| + statistics as runs are pulled (16a1720); f4f29c6 interleaved: 1.26-1.47 s | 1.30-1.39 s (4 runs) | 1.5-1.9 s · 0.45-0.57 s · 0.22-0.27 s · 0.71-1.01 s |
| f316c9c vs 16a1720 interleaved at load 1.8-3.5 | 1.45-2.00 s vs 1.21-1.72 s (4 runs each) | after: 1.55-2.3 s · 0.37-0.66 s · 0.19-0.45 s · 0.77-2.1 s |
| 03b08ec, 2026-12-02 (load 2.0-3.1) | 1.54-2.26 s (4 runs) | 1.8-2.7 s · 0.59-0.79 s · 0.29-0.44 s · 0.97-2.36 s |
| + run over -> next launch in one SSH command, interleaved with the row above | 1.27-1.76 s (4 runs; a 5th alone: 1.16 s) | 2.0-2.5 s · 0.29-0.49 s · 0.24-0.43 s · 0.89-2.06 s |
| 32f3c97, 2026-12-02 06:05 (load 0.6-1.1), login rc | 0.77-0.84 s (3 runs) | 1.20-1.52 s · 0.18-0.19 s · 0.15-0.18 s · 0.56-0.58 s |
| the same, sessions skip ~/.bashrc (reval's own) | 0.56-0.59 s (3 runs) | 0.62-0.80 s · 0.20-0.21 s · 0.06-0.07 s · 0.55-0.65 s |
| + plots with fixed margins, plain DDTree ticks (1356a85), interleaved, login rc | 0.65-0.94 s (3 runs) | 1.09-1.28 s · 0.17-0.28 s · 0.15-0.25 s · 0.32-0.50 s |
| the same, skip ~/.bashrc | 0.51-0.58 s (3 runs) | 0.69-0.81 s · 0.22-0.26 s · 0.08-0.09 s · 0.33-0.39 s |
| 1356a85 vs + the long poll brings the ended run's files (this row), interleaved (load 0.4-1.1), login rc | 0.71-0.73 s vs 0.68-0.70 s (4 runs each) | after: 1.16-1.29 s · 0.16-0.21 s · 0.07-0.09 s (was 0.16-0.18) · 0.33-0.37 s |
| the same, skip ~/.bashrc | 0.46-0.57 s vs 0.46-0.56 s (5 runs each) | after: 0.58-0.67 s · 0.22-0.28 s · 0.07-0.11 s · 0.32-0.39 s |

What changed (issue 19 item 26): discovery hashed each small checkpoint with 64 MiB buffers zeroed per thread
(12 checkpoints: 0.9 s, now 10 ms); a run's pull waited before the slot's next launch (now after it); staging
took three round trips (probe, rsync, touch; now one rsync whose remote command writes the marker); a launched
run got a first-look probe before its long poll (now the long poll at once); the long poll looked every 0.1 s
(now it also wakes the moment the run's leader exits: a pidfd); the report's plotting modules loaded after the
last run (now during the sweep). Then: plots.png (~0.9 s of Agg drawing) is drawn by a plot worker, a second
process started with the first followed run (orchestrator/render/plotworker.py), while report.html's five SVGs
(~0.8 s) are drawn here: the report halves where a core is free, and gains nothing when the machine's two cores
are taken by other suites (the last row's slowest `after`); each run's bootstraps are computed as it is pulled
(the report's `build_report` was ~0.25 s after the last run). Then: a slot's long poll on its run also starts
the slot's next (staged) run the moment the run ends, in the same SSH command (Backend.wait_then_submit,
the SSH backend's WAIT_THEN_SUBMIT: runstate.py's `wait-over` exits 10 only when status.json says the run
ended and its group is gone, and only then does the launch script run): three SSH sessions a checkpoint
instead of four, `per cycle` halved.

Then (2026-12-02, second round): the plots have fixed margins in inches instead of constrained layout (which
measured every text twice: the report's five SVGs 0.48-0.60 s -> 0.25-0.35 s, plots.png 0.56-0.60 s ->
0.35-0.43 s alone; tests/test_plots.py holds that nothing drawn leaves its figure or meets a neighbour) and the
DDTree panel's budgets are plain numbers (16 ... 512; its mathtext 2^k ticks were ~40% of that panel):
`report` 0.55-0.65 s -> 0.32-0.39 s. The long poll that sees a run end brings its contract files in the same
answer (a base64 tar after the next launch's answer, up to 4 MiB; backends/ssh.py): a checkpoint costs two
SSH sessions (staging, long poll + launch + files) instead of three, and the slot's last run is pulled by its
long poll too, so `end` lost a session (0.16-0.18 s -> 0.07-0.09 s with the login rc); where sessions are
cheap (skip) it is within the noise. The test harness's sessions skip ~/.bashrc (see above).

What is left (reval's own overhead, sessions without ~/.bashrc: 0.46-0.57 s, around the 0.5 s target; with
root's ~/.bashrc here 0.68-0.73 s). `per cycle` (0.2-0.28 s; a third of the headline; `on the host`, from one
eval's last event to the next one's first: 0.16-0.17 s at load ~0.3) is now almost all Python starting on
the host, on the critical path from one run's last event to the next one's first: the
long poll notices the end (~0.04 s: the wrapper records it, then exits), the launch starts the wrapper
(python -m remote_payload wrap: ~0.07-0.13 s until its status.json), the wrapper starts the payload (~0.1 s
until the dummy's first event; a real eval imports torch there), while the slot's staging and the other slots'
cycles share the 2 cores; what the controller does after the launch's answer is off that path. Shortening it
means a lighter wrapper start (its imports: remote_payload.contract.gpus ~14 ms, the site's editable-install
finder ~17 ms in this venv) or a wrapper started ahead that waits for the slot's run to end: payload work, not
the sweep's. `start` (0.6-0.7 s; 1.2-1.3 s with the login rc, its four sessions: probe, payload rsync, staging,
launch) counts once per slot: hosts ready ~0.35-0.47 s (the ControlMaster's key exchange, the probe's python,
the payload rsync), then staging and launch. `report` (0.32-0.39 s) is plots.png in the plot worker beside the
five SVGs here, each ~0.3 s of matplotlib drawing.

Tried and reverted (8097696, reverted in 0295a91): a slot's first run started by its checkpoint's copy (the
staging rsync's remote command launching the run, for local checkpoints <= 64 MiB). Interleaved with its parent,
5 runs each at load 0.35-1.2: login rc 0.64-0.85 -> 0.61-0.74 s (start 1.15-1.50 -> 1.06-1.31 s), skip
0.47-0.53 -> 0.47-0.54 s (no gain). Real checkpoints (GBs) would never take that path, it changed what a cut
means for the slot's first job (kept on its host until the next sweep instead of handed to another), and it was
~350 lines: a benchmark-only gain, not worth that. Also measured and dropped: planning before the hosts are
ready and copying each host's first checkpoint beside its payload push (skip 0.45-0.47 vs 0.43-0.46 s; the
sessions are CPU-bound on this 2-core machine, and the real eval's cache fingerprint, part of the ledger key,
is only known after the sync).
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
                                      payload="dummy", eval_args=["--lines", str(lines), "--interval-s", "0.1"],
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
