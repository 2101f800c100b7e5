"""`reval demo`: the embedded default, end to end, with no server and no downloads.

On the `local` host of the inventory (the default hosts.yaml has one): sync the payload, build the tiny
offline fixtures there (a synthetic language, a tiny Qwen3 target trained on it, a hidden-state cache,
DFlash drafters trained against it; cached after the first build), then evaluate an early checkpoint and
the final drafter through the `reval` API (the same lifecycle as `reval run`), and compare the two
("checkpoint vs checkpoint", the final drafter as the baseline).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

from ..argparsing import positive_int
from ..errors import EXIT_OK, EvalFailed
from ..transport import q


def register(sub) -> None:
    p = sub.add_parser("demo", help="the embedded default: tiny offline models, two evals on the local host, compare",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="local", help="inventory host to run on (default: local)")
    p.add_argument("--max-blocks", type=positive_int, default=30, help="draft rounds per prompt (default 30)")
    p.add_argument("--early", default=None,
                   help="the early checkpoint to compare (default: the second saved step, drafters/step-*)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="also write the comparison plots")
    p.set_defaults(func=cmd_demo)


def _stream(t, cmd: str) -> int:
    """Run `cmd` on the host, printing its output as it comes (fixture building takes a minute or two)."""
    proc = t.popen(cmd)
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):
        print("  " + line.decode(errors="replace").rstrip(), flush=True)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    rc = proc.wait()
    if rc:
        sys.stderr.write(err[-2000:])
    return rc


def cmd_demo(args) -> int:
    """A thin layer over the `reval` API: reval.submit / Run / reval.compare, the CLI's display on top."""
    import reval

    from .. import compare, report, tables
    from ..backends import get_backend
    from ..backends.ssh import describe, normalize_gpus
    from ..lifecycle import prepare
    from .runs import finish_run, make_sink
    inv = reval.Inventory.load(args.inventory)
    host = inv[args.host]
    t0 = time.monotonic()
    backend = get_backend(host)
    env = prepare(backend).env
    t, workdir = backend.transport, backend.workdir()
    fixtures = f"{workdir}/fixtures"
    print(f"demo    building the tiny fixtures on {host.name} (cached after the first time): {fixtures}")
    rc = _stream(t, f"cd {q(workdir + '/payload')} && PYTHONUNBUFFERED=1 {q(env.python)} -m remote_payload "
                    f"fixtures --out {q(fixtures)} 2>&1")
    if rc:
        raise EvalFailed(f"building the fixtures on {host.name} failed (exit {rc})",
                         hint="see the output above; rerun with: python -m remote_payload fixtures --out DIR")
    meta = json.loads(t.run(f"cat {q(fixtures + '/fixtures.json')}").stdout)
    paths = meta["paths"]
    steps = list(paths["drafters"])  # drafters/step-NNNN in training order
    early = args.early or steps[min(1, len(steps) - 1)]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    results, refs = [], []
    for label, drafter in (("early", early), ("final", paths["drafter_good"])):
        name = f"demo-{label}-{stamp}"
        print(f"\ndemo    eval {label} drafter {drafter} as {name}")
        spec = reval.EvalSpec(drafter=f"{fixtures}/{drafter}", target=f"{fixtures}/{paths['target']}",
                              cache=f"{fixtures}/{paths['cache']}", max_blocks=args.max_blocks)
        run = reval.submit(host, spec, name=name)
        print(f"launch  {describe(run.handle.launch, normalize_gpus(host.gpus))}", flush=True)
        rc = finish_run(run.handle, sink=make_sink())  # the same follow/pull/final line as `reval run`
        if rc != EXIT_OK:
            return rc
        results.append(reval.load(run.handle.local_dir))
        refs.append(run.ref)
    print(f"\ndemo    comparing: reval compare {' '.join(refs)} --baseline {refs[-1]}")
    cmp = reval.compare(results, baseline=results[-1])
    compare.require_comparable(cmp.model)
    paired = tables.paired_table(cmp.model)  # the early checkpoint paired by prompt with the final one
    report.print_tables([tables.main_table(cmp.model)] + ([paired] if paired else []))
    if args.plot:
        from .. import plots  # matplotlib only when asked
        print(f"plot    {plots.save_comparison_plot(cmp.model, args.plot)}", file=sys.stderr)
    print(f"\ndemo    done in {time.monotonic() - t0:.0f}s. Next: reval compare {shlex.join(refs)} --per-position "
          f"--plot demo.png")
    return EXIT_OK
