"""docs/results.md, generated from the results.json schema (remote_payload/contract/results.py):
`python -m remote_payload.tools.results_docs > docs/results.md` (a test fails when the file is stale)."""
from __future__ import annotations

import types
import typing
from dataclasses import MISSING, fields
from typing import Any

from remote_payload.contract.records import _hints, _type_name
from remote_payload.contract.results import (
    SCHEMA,
    CacheInfo,
    Comparability,
    DDTreeBest,
    Drafter,
    Environment,
    ExpectedWalk,
    FirstBlock,
    Health,
    LayerAttention,
    Metrics,
    Online,
    OnlinePrompt,
    Options,
    PromptResult,
    Regime,
    Result,
    SampleResult,
    Speedup,
    Suite,
    SuiteMean,
    SuiteSpeedup,
    Target,
    Timing,
)

_SECTIONS = [(Result, "results.json"), (Drafter, "drafter"), (LayerAttention, "drafter.attention[]"),
             (Target, "target"), (CacheInfo, "cache"), (Options, "options"), (Comparability, "comparability"),
             (Metrics, "metrics"), (DDTreeBest, "metrics.ddtree_best"), (PromptResult, "per_prompt[]"),
             (FirstBlock, "per_prompt[].first_block"), (SampleResult, "per_prompt[].samples[]"),
             (ExpectedWalk, "per_prompt[].samples[].expected"), (Regime, "regime"), (Health, "health"),
             (Timing, "timing"),
             (Environment, "environment"), (Suite, "suites[]"), (SuiteMean, "suite_mean"),
             (Online, "online"), (OnlinePrompt, "online.per_prompt[]"), (Speedup, "speedup"),
             (SuiteSpeedup, "speedup.by_suite[]")]


def markdown() -> str:
    """docs/results.md, generated from the dataclasses above."""
    out = [f"# results.json (schema `{SCHEMA}`)", "",
           "Written once, atomically, by the payload at the end of a successful eval; read back by the orchestrator",
           "through the same classes (`remote_payload/contract/results.py`), and generated from them:",
           "`python -m remote_payload.tools.results_docs > docs/results.md`.", "",
           "- A field marked *required* must be present (its value may still be null where the type allows it);",
           "  a missing one is a one-line error naming the file and the field.",
           "- Unknown fields are kept and ignored, so a newer payload's additions do not break an older reval.",
           "- Files of `reval.results/1` (before per-layer attention was recorded) still load.",
           "- Every metric's exact definition is in the file itself (`definitions`); `tau` includes the bonus",
           "  token, `streak` excludes it. Confidence intervals are not stored: reval computes them from",
           "  `per_prompt` when it compares or reports, so older runs get them too.", ""]
    for cls, title in _SECTIONS:
        out += [f"## `{title}`", "", "| field | type | | meaning |", "|---|---|---|---|"]
        hints = _hints(cls)
        for f in fields(cls):
            if f.metadata.get("internal"):
                continue
            req = "required" if f.default is MISSING and f.default_factory is MISSING else "optional"
            tp = hints[f.name]
            name = next((t for c, t in _SECTIONS if c is _inner(tp)), None)
            shown = f"{_type_name(tp)} (`{name}`)" if name else _type_name(tp)
            out.append(f"| `{f.name}` | {shown} | {req} | {f.metadata['doc']} |")
        out.append("")
    return "\n".join(out)


def _inner(tp: Any) -> Any:
    while typing.get_origin(tp) in (typing.Union, types.UnionType, list):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


if __name__ == "__main__":  # pragma: no cover
    print(markdown(), end="")
