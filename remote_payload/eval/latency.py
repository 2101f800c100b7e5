"""The latency model, measured (`--speedup`): what one step of each kind costs on this GPU, at batch 1.

A DFlash round drafts one block (`draft_s`: the drafter's block forward with the context K/V already there, its
lm_head and top-k) and the target verifies it in one forward over its KV cache (`verify_s[n]`, n tokens fed:
`block_size` for the linear block, B + 1 for a DDTree of budget B: the root, i.e. the bonus token, and B nodes).
Plain decoding costs `decode_s` a token. The projected speed-up of a drafter with acceptance length tau is

    speedup = tau * decode_s / (draft_s + verify_s[n])                  (projected_speedup)

Measured (`measure`) at batch 1 in the models' dtype on their device: each number is the median of `repeats`
timed runs after a warm-up, a run being the mean of enough back-to-back calls to last `min_repeat_s`, each call
followed by a device sync (a batch-1 loop needs every step's result before the next: no overlap across steps).
The target runs over a static KV cache of `context_len` positions (treeverify.py: the steps, the trees and their
masks), so repeated calls are the same call.

Regimes: "eager" (each kernel launched from Python, as HF runs) or "cuda-graphs" (every step captured once with
torch.cuda.CUDAGraph over the static cache and replayed: launch overhead gone, as a serving engine runs it).
"auto" is CUDA graphs on CUDA where capture works (else eager, saying why in `note`), eager on CPU. The regime
the numbers were measured in is `Latencies.regime`.

`LatencyTable`: a small JSON file in the host's workdir holding measured `Latencies` by key (`latency_key`: GPU,
dtype, target content hash, drafter architecture, torch/transformers/payload versions, context_len, regime,
block_size, budgets); reused while the key matches.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from remote_payload.contract.runstate import read_regular
from remote_payload.eval.treeverify import (
    _attention,
    _attention_of,
    _groups,
    _prefill,
    _slot_cache,
    _Step,
    chain,
    ddtree_tree,
)

LATENCY_SCHEMA = "reval.latency/1"  # bump when what is measured, or how, changes: old table entries then miss
TABLE_SCHEMA = "reval.latency-table/1"
REGIMES = ("eager", "cuda-graphs")
TABLE_MAX_ENTRIES = 64  # the oldest go first
TABLE_MAX_BYTES = 4 << 20  # a bigger file is damage, not a table


@dataclass
class Latencies:
    device: str  # "cuda:0", "cpu"
    gpu: str | None  # torch.cuda.get_device_name, None on CPU
    dtype: str  # "bfloat16", "float32", ...
    regime: str  # "eager" or "cuda-graphs": what the numbers were measured in
    context_len: int  # KV-cache length the steps were measured at
    decode_s: float  # one target decode step (1 token) at batch 1
    verify_s: dict[int, float]  # verify forward of n tokens over the KV cache: n = block_size and each budget + 1
    draft_s: float  # one drafter block at batch 1 (context K/V precomputed, one anchor: draft_hidden + lm_head + top-k)
    key: dict  # what invalidates it (`latency_key`)
    note: str = ""  # why "auto" fell back to eager, when it did

    def speedup(self, tau: float, *, budget: int | None = None, block_size: int | None = None) -> float:
        """`projected_speedup` with this table's numbers: the linear block (n = block_size, the key's by default)
        or a DDTree of `budget` nodes (n = budget + 1)."""
        n = budget + 1 if budget is not None else (block_size or int(self.key.get("block_size", 0)))
        if n not in self.verify_s:
            raise KeyError(f"no verify latency for {n} tokens (measured: {sorted(self.verify_s)})")
        return projected_speedup(tau, self.decode_s, self.draft_s, self.verify_s[n])

    def to_json(self) -> dict:
        d = asdict(self)
        d["verify_s"] = {str(n): s for n, s in sorted(self.verify_s.items())}
        return d

    @classmethod
    def from_json(cls, d) -> Latencies:
        """The inverse of `to_json`; anything off is a TypeError or ValueError (a table skips such an entry)."""
        if not isinstance(d, dict):
            raise TypeError("a latency entry must be an object")

        def want(name, types, optional=False):
            v = d.get(name)
            if v is None and optional:
                return None
            if not isinstance(v, types) or isinstance(v, bool):
                raise TypeError(f"latency entry field {name!r}: {v!r}")
            return v

        def secs(v, name):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"latency entry field {name!r}: {v!r} is not a positive time")
            return float(v)

        verify = want("verify_s", dict)
        try:
            verify_s = {int(n): secs(s, f"verify_s[{n}]") for n, s in verify.items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"latency entry field 'verify_s': {e}") from None
        regime = want("regime", str)
        if regime not in REGIMES:
            raise ValueError(f"latency entry regime {regime!r}")
        return cls(device=want("device", str), gpu=want("gpu", str, optional=True), dtype=want("dtype", str),
                   regime=regime, context_len=want("context_len", int), decode_s=secs(d.get("decode_s"), "decode_s"),
                   verify_s=verify_s, draft_s=secs(d.get("draft_s"), "draft_s"), key=want("key", dict),
                   note=d.get("note") if isinstance(d.get("note"), str) else "")


def projected_speedup(tau: float, decode_s: float, draft_s: float, verify_s: float) -> float:
    """tau * t(decode) / (t(draft) + t(verify)): tokens a round yields (tau, bonus included) over the round's
    cost, in units of plain decode steps: the projection `--speedup` reports."""
    for name, v in (("tau", tau), ("decode_s", decode_s), ("draft_s", draft_s), ("verify_s", verify_s)):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"projected_speedup: {name} must be a finite number >= 0, got {v!r}")
    if draft_s + verify_s <= 0:
        raise ValueError("projected_speedup: draft_s + verify_s must be > 0")
    return float(tau) * float(decode_s) / (float(draft_s) + float(verify_s))


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


def _time(fn, dev: torch.device, repeats: int, min_repeat_s: float) -> float:
    """Median over `repeats` runs of the mean time of one call (each call followed by a sync), after a warm-up;
    a run makes enough calls to last about min_repeat_s (timer resolution, launch jitter)."""
    fn()
    _sync(dev)
    t = time.perf_counter()
    fn()
    _sync(dev)
    once = max(time.perf_counter() - t, 1e-7)
    inner = max(1, min(1000, math.ceil(min_repeat_s / once)))
    samples = []
    for _ in range(repeats):
        _sync(dev)
        t = time.perf_counter()
        for _ in range(inner):
            fn()
            _sync(dev)
        samples.append((time.perf_counter() - t) / inner)
    return float(statistics.median(samples))


# ---------------------------------------------------------------- keys and measuring

def target_content_hash(target_dir) -> str:
    """The target's content hash (`contract.contenthash`: config.json + the weight files the index names, or
    model.safetensors; every file of any other folder)."""
    from remote_payload.contract.contenthash import content_hash
    return content_hash(target_dir)


def target_signature(target_dir) -> str:
    """Which files the target's content hash covers, with their sizes and modification times (a stat per file,
    no read): while it is unchanged the hash a table entry was measured under still names the target."""
    from remote_payload.contract.contenthash import content_files
    h = hashlib.sha256()
    for f in content_files(target_dir):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return "stat-sha256:" + h.hexdigest()


def _model_hash(model) -> str:
    """A target's content hash from the folder it was loaded from; a model not loaded from a folder (random
    weights) is named by its config, all its timing depends on."""
    path = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if path and Path(path).is_dir():
        return target_content_hash(path)
    return "config-sha256:" + hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()


def _verify_sizes(budgets, block_size: int) -> list[int]:
    return sorted({int(block_size), *(int(b) + 1 for b in budgets)})


def latency_key(target_model, drafter, *, context_len: int, budgets, block_size: int, regime: str = "auto",
                target_hash: str | None = None) -> dict:
    """What a measurement depends on; `measure(...)` with the same arguments returns Latencies with this key,
    so a caller can look a table up before measuring. `regime` is the one asked for ("auto" included)."""
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
        "batch": 1,
        "attention": _attention(target_model),
    }
    if dev.type == "cpu":  # a CPU's numbers depend on which CPU and how many threads
        key["cpu"] = platform.processor() or platform.machine()
        key["threads"] = torch.get_num_threads()
    return key


def measure(target_model, drafter, head, *, context_len: int, budgets: list[int], block_size: int, repeats: int = 5,
            regime: str = "auto", target_hash: str | None = None, min_repeat_s: float = 0.01,
            seed: int = 0) -> Latencies:
    """At batch 1 in the models' dtype on their device: median of `repeats` timed runs after a warm-up (module
    doc). decode_s: 1 token; verify_s[n] for n = block_size (a causal block) and each budget B + 1 (the DDTree of
    `ddtree_tree`, under `tree_mask`, at positions context_len + depth); draft_s: `draft_hidden` at one anchor
    (context K/V of context_len positions precomputed) + `logits_topk` with k = the largest budget.
    regime "auto": CUDA graphs on CUDA when capture works, else eager (the reason in `note`); eager on CPU.
    target_hash: the target's content hash, when the caller has it (else computed from the model's folder).
    A budget B with B + 1 == block_size shares the block's entry (the same n tokens: the same cost)."""
    if regime not in ("auto", *REGIMES):
        raise ValueError(f"regime {regime!r}: use auto, eager or cuda-graphs")
    if context_len < 1 or block_size < 2 or repeats < 1 or any(int(b) < 1 for b in budgets):
        raise ValueError(f"measure: context_len {context_len} >= 1, block_size {block_size} >= 2, repeats "
                         f"{repeats} >= 1 and budgets {list(budgets)} >= 1, please")
    dev = next(target_model.parameters()).device
    if regime == "cuda-graphs" and dev.type != "cuda":
        raise ValueError(f"regime cuda-graphs needs a CUDA device; the target is on {dev}")
    key = latency_key(target_model, drafter, context_len=context_len, budgets=budgets, block_size=block_size,
                      regime=regime, target_hash=target_hash)
    args = (target_model, drafter, head, context_len, budgets, block_size, repeats, min_repeat_s, seed, key)
    note = ""
    if regime == "cuda-graphs" or (regime == "auto" and dev.type == "cuda"):
        try:
            return _measure(*args, graphs=True)
        except Exception as e:  # any capture failure: "auto" measures eager instead
            if regime == "cuda-graphs":
                raise
            note = f"CUDA graphs failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); eager"
            _sync(dev)
    return _measure(*args, graphs=False, note=note)


def _measure(*args, graphs: bool, note: str = "") -> Latencies:
    dev = next(args[0].parameters()).device
    try:
        return _measure_once(*args, graphs=graphs, note=note)
    finally:  # the cache, the graphs and their pools are gone with _measure_once's frame: give their memory back
        if dev.type == "cuda":
            torch.cuda.empty_cache()


@torch.inference_mode()
def _measure_once(model, drafter, head, context_len, budgets, block_size, repeats, min_repeat_s, seed, key, *,
                  graphs: bool, note: str) -> Latencies:
    from remote_payload.eval.drafter import logits_topk
    p = next(model.parameters())
    dev, dtype = p.device, p.dtype
    vocab = int(model.config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(seed)
    trees = {1: chain(1), block_size: chain(block_size)}
    for b in sorted({int(b) for b in budgets}):
        trees.setdefault(b + 1, ddtree_tree(b, block_size))
    impl = key["attention"]
    groups = _groups(model, impl)

    def timed(fn):
        if graphs:
            fn = _graphed(fn, dev)
        return _time(fn, dev, repeats, min_repeat_s)

    secs = {}
    with _attention_of(model, impl):
        cache = _slot_cache(model, context_len + max(trees))
        _prefill(model, cache, torch.randint(0, vocab, (context_len,), generator=g), groups)
        for n, parents in trees.items():
            step = _Step(model, cache, torch.randint(0, vocab, (n,), generator=g), parents, context_len, groups)
            secs[n] = timed(lambda step=step: step().argmax(-1))  # the verify's answer: the target's token a node

    # the drafter: one anchor at the end of a context_len context, K/V precomputed (not timed)
    cfg = drafter.cfg
    feats = torch.randn(context_len, cfg.fc_in_features, generator=g).to(dev, drafter.dtype)
    ctx = drafter.precompute_context(feats)
    anchor = torch.tensor([context_len], device=dev)
    bonus = torch.randint(0, min(cfg.vocab_size, head.embed.shape[0]), (1,), generator=g).to(dev)
    k = min(max([*budgets, 1]), cfg.vocab_size)

    def draft():
        hidden = drafter.draft_hidden(ctx, anchor, bonus, head, bounds=(context_len, context_len))
        return logits_topk(hidden, head, k).topk_ids
    draft_s = timed(draft)
    return Latencies(device=str(dev), gpu=key["gpu"], dtype=str(dtype).removeprefix("torch."),
                     regime="cuda-graphs" if graphs else "eager", context_len=int(context_len), decode_s=secs[1],
                     verify_s={n: secs[n] for n in _verify_sizes(budgets, block_size)},
                     draft_s=draft_s, key=key, note=note)


# ---------------------------------------------------------------- the table

def _norm(key: dict) -> dict:
    return json.loads(json.dumps(key, sort_keys=True, default=str))


class LatencyTable:
    """Measured Latencies by key in one small JSON file ({"schema", "entries": [Latencies.to_json(), ...]}).
    `get` returns the entry whose key equals the asked one; `put` adds or replaces by key (the newest
    TABLE_MAX_ENTRIES kept) with an atomic write. A damaged file (unreadable, not JSON, wrong shape, an entry
    out of shape) is ignored — a miss — and replaced by the next `put`; neither raises on it. A `put` that cannot
    write returns False and says why in `error` (the numbers are then merely measured again next time)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.error: str | None = None

    def _entries(self) -> list:
        try:
            if self.path.stat().st_size > TABLE_MAX_BYTES:
                return []
            data = json.loads(read_regular(self.path))
        except (OSError, ValueError, RecursionError):  # missing, a folder, not UTF-8, not JSON, nested too deep
            return []
        if not isinstance(data, dict) or data.get("schema") != TABLE_SCHEMA or not isinstance(data.get("entries"), list):
            return []
        return data["entries"]

    def get(self, key: dict) -> Latencies | None:
        want = _norm(key)
        for entry in reversed(self._entries()):
            if isinstance(entry, dict) and entry.get("key") == want:
                try:
                    return Latencies.from_json(entry)
                except (TypeError, ValueError):
                    return None
        return None

    def known_hash(self, signature: str) -> str | None:
        """The target content hash an entry was measured under when its files had `signature` (their names,
        sizes and mtimes): a later run on the same files skips re-reading the whole target to hash it."""
        for entry in reversed(self._entries()):
            key = entry.get("key") if isinstance(entry, dict) else None
            if isinstance(key, dict) and key.get("target_stat") == signature and isinstance(key.get("target"), str):
                return key["target"]
        return None

    def put(self, lat: Latencies) -> bool:
        from remote_payload.contract.protocol import atomic_write_json
        want = _norm(lat.key)
        entries = [e for e in self._entries() if not (isinstance(e, dict) and e.get("key") == want)]
        entries = [*entries, _norm(lat.to_json())][-TABLE_MAX_ENTRIES:]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, {"schema": TABLE_SCHEMA, "entries": entries})
        except OSError as e:
            self.error = f"cannot write {self.path}: {e}"
            return False
        self.error = None
        return True
