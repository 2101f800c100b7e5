"""`python -m remote_payload dummy --run-dir D --lines N --interval-s S [--exit-code K] [--crash]`

A torch-free stand-in for `eval` (a test seam): it prints progress lines in the seeds' style, appends
events.jsonl (stage, i, n) and, when it ends well, writes a small schema-valid results.json.
"""
from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from remote_payload.contract import protocol
from remote_payload.contract.results import Result

BLOCK_SIZE = 16


def add_arguments(p) -> None:
    p.add_argument("--run-dir", required=True)
    p.add_argument("--lines", type=int, default=10, help="progress lines (one per fake prompt)")
    p.add_argument("--interval-s", type=float, default=0.1, help="pause between lines")
    p.add_argument("--exit-code", type=int, default=0, help="exit with this code at the end (no results.json)")
    p.add_argument("--crash", action="store_true", help="raise an exception halfway (a crashing payload)")
    p.add_argument("--suspect", action="store_true", help="results flagged suspect (what a broken load looks like)")
    p.add_argument("--suite", action="append", default=[], metavar="NAME",
                   help="split the prompts into benchmark suites (results.json `suites` + `suite_mean`); repeatable")


SUSPECT_REASON = "position-1 accuracy 0.000 over 30 blocks (dummy)"


def fake_results(run: str, n: int, suspect: bool = False) -> dict:
    """A results.json (docs/results.md) whose numbers are made up but consistent: tau = streak + 1."""
    lengths = [[(i + r) % BLOCK_SIZE + 1 for r in range(3)] for i in range(n)]
    taus = [sum(ls) / len(ls) for ls in lengths]
    tau = sum(taus) / max(n, 1)
    pooled = sum(map(sum, lengths)) / max(sum(map(len, lengths)), 1)
    hist = [0] * (BLOCK_SIZE + 1)
    for ls in lengths:
        for a in ls:
            hist[a] += 1
    rounds = sum(hist)
    uncond = [sum(hist[k + 1:]) / max(rounds, 1) for k in range(1, BLOCK_SIZE)]
    cond = [uncond[0]] + [uncond[k] / uncond[k - 1] if uncond[k - 1] else 0.0 for k in range(1, BLOCK_SIZE - 1)]
    pos_acc = [round(0.9 ** k, 4) for k in range(1, BLOCK_SIZE)]
    comp = {"cache_fingerprint": "sha256:dummy", "prompt_set": "sha256:dummy", "num_prompts": n,
            "max_blocks": 3, "block_size": BLOCK_SIZE, "metrics_version": protocol.METRICS_VERSION}
    return Result.from_dict({
        "schema": protocol.RESULTS_SCHEMA, "run": run, "created_at": protocol.now_iso(),
        "drafter": {"path": "dummy", "name": "dummy", "layout": "pt", "step": None, "content_hash": "sha256:dummy",
                    "target_layer_ids": [1], "fc_layer_ids": [1], "num_parameters": 0},
        "target": {"path": "dummy", "embed_key": "model.embed_tokens.weight", "lm_head_key": None},
        "cache": {"path": "dummy", "fingerprint": "sha256:dummy", "layer_ids": [1], "num_prompts_total": n},
        "options": {"num_prompts": n, "max_blocks": 3, "block_size": BLOCK_SIZE, "ddtree_budgets": [16],
                    "tree_widths": [4, 8], "device": "cpu", "dtype": "float32", "batch_size": 1, "strict": False},
        "comparability": comp,
        "definitions": {"tau": "mean acceptance length incl. bonus token, macro-averaged over prompts",
                        "streak": "tau - 1 (accepted drafts, bonus excluded)", "note": "dummy payload: fake"},
        "metrics": {"tau": tau, "tau_pooled": pooled, "streak": tau - 1, "streak_pooled": pooled - 1,
                    "num_prompts": n, "num_rounds": rounds, "num_anchors": rounds * BLOCK_SIZE,
                    "acceptance_histogram": hist, "per_position_acceptance_unconditional": uncond,
                    "per_position_acceptance_conditional": cond, "position_accuracy": pos_acc,
                    "position_1_accuracy": pos_acc[0], "ddtree_tau": {"16": tau + 1},
                    "ddtree_best": {"budget": 16, "tau": tau + 1}, "tree_width_tau": {"4": tau + 0.5, "8": tau + 1}},
        "per_prompt": [{"name": f"prompt{i}", "prompt_len": 8, "seq_len": 8 + sum(ls), "acceptance_lengths": ls,
                        "tau": t} for i, (ls, t) in enumerate(zip(lengths, taus))],
        "health": {"suspect": suspect, "reasons": [SUSPECT_REASON] if suspect else []},
        "timing": {"load_s": 0.0, "eval_s": 0.0, "anchors_per_s": 0.0, "total_s": 0.0},
        "environment": {"torch": None, "cuda": None, "gpu": None, "hostname": socket.gethostname()},
    }).to_dict()


def with_suites(res: dict, names: list[str]) -> dict:
    """The results split into suites: consecutive prompt ranges, each suite's tau over its own prompts."""
    pp, k = res["per_prompt"], len(names)
    bounds = [len(pp) * i // k for i in range(k + 1)]
    suites = []
    for i, name in enumerate(names):
        a, b = bounds[i], bounds[i + 1]
        for p in pp[a:b]:
            p["name"] = f"{name}/{p['name']}"
        tau = sum(p["tau"] for p in pp[a:b]) / max(b - a, 1)
        metrics = {**res["metrics"], "tau": tau, "streak": tau - 1, "num_prompts": b - a}
        suites.append({"name": name, "cache": {**res["cache"], "path": f"dummy/{name}"},
                       "comparability": {**res["comparability"], "num_prompts": b - a}, "metrics": metrics,
                       "prompt_range": [a, b]})
    taus = [s["metrics"]["tau"] for s in suites]
    mean = sum(taus) / len(taus)
    res["suites"] = suites
    res["suite_mean"] = {"num_suites": k, "tau": mean, "streak": mean - 1,
                         "position_1_accuracy": res["metrics"]["position_1_accuracy"],
                         "ddtree_tau": dict(res["metrics"]["ddtree_tau"])}
    return Result.from_dict(res).to_dict()


def main(args) -> int:
    run_dir = Path(args.run_dir)
    events = run_dir / protocol.EVENTS_JSONL
    n = args.lines
    print("[1/3] Loading tokenizer... vocab_size=1000")
    protocol.append_event(events, {"stage": "load", "i": 0, "n": n, "message": "loading"})
    print(f"[2/3] Loading cached completions... Loaded {n} cached completions")
    print("[3/3] Evaluating")
    for i in range(1, n + 1):
        time.sleep(args.interval_s)
        if args.crash and i > n // 2:
            raise RuntimeError(f"dummy crash at prompt {i} of {n}")
        print(f"      [{i}/{n}] prompt{i}: {500 + i} tokens aux_mean=0.0084 aux_std=0.9981")
        protocol.append_event(events, {"stage": "eval", "i": i, "n": n, "message": f"prompt{i}"})
    if args.exit_code:
        print(f"dummy: exiting with {args.exit_code}", file=sys.stderr)
        return args.exit_code
    if args.suspect:
        print(f"warning: SUSPECT RESULT — {SUSPECT_REASON}", file=sys.stderr)
    res = fake_results(run_dir.name, n, args.suspect)
    if args.suite:
        res = with_suites(res, args.suite)
    protocol.atomic_write_json(run_dir / protocol.RESULTS_JSON, res)
    protocol.append_event(events, {"stage": "done", "i": n, "n": n, "message": "results.json written"})
    print(f"done: tau {fake_results(run_dir.name, n)['metrics']['tau']:.2f}")
    return 0
