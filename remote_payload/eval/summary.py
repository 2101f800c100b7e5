"""The end of an eval on screen and in results.json: the health guard (a result that looks like a broken
load is flagged suspect), the headline numbers (the last event) and the summary table."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from remote_payload.contract.errors import PayloadError
from remote_payload.eval import metrics

# Health guards (the seeds' harness printed "Loaded" and then drafted gibberish at 0.000 accuracy).
SUSPECT_POS1_ACCURACY = 0.05
SUSPECT_DRAFT_SHARE = 0.5


def assess_health(m: dict, drafts: np.ndarray, targets: np.ndarray, tok, rep) -> dict:
    """Flag results that look like a broken load rather than a weak drafter (loud warning + reasons)."""
    reasons, hints = [], []
    pos1 = m.get("position_1_accuracy")
    if pos1 is not None and pos1 < SUSPECT_POS1_ACCURACY:
        reasons.append(f"position-1 accuracy {pos1:.3f} over {m['num_anchors']} anchors")
    degenerate, token, share = metrics.degenerate_drafts(drafts, SUSPECT_DRAFT_SHARE)
    valid = targets[targets >= 0]
    target_share = float((valid == token).mean()) if valid.size and token is not None else 0.0
    if degenerate and share > 2 * target_share:  # the target itself does not repeat that token
        reasons.append(f"drafts repeat one token ({decode(tok, [token])!r}, {share:.0%} of drafts vs "
                       f"{target_share:.0%} of target tokens)")
    if reasons:
        hints.append("weights loaded but the drafts look like gibberish: check weight key paths, the target "
                     "(embed_tokens/lm_head) and dtypes")
        rep.line(f"\nwarning: SUSPECT RESULT — {'; '.join(reasons)}.\n         {hints[0]}. "
                 "results.json marked suspect.", stage="suspect")
    return {"suspect": bool(reasons), "reasons": reasons, "hints": hints,
            "top_draft_token": {"id": token, "share": share, "target_share": target_share}}


def load_tokenizer(target: str):
    """The target folder's tokenizer.json, read by a helper process beside the weight load (tokproc.py: it
    answers get_vocab_size() and decode() as a tokenizers.Tokenizer), or None (tokens are then shown as ids)."""
    path = Path(target) / "tokenizer.json"
    if not path.exists():
        return None
    if not path.is_file():  # a FIFO would hold the helper's read until its timeout, /dev/zero never end it
        raise PayloadError(f"{path} is not a regular file: replace it with the target's tokenizer.json or remove "
                           "it (without it, tokens are shown as ids)")
    from remote_payload.eval.tokproc import TokenizerProcess
    return TokenizerProcess(path)


def decode(tok, ids) -> str:
    ids = [int(i) for i in ids if int(i) >= 0]
    if tok is None:
        return " ".join(map(str, ids))
    return tok.decode(ids, skip_special_tokens=False)


def fmt(x, nd=3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def headline(results: dict) -> dict:
    m = results["metrics"]
    return {"tau": m["tau"], "streak": m["streak"], "ddtree_best": m.get("ddtree_best"),
            "tree_width_tau": m.get("tree_width_tau"), "position_1_accuracy": m["position_1_accuracy"],
            "num_rounds": m["num_rounds"], "num_prompts": m["num_prompts"],
            "suspect": results["health"]["suspect"]}


def speedup_rows(sp: dict) -> list[tuple[str, str]]:
    """The summary's --speedup rows (projection.py: the figures, the best per batch or the tied methods)."""
    from remote_payload.eval.projection import summary_rows
    return summary_rows(sp)


def _count(x) -> str:
    """A count: as is; an expected count (sampled drafts) to one decimal."""
    return str(x) if isinstance(x, int) or float(x).is_integer() else f"{x:.1f}"


def _regime(r: dict, m: dict) -> str:
    return (f"T={r['temperature']:g} top_k={r['top_k']} top_p={r['top_p']:g} seed={r['seed']}, {r['samples']} "
            f"samples a prompt ({m.get('num_samples')} completions), draft {r['draft']}"
            + (" (exact expectations; DDTree left out)" if r["draft"] == "sampled" else ""))


def _online(o: dict) -> str:
    runs = [x for x in o.get("measured_speedup_runs") or [] if x is not None]
    spread = f" (median of {len(runs)} timed runs, {min(runs):.2f}-{max(runs):.2f}x)" if len(runs) > 1 else ""
    speed = f"measured speedup {fmt(o['measured_speedup'], 2)}x{spread}"
    if not o.get("regime"):
        return f"{o['rounds_agreeing']}/{o['rounds']} rounds = offline · {speed}"
    ci = (lambda x: "" if not x else f" [{x[0]:.2f}, {x[1]:.2f}]")
    return (f"tau {fmt(o['tau_online'], 2)}{ci(o['tau_online_ci'])} online ({o['regime']['seeds']} seeds) vs "
            f"{fmt(o['tau_offline'], 2)}{ci(o['tau_offline_ci'])} offline · {speed}")


def print_summary(results: dict) -> None:
    m, o = results["metrics"], results["options"]
    rows = [("tau (incl. bonus, macro)", fmt(m["tau"], 2)), ("tau pooled", fmt(m["tau_pooled"], 2)),
            ("streak (excl. bonus)", fmt(m["streak"], 2))]
    rows += [(f"DDTree-{b} tau", fmt(v, 2)) for b, v in m["ddtree_tau"].items()]
    rows += [(f"width-{w} tree tau", fmt(v, 2)) for w, v in m["tree_width_tau"].items()]
    rows += [("position-1 accuracy", fmt(m["position_1_accuracy"])),
             (f"position accuracy k=1..{o['block_size'] - 1}", " ".join(fmt(x, 2) for x in m["position_accuracy"])),
             (f"acceptance histogram 1..{o['block_size']}",
              " ".join(_count(x) for x in m["acceptance_histogram"][1:])),
             ("rounds / prompts / anchors", f"{_count(m['num_rounds'])} / {m['num_prompts']} / {m['num_anchors']}"),
             *([("regime", _regime(results["regime"], m))] if (results.get("regime") or {}).get("seed") is not None
               else []),
             ("max blocks", str(o["max_blocks"])),
             ("attention", (results["comparability"].get("attention") or "n/a").replace("_attention", "")),
             *[(f"suite {x['name']} tau", f"{fmt(x['metrics']['tau'], 2)} ({x['metrics']['num_prompts']} prompts)")
               for x in results.get("suites") or []],
             *([("tau, mean over suites", fmt(results["suite_mean"]["tau"], 2))] if results.get("suite_mean") else []),
             *(speedup_rows(results["speedup"]) if results.get("speedup") else []),
             *([(f"online ({results['online'].get('method') or 'block'})", _online(results["online"]))]
               if results.get("online") else []),
             ("load / eval", f"{results['timing']['load_s']:.2f}s / {results['timing']['eval_s']:.2f}s"),
             ("suspect", "YES: " + "; ".join(results["health"]["reasons"]) if results["health"]["suspect"] else "no")]
    w = max(len(k) for k, _ in rows)
    print("\n" + "=" * 70)
    print(f"Summary: {results['run']}")
    print("=" * 70)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    print("=" * 70, flush=True)
