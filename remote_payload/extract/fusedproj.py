"""q/k/v and gate/up as one GEMM each in extract's decode steps (issue 33 item 2).

At batch 32 a decode step's GEMMs read the weights with M = 32 rows: seven small GEMMs a layer (q, k, v, o,
gate, up, down) each pay cuBLAS's split-K set-up and reduction; q/k/v as one [q;k;v] weight and gate/up as one
[gate;up] make it four. The concatenated weight is made once per model (`concatenated`) and each Linear's weight
becomes a view of its rows (`param.data` rebound): the model's own forward (the prefill) reads the same numbers
from the same layout, and no second copy of the weights is kept. While `Projections` is entered, the q_proj of an
attention computes the one GEMM and hands k_proj and v_proj their columns (a call on other inputs runs the
Linear's own); the MLP's forward (fastgen's `_mlp_forward`) reads gate and up from one GEMM. Only the classes
fastgen names (Qwen3 / Qwen2 / Llama), whose forwards call q, k, v on one input in that order.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
_ATTENTION = {"qwen3": "Qwen3Attention", "qwen2": "Qwen2Attention", "llama": "LlamaAttention"}


def projections_available(device, dtype) -> bool:
    """The decode steps' fused projections: CUDA in a 16-bit dtype (where a step's GEMMs read the weights at a
    small M), REVAL_DECODE_PROJ not `separate`, REVAL_DECODE_FUSED not 0 (the model's own layers throughout)."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and os.environ.get("REVAL_DECODE_PROJ") != "separate" and os.environ.get("REVAL_DECODE_FUSED") != "0")


def _attention_classes() -> tuple:
    import importlib
    out = []
    for name, cls in _ATTENTION.items():
        try:
            mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        if hasattr(mod, cls):
            out.append(getattr(mod, cls))
    return tuple(out)


def linears(module, names: tuple[str, ...]) -> list | None:
    """The module's Linears of those names, when they can be one GEMM: plain nn.Linear (no forward of their
    own: hooks), one input size, dtype and device, all with a bias or none."""
    ls = [getattr(module, n, None) for n in names]
    if not all(type(x) is torch.nn.Linear and "forward" not in x.__dict__ for x in ls):
        return None
    w0 = ls[0].weight
    if any(x.weight.shape[1] != w0.shape[1] or x.weight.dtype != w0.dtype or x.weight.device != w0.device
           for x in ls) or len({x.bias is None for x in ls}) != 1:
        return None
    return ls


def concatenated(module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    """(weight [sum of outputs, in], bias or None, output sizes) of the module's Linears `names`, made once: the
    Linears' weights (and biases) are rebound as views of it, so the memory is the same as before. Made again if
    they are no longer its views (the model moved or reloaded them)."""
    ls = linears(module, names)
    if ls is None:
        return None
    kept = module.__dict__.get("_reval_cat_" + names[0])
    if kept is not None and _still_views(ls, kept):
        return kept
    with torch.no_grad():
        weight = torch.cat([x.weight.data for x in ls])
        bias = None if ls[0].bias is None else torch.cat([x.bias.data for x in ls])
        sizes, at = [x.weight.shape[0] for x in ls], 0
        for x, n in zip(ls, sizes):
            x.weight.data = weight[at:at + n]
            if bias is not None:
                x.bias.data = bias[at:at + n]
            at += n
    module.__dict__["_reval_cat_" + names[0]] = kept = (weight, bias, sizes)
    return kept


def _still_views(ls, kept) -> bool:
    weight, bias, sizes = kept
    at = 0
    for x, n in zip(ls, sizes):
        if x.weight.data_ptr() != weight[at:at + n].data_ptr() or x.weight.shape != weight[at:at + n].shape:
            return False
        if bias is not None and x.bias.data_ptr() != bias[at:at + n].data_ptr():
            return False
        at += n
    return True


def _qkv_forwards(attn, weight, bias, sizes):
    """Forwards for attn's q_proj, k_proj, v_proj: q's computes [q;k;v] in one GEMM and keeps k and v for the
    k_proj and v_proj calls on the same input. Without a q/k norm (Llama, Qwen2) q and k are made contiguous
    (the RoPE pass takes contiguous heads); Qwen3's q/k norms take the strided heads and write them contiguous."""
    q_lin, k_lin, v_lin = (getattr(attn, n) for n in QKV)
    contiguous = not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm"))
    kept: dict = {}

    def q(x):
        qs, ks, vs = F.linear(x, weight, bias).split(sizes, dim=-1)
        kept.update(x=x, k=ks.contiguous() if contiguous else ks, v=vs)
        return qs.contiguous() if contiguous else qs

    def k(x):
        return kept.pop("k") if kept.get("x") is x and "k" in kept else F.linear(x, k_lin.weight, k_lin.bias)

    def v(x):
        if kept.get("x") is x and "v" in kept:
            kept.pop("x")
            return kept.pop("v")
        return F.linear(x, v_lin.weight, v_lin.bias)
    return {q_lin: q, k_lin: k, v_lin: v}


class Projections:
    """While entered, every attention of the classes named above computes q/k/v as one GEMM (per-instance
    forwards on its q/k/v Linears, removed on exit). `gate_up(mlp)` gives an MLP's [gate;up] weight for the
    MLP forward fastgen installs. `active` where `projections_available` says so."""

    def __init__(self, model, enabled: bool = True):
        p = next(model.parameters())
        self.model, self.swapped = model, []
        self.active = enabled and projections_available(p.device, p.dtype)

    def attentions(self) -> list:
        classes = _attention_classes()
        return [m for m in self.model.modules() if classes and isinstance(m, classes) and type(m) in classes
                and linears(m, QKV) is not None]

    def gate_up(self, mlp):
        return concatenated(mlp, GATE_UP) if self.active else None

    def __enter__(self):
        if not self.active:
            return self
        for attn in self.attentions():
            weight, bias, sizes = concatenated(attn, QKV)
            for lin, fn in _qkv_forwards(attn, weight, bias, sizes).items():
                lin.forward = fn
                self.swapped.append(lin)
        return self

    def __exit__(self, *exc):
        for m in self.swapped:
            m.__dict__.pop("forward", None)
        self.swapped = []
