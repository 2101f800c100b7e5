"""results.json (schema: docs/results.md) from the steps' outputs: `build_results` for one cache or one suite,
and what the suites' results share (`JoinedCache`, `suite_mean`).
"""
from __future__ import annotations

import json
import platform
import socket
from dataclasses import dataclass

import torch

from remote_payload import __version__
from remote_payload.contract import protocol
from remote_payload.contract import results as R
from remote_payload.eval import metrics, samples
from remote_payload.eval.evalopts import EvalOptions
from remote_payload.eval.steps import Drafted, Inputs, Loaded, layer_attention
from remote_payload.eval.summary import dtype_name


def _allowed(cfg) -> dict:
    """{key: value as JSON text} of the config keys the user allowed uninterpreted (--allow-unknown-config)."""
    out = {}
    for k in cfg.allowed_unknown:
        src, name = (cfg.extra.get("dflash_config") or {}, k.split(".", 1)[1]) if k.startswith("dflash_config.") \
            else (cfg.extra, k)
        out[k] = json.dumps(src.get(name), sort_keys=True)
    return out


def cache_recipe(cache) -> dict:
    """The cache's recipe and key as its cache.json records them (a store's cache: `reval caches`); {} when it
    records none (an older cache, a seeds cache, the suites joined)."""
    meta = getattr(cache, "meta", None)
    rec = meta.get("recipe") if isinstance(meta, dict) else None
    if not isinstance(rec, dict):
        return {}
    key = rec.get("key")
    return {"key": key if isinstance(key, str) else None, "recipe": {k: v for k, v in rec.items() if k != "key"}}


def build_results(opts: EvalOptions, inp: Inputs, mod: Loaded, ev: Drafted, m: dict, health: dict,
                  device: torch.device, dtype: torch.dtype, total_s: float) -> dict:
    """results.json (schema: docs/results.md)."""
    cfg, info, hinfo, cache = mod.drafter.cfg, mod.info, mod.hinfo, inp.cache
    bs, budgets, widths = cfg.block_size, opts.ddtree_budgets, opts.tree_widths
    eval_s = ev.eval_s
    fingerprint = cache.fingerprint
    attention = layer_attention(cfg)
    regime = regime_record(getattr(cache, "regime", None), opts.draft)
    family = getattr(cfg, "family", "dflash")  # an EAGLE-3 head's view (eagle3/evaluate.HeadView) says eagle3
    n_prompts = len(ev.per_prompt)  # a sampled cache: prompts, each with its samples
    result = R.Result(
        schema=R.SCHEMA, run=opts.name, created_at=protocol.now_iso(),
        drafter=R.Drafter(path=str(opts.drafter), name=info.name, layout=info.layout, step=info.step,
                          content_hash=info.content_hash, target_layer_ids=list(cfg.target_layer_ids),
                          fc_layer_ids=list(cfg.fc_layer_ids), num_parameters=info.num_parameters,
                          attention=attention, mask_embedding=info.mask_embedding,
                          renamed_weights=list(info.renamed) or None,
                          allowed_unknown_config=_allowed(cfg) or None, family=family),
        target=R.Target(path=str(opts.target), embed_key=hinfo.embed_key,
                        lm_head_key=None if hinfo.tied else hinfo.lm_head_key, tied=hinfo.tied,
                        config_matches_cache=mod.target_matches),
        cache=R.CacheInfo(path=str(opts.cache), fingerprint=fingerprint, layer_ids=list(cache.layer_ids),
                          num_prompts_total=_prompts_total(cache),
                          argmax_agreement=getattr(cache, "agreement", getattr(cache, "argmax_agreement", None)),
                          **cache_recipe(cache)),
        options=R.Options(num_prompts=n_prompts, max_blocks=opts.max_blocks, block_size=bs,
                          ddtree_budgets=budgets, tree_widths=widths, device=str(device), dtype=dtype_name(dtype),
                          batch_size=ev.batch_size, strict=opts.strict,
                          position_accuracy_anchors="all" if opts.all_anchors else "walk_reach"),
        comparability=R.Comparability(
            cache_fingerprint=fingerprint, prompt_set=ev.prompt_set,
            num_prompts=n_prompts, max_blocks=opts.max_blocks, block_size=bs,
            metrics_version=protocol.METRICS_VERSION + ("+all-anchors" if opts.all_anchors else ""),
            attention=R.attention_signature(attention), family=family,
            regime=regime.signature()),
        definitions=metrics.DEFINITIONS,
        metrics=R.Metrics.from_dict(m, "metrics"),
        per_prompt=[R.PromptResult.from_dict(p, f"per_prompt[{i}]") for i, p in enumerate(ev.per_prompt)],
        health=R.Health.from_dict(health, "health"),
        timing=R.Timing(load_s=round(mod.load_s, 3), eval_s=round(eval_s, 3),
                        anchors_per_s=round(ev.num_anchors / eval_s, 1) if eval_s > 0 else None,
                        total_s=round(total_s, 3)),
        environment=R.Environment(torch=torch.__version__, cuda=torch.version.cuda,
                                  gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                                  hostname=socket.gethostname(), python=platform.python_version(),
                                  payload_version=__version__),
        notes=[f"drafter config: {c}" for c in getattr(cfg, "conflicts", ())] or None, regime=regime)
    return result.to_dict()


def regime_record(regime, draft: str) -> R.Regime:
    """results.json's regime: the cache's sampling transform (eval/regime.py; None: greedy) and the draft rule."""
    if regime is None:
        return R.Regime(temperature=0.0, top_k=0, top_p=1.0, seed=None, samples=1, draft=draft)
    return R.Regime(**regime.to_json(), draft=draft, notes=samples.notes(draft))


def _prompts_total(cache) -> int:
    """Prompts in the cache: a sampled cache's entries are its prompts' samples."""
    if getattr(cache, "regime", None) is None:
        return len(cache.prompts)
    return len({cache.sample_of(i)[0] for i in range(len(cache.prompts))})


@dataclass
class JoinedCache:
    """What build_results reads of a cache, for the suites together (their fingerprints hashed by name)."""
    fingerprint: str
    layer_ids: list
    prompts: list
    meta: dict | None
    regime: object = None  # None: run.py records the run's regime from its suites' (eval/suiteregimes.py)


def suite_mean(suites: list) -> R.SuiteMean:
    """Unweighted mean over suites of each suite's value (a suite without the value is left out of that mean)."""
    def mean(values):
        vals = [v for v in values if v is not None]
        return sum(vals) / len(vals) if vals else None
    tau = mean(s.metrics.tau for s in suites)
    budgets = sorted({b for s in suites for b in s.metrics.ddtree_tau}, key=int)
    return R.SuiteMean(num_suites=len(suites), tau=tau, streak=None if tau is None else tau - 1,
                       position_1_accuracy=mean(s.metrics.position_1_accuracy for s in suites),
                       ddtree_tau={b: mean(s.metrics.ddtree_tau.get(b) for s in suites) for b in budgets})
