"""The latency model, measured (`--speedup`): what one step of each kind costs on this GPU, at each batch size.

A DFlash round drafts one block per sequence (`draft`: the drafter's block forward with the context K/V already
there, its lm_head and top-k) and the target verifies every sequence's block in one forward over its KV cache
(`verify[n]`, n tokens a sequence: `block_size` for the linear block, B + 1 for a DDTree of budget B: the root,
i.e. the bonus token, and B nodes). Plain decoding costs `decode` a token per sequence. At batch b (b sequences
decoded together, each its own context of `context_len`) the projected speed-up of a method with acceptance
length tau is

    speedup(b) = tau * decode(b) / (draft(b) + verify[n](b))            (projected_speedup)

Each latency is a `Spread`: the median of timed runs (a run being the mean of enough back-to-back calls to last
`min_repeat_s`, each call followed by a device sync: a decode loop needs every step's result before the next),
after a warm-up, with the quartiles, min, max and the number of runs kept. `repeats` runs at least; more (up to
`max_repeats`) while the interquartile range is over `REL_SPREAD` of the median: on a noisy machine the numbers
then carry enough runs, and their spread says how far to trust a difference (projection.py names a best method
only when its lead exceeds it).

Batches: the target's step at batch b feeds the same tree for each of b sequences over a slot cache of b copies
of one prefilled context (treeverify: `_Step`, `_batched_cache`); the drafter's block at batch b drafts one anchor
at the end of each of b contexts. Hybrid targets (linear-attention layers) are not modelled faithfully
(treeverify.py).

Regimes: "eager" (each kernel launched from Python, as HF runs) or "cuda-graphs" (every step captured once with
torch.cuda.CUDAGraph over the static cache and replayed: launch overhead gone, as a serving engine runs it).
"auto" is CUDA graphs on CUDA where capture works (else eager, saying why in `note`), eager on CPU. The regime
the numbers were measured in is `Latencies.regime`.

latencytable.py keeps measured `Latencies` by key (`latency_key`) in a small JSON file; an entry that is out of
shape, lacks a time the key asks for, or holds an absurd time (`MIN_S`..`MAX_S`) is refused: a miss.
"""
from __future__ import annotations

import hashlib
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from remote_payload.eval.treeverify import (
    _attention,
    _attention_of,
    _batched_cache,
    _groups,
    _prefill,
    _slot_cache,
    _Step,
    chain,
    ddtree_tree,
)

LATENCY_SCHEMA = "reval.latency/2"  # bump when what is measured, or how, changes: old table entries then miss
REGIMES = ("eager", "cuda-graphs")
DEFAULT_BATCHES = (1, 4, 16, 64)
DEFAULT_REPEATS = 7
REL_SPREAD = 0.05  # more runs while (q3 - q1) / median exceeds this (up to max_repeats)
MIN_S, MAX_S = 1e-7, 600.0  # a step time outside this is absurd: the entry holding it is refused


@dataclass(frozen=True)
class Spread:
    """One latency: the median of n timed runs, their quartiles and extremes (seconds)."""
    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Spread:
        xs = sorted(float(x) for x in samples)
        if not xs:
            raise ValueError("Spread.of: no samples")
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
        return cls(median=float(statistics.median(xs)), q1=q1, q3=q3, min=xs[0], max=xs[-1], n=len(xs))

    @property
    def rel_iqr(self) -> float:
        return (self.q3 - self.q1) / self.median

    def to_json(self) -> dict:
        return {"median": self.median, "q1": self.q1, "q3": self.q3, "min": self.min, "max": self.max, "n": self.n}

    @classmethod
    def from_json(cls, d, name: str) -> Spread:
        """Checked: every time finite and within MIN_S..MAX_S, min <= q1 <= median <= q3 <= max, n >= 1."""
        if not isinstance(d, dict):
            raise TypeError(f"latency {name}: not an object")
        vals = []
        for f in ("min", "q1", "median", "q3", "max"):
            v = d.get(f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or \
                    not MIN_S <= v <= MAX_S:
                raise ValueError(f"latency {name}.{f}: {v!r} is not a time within {MIN_S:g}..{MAX_S:g} s")
            vals.append(float(v))
        if vals != sorted(vals):
            raise ValueError(f"latency {name}: min <= q1 <= median <= q3 <= max does not hold: {vals}")
        n = d.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"latency {name}.n: {n!r}")
        return cls(median=vals[2], q1=vals[1], q3=vals[3], min=vals[0], max=vals[4], n=n)


@dataclass
class Latencies:
    device: str  # "cuda:0", "cpu"
    gpu: str | None  # torch.cuda.get_device_name, None on CPU
    dtype: str  # "bfloat16", "float32", ...
    regime: str  # "eager" or "cuda-graphs": what the numbers were measured in
    context_len: int  # KV-cache length (per sequence) the steps were measured at
    batches: list[int]  # the batch sizes measured, ascending
    decode: dict[int, Spread]  # batch -> one target decode step (1 token a sequence)
    verify: dict[int, dict[int, Spread]]  # n tokens a sequence -> batch -> the verify forward
    draft: dict[int, Spread]  # batch -> one drafter block a sequence (context K/V precomputed)
    key: dict  # what invalidates it (`latency_key`)
    note: str = ""  # why "auto" fell back to eager, when it did
    measured_at: str = ""  # UTC ISO 8601, when measured
    measure_s: float = 0.0  # seconds the measurement took

    # the smallest batch's medians (batch 1 by default): what a batch-1 reader wants
    @property
    def decode_s(self) -> float:
        return self.decode[self.batches[0]].median

    @property
    def draft_s(self) -> float:
        return self.draft[self.batches[0]].median

    @property
    def verify_s(self) -> dict[int, float]:
        return {n: by[self.batches[0]].median for n, by in sorted(self.verify.items())}

    def tokens(self, *, budget: int | None = None, block_size: int | None = None) -> int:
        """n, the tokens a sequence a verify feeds: budget + 1 (DDTree) or the block (the key's by default)."""
        return budget + 1 if budget is not None else (block_size or int(self.key.get("block_size", 0)))

    def speedup(self, tau: float, *, budget: int | None = None, block_size: int | None = None,
                batch: int | None = None) -> float:
        """`projected_speedup` with this table's medians at `batch` (the smallest measured by default)."""
        n, b = self.tokens(budget=budget, block_size=block_size), batch or self.batches[0]
        if n not in self.verify or b not in self.verify[n]:
            raise KeyError(f"no verify latency for {n} tokens at batch {b} (measured: {sorted(self.verify)} tokens "
                           f"at batches {self.batches})")
        return projected_speedup(tau, self.decode[b].median, self.draft[b].median, self.verify[n][b].median)

    def to_json(self) -> dict:
        return {"device": self.device, "gpu": self.gpu, "dtype": self.dtype, "regime": self.regime,
                "context_len": self.context_len, "batches": list(self.batches),
                "decode": {str(b): s.to_json() for b, s in sorted(self.decode.items())},
                "draft": {str(b): s.to_json() for b, s in sorted(self.draft.items())},
                "verify": {str(n): {str(b): s.to_json() for b, s in sorted(by.items())}
                           for n, by in sorted(self.verify.items())},
                "key": self.key, "note": self.note, "measured_at": self.measured_at, "measure_s": self.measure_s}

    @classmethod
    def from_json(cls, d) -> Latencies:
        """The inverse of `to_json`; anything off is a TypeError or ValueError (a table refuses such an entry):
        a field out of shape, a batch or a verify size the key asks for missing, an absurd time."""
        if not isinstance(d, dict):
            raise TypeError("a latency entry must be an object")
        key, batches = d.get("key"), d.get("batches")
        if not isinstance(key, dict):
            raise TypeError("latency entry field 'key'")
        if not isinstance(batches, list) or not batches or \
                any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batches) or \
                batches != sorted(set(batches)) or batches != key.get("batches"):
            raise ValueError(f"latency entry field 'batches': {batches!r}")
        sizes = _verify_sizes(key.get("budgets") or [], int(key.get("block_size") or 0))

        def per_batch(obj, name) -> dict[int, Spread]:
            if not isinstance(obj, dict):
                raise TypeError(f"latency entry field {name!r}")
            missing = [b for b in batches if str(b) not in obj]
            if missing:
                raise ValueError(f"latency entry lacks {name} at batch {missing[0]}")
            return {b: Spread.from_json(obj[str(b)], f"{name}[{b}]") for b in batches}

        verify = d.get("verify")
        if not isinstance(verify, dict):
            raise TypeError("latency entry field 'verify'")
        lacking = [n for n in sizes if str(n) not in verify]
        if lacking:
            raise ValueError(f"latency entry lacks the verify time of {lacking[0]} tokens")
        regime = d.get("regime")
        if regime not in REGIMES:
            raise ValueError(f"latency entry regime {regime!r}")
        for f, types in (("device", str), ("dtype", str), ("context_len", int)):
            if not isinstance(d.get(f), types) or isinstance(d.get(f), bool):
                raise TypeError(f"latency entry field {f!r}: {d.get(f)!r}")
        if d.get("gpu") is not None and not isinstance(d.get("gpu"), str):
            raise TypeError("latency entry field 'gpu'")
        text = {f: d[f] if isinstance(d.get(f), str) else "" for f in ("note", "measured_at")}
        ms = d.get("measure_s")
        return cls(device=d["device"], gpu=d.get("gpu"), dtype=d["dtype"], regime=regime,
                   context_len=d["context_len"], batches=list(batches), decode=per_batch(d.get("decode"), "decode"),
                   verify={n: per_batch(verify[str(n)], f"verify[{n}]") for n in sizes},
                   draft=per_batch(d.get("draft"), "draft"), key=key, **text,
                   measure_s=float(ms) if isinstance(ms, (int, float)) and math.isfinite(ms) and ms >= 0 else 0.0)


def projected_speedup(tau: float, decode_s: float, draft_s: float, verify_s: float) -> float:
    """tau * t(decode) / (t(draft) + t(verify)): tokens a round yields (tau, bonus included) over the round's
    cost, in units of plain decode steps: the projection `--speedup` reports. Raises ValueError on anything
    that is not a finite number, and on a result that is not finite (absurd times)."""
    for name, v in (("tau", tau), ("decode_s", decode_s), ("draft_s", draft_s), ("verify_s", verify_s)):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"projected_speedup: {name} must be a finite number >= 0, got {v!r}")
    if draft_s + verify_s <= 0:
        raise ValueError("projected_speedup: draft_s + verify_s must be > 0")
    x = float(tau) * float(decode_s) / (float(draft_s) + float(verify_s))
    if not math.isfinite(x):
        raise ValueError(f"projected_speedup: tau {tau} x {decode_s} / ({draft_s} + {verify_s}) is not finite")
    return x


# ---------------------------------------------------------------- timing

def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _graphed(fn, dev: torch.device):
    """fn captured in a CUDA graph (warmed up on a side stream first, as torch asks) -> a replaying callable
    returning the graph's static output."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    _sync(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out
    replay.graph = graph  # kept alive with the callable
    return replay


def _time(fn, dev: torch.device, repeats: int, min_repeat_s: float, max_repeats: int | None = None) -> Spread:
    """The Spread of at least `repeats` runs (up to max_repeats while the IQR is over REL_SPREAD of the median)
    of the mean time of one call (each call followed by a sync), after a warm-up; a run makes enough calls to
    last about min_repeat_s (timer resolution, launch jitter)."""
    fn()
    _sync(dev)
    t = time.perf_counter()
    fn()
    _sync(dev)
    once = max(time.perf_counter() - t, 1e-7)
    inner = max(1, min(1000, math.ceil(min_repeat_s / once)))
    samples: list[float] = []
    top = max(repeats, max_repeats or 3 * repeats)
    while len(samples) < repeats or (len(samples) < top and Spread.of(samples).rel_iqr > REL_SPREAD):
        _sync(dev)
        t = time.perf_counter()
        for _ in range(inner):
            fn()
            _sync(dev)
        samples.append(max((time.perf_counter() - t) / inner, MIN_S))
    return Spread.of(samples)


# ---------------------------------------------------------------- keys and measuring

def _model_hash(model) -> str:
    """A target's content hash from the folder it was loaded from; a model not loaded from a folder (random
    weights) is named by its config, all its timing depends on."""
    from remote_payload.contract.contenthash import content_hash
    path = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if path and Path(path).is_dir():
        return content_hash(path)  # latencytable.target_content_hash
    return "config-sha256:" + hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()


def _verify_sizes(budgets, block_size: int) -> list[int]:
    return sorted({int(block_size), *(int(b) + 1 for b in budgets)})


def latency_key(target_model, drafter, *, context_len: int, budgets, block_size: int, regime: str = "auto",
                target_hash: str | None = None, batches=(1,), repeats: int = DEFAULT_REPEATS,
                method: str | None = None) -> dict:
    """What a measurement depends on; `measure(...)` with the same arguments returns Latencies with this key,
    so a caller can look a table up before measuring. `regime` is the one asked for ("auto" included).
    method: another drafter family's method (`Custom.method`, e.g. "eagle3-chain-5"), in the key as "method" (a
    DFlash key has none, so neither family's entry is ever reused for the other)."""
    import transformers

    import remote_payload
    p = next(target_model.parameters())
    dev = p.device
    key = {
        "schema": LATENCY_SCHEMA,
        "device": dev.type,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "dtype": str(p.dtype).removeprefix("torch."),
        "drafter_dtype": str(drafter.dtype).removeprefix("torch."),
        "target": target_hash or _model_hash(target_model),
        "drafter_config": "sha256:" + hashlib.sha256(
            json.dumps(drafter.cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if dev.type == "cuda" else None,
        "transformers": transformers.__version__,
        "payload": remote_payload.__version__,
        "context_len": int(context_len),
        "regime": regime,
        "block_size": int(block_size),
        "budgets": sorted({int(b) for b in budgets}),
        "batches": sorted({int(b) for b in batches}),
        "repeats": int(repeats),
        "attention": _attention(target_model),
    }
    if dev.type == "cpu":  # a CPU's numbers depend on which CPU and how many threads
        key["cpu"] = platform.processor() or platform.machine()
        key["threads"] = torch.get_num_threads()
    if method is not None:
        key["method"] = method
    return key


@dataclass(frozen=True)
class Custom:
    """Another drafter family's steps for `measure`: its method's name (in the key), the tree its verify feeds
    (parents as treeverify.tree_mask's, root first: len(parents) = block_size, the verify's tokens) and its draft
    step (`draft(context_len, batch, generator, device)` -> a callable running one round's draft for `batch`
    sequences at context_len, capturable in a CUDA graph: no host sync)."""
    method: str
    parents: list[int]
    draft: object


def measure(target_model, drafter, head, *, context_len: int, budgets: list[int], block_size: int,
            repeats: int = DEFAULT_REPEATS, regime: str = "auto", target_hash: str | None = None,
            min_repeat_s: float = 0.01, seed: int = 0, batches=(1,), max_repeats: int | None = None,
            custom: Custom | None = None) -> Latencies:
    """At each of `batches` in the models' dtype on their device (module doc): decode (1 token a sequence);
    verify[n] for n = block_size (a causal block) and each budget B + 1 (the DDTree of `ddtree_tree`, under
    `tree_mask`, at positions context_len + depth); draft: `draft_hidden` at one anchor a sequence (context K/V
    of context_len positions precomputed) + `logits_topk` with k = the largest budget.
    regime "auto": CUDA graphs on CUDA when capture works, else eager (the reason in `note`); eager on CPU.
    target_hash: the target's content hash, when the caller has it (else computed from the model's folder).
    A budget B with B + 1 == block_size shares the block's entry (the same n tokens: the same cost).
    custom: another family's verify tree and draft step in place of the DFlash block's (`Custom`); block_size is
    then its verify's tokens and budgets are refused."""
    if regime not in ("auto", *REGIMES):
        raise ValueError(f"regime {regime!r}: use auto, eager or cuda-graphs")
    batches = sorted({int(b) for b in batches})
    if context_len < 1 or block_size < 2 or repeats < 1 or any(int(b) < 1 for b in budgets) or not batches \
            or batches[0] < 1:
        raise ValueError(f"measure: context_len {context_len} >= 1, block_size {block_size} >= 2, repeats "
                         f"{repeats} >= 1, budgets {list(budgets)} >= 1 and batches {batches} >= 1, please")
    if custom is not None and (budgets or len(custom.parents) != block_size):
        raise ValueError(f"measure: {custom.method} verifies {len(custom.parents)} tokens (block_size {block_size}) "
                         f"and takes no DDTree budgets ({list(budgets)})")
    dev = next(target_model.parameters()).device
    if regime == "cuda-graphs" and dev.type != "cuda":
        raise ValueError(f"regime cuda-graphs needs a CUDA device; the target is on {dev}")
    key = latency_key(target_model, drafter, context_len=context_len, budgets=budgets, block_size=block_size,
                      regime=regime, target_hash=target_hash, batches=batches, repeats=repeats,
                      method=custom.method if custom else None)
    args = (target_model, drafter, head, context_len, budgets, block_size, (repeats, min_repeat_s, max_repeats),
            seed, key, batches, custom)
    note, t0 = "", time.perf_counter()
    if regime == "cuda-graphs" or (regime == "auto" and dev.type == "cuda"):
        try:
            return _measure(*args, graphs=True, t0=t0)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # any capture failure: "auto" measures eager instead
            if regime == "cuda-graphs":
                raise
            note = f"CUDA graphs failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); eager"
            _sync(dev)
    return _measure(*args, graphs=False, note=note, t0=t0)


def _measure(*args, graphs: bool, t0: float, note: str = "") -> Latencies:
    dev = next(args[0].parameters()).device
    try:
        lat = _measure_once(*args, graphs=graphs, note=note)
    finally:  # the cache, the graphs and their pools are gone with _measure_once's frame: give their memory back
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    lat.measure_s = round(time.perf_counter() - t0, 3)
    return lat


@torch.inference_mode()
def _measure_once(model, drafter, head, context_len, budgets, block_size, timing, seed, key, batches, custom, *,
                  graphs: bool, note: str) -> Latencies:
    p = next(model.parameters())
    dev, dtype = p.device, p.dtype
    vocab = int(model.config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(seed)
    trees = {1: chain(1), block_size: list(custom.parents) if custom else chain(block_size)}
    for b in sorted({int(b) for b in budgets}):
        trees.setdefault(b + 1, ddtree_tree(b, block_size))
    impl = key["attention"]
    groups = _groups(model, impl)

    def timed(fn):
        if graphs:
            fn = _graphed(fn, dev)
        return _time(fn, dev, *timing)

    secs: dict[int, dict[int, Spread]] = {n: {} for n in trees}
    with _attention_of(model, impl):
        one = _slot_cache(model, context_len + max(trees))
        _prefill(model, one, torch.randint(0, vocab, (context_len,), generator=g), groups)
        ids = {n: torch.randint(0, vocab, (n,), generator=g) for n in trees}
        for batch in batches:
            cache = one if batch == 1 else _batched_cache(model, one, batch)
            for n, parents in trees.items():
                step = _Step(model, cache, ids[n], parents, context_len, groups, batch=batch)
                secs[n][batch] = timed(lambda step=step: step().argmax(-1))  # the verify's answer: a token a node
            del cache
    draft = {b: timed(custom.draft(context_len, b, g, dev) if custom
                      else _draft_fn(drafter, head, context_len, budgets, b, g, dev)) for b in batches}
    return Latencies(device=str(dev), gpu=key["gpu"], dtype=str(dtype).removeprefix("torch."),
                     regime="cuda-graphs" if graphs else "eager", context_len=int(context_len), batches=list(batches),
                     decode=secs[1], verify={n: secs[n] for n in _verify_sizes(budgets, block_size)}, draft=draft,
                     key=key, note=note, measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def _draft_fn(drafter, head, context_len: int, budgets, batch: int, g: torch.Generator, dev: torch.device):
    """The drafter's block at `batch` sequences: one anchor at the end of each of `batch` contexts of
    context_len positions (K/V precomputed, not timed) -> a callable returning the top-k ids."""
    from remote_payload.eval.drafter import ContextKV, logits_topk
    cfg = drafter.cfg
    feats = torch.randn(context_len, cfg.fc_in_features, generator=g).to(dev, drafter.dtype)
    one = drafter.precompute_context(feats)
    ctx = ContextKV(k=[k.repeat(batch, 1, 1, 1) for k in one.k], v=[v.repeat(batch, 1, 1, 1) for v in one.v],
                    lengths=one.lengths.repeat(batch), T=one.T, host_lengths=one.host_lengths * batch)
    anchors = torch.full((batch, 1), context_len, device=dev)
    bonus = torch.randint(0, min(cfg.vocab_size, head.embed.shape[0]), (1, 1), generator=g).to(dev).repeat(batch, 1)
    k = min(max([*budgets, 1]), cfg.vocab_size)

    def draft():
        hidden = drafter.draft_hidden(ctx, anchors, bonus, head, bounds=(context_len, context_len))
        return logits_topk(hidden, head, k).topk_ids
    return draft
