"""`python -m remote_payload eval`: evaluate one drafter on a cache of target hidden states.

    [1/5] tokenizer  [2/5] cached completions  [3/5] cached hidden states  [4/5] drafter + target head
    [5/5] drafting at every anchor, then the walks and metrics (metrics.py) -> results.json

The drafter's output at anchor a depends only on the cached features (< a) and the bonus token g[a], so
the drafter runs ONCE at every anchor the walk could reach (teacher-forced), in large batches over a
prompt's anchors with the prompt's context K/V computed once; every walk (vanilla, DDTree per budget,
width-k) then hops over those per-anchor results. This reproduces online greedy speculative decoding
exactly, and gives position-k accuracy at every anchor for free.

The steps are in steps.py, results.json's assembly in record.py, --speedup and --online in targetchecks.py;
here: the command, and the one-cache and several-suite evals that string them together.

Run directory (protocol.py): events.jsonl as we go, results.json once at the end (atomically), and
status.json only when no wrapper owns it (a standalone run). A PayloadError (bad input) exits 3 with one
line; anything else keeps its traceback and exits 1; nothing half-written either way.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from remote_payload import __version__
from remote_payload.contract import protocol
from remote_payload.contract import results as R
from remote_payload.contract.drafterconfig import check_features
from remote_payload.contract.errors import FeatureMismatchError, PayloadError
from remote_payload.contract.spec import joined_fingerprint
from remote_payload.eval import kernels, samples
from remote_payload.eval import suiteregimes as SR
from remote_payload.eval.cache import open_cache
from remote_payload.eval.devices import resolve_device_dtype
from remote_payload.eval.evalopts import EvalOptions, add_arguments, options_from_args
from remote_payload.eval.record import JoinedCache, build_results, suite_mean
from remote_payload.eval.steps import (
    STEPS,
    Drafted,
    Inputs,
    Reporter,
    cache_exactness,
    eval_prompts,
    feature_pass,
    load_beside_features,
    open_inputs,
)
from remote_payload.eval.summary import assess_health, dtype_name, headline, load_tokenizer, print_summary
from remote_payload.eval.targetchecks import check_online_target, target_checks

__all__ = ["add_arguments", "evaluate", "main"]  # add_arguments + main: what __main__.py asks of a command


# ---------------------------------------------------------------------------------------------- CLI
def main(args: argparse.Namespace, evaluate_fn=None) -> int:
    """The command; `evaluate_fn`: another family's evaluate (eagle3/family.py), else the DFlash eval's."""
    try:
        opts = options_from_args(args)
    except (PayloadError, protocol.ProtocolError) as e:
        print(f"error: {e}", file=sys.stderr)
        return protocol.EXIT_BAD_INPUT
    run_dir = Path(opts.run_dir)
    if (run_dir / protocol.RESULTS_JSON).exists():
        print(f"error: {run_dir} already holds results.json: pick another --name/--run-dir", file=sys.stderr)
        return protocol.EXIT_BAD_INPUT
    run_dir.mkdir(parents=True, exist_ok=True)
    # under `wrap` (REVAL_WRAPPED) the wrapper owns status.json; standalone, the payload writes its own
    own_status = not os.environ.get("REVAL_WRAPPED") and not (run_dir / protocol.STATUS_JSON).exists()
    started = protocol.now_iso()
    if not (run_dir / protocol.RUN_JSON).exists():
        protocol.atomic_write_json(run_dir / protocol.RUN_JSON, {
            "run": opts.name, "argv": sys.argv, "options": asdict(opts), "host": socket.gethostname(),
            "created_at": started, "payload_version": __version__})
    if own_status:
        _write_status(run_dir, protocol.RUNNING, started)
    rc = protocol.EXIT_FAILED
    sys.stdout = _ClosedReaderTolerant(sys.stdout)  # `eval ... | head`: the eval goes on, its log in events.jsonl
    try:
        results = (evaluate_fn or evaluate)(opts, Reporter(run_dir / protocol.EVENTS_JSONL))
        protocol.atomic_write_json(run_dir / protocol.RESULTS_JSON, results)
        print(f"results: {run_dir / protocol.RESULTS_JSON}")
        rc = protocol.EXIT_FAILED if (opts.strict and results["health"]["suspect"]) else protocol.EXIT_OK
        if rc:
            print("error: --strict: the result is SUSPECT (see the warning above); exit 1", file=sys.stderr)
    except PayloadError as e:
        print(f"error: {e}", file=sys.stderr)
        protocol.append_event(run_dir / protocol.EVENTS_JSONL, {"stage": "error", "message": str(e)})
        rc = e.exit_code
    except KeyboardInterrupt:  # Ctrl-C on a standalone eval: one line, no results.json, status cancelled
        print("interrupted: nothing evaluated to the end, no results.json written", file=sys.stderr)
        protocol.append_event(run_dir / protocol.EVENTS_JSONL, {"stage": "error", "message": "interrupted"})
        rc = protocol.EXIT_CANCELLED
    except Exception as e:  # noqa: BLE001 — unexpected: keep the traceback, exit 1
        traceback.print_exc()
        protocol.append_event(run_dir / protocol.EVENTS_JSONL,
                              {"stage": "error", "message": f"{type(e).__name__}: {e}"})
        rc = protocol.EXIT_FAILED
    if own_status:
        state = {protocol.EXIT_OK: protocol.SUCCEEDED, protocol.EXIT_CANCELLED: protocol.CANCELLED}
        _write_status(run_dir, state.get(rc, protocol.FAILED), started, rc)
    return rc


class _ClosedReaderTolerant:
    """stdout that goes quiet instead of raising once its reader has gone (a closed pipe)."""

    def __init__(self, stream):
        self._stream, self._closed = stream, False

    def write(self, text: str) -> int:
        if not self._closed:
            try:
                self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self._closed:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self._closed = True
        try:  # no second EPIPE when the interpreter flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _write_status(run_dir: Path, state: str, started: str, exit_code: int | None = None) -> None:
    st = {"state": state, "pid": os.getpid(), "pgid": os.getpgid(0), "started_at": started,
          "host": socket.gethostname(), "boot_id": protocol.boot_id(), "owner": "payload"}
    if state != protocol.RUNNING:
        st.update(finished_at=protocol.now_iso(), exit_code=exit_code)
    protocol.atomic_write_json(run_dir / protocol.STATUS_JSON, st)


def evaluate(opts: EvalOptions, rep: Reporter) -> dict:
    """The five steps (module doc), then the walks' aggregate, the health guard and results.json's dict.
    With suites (`--cache NAME=PATH` repeated) steps 2, 3 and 5 run per suite on the weights loaded once."""
    t0 = time.perf_counter()
    kernels.sdpa_backend()  # a bad REVAL_SDPA: exit 3 before anything is read
    device, dtype = resolve_device_dtype(opts.device, opts.dtype)
    rep.line(f"DFlash drafter eval · {opts.name} · device {device} ({dtype_name(dtype)})")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # `--device cuda:1`: the pipeline's events and streams on that device
    check_online_target(opts)
    tok = load_tokenizer(opts.target)
    try:
        if opts.suites:
            return evaluate_suites(opts, rep, device, dtype, t0, tok)
        return _evaluate(opts, rep, device, dtype, t0, tok)
    finally:
        if tok is not None:
            tok.close()


def _evaluate(opts: EvalOptions, rep: Reporter, device: torch.device, dtype: torch.dtype, t0: float, tok) -> dict:
    tok, cache, prompts = open_inputs(opts, rep, tok)
    inp, mod = load_beside_features(opts, tok, cache, prompts, device, dtype, rep)
    ev = eval_prompts(opts, inp, mod, device, dtype, rep)
    m = samples.aggregate(ev.per_prompt, mod.drafter.cfg.block_size)
    health = assess_health(m, ev.drafts, ev.targets, inp.tok, rep)
    cache_exactness(inp.cache, health, rep)
    health.update(feature_stats=inp.feature_stats, weight_stats=mod.info.weight_stats, embed_stats=mod.embed_stats)
    results = build_results(opts, inp, mod, ev, m, health, device, dtype, time.perf_counter() - t0)
    target_checks(opts, results, mod, inp, device, dtype, rep)
    print_summary(results)
    rep.event(stage="done", step=STEPS, steps=STEPS, metrics=headline(results))
    return results


def _suite_features(so: EvalOptions, rep: Reporter, tok, cache, prompts, mod, device: torch.device,
                    dtype: torch.dtype):
    """A suite's features read and checked against the drafter (loaded beside the first suite's)."""
    if mod is None:
        return load_beside_features(so, tok, cache, prompts, device, dtype, rep)
    check_features(mod.drafter.cfg, cache.layer_ids, cache.hidden_size)
    return Inputs(tok, cache, prompts, feature_pass(so, cache, prompts, rep)), mod


@dataclasses.dataclass(frozen=True)
class SuiteSteps:
    """A drafter family's steps in `evaluate_suites` (DFlash's below; EAGLE-3's in eagle3/suites.py)."""
    features: Callable  # (so, rep, tok, cache, prompts, mod or None, device, dtype) -> (Inputs, Loaded)
    draft: Callable  # (so, inp, mod, device, dtype, rep) -> Drafted
    record_opts: Callable = lambda o: o  # the options results.json records (build_results)
    finish: Callable = lambda results, mod: None  # the family's own results.json fields
    checks: Callable = target_checks  # --speedup / --online after the offline eval


DFLASH_STEPS = SuiteSteps(features=_suite_features, draft=eval_prompts)


def evaluate_suites(opts: EvalOptions, rep: Reporter, device: torch.device, dtype: torch.dtype, t0: float,
                    tok, steps: SuiteSteps = DFLASH_STEPS) -> dict:
    """One drafter over several caches: each suite evaluated as a one-cache eval would be (the same functions,
    its own cache), the weights loaded once; results.json = every prompt pooled at the top level (names
    `<suite>/<prompt>`), per-suite metrics and comparability in `suites`, their unweighted mean in `suite_mean`.
    steps: the family's load/draft/record (`SuiteSteps`)."""
    names = [n for n, _ in opts.suites]
    rep.line(f"  suites: {', '.join(names)}" + (f" (--num-prompts {opts.num_prompts} applies per suite: the first "
                                                f"{opts.num_prompts} prompts of each)" if opts.num_prompts else ""))
    done: list[tuple[str, EvalOptions, Inputs, Drafted]] = []
    mod = None
    seen: dict[str, str] = {}  # cache fingerprint -> the suite that gave it
    regimes = [(name, open_cache(path, seeds_layer_ids=opts.cache_layers).regime) for name, path in opts.suites]
    SR.check_drafts(opts.draft, regimes)  # each suite in its own regime (suiteregimes.py)
    for k, ((name, path), (_, regime)) in enumerate(zip(opts.suites, regimes)):
        so = dataclasses.replace(opts, cache=path, suites=None, draft=SR.suite_draft(opts.draft, regime))
        rep.line(f"\n== suite {name} ({k + 1}/{len(names)}): {path} ({_said(regime, so.draft)})", stage="suite",
                 suite=name, i=k + 1, n=len(names))
        tok, cache, prompts = open_inputs(so, rep, tok)
        if cache.fingerprint in seen:  # a copy or a link of another suite's cache: its prompts would count twice
            raise PayloadError(f"--cache: suite {name}'s cache {path} holds the same data as suite "
                               f"{seen[cache.fingerprint]}'s; its prompts would count twice in every pooled figure "
                               "(give each cache once)")
        seen[cache.fingerprint] = name
        try:
            inp, mod = steps.features(so, rep, tok, cache, prompts, mod, device, dtype)
        except FeatureMismatchError as e:  # which suite's cache is the wrong one
            raise FeatureMismatchError(f"suite {name} (--cache {name}={path}): {e}") from None
        done.append((name, so, inp, steps.draft(so, inp, mod, device, dtype, rep)))
    bs = mod.drafter.cfg.block_size
    suites, per_prompt, feature_stats = [], [], {}
    for name, so, inp, ev in done:
        m = samples.aggregate(ev.per_prompt, bs)
        one = build_results(steps.record_opts(so), inp, mod, ev, m, {"suspect": False, "reasons": [], "hints": []},
                            device, dtype, 0.0)
        suites.append(R.Suite(name=name, cache=R.CacheInfo.from_dict(one["cache"], "cache"),
                              comparability=R.Comparability.from_dict(one["comparability"], "comparability"),
                              metrics=R.Metrics.from_dict(one["metrics"], "metrics"),
                              prompt_range=[len(per_prompt), len(per_prompt) + len(ev.per_prompt)],
                              regime=SR.suite_regime(one["regime"], opts.draft)))
        per_prompt += [{**p, "name": f"{name}/{p['name']}"} for p in ev.per_prompt]
        feature_stats.update({f"{name}/{k}": v for k, v in inp.feature_stats.items()})
    first = done[0][2]
    both = hashlib.sha256("".join(f"{s.name}\0{s.comparability.prompt_set}\n" for s in suites).encode())
    ev_all = Drafted(per_prompt, np.concatenate([d[3].drafts for d in done]),
                     np.concatenate([d[3].targets for d in done]), "sha256:" + both.hexdigest(),
                     sum(d[3].num_anchors for d in done), sum(d[3].eval_s for d in done), done[0][3].batch_size)
    signature = SR.mixed_signature(suites)
    mixed = signature is not None and signature.startswith("mixed:")
    m = SR.pooled_metrics(per_prompt, bs) if mixed else samples.aggregate(per_prompt, bs)
    health = assess_health(m, ev_all.drafts, ev_all.targets, first.tok, rep)
    for name, _so, inp_s, _ev in done:
        cache_exactness(inp_s.cache, health, rep, suite=name)
    health.update(feature_stats=feature_stats, weight_stats=mod.info.weight_stats, embed_stats=mod.embed_stats)
    joined = JoinedCache(fingerprint=joined_fingerprint([(s.name, s.cache.fingerprint) for s in suites]),
                         layer_ids=list(first.cache.layer_ids),
                         prompts=[p for d in done for p in d[2].cache.prompts], meta=None)
    inp_all = Inputs(first.tok, joined, [p for d in done for p in d[2].prompts], feature_stats)
    results = build_results(steps.record_opts(opts), inp_all, mod, ev_all, m, health, device, dtype,
                            time.perf_counter() - t0)
    results["cache"]["num_prompts_total"] = sum(s.cache.num_prompts_total for s in suites)  # not sample entries
    results["comparability"]["regime"] = signature
    results["regime"] = (SR.mixed_regime(opts.draft) if mixed else suites[0].regime).to_dict()
    results["suites"] = [s.to_dict() for s in suites]
    results["suite_mean"] = None if mixed else suite_mean(suites).to_dict()
    if mixed:
        results["notes"] = (results.get("notes") or []) + [SR.MIXED_NOTE]
    steps.finish(results, mod)
    steps.checks(opts, results, mod, done[0][2], device, dtype, rep)
    print_summary(results)
    rep.event(stage="done", step=STEPS, steps=STEPS, metrics=headline(results))
    return results


def _said(regime, draft: str) -> str:
    return "greedy" if regime is None else f"sampled {regime.label()}, --draft {draft}"


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(main(p.parse_args()))
