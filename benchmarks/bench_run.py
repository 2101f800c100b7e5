"""Benchmarks of the run path, for benchmarks.bench's table (BENCHES += RUN_BENCHES):

- live-progress latency: a line appended to eval.log on the server -> handed to the follower's sink, over a
  real sshd on loopback; median over ~50 lines (target: under 0.5 s);
- `reval run` overhead on the `local` host over running the same payload directly (target: under +1 s);
- `reval run --prompts` with its cache in the host's store vs the same eval on `--cache` (target: under +1.5 s).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness import BenchContext, Row, median_s
from orchestrator.hosts import transport as transport_mod
from orchestrator.hosts.inventory import load_inventory
from orchestrator.hosts.sync import sync_payload
from orchestrator.rundir.follow import follow
from remote_payload.contract import protocol
from reval.cli.display import PlainSink

LATENCY_LINES = 50


class _Stamps(PlainSink):
    """Records (line, arrival time) pairs."""

    def __init__(self):
        self.got: list[tuple[str, float]] = []

    def line(self, text: str) -> None:
        self.got.append((text, time.time()))

    def note(self, text: str) -> None:
        pass


def bench_live_latency(ctx: BenchContext) -> list[Row]:
    c = ctx.ssh_hosts(1)
    host = load_inventory(c.inventory_path).get("ssh1")
    t = transport_mod.get_transport(host)
    sync_payload(t, host)
    run_dir = c.hosts[0].workdir / "runs" / "latency"
    run_dir.mkdir(parents=True)
    # A live process group for the run (the "payload"), so the follower sees a running run.
    holder = subprocess.Popen(["sleep", "600"], start_new_session=True)
    protocol.atomic_write_json(run_dir / "status.json", {"state": "running", "pid": holder.pid, "pgid": holder.pid,
                                                         "started_at": protocol.now_iso()})
    sink, done = _Stamps(), threading.Event()
    th = threading.Thread(target=lambda: (follow(t, "latency", workdir=str(c.hosts[0].workdir),
                                                 python=host.python, sink=sink, save=False), done.set()))
    th.start()
    try:
        time.sleep(1.0)  # connected and streaming
        with open(run_dir / "eval.log", "a", encoding="utf-8") as f:
            for i in range(LATENCY_LINES):
                f.write(f"line {i} written_at {time.time():.6f}\n")
                f.flush()
                time.sleep(0.1 + (i % 7) * 0.013)  # not in step with the server's poll
        protocol.atomic_write_json(run_dir / "status.json", {"state": "succeeded", "pid": holder.pid,
                                                             "pgid": holder.pid, "exit_code": 0})
        th.join(60)
    finally:
        holder.kill()
        holder.wait()
    lat = [arrived - float(text.rsplit(" ", 1)[1]) for text, arrived in sink.got if "written_at" in text]
    assert len(lat) == LATENCY_LINES and done.is_set(), f"follower got {len(lat)} of {LATENCY_LINES} lines"
    return [Row(f"live-progress latency (median of {LATENCY_LINES} lines)", statistics.median(lat), 0.5,
                "the 0.5 s target", 1.0)]


def bench_run_overhead(ctx: BenchContext) -> list[Row]:
    cwd = Path(tempfile.mkdtemp(dir=ctx.root))
    env = {k: v for k, v in os.environ.items() if k not in ("REVAL_HOSTS", "REVAL_RUNS_DIR")}
    reval = [sys.executable, "-m", "reval"]
    payload = ["--lines", "5", "--interval-s", "0.05"]
    n = iter(range(10_000))

    def ours():
        subprocess.run([*reval, "run", "local", "--payload", "dummy", "--name", f"o{next(n)}", "--", *payload],
                       cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL)

    def direct():
        d = cwd / "direct" / f"d{next(n)}"
        d.mkdir(parents=True)
        subprocess.run([sys.executable, "-m", "remote_payload", "dummy", "--run-dir", str(d), *payload],
                       cwd=cwd / ".reval/local/payload", env=env, check=True, stdout=subprocess.DEVNULL)

    ours()  # first sync of the payload, outside the timing
    ours_s, direct_s = median_s(ours, ctx.repeat), median_s(direct, ctx.repeat)
    return [Row("reval run on local vs payload directly", ours_s, direct_s, "the payload run directly (+1 s)",
                (direct_s + 1.0) / direct_s)]


def bench_prompts_reuse(ctx: BenchContext) -> list[Row]:
    """`reval run --prompts` whose cache is in the host's store (the prompt file's look, the plan) vs the same
    eval given `--cache PATH`: the reuse path's cost (target: under +1.5 s). The tiny trained fixtures
    (.cache/fixtures, built when missing), 2 prompts; the cache is built once, outside the timing."""
    root = Path(__file__).resolve().parents[1]
    fx = root / ".cache" / "fixtures"
    env = {k: v for k, v in os.environ.items() if k not in ("REVAL_HOSTS", "REVAL_RUNS_DIR")}
    subprocess.run([sys.executable, "-m", "remote_payload", "fixtures", "--out", str(fx)], env=env, check=True,
                   stdout=subprocess.DEVNULL)  # reused while its recipe holds
    cwd = Path(tempfile.mkdtemp(dir=ctx.root))
    prompts = cwd / "two.jsonl"
    prompts.write_text("".join((fx / "prompts.jsonl").read_text().splitlines(keepends=True)[:2]))
    reval = [sys.executable, "-m", "reval", "run", "local", "--drafter", str(fx / "drafter-good"), "--target",
             str(fx / "target"), "--max-blocks", "3"]
    tail = ["--", "--device", "cpu", "--dtype", "fp32"]
    n = iter(range(10_000))

    def run(*how: str) -> None:
        subprocess.run([*reval, *how, "--name", f"p{next(n)}", *tail], cwd=cwd, env=env, check=True,
                       stdout=subprocess.DEVNULL)
    run("--prompts", f"two={prompts}", "--max-new-tokens", "16")  # builds the cache (and syncs): not timed
    key = json.loads((cwd / "runs" / "local" / "p0" / "run.json").read_text())["prompt_caches"]["two"]["key"]
    cache = cwd / ".reval" / "local" / "caches" / key
    ours_s = median_s(lambda: run("--prompts", f"two={prompts}", "--max-new-tokens", "16"), ctx.repeat)
    base_s = median_s(lambda: run("--cache", f"two={cache}"), ctx.repeat)
    return [Row("run --prompts (cache in the store) vs --cache", ours_s, base_s, "the same eval on --cache (+1.5 s)",
                (base_s + 1.5) / base_s)]


def bench_prompts_lookup(ctx: BenchContext) -> list[Row]:
    """The reuse path alone over a real sshd host: a --prompts suite whose cache is in the store resolved to it
    (the prompt file's look, then `extract --plan` in the payload's python) vs one round trip that starts the
    host's python (the floor of any answer from the payload; a bare `ssh true` is ~30 ms here); each
    sample on the open connection. The cache is built once, outside the timing."""
    import reval
    root = Path(__file__).resolve().parents[1]
    fx = root / ".cache" / "fixtures"
    c = ctx.ssh_hosts(1)
    host = load_inventory(c.inventory_path).get("ssh1")
    prompts = Path(tempfile.mkdtemp(dir=ctx.root)) / "two.jsonl"
    prompts.write_text("".join((fx / "prompts.jsonl").read_text().splitlines(keepends=True)[:2]))
    spec = reval.EvalSpec(drafter=str(fx / "drafter-good"), target=str(fx / "target"),
                          prompts=[f"two={prompts}"], max_new_tokens=16)
    prep = reval.prepare(host)
    _, found = reval.resolve_prompts(host, spec, prepared=prep)  # built here (not timed)
    assert found["two"]["built"], found
    t = prep.backend.transport

    def lookup() -> None:
        _, again = reval.resolve_prompts(host, spec, prepared=prep)
        assert not again["two"]["built"]
    def warm(fn) -> float:  # on the connection `reval run` opened already (prepare's probe), as it runs there
        times = []
        for _ in range(ctx.repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    bare = f"{prep.python} -c pass"
    ours_s, base_s = warm(lookup), warm(lambda: t.run(bare))
    return [Row("run --prompts reuse path (look + plan)", ours_s, base_s, "one round trip starting python", 4.0)]


RUN_BENCHES = [bench_live_latency, bench_run_overhead, bench_prompts_reuse, bench_prompts_lookup]
