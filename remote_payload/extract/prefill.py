"""The feature prefill of `extract`: several sequences (prompt + completion) in one causal forward, RIGHT-padded,
keeping the tapped layers' hidden states hs[l+1] (target.forward's `tapped_features` numbers, bit for bit) and the
argmax agreement at the completion positions (`prefill_batch`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from remote_payload.eval.sampling import token_logprobs
from remote_payload.target.forward import last_logits_kw


class _Stop(Exception):  # not an error: raised by a hook to end a forward early
    """Raised by `prefill_batch`'s hook once everything it needs is computed: the rest of the forward is skipped."""


def _decoder_stack(model):
    """(the decoder: the module whose output is the final-normed last hidden state, its decoder blocks) of a HF
    causal LM, or None when not found (prefill_batch then asks for every hidden state)."""
    n = model.config.get_text_config().num_hidden_layers
    for get in (lambda m: m.get_decoder(), lambda m: m.model, lambda m: m.model.language_model):
        try:
            base = get(model)
        except (AttributeError, NotImplementedError, TypeError):
            continue
        layers = getattr(base, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
            return base, layers
    return None


def _block_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _decoder_output(out) -> torch.Tensor:
    h = getattr(out, "last_hidden_state", None)
    return h if h is not None else out[0]


@dataclass
class Prefill:
    """`prefill_batch`'s result: features [B, T, len(layer_ids), H] (right-padded to T = the longest sequence;
    row i's first lens[i] positions are its own) and, when asked for, agree [B, 2] = per row (positions where the
    target's argmax is the next token, completion positions)."""
    features: torch.Tensor
    lens: list[int]
    agree: torch.Tensor | None = None
    logp: torch.Tensor | None = None  # sampled regime: [sum of completion lengths] fp32, row after row

    def rows(self) -> list[torch.Tensor]:
        return [self.features[i, :n] for i, n in enumerate(self.lens)]


@torch.no_grad()
def prefill_batch(model, seqs: list[torch.Tensor], layer_ids: list[int], prompt_lens: list[int] | None = None,
                  *, chunk_logits: int = 1 << 28, transform: tuple | None = None) -> Prefill:
    """Several sequences in one causal prefill, RIGHT-padded (a causal position never sees the pads after it, so
    no mask is needed): the tapped hidden states hs[l+1] (`tapped_features`' numbers, bit for bit) and, given
    the prompt lengths, the argmax agreement at the completion positions.

    Forward hooks on the tapped decoder blocks keep their outputs and nothing else (output_hidden_states would
    keep every layer's). hs[n] of the last block l = n-1 is, as HF returns it, after the final norm: the
    decoder's own output, hooked there. The forward ends (`_Stop`) at the last module needed: the last tapped
    block when neither the last block nor the agreement is asked for, else the decoder, so no lm_head runs over
    the whole sequence. The agreement: the final hidden state at the positions that predict a completion token
    (prompt_len-1 .. T-2) through the lm_head in chunks of about `chunk_logits` logits, argmax, compared with
    the tokens. A model whose decoder blocks are not found runs with output_hidden_states (the same numbers).
    transform (temperature, top_k, top_p; a sampled cache): the agreement counts the completion tokens of
    probability > 0 under the transform instead, and `logp` holds each one's log-prob (sampling.token_logprobs)."""
    dev = next(model.parameters()).device
    lens = [len(x) for x in seqs]
    T = max(lens)
    ids = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)] = x
    ids = ids.to(dev)
    cfg = model.config.get_text_config()
    n = cfg.num_hidden_layers
    tie_last = getattr(cfg, "tie_last_hidden_states", None) is not False  # HF: hs[-1] = the normed output
    stack = _decoder_stack(model)
    if stack is None:
        hs = model(ids, output_hidden_states=True, use_cache=False, **last_logits_kw(model)).hidden_states
        if len(hs) != n + 1:
            raise RuntimeError(f"expected {n + 1} hidden states (embeddings + {n} blocks), got {len(hs)}")
        taps, final = {l: hs[l + 1] for l in layer_ids}, hs[n]
    else:
        base, layers = stack
        from_final = {l for l in layer_ids if l == n - 1 and tie_last}
        need_final = bool(from_final) or prompt_lens is not None
        last = None if need_final else max(layer_ids)
        got: dict = {}

        def keep(key, unpack):
            def hook(_module, _args, out):
                got[key] = unpack(out)
                if key == last or (key == "final" and need_final):
                    raise _Stop
            return hook
        hooks = [layers[l].register_forward_hook(keep(l, _block_output)) for l in sorted(set(layer_ids) - from_final)]
        if need_final:
            hooks.append(base.register_forward_hook(keep("final", _decoder_output)))
        try:
            model(ids, use_cache=False, **last_logits_kw(model))
        except _Stop:
            pass
        finally:
            for h in hooks:
                h.remove()
        final = got.get("final")
        taps = {l: final if l in from_final else got[l] for l in layer_ids}
    features = torch.stack([taps[l].to(dev) for l in layer_ids], dim=2)  # [B, T, n_layers, H]
    if prompt_lens is None:
        return Prefill(features, lens)
    agree, logp = _agreement(model, final, ids, lens, prompt_lens, chunk_logits, transform)
    return Prefill(features, lens, agree, logp)


def _agreement(model, final: torch.Tensor, ids: torch.Tensor, lens: list[int], prompt_lens: list[int],
               chunk_logits: int, transform: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([B, 2] long on final's device: per row, how many completion tokens ids[p..T-1] are the lm_head's argmax
    of final[p-1..T-2] (with a transform: have probability > 0 under it), and how many there are; with a
    transform, the tokens' log-probs [N] fp32, else None)."""
    head = model.get_output_embeddings()
    B, dev = final.shape[0], final.device
    rows = torch.cat([torch.full((t - p,), i, dtype=torch.long) for i, (p, t) in enumerate(zip(prompt_lens, lens))])
    cols = torch.cat([torch.arange(p - 1, t - 1) for p, t in zip(prompt_lens, lens)])
    rows, cols = rows.to(dev), cols.to(dev)
    want = ids.to(dev)[rows, cols + 1]
    h = final[rows, cols]  # [N, H]
    step = max(1, chunk_logits // max(1, head.weight.shape[0]))
    if transform is None:
        logp = None
        hit = torch.cat([head(h[s:s + step]).argmax(-1).to(dev) == want[s:s + step]
                         for s in range(0, h.shape[0], step)])
    else:
        logp = torch.cat([token_logprobs(head(h[s:s + step]), want[s:s + step], *transform).to(dev)
                          for s in range(0, h.shape[0], step)])
        hit = logp > float("-inf")
    out = torch.zeros((B, 2), dtype=torch.long, device=dev)
    out[:, 0].index_add_(0, rows, hit.long())
    out[:, 1].index_add_(0, rows, torch.ones_like(rows))
    return out, logp
