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

import os

import torch

from remote_payload.eval.kernels import _load_triton
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

def split_kv_available(device, dtype, head_dim: int) -> bool:
    """Whether the decode steps can attend with the split-KV Triton kernels: CUDA, a 16-bit dtype, a power-of-two
    head size, Triton installed, REVAL_DECODE_ATTENTION not `grouped`."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim >= 16
            and head_dim & (head_dim - 1) == 0 and os.environ.get("REVAL_DECODE_ATTENTION") != "grouped"
            and bool(_load_triton()))


def split_kv_runs(query, key, value) -> bool:
    return (split_kv_available(query.device, query.dtype, query.shape[-1]) and key.dtype == query.dtype
            and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1)


def _splits(programs: int, device) -> int:
    """Parts each row's filled slots are cut into: enough programs for ~4 per SM, at most 16."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(16, -(-4 * sms // programs)))


def _split_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                  filled: torch.Tensor, scale: float, splits: int = 0) -> torch.Tensor:
    kernels = _load_triton()
    B, H, _, d = query.shape
    Hkv = key.shape[1]
    G = H // Hkv
    S = splits or _splits(B * Hkv, query.device)
    gp = max(16, 1 << (G - 1).bit_length())
    part = torch.empty(B * Hkv * S * G * d, dtype=torch.float32, device=query.device)
    ml = torch.empty(B * Hkv * S * 2 * G, dtype=torch.float32, device=query.device)
    out = torch.empty((B, 1, H, d), dtype=query.dtype, device=query.device)
    m2 = mask[:, 0, -1, :]  # [B, >= L] additive
    kernels["decode_split"][(B * Hkv, S)](
        query, key, value, m2, filled, part, ml, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        key.stride(2), value.stride(0), value.stride(1), value.stride(2), m2.stride(0), m2.stride(1), scale,
        HKV=Hkv, G=G, GP=gp, D=d, S=S, BLOCK_N=64)
    kernels["decode_combine"][(B * Hkv,)](part, ml, out, out.stride(0), out.stride(2), HKV=Hkv, G=G, GP=gp, D=d, S=S)
    return out


def _split_decode_fake(query, key, value, mask, filled, scale):
    B, H, _, d = query.shape
    return query.new_empty((B, 1, H, d))


_split_op = None


def split_decode_attention(query, key, value, mask, filled, scale: float):
    """One new token per row over the static cache, reading its filled slots only (`filled` = the step's cache
    position, on the device: graph-safe): [B, 1, H, d]. A torch custom op where torch has them, so that
    torch.compile calls it as one opaque kernel."""
    global _split_op
    if _split_op is None:
        _split_op = _split_decode
        lib = getattr(torch, "library", None)
        if hasattr(lib, "custom_op"):
            try:
                op = lib.custom_op("reval::split_decode_attention", mutates_args=())(_split_decode)
                op.register_fake(_split_decode_fake)
                _split_op = op
            except Exception:  # noqa: BLE001 - registered already (a reload) or an older API: call it directly
                _split_op = _split_decode
    return _split_op(query, key, value, mask, filled, float(scale))


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

    def plan(self) -> list[tuple]:
        """(kind, module or modeling module, replacement) for what this model would have replaced."""
        from remote_payload.eval import kernels
        norms, mlps = _fusable()
        out, modeling = [], set()
        for m in self.model.modules():
            if "forward" in m.__dict__:
                continue
            if type(m) in norms:
                out.append(("norm", m, _norm_forward(m, kernels)))
            elif type(m) in mlps and _silu(m.act_fn):
                out.append(("mlp", m, _mlp_forward(m, kernels)))
            if type(m) in norms or type(m) in mlps:
                modeling.add(norms.get(type(m)) or mlps.get(type(m)))
        for mod in sorted(modeling, key=lambda x: x.__name__):
            if callable(getattr(mod, "apply_rotary_pos_emb", None)):
                out.append(("rope", mod, _rope_function(mod.apply_rotary_pos_emb, kernels)))
        return out

    def __enter__(self):
        if not self.active:
            return self
        for kind, target, fn in self.plan():
            if kind == "rope":
                self.globals.append((target, target.apply_rotary_pos_emb))
                target.apply_rotary_pos_emb = fn
            else:
                target.forward = fn
                self.swapped.append(target)
            self.counts[kind] = self.counts.get(kind, 0) + 1
        return self

    def __exit__(self, *exc):
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


def _mlp_forward(m, kernels):
    def forward(x):
        gate, up = m.gate_proj(x), m.up_proj(x)
        act = kernels.silu_and_mul(gate, up, always=True)
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
    if not fl.active:
        return None
    counts: dict[str, int] = {}
    for kind, _, _ in fl.plan():
        counts[kind] = counts.get(kind, 0) + 1
    names = {"norm": "RMSNorm x{}", "mlp": "SiLU * up x{}", "rope": "RoPE"}
    return ", ".join(names[k].format(n) for k, n in counts.items()) + " as Triton passes (fastgen.FusedLayers)" \
        if counts else None


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
                  fused: bool = True, sampler=None) -> list[list[int]]:
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
    its uniforms are on the device before the loop) instead of the argmax."""
    with _DecodeAttention(model, grouped_attention) as attention:
        return _greedy_static(model, prompts, max_new_tokens, eos_ids, pad_id, graphs=graphs, compile=compile,
                              eos_every=eos_every, bucket=bucket, phases=phases, attention=attention,
                              fused=FusedLayers(model, enabled=fused and not compile), sampler=sampler)


@torch.no_grad()
def _greedy_static(model, prompts, max_new_tokens, eos_ids, pad_id, *, graphs, compile, eos_every, bucket, phases,
                   attention, fused, sampler):
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
    cache = _static_cache(model, B, L, dev, dtype)
    logits = model(input_ids=ids, attention_mask=pre_mask, position_ids=pos, cache_position=torch.arange(P, device=dev),
                   use_cache=True, logits_to_keep=1, **{cache_kw(model): cache}).logits
    pick = None if sampler is None else sampler.to(dev)
    first = (logits[:, -1].argmax(-1) if pick is None else pick(logits[:, -1], 0))[:, None]  # [B, 1]
    clock("prefill_s")

    with fused:  # the decode steps only: the prefill (and its first token) is the model's own code
        # decode buffers (fixed for the whole loop): the token to feed, its position, its cache slot, the mask
        tok = first.clone()
        posb = (lens.to(dev)[:, None]).clone()  # the first completion token's position = the prompt's length
        cp = torch.tensor([P], dtype=torch.long, device=dev)
        attention.filled(cp)
        mask = torch.zeros((B, 1, 1, L), dtype=dtype, device=dev).masked_fill_(~real[:, None, None, :], neg)
        mask[..., P] = 0.0  # slot P: the first completion token, fed by the first step
        out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=dev)
        out[:, :1] = first
        step = _StaticStep(model, cache, tok, posb, cp, mask, out, P - 1,  # step k writes column cp - (P - 1)
                           forward=_compiled(model) if compile else None, pick=pick)
        done = 1
        if graphs and max_new_tokens > 3:
            side = torch.cuda.Stream()  # warm-up (allocations, kernel choice, compilation): 2 real steps
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
                step()
            torch.cuda.current_stream().wait_stream(side)
            done = 3
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
    if phases is not None:
        phases["decode_steps"] = done - (3 if step.graph is not None else 1)
    result = []
    for p, r in zip(prompts, rows):
        comp = []
        for t in r:
            comp.append(t)
            if t in eos_ids:
                break
        result.append(list(p) + comp)
    return result
