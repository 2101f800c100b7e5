"""`reval compare RUN... [--baseline RUN]`: rank pulled runs side by side (offline), optionally pulling first."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import reval
from orchestrator.render import formats, speedup, suites, tables


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare pulled runs: tau, streak, DDTree, position accuracy",
                       description="Compare pulled runs (runs/<host>/<run>/) side by side. RUN is a name, "
                                   "HOST/NAME or a path. Refuses to rank runs that are not comparable.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="runs to compare: NAME, HOST/NAME, a run folder, or a "
                                                         "quoted glob over the pulled runs ('step-*', by step)")
    p.add_argument("--baseline", metavar="RUN", help="show every metric also as ratio and delta against RUN "
                                                     "(a glob must match one run)")
    p.add_argument("--per-position", action="store_true", help="add per-position acceptance/accuracy tables")
    p.add_argument("--per-prompt", action="store_true", help="add a per-prompt tau table")
    p.add_argument("--by", choices=("run", "suite"), default="run",
                   help="suite: the papers' layout for runs evaluated over several caches (--cache NAME=PATH): "
                        "rows = runs, columns = suites matched by name (tau [95%% CI]) and the mean over "
                        "suites; with --baseline each suite's Δ tau, paired by prompt")
    p.add_argument("--format", choices=("table", "md", "csv", "json"), default="table",
                   help="table (fits 100 columns; --wide: every column), md, csv or json (every value, with "
                        "95%% intervals, SD, n and the paired comparison)")
    p.add_argument("--json", action="store_const", const="json", dest="format",
                   help="the same as --format json (as llm and sqlite-utils spell it)")
    p.add_argument("--wide", action="store_true",
                   help="every column (tau pooled, streak, each DDTree budget, width-k trees, host, step, "
                        "...), not only the headline ones, and, where runs measured --speedup, the projected "
                        "speedup at each batch size per method, best or within noise (≈) marked (--by run)")
    p.add_argument("--threshold", type=float, default=0.1, metavar="TAU",
                   help="the tau change that matters: how many prompts would detect it (default 0.1)")
    p.add_argument("--html", metavar="FILE.html", help="write a self-contained HTML report (tables, plots, "
                                                       "definitions, provenance; no network needed to view it)")
    p.add_argument("--plot", metavar="FILE", help="write acceptance curves, histogram and DDTree plots "
                                                  "(.png, .svg or .pdf)")
    p.add_argument("--allow-incomparable", action="store_true",
                   help="show runs that differ in cache/prompts/max-blocks/metrics anyway (marked, not ranked)")
    p.add_argument("--pull", action="store_true", help="pull the runs from their hosts first (HOST/NAME or NAME)")
    p.add_argument("--runs-dir", default=None, metavar="DIR",
                   help="where pulled runs live, and where --pull puts them (default: $REVAL_RUNS_DIR or ./runs)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.by == "suite" and args.wide:
        raise reval.Error("--wide widens the per-run table; --by suite shows every suite already",
                          hint="drop --wide, or use --by run --wide for every per-run column")
    if args.pull:  # into --runs-dir: the pulls, the lookups and the comparison all read that one folder
        for spec in list(args.runs) + ([args.baseline] if args.baseline else []):
            print(f"pulled  {pull_spec(args.inventory, spec, args.runs_dir)}", file=sys.stderr)
    found = reval.compare(args.runs, baseline=args.baseline, allow_incomparable=args.allow_incomparable,
                          by=args.by, runs_dir=args.runs_dir)
    cmp = found.model  # what the tables are drawn from
    if args.by == "suite":  # the suite table's cells carry the paired Δ (csv); text and md add its table
        main_t, paired_t = suites.suite_table(cmp), suites.suite_paired_table(cmp)
    else:
        main_t, paired_t = tables.main_table(cmp, args.threshold), tables.paired_table(cmp, args.threshold)
    extra = tables.per_position_tables(cmp) if args.per_position else []
    batch_t = speedup.batch_table(cmp) if args.wide else None
    if batch_t is not None:  # --speedup's projection at every batch measured, a row per run and method
        extra.insert(0, batch_t)
    if args.per_prompt:
        extra.append(tables.per_prompt_table(cmp))
    if args.plot:
        print(f"plot    {found.save_plot(args.plot)}", file=sys.stderr)
    if args.html:
        print(f"html    {found.write_html(args.html, threshold=args.threshold)}", file=sys.stderr)
    if args.format == "json" and args.by == "suite":
        sys.stdout.write(formats.render_json(found.by_suite))
    elif args.format == "json":
        sys.stdout.write(formats.render_json(tables.comparison_json(cmp, args.per_position, args.per_prompt)))
    elif args.format == "md":
        sys.stdout.write(formats.render_markdown([main_t] + ([paired_t] if paired_t else []) + extra))
    elif args.format == "csv":  # the main table's cells carry the paired comparison: one CSV block per table
        sys.stdout.write(formats.render_csv([main_t] + extra))
    else:
        formats.print_tables([main_t] + ([paired_t] if paired_t else []) + extra, wide=args.wide)
    return 0


def pull_spec(inventory_path: str | None, spec: str, runs_dir: str | None = None) -> str:
    """Pull one RUN (HOST/NAME, or a NAME found on one host) into runs/<host>/<name>/; a path is left as is."""
    if "/" in spec and Path(spec).is_dir():
        return f"{spec} (a local folder: not pulled)"
    if reval.is_run_glob(spec):
        return f"{spec} (a glob: the runs pulled here that match it; not pulled)"
    p = reval.find(spec, inventory=inventory_path, runs_dir=runs_dir).pull()
    return f"{p.host}/{p.name} -> {p.path}/"
