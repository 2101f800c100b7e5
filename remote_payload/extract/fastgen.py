"""Greedy decoding at the GPU's memory-bandwidth pace: a static KV cache, one fixed-shape decode step captured
as a CUDA graph, the argmax on the device and eos looked at every few steps (no host sync per step).

`greedy_static` computes what `decode.greedy_complete_batch` computes (left padding, pads masked out, positions
counted from each prompt's first real token; a row ends at its eos, kept): the same model, the same masks, the
keys of a row being its prompt and its completion so far. What differs is the shape: the KV cache holds
`P + max_new_tokens (+1)` slots from the start (StaticCache), so every decode step has the same shapes and one
captured graph replays it. The attention mask is built here as a 4D additive mask (transformers uses a 4D mask
as given), so nothing in the step depends on host-side values.

On the CPU (or with graphs=False) the same step runs eagerly: the tests compare it with the dynamic-cache
decoder token for token.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F

from remote_payload.eval.kernels import _load_triton
from remote_payload.extract.fusedproj import Projections
from remote_payload.extract.splitkv import split_decode_attention, split_kv_available, split_kv_runs
from remote_payload.extract.staticcache import reset_static_cache
from remote_payload.extract.staticcache import static_cache as _static_cache


def _bucket(n: int, to: int) -> int:
    return -(-n // to) * to


def cache_kw(model) -> str:
    """The forward's name for the KV cache: `cache` in newer transformers, `past_key_values` before."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class _StaticStep:
    """One decode step over fixed buffers: reads tok/pos/cp/mask, writes the argmax into out and advances them.
    Every forward on the cache runs once, in order: StaticCache writes at its own counter (staticcache.py)."""

    def __init__(self, model, cache, tok, pos, cp, mask, out, P: int, forward=None, pick=None):
        self.model, self.cache, self.P, self.kw, self.pick = model, cache, P, cache_kw(model), pick
        self.forward = forward or model
        self.tok, self.pos, self.cp, self.mask, self.out = tok, pos, cp, mask, out
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self) -> None:
        logits = self.forward(input_ids=self.tok, attention_mask=self.mask, position_ids=self.pos,
                            cache_position=self.cp, use_cache=True, logits_to_keep=1,
                            **{self.kw: self.cache}).logits  # [B, 1, V]
        nxt = (logits[:, -1].argmax(-1) if self.pick is None else self.pick(logits[:, -1], self.cp - self.P))[:, None]
        self.out.index_copy_(1, self.cp - self.P, nxt)  # out [B, max_new]: column cp-P
        self.tok.copy_(nxt)
        self.pos.add_(1)
        self.mask.index_fill_(3, self.cp + 1, 0.0)  # the next token's slot becomes visible
        self.cp.add_(1)

    def capture(self) -> None:
        """Capture one step as a CUDA graph. The steps before it ran for real (the warm-up is real progress), so
        every state the model or the cache keeps on the device, ours or its own, stays consistent."""
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self()

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self()


DECODE_ATTENTION = "reval_grouped_decode"


def grouped_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """Attention for one new token per row, the query heads of a KV head grouped onto it: scores [B, Hkv, G, L]
    = q [B, Hkv, G, d] @ K^T, the additive mask, a float32 softmax, @ V. Each K and V is read once, with no
    copy (SDPA's GQA path repeats K and V per query head, and its flash kernels pad the one query row to a
    16-128-row tile). Anything else (a prefill, a window, soft-capping, sinks, dropout) goes to the model's own
    attention, unchanged."""
    B, H, q, d = query.shape
    Hkv = key.shape[1]
    special = any(kwargs.get(k) is not None for k in ("sliding_window", "softcap", "s_aux", "position_bias"))
    if q != 1 or special or dropout or H % Hkv or attention_mask is None or attention_mask.dim() != 4:
        own = _resolve(_ORIGINAL.get(id(module.config)))
        return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = d ** -0.5 if scaling is None else scaling
    filled = _FILLED.get(id(module.config))  # the step's cache position on the device, while greedy_static runs
    if filled is not None and split_kv_runs(query, key, value):
        return split_decode_attention(query, key, value, attention_mask, filled, scale), None
    qg = query.reshape(B, Hkv, H // Hkv, d)
    scores = torch.matmul(qg, key.transpose(-1, -2)).float() * scale  # [B, Hkv, G, L]
    scores = scores + attention_mask[:, :, -1:, :key.shape[2]].float()  # [B, 1, 1, L]
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, Hkv, G, d]
    return out.reshape(B, H, 1, d).transpose(1, 2), None  # [B, 1, H, d], as the interface returns


_ORIGINAL: dict[int, str] = {}  # id(config) -> its own attention implementation while greedy_static runs
_FILLED: dict[int, torch.Tensor] = {}  # id(config) -> the decode step's cache position (device) for split-KV


def _resolve(name):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if name in (None, "eager"):
        from transformers.models.llama.modeling_llama import eager_attention_forward
        return eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _attention_interface():
    """transformers' AttentionInterface, or None in a transformers without it (the model's attention stays)."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return None
    return AttentionInterface


def decode_attention_name(model) -> str:
    """What greedy_static's decode steps attend with on this model (cache.json's generation record)."""
    if _attention_interface() is None:
        return str(getattr(model.config, "_attn_implementation", None))
    p = next(model.parameters())
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    how = ("split-KV Triton kernels over the filled slots, fastgen.split_decode_attention"
           if split_kv_available(p.device, p.dtype, d) else "fastgen.grouped_decode_attention")
    return f"{DECODE_ATTENTION} ({how}; the prefill: the model's own)"


class _DecodeAttention:
    """While entered, the model's attention layers call `grouped_decode_attention` (registered with
    transformers' AttentionInterface); its own implementation serves everything else and is restored on exit.
    A transformers without the interface keeps its own attention (`active` False)."""

    def __init__(self, model, enabled: bool = True):
        self.cfg, self.active = model.config, False
        if not enabled:
            return
        interface = _attention_interface()
        if interface is None:
            return
        interface.register(DECODE_ATTENTION, grouped_decode_attention)
        self.active = True

    def __enter__(self):
        if self.active:
            _ORIGINAL[id(self.cfg)] = self.cfg._attn_implementation
            self.cfg._attn_implementation = DECODE_ATTENTION
        return self

    def filled(self, cp: torch.Tensor) -> None:
        """The decode steps' cache position (a device tensor the steps advance): split-KV reads it."""
        if self.active:
            _FILLED[id(self.cfg)] = cp

    def __exit__(self, *exc):
        if self.active:
            self.cfg._attn_implementation = _ORIGINAL.pop(id(self.cfg))
            _FILLED.pop(id(self.cfg), None)


# transformers' blocks whose forward FusedLayers replaces by one Triton pass while the decode steps run: the
# classes are named (their code is the formula the kernel computes), never matched by name or shape alone
_FUSABLE = {"qwen3": ("Qwen3RMSNorm", "Qwen3MLP"), "qwen2": ("Qwen2RMSNorm", "Qwen2MLP"),
            "llama": ("LlamaRMSNorm", "LlamaMLP")}


def _fusable():
    """{norm class: module, mlp class: module} for the transformers modules above that import here."""
    import importlib
    norms, mlps = {}, {}
    for name, (norm, mlp) in _FUSABLE.items():
        try:
            mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        if hasattr(mod, norm):
            norms[getattr(mod, norm)] = mod
        if hasattr(mod, mlp):
            mlps[getattr(mod, mlp)] = mod
    return norms, mlps


def fused_available(device, dtype) -> bool:
    """Whether FusedLayers runs its kernels: CUDA, bf16, Triton installed, REVAL_DECODE_FUSED not 0,
    REVAL_TORCH_KERNELS unset."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and os.environ.get("REVAL_DECODE_FUSED") != "0"
            and not os.environ.get("REVAL_TORCH_KERNELS") and bool(_load_triton()))


def _silu(act) -> bool:
    """act is F.silu: torch's module or transformers' (whose forward is F.silu)."""
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return type(act) is torch.nn.SiLU
    return type(act) in (torch.nn.SiLU, SiLUActivation)


class FusedLayers:
    """While entered, the model's RMSNorms, SiLU MLPs and RoPE (of the transformers classes in `_FUSABLE`) run
    as one Triton pass each (kernels.rms_norm, silu_and_mul, rope): eager, a layer's elementwise work is ~40
    small kernels, which at batch 32 cost a decode step more than its attention. RoPE and SiLU * up give torch's
    numbers bit for bit; RMSNorm its roundings with Triton's summation order. A call the kernels do not take
    (another shape, dtype, layout) runs the model's own code. Per-instance forwards (and the modeling module's
    apply_rotary_pos_emb), all restored on exit; a module with a forward of its own already (hooks) is left alone.
    Active where `fused_available` says so."""

    def __init__(self, model, enabled: bool = True):
        self.model, self.swapped, self.globals = model, [], []
        self.counts: dict[str, int] = {}
        p = next(model.parameters())
        self.active = enabled and fused_available(p.device, p.dtype)
        self.proj = Projections(model, enabled)  # q/k/v and gate/up as one GEMM each (fusedproj.py)
        self.projections = self.proj.active

    def plan(self) -> list[tuple]:
        """(kind, module or modeling module) for what this model would have replaced: the Triton passes where
        `active`, the MLPs' one gate/up GEMM where only `projections` is."""
        norms, mlps = _fusable()
        out, modeling = [], set()
        for m in self.model.modules():
            if "forward" in m.__dict__:
                continue
            if type(m) in norms and self.active:
                out.append(("norm", m))
            elif type(m) in mlps and _silu(m.act_fn) and (self.active or self.proj.gate_up(m) is not None):
                out.append(("mlp", m))
            if type(m) in norms or type(m) in mlps:
                modeling.add(norms.get(type(m)) or mlps.get(type(m)))
        for mod in sorted(modeling, key=lambda x: x.__name__):
            if self.active and callable(getattr(mod, "apply_rotary_pos_emb", None)):
                out.append(("rope", mod))
        return out

    def __enter__(self):
        from remote_payload.eval import kernels
        if not (self.active or self.projections):
            return self
        triton = kernels if self.active else None
        for kind, target in self.plan():
            if kind == "rope":
                self.globals.append((target, target.apply_rotary_pos_emb))
                target.apply_rotary_pos_emb = _rope_function(target.apply_rotary_pos_emb, kernels)
            else:
                target.forward = (_norm_forward(target, kernels) if kind == "norm"
                                  else _mlp_forward(target, triton, self.proj.gate_up(target)))
                self.swapped.append(target)
            self.counts[kind] = self.counts.get(kind, 0) + 1
        self.proj.__enter__()
        if self.proj.swapped:
            self.counts["qkv"] = len(self.proj.swapped) // 3
        return self

    def __exit__(self, *exc):
        self.proj.__exit__(*exc)
        for m in self.swapped:
            m.__dict__.pop("forward", None)
        for mod, fn in self.globals:
            mod.apply_rotary_pos_emb = fn
        self.swapped, self.globals = [], []


def _norm_forward(m, kernels):
    def forward(hidden_states):
        out = kernels.rms_norm(hidden_states, m.weight, m.variance_epsilon, always=True)
        return out if out is not None else type(m).forward(m, hidden_states)
    return forward


def _mlp_forward(m, kernels, gate_up=None):
    """down(silu(gate) * up): silu * up one Triton pass (kernels given), gate and up one GEMM (gate_up given:
    fusedproj.concatenated's weight, bias, sizes)."""
    def forward(x):
        if gate_up is not None:
            gate, up = F.linear(x, gate_up[0], gate_up[1]).split(gate_up[2], dim=-1)
        else:
            gate, up = m.gate_proj(x), m.up_proj(x)
        act = None if kernels is None else kernels.silu_and_mul(gate, up, always=True)
        return m.down_proj(act if act is not None else m.act_fn(gate) * up)
    return forward


def _rope_function(own, kernels):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kw):
        # a decode step: q [B, H, 1, d] and k [B, Hkv, 1, d], views of [B, 1, H, d] rows; cos/sin [B, 1, d]
        if (not args and not kw and q.dim() == k.dim() == 4 and q.shape[2] == k.shape[2] == 1
                and cos.dim() == sin.dim() == 3 and cos.shape[1] == 1):
            cs, sn = cos.unsqueeze(2), sin.unsqueeze(2)
            qo = kernels.rope(q.transpose(1, 2), cs, sn, always=True)
            ko = kernels.rope(k.transpose(1, 2), cs, sn, always=True) if qo is not None else None
            if ko is not None:
                return qo.transpose(1, 2), ko.transpose(1, 2)
        return own(q, k, cos, sin, *args, **kw)
    return apply_rotary_pos_emb


def decode_fused_name(model, compile: bool = False) -> str | None:
    """What FusedLayers replaces on this model (cache.json's generation record), or None."""
    if compile:
        return None
    fl = FusedLayers(model)
    counts: dict[str, int] = {}
    for kind, _ in fl.plan():
        counts[kind] = counts.get(kind, 0) + 1
    parts = []
    if fl.active and counts:
        names = {"norm": "RMSNorm x{}", "mlp": "SiLU * up x{}", "rope": "RoPE"}
        parts.append(", ".join(names[k].format(n) for k, n in counts.items()) + " as Triton passes")
    qkv = len(fl.proj.attentions()) if fl.projections else 0
    if qkv or (fl.projections and counts.get("mlp")):
        parts.append(f"q/k/v x{qkv} and gate/up x{counts.get('mlp', 0)} one GEMM each")
    return "; ".join(parts) + " (fastgen.FusedLayers)" if parts else None


def _compiled(model):
    """model.forward through torch.compile (fusion only: the CUDA graph is ours), once per model."""
    fn = getattr(model, "_reval_compiled_forward", None)
    if fn is None:
        fn = torch.compile(model.forward, dynamic=False)
        model._reval_compiled_forward = fn
    return fn


class _Phases:
    """Seconds between marks, synced, into a dict; nothing at all when the dict is None."""

    def __init__(self, out: dict | None, dev):
        import time
        self.out, self.dev, self.now = out, dev, time.perf_counter
        self.t = self.now() if out is not None else 0.0

    def __call__(self, key: str) -> None:
        if self.out is None:
            return
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        t = self.now()
        self.out[key] = t - self.t
        self.t = t


def greedy_static(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int], pad_id: int = 0, *,
                  graphs: bool | None = None, compile: bool = False, eos_every: int = 16,
                  bucket: int = 64, phases: dict | None = None, grouped_attention: bool = True,
                  fused: bool = True, sampler=None, reuse: bool = True) -> list[list[int]]:
    """Greedy completions of `prompts` (token id lists) at once; rows as `greedy_complete_batch` returns them.

    graphs: capture the decode step as a CUDA graph (default: on CUDA). eos_every: steps between the host's
    looks at the generated tokens (the only syncs of the loop). bucket: the padded prompt length is a multiple
    of it, so a few shapes serve many batches. compile: run the step through torch.compile (kernel fusion;
    compiled once per model and shape) before capturing it. phases: when given a dict, it receives the seconds
    of each phase (prefill, warm-up + capture, decode, the steps decoded), at the cost of a sync per phase.
    grouped_attention: the decode steps' attention is `grouped_decode_attention` (the prefill's stays the
    model's own); on CUDA in bf16/fp16 with Triton, its split-KV kernels (`split_decode_attention`: the filled
    slots only; REVAL_DECODE_ATTENTION=grouped keeps the torch matmuls). fused: the decode steps' RMSNorms, SiLU
    MLPs and RoPE as one Triton pass each (`FusedLayers`: CUDA, bf16; not with compile, which fuses them itself;
    REVAL_DECODE_FUSED=0 keeps the model's own). sampler: decode.Sampler, the sampled regime's pick (in the graph:
    its uniforms are on the device before the loop) instead of the argmax. reuse: keep the static cache, the
    step's buffers and its captured graph on the model for the next call of the same shape (`_Shape`: one capture
    per extract, one shape's cache held between calls; the same tokens as a fresh state); False: made and freed
    per call."""
    with _DecodeAttention(model, grouped_attention) as attention:
        return _greedy_static(model, prompts, max_new_tokens, eos_ids, pad_id, graphs=graphs, compile=compile,
                              eos_every=eos_every, bucket=bucket, phases=phases, attention=attention,
                              fused=FusedLayers(model, enabled=fused and not compile), sampler=sampler,
                              reuse=reuse)


class _Shape:
    """One decode shape's fixed state: the StaticCache, the step's buffers (token, position, slot, mask, output,
    the sampler's uniforms) and, once captured, the step's CUDA graph. Kept on the model (`_reval_decode`) and
    reused by every later batch of the same key (batch rows, padded prompt, cache length, the step's kernels):
    one capture per extract, not per batch. Each batch resets the cache and loads its own values into these
    very tensors, which the graph reads and advances."""

    def __init__(self, key: tuple, model, B: int, P: int, L: int, max_new: int, dev, dtype, pick, forward):
        self.key, self.P = key, P
        self.cache = _static_cache(model, B, L, dev, dtype)
        self.tok, self.pos = (torch.zeros((B, 1), dtype=torch.long, device=dev) for _ in range(2))
        self.cp = torch.zeros(1, dtype=torch.long, device=dev)
        self.mask = torch.zeros((B, 1, 1, L), dtype=dtype, device=dev)
        self.out = torch.zeros((B, max_new), dtype=torch.long, device=dev)
        self.pick = None if pick is None else dataclasses.replace(pick, uniforms=torch.empty_like(pick.uniforms))
        self.step = _StaticStep(model, self.cache, self.tok, self.pos, self.cp, self.mask, self.out,
                                P - 1, forward=forward, pick=self.pick)  # step k writes column cp - (P - 1)
        self.used = False

    def load(self, first, lens, real, neg: float, pad_id: int, pick) -> None:
        """A batch's decode values, in place: after the prefill of P slots the first completion token is fed at
        slot P (visible), its position the prompt's length; slots after P masked until their step."""
        P = self.P
        self.tok.copy_(first)
        self.pos.copy_(lens.to(self.pos.device)[:, None])
        self.cp.fill_(P)
        self.mask.zero_().masked_fill_(~real[:, None, None, :], neg)
        self.mask[..., P] = 0.0  # slot P: the first completion token, fed by the first step
        self.out.fill_(pad_id)
        self.out[:, :1] = first
        if pick is not None:
            self.pick.uniforms.copy_(pick.uniforms)


def _shape_for(model, key: tuple, reuse: bool, make) -> _Shape:
    """The kept state of `key` with its cache reset (staticcache.reset_static_cache), or a new one (the kept
    state of another key is dropped first: one cache at a time)."""
    kept = model.__dict__.pop("_reval_decode", None)
    if reuse and kept is not None and kept.key == key and reset_static_cache(kept.cache):
        return kept
    del kept
    return make()


@torch.no_grad()
def _greedy_static(model, prompts, max_new_tokens, eos_ids, pad_id, *, graphs, compile, eos_every, bucket, phases,
                   attention, fused, sampler, reuse):
    clock = _Phases(phases, next(model.parameters()).device)
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    graphs = dev.type == "cuda" if graphs is None else graphs
    B = len(prompts)
    P = _bucket(max(len(p) for p in prompts), bucket)
    L = P + max_new_tokens + 1  # +1: the slot the step after the last one would make visible
    lens = torch.tensor([len(p) for p in prompts])
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    real = torch.zeros((B, L), dtype=torch.bool)  # key slots holding a real token of the row
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        real[i, P - len(p):P] = True
    ids, real = ids.to(dev), real.to(dev)
    neg = torch.finfo(dtype).min
    # prefill: query i (slot i) sees key slot j iff j <= i and j is real; a pad query sees itself (kept finite)
    slots = torch.arange(P, device=dev)
    causal = slots[None, :] <= slots[:, None]  # [P, P]
    vis = causal[None] & real[:, None, :P]  # [B, P, P]
    vis |= torch.eye(P, dtype=torch.bool, device=dev)[None]
    pre_mask = torch.zeros((B, 1, P, L), dtype=dtype, device=dev).masked_fill_(
        ~torch.cat([vis, torch.zeros((B, P, L - P), dtype=torch.bool, device=dev)], 2)[:, None], neg)
    pos = (real[:, :P].long().cumsum(1) - 1).clamp(min=0)  # [B, P]
    pick = None if sampler is None else sampler.to(dev)
    key = (B, P, L, max_new_tokens, dtype, graphs, compile, attention.active, fused.active, fused.projections,
           os.environ.get("REVAL_DECODE_ATTENTION"), None if pick is None else pick.transform)
    state = _shape_for(model, key, reuse, lambda: _Shape(key, model, B, P, L, max_new_tokens, dev, dtype, pick,
                                                         _compiled(model) if compile else None))
    logits = model(input_ids=ids, attention_mask=pre_mask, position_ids=pos, cache_position=torch.arange(P, device=dev),
                   use_cache=True, logits_to_keep=1, **{cache_kw(model): state.cache}).logits
    first = (logits[:, -1].argmax(-1) if pick is None else pick(logits[:, -1], 0))[:, None]  # [B, 1]
    clock("prefill_s")

    with fused:  # the decode steps only: the prefill (and its first token) is the model's own code
        state.load(first, lens, real, neg, pad_id, pick)
        attention.filled(state.cp)
        step, out, done, captured = state.step, state.out, 1, False
        if graphs and max_new_tokens > 3 and step.graph is None:
            side = torch.cuda.Stream()  # warm-up (allocations, kernel choice, compilation): 2 real steps
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
                step()
            torch.cuda.current_stream().wait_stream(side)
            done, captured = 3, True
            step.capture()
        clock("capture_s")
        eos = torch.tensor(sorted(eos_ids) or [-1], device=dev)
        while done < max_new_tokens:
            n = min(eos_every, max_new_tokens - done)
            for _ in range(n):
                step.step()
            done += n
            if bool(torch.isin(out[:, :done], eos).any(1).all()):  # one host sync per eos_every steps
                break
    rows = out[:, :done].tolist()
    clock("decode_s")
    if reuse:
        model._reval_decode = state
    if phases is not None:
        phases["decode_steps"] = done - (3 if captured else 1)
        phases["captured"] = captured
    result = []
    for p, r in zip(prompts, rows):
        comp = []
        for t in r:
            comp.append(t)
            if t in eos_ids:
                break
        result.append(list(p) + comp)
    return result
