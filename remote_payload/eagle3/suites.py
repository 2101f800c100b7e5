"""Several suites in one EAGLE-3 eval: `eval --drafter EAGLE3 --cache g=GREEDY --cache t1=SAMPLED`.

The DFlash eval's several-suite assembly (eval/run.evaluate_suites, with eval/suiteregimes.py's regimes) with the
EAGLE-3 steps (`STEPS`): the head and the target's embedding loaded once, with the first suite's cache; every
later suite's cache checked for the head's three taps (evaluate.resolve_taps, exit 3 naming the suite); each suite
drafted and walked as a one-cache eval of it would be (evaluate.draft_prompts: the chain or the tree, in its
cache's regime: --draft on a sampled cache, greedy on a greedy one); results.json's suites[] with each suite's
regime and comparability, and drafter.eagle3 as a one-cache run records it.
"""
from __future__ import annotations

import dataclasses

import torch

from remote_payload.contract.errors import PayloadError
from remote_payload.eagle3.evaluate import draft_prompts, finish_results, load_head, prepare, resolve_taps
from remote_payload.eval import run
from remote_payload.eval.evalopts import EvalOptions
from remote_payload.eval.steps import Inputs, Loaded, Reporter, feature_pass
from remote_payload.eval.summary import load_tokenizer


def _features(so: EvalOptions, rep: Reporter, tok, cache, prompts, mod: Loaded | None, device, dtype):
    """A suite's features; the head loaded with the first suite's cache, later caches checked for its taps."""
    if mod is not None:
        resolve_taps(mod.drafter.head.cfg, so.target, cache)  # FeatureMismatchError: run.py names the suite
        return Inputs(tok, cache, prompts, feature_pass(so, cache, prompts, rep)), mod
    inp = Inputs(tok, cache, prompts, feature_pass(so, cache, prompts, rep))
    mod, record = load_head(so, inp, device, dtype, rep)
    mod.drafter.record = record
    return inp, mod


def _draft(so: EvalOptions, inp: Inputs, mod: Loaded, device, dtype, rep: Reporter):
    with torch.no_grad():
        return draft_prompts(so, inp, mod, device, dtype, rep)


def _no_trees(o: EvalOptions) -> EvalOptions:
    """The options results.json records: no DDTree or width-k trees (EAGLE's own tree is --eagle-tree)."""
    return dataclasses.replace(o, ddtree_budgets=[], tree_widths=[])


def _no_target_checks(opts, results, mod, inp, device, dtype, rep) -> None:
    """--online / --speedup never reach here (evaluate_suites refuses them with suites)."""


STEPS = run.SuiteSteps(features=_features, draft=_draft, record_opts=_no_trees,
                   finish=lambda results, mod: finish_results(results, mod.drafter.record), checks=_no_target_checks)


def evaluate_suites(opts: EvalOptions, rep: Reporter) -> dict:
    """results.json's dict of an EAGLE-3 eval over several suites (module doc; family.py sends `--cache NAME=PATH`
    repeated here, one cache to evaluate.evaluate)."""
    t0, device, dtype = prepare(opts, rep)
    for flag, on in (("--online", opts.online), ("--speedup", opts.speedup)):
        if on:
            raise PayloadError(f"{flag} with several suites (--cache NAME=PATH) is not implemented for EAGLE-3 "
                               "drafters; run it on one suite's cache")
    tok = load_tokenizer(opts.target)
    try:
        return run.evaluate_suites(opts, rep, device, dtype, t0, tok, steps=STEPS)
    finally:
        if tok is not None:
            tok.close()
