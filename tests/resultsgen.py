"""Realistic synthetic results.json files (the current schema, remote_payload/contract/results.py) for
compare/sweep tests.

Metrics are derived from generated acceptance walks (so tau, streak, histogram and per-position curves
agree with each other as the payload's would), not typed in by hand."""
from __future__ import annotations

import io
import random
from pathlib import Path

from rich.console import Console

from orchestrator.errors import ConfigError, RunNotFound
from orchestrator.render import formats
from orchestrator.results.compare import load_run
from remote_payload.contract import protocol
from remote_payload.contract import results as R

BLOCK = 16


def _walk(rng: random.Random, p_accept: float, num_blocks: int) -> list[int]:
    """Acceptance lengths incl. bonus (1..16): each draft position accepted with p_accept until a miss."""
    out = []
    for _ in range(num_blocks):
        acc = 0
        while acc < BLOCK - 1 and rng.random() < p_accept:
            acc += 1
        out.append(acc + 1)
    return out


def make_results(run: str, *, quality: float = 0.8, num_prompts: int = 4, max_blocks: int = 12, seed: int = 0,
                 cache_fingerprint: str = "sha256:cafe", prompt_set: str = "sha256:p1", step: int | None = None,
                 suspect: bool = False, metrics_version: str = protocol.METRICS_VERSION,
                 drafter_name: str = "tiny-dflash", total_s: float = 12.5, causal: bool = False) -> dict:
    rng = random.Random(f"{run}-{seed}-{quality}")
    per_prompt, all_lengths = [], []
    budgets = [16, 32, 64, 128, 256, 512]
    for i in range(num_prompts):
        lengths = _walk(rng, quality, max_blocks)
        all_lengths += lengths
        p_tau = sum(lengths) / len(lengths)
        anchors = 20 + sum(lengths)
        hits = [sum(rng.random() < quality ** (0.6 * k) for _ in range(anchors)) for k in range(1, BLOCK)]
        per_prompt.append({"name": f"prompt-{i}", "prompt_len": 20, "seq_len": 20 + sum(lengths),
                           "acceptance_lengths": lengths, "tau": p_tau, "num_anchors": anchors,
                           "position_hits": hits, "position_totals": [anchors] * (BLOCK - 1),
                           "position_accuracy": [h / anchors for h in hits],
                           "ddtree_tau": {str(b): round(p_tau * (1.2 + 0.08 * j), 4) for j, b in enumerate(budgets)},
                           "tree_width_tau": {"4": round(p_tau * 1.3, 4), "8": round(p_tau * 1.45, 4)},
                           "first_block": {"draft": "a b c", "target": "a b d"}})
    tau = sum(p["tau"] for p in per_prompt) / num_prompts
    tau_pooled = sum(all_lengths) / len(all_lengths)
    hist = [0] * (BLOCK + 1)
    for L in all_lengths:
        hist[L] += 1
    accs = [L - 1 for L in all_lengths]
    uncond = [sum(a >= k for a in accs) / len(accs) for k in range(1, BLOCK)]
    cond = [sum(a >= k for a in accs) / max(1, sum(a >= k - 1 for a in accs)) for k in range(1, BLOCK)]
    pos_acc = [sum(p["position_hits"][k] for p in per_prompt) / sum(p["position_totals"][k] for p in per_prompt)
               for k in range(BLOCK - 1)]
    ddtree = {str(b): sum(p["ddtree_tau"][str(b)] for p in per_prompt) / num_prompts for b in budgets}
    widths = {w: sum(p["tree_width_tau"][w] for p in per_prompt) / num_prompts for w in ("4", "8")}
    path = f"/ckpt/step-{step}" if step is not None else f"/models/{drafter_name}"
    attention = [R.LayerAttention(layer=0, type="full_attention", window=None, causal_in_block=causal)]
    return R.Result.from_dict({
        "schema": protocol.RESULTS_SCHEMA, "run": run, "created_at": "2026-11-30T10:00:00Z",
        "drafter": {"path": path, "name": drafter_name, "layout": "zlab", "step": step,
                    "content_hash": f"sha256:{run}", "target_layer_ids": [1, 2], "fc_layer_ids": [1, 2],
                    "num_parameters": 1000, "attention": [a.to_dict() for a in attention]},
        "target": {"path": "/models/target", "embed_key": "model.embed_tokens.weight", "lm_head_key": None},
        "cache": {"path": "/eval/cache", "fingerprint": cache_fingerprint, "layer_ids": [1, 2],
                  "num_prompts_total": num_prompts},
        "options": {"num_prompts": num_prompts, "max_blocks": max_blocks, "block_size": BLOCK,
                    "ddtree_budgets": budgets, "tree_widths": [4, 8], "device": "cpu", "dtype": "float32",
                    "batch_size": 8, "strict": False},
        "comparability": {"cache_fingerprint": cache_fingerprint, "prompt_set": prompt_set,
                          "num_prompts": num_prompts, "max_blocks": max_blocks, "block_size": BLOCK,
                          "metrics_version": metrics_version, "attention": R.attention_signature(attention)},
        "definitions": {"tau": "mean acceptance length incl. bonus token, macro-averaged over prompts"},
        "metrics": {"tau": tau, "tau_pooled": tau_pooled, "streak": tau - 1, "streak_pooled": tau_pooled - 1,
                    "num_prompts": num_prompts, "num_rounds": len(all_lengths),
                    "num_anchors": len(all_lengths) * BLOCK, "acceptance_histogram": hist,
                    "per_position_acceptance_unconditional": uncond, "per_position_acceptance_conditional": cond,
                    "position_accuracy": pos_acc, "position_1_accuracy": pos_acc[0],
                    "ddtree_tau": ddtree, "ddtree_best": {"budget": 512, "tau": ddtree["512"]},
                    "tree_width_tau": widths},
        "per_prompt": per_prompt,
        "health": {"suspect": suspect, "reasons": ["position-1 accuracy 0.000"] if suspect else []},
        "timing": {"load_s": 1.0, "eval_s": total_s - 1.0, "anchors_per_s": 100.0, "total_s": total_s},
        "environment": {"torch": "2.13.0", "cuda": None, "gpu": None, "hostname": "test"},
    }).to_dict()


def write_run(root: Path, host: str, run: str, results: dict | None = None, *, state: str = "succeeded",
              **kw) -> Path:
    """A pulled run dir `root/host/run/` with run.json, status.json and (unless state != succeeded) results."""
    d = Path(root) / host / run
    d.mkdir(parents=True, exist_ok=True)
    protocol.atomic_write_json(d / protocol.RUN_JSON, {"run": run, "host": host, "argv": ["eval"]})
    protocol.atomic_write_json(d / protocol.STATUS_JSON, {
        "state": state, "exit_code": 0 if state == "succeeded" else 1,
        "started_at": "2026-11-30T10:00:00Z", "finished_at": "2026-11-30T10:02:41Z"})
    if state == "succeeded":
        protocol.atomic_write_json(d / protocol.RESULTS_JSON, results or make_results(run, **kw))
    (d / protocol.EVAL_LOG).write_text("log\n")
    return d


# helpers the library does not need: comparison tables as plain text, and a results.json read as its type
def render_text(tables, width: int = 160, wide: bool = False) -> str:
    """Comparison tables rendered by rich to plain text at a fixed width (no colour, no bold)."""
    con = Console(width=width, file=io.StringIO(), color_system=None, force_terminal=False, record=True)
    for t in tables:
        con.print(formats.rich_table(t, wide))
    return con.export_text()


def load_result(path: str | Path) -> R.Result:
    """A results.json, or a run directory holding one, as a typed R.Result (ConfigError naming the
    file and field when it breaks the schema; RunNotFound when there is none)."""
    path = Path(path)
    rec = load_run(path) if path.is_dir() else None
    if rec is not None:
        if rec.result is None:
            raise RunNotFound(f"{path}: no results.json (state {rec.state})", hint="pull it when it has finished")
        return rec.result
    try:
        return R.Result.load(path)
    except FileNotFoundError:
        raise RunNotFound(f"{path}: no such results.json or run directory") from None
    except R.ResultsError as e:
        raise ConfigError(str(e), hint="re-run the eval with this version of reval") from None
