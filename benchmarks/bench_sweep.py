"""Sweep overhead per checkpoint beyond the eval itself (discover, hash, schedule, stage, launch, follow, pull,
ledger, report), over real sshd hosts on loopback with `python -m remote_payload dummy` as the eval.

    scripts/netns-run .venv/bin/python -m benchmarks.bench_sweep [--hosts 3] [--checkpoints 12] [--eval-s 3]

Each host is a CPU host (one run at a time), so the ideal sweep takes ceil(checkpoints / hosts) x eval-s;
overhead per checkpoint = (wall x hosts - checkpoints x eval-s) / checkpoints. Target: under 2 s, and
under 10% of the total when each eval takes a minute. Needs root + the private netns (sshd on 127.0.0.x).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from orchestrator import sweep
from orchestrator.inventory import load_inventory
from orchestrator.transport import close_all


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--checkpoints", type=int, default=12)
    p.add_argument("--eval-s", type=float, default=3.0, help="how long each dummy eval runs")
    p.add_argument("--poll-s", type=float, default=10.0, help="the sweep's long-poll limit (CLI default 10)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests import sshd  # the same real-sshd harness as the tests

    why = sshd.netns_skip_reason()
    if why:
        print(f"bench_sweep: skipped: {why}", file=sys.stderr)
        return 3
    with tempfile.TemporaryDirectory(prefix="reval-bench-sweep-") as tmp:
        root = Path(tmp)
        cluster = sshd.make_ssh_hosts(root / "sshd", args.hosts)
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
            t0 = time.perf_counter()
            rep = sweep.Sweep(opts, load_inventory(cluster.inventory_path)).run()
            sweep.write_report_files(rep)
            wall = time.perf_counter() - t0
            t1 = time.perf_counter()
            rep2 = sweep.Sweep(opts, load_inventory(cluster.inventory_path)).run()  # all skipped
            rerun = time.perf_counter() - t1
        finally:
            os.chdir(cwd)
            close_all()
            cluster.close()
    n, h, eval_s = args.checkpoints, args.hosts, lines * 0.1
    ok = sum(o.state == "succeeded" for o in rep.outcomes)
    overhead = (wall * h - n * eval_s) / n
    share_60 = overhead / (60 + overhead)
    res = {"hosts": h, "checkpoints": n, "succeeded": ok, "eval_s": eval_s, "poll_s": args.poll_s,
           "wall_s": round(wall, 2), "ideal_s": round(math.ceil(n / h) * eval_s, 2),
           "overhead_per_checkpoint_s": round(overhead, 3), "overhead_share_at_60s_eval": round(share_60, 4),
           "rerun_all_skipped_s": round(rerun, 2), "rerun_skipped": sum(o.state == "skipped" for o in rep2.outcomes)}
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"sweep   {n} checkpoints on {h} loopback sshd hosts · dummy eval {eval_s:.1f}s · poll {args.poll_s}s")
        print(f"wall    {wall:.2f}s (ideal {res['ideal_s']:.1f}s) · {ok}/{n} succeeded")
        print(f"overhead {overhead:.2f}s per checkpoint (target < 2 s) · {share_60:.1%} of the total at 60 s evals "
              "(target < 10%)")
        print(f"re-run  {rerun:.2f}s with all {res['rerun_skipped']} skipped by the ledger")
    return 0 if ok == n else 1


if __name__ == "__main__":
    sys.exit(main())
