"""`DrafterConfig`: the DFlash drafter's architecture, read from a z-lab / vLLM style `config.json`.

Where each field may live (the published configs are not uniform):
- `mask_token_id`, `target_layer_ids`: `dflash_config` first, then the top level.
- `block_size`: top level first, then `dflash_config`; default 16.
- `rope_theta`: top level, else `rope_parameters.rope_theta` (transformers 5), else `rope_scaling.rope_theta`.
- `target_layer_ids` absent: evenly spaced from 1 to N-3, `round(1 + i*(N-4)/(L-1))` (N = num_target_layers,
  L = num_hidden_layers), as the reference code does.
- `fc_layer_ids` (ours): the tapped layers fc consumes, in fc's input order; default = target_layer_ids.

The attention layout of layer i, resolved once here (`layer_type`, `layer_window`, `layer_is_causal`) by the
rules of vLLM's DFlash loader (`qwen3_dflash.py` `_resolve_layer_attention`), which agree with z-lab's
`model.py` wherever the z-lab configs reach:
1. type: `layer_types[i]` when `layer_types` is given and has a sliding layer (or `dflash_config.use_swa` is
   not true); `sliding_attention` on EVERY layer when `dflash_config.use_swa` is true and `layer_types` is absent
   or all full; `full_attention` on every layer when neither is given.
2. window (sliding layers): `dflash_config.swa_window_size`, else the top-level `sliding_window`; none: error.
3. causal inside the block: the top-level `is_causal` when set (z-lab's rule: all layers); else
   `dflash_config.causal` when set (all layers); else, with `layer_types` given, causal iff the layer is
   sliding; without `layer_types`, bidirectional (use_swa checkpoints such as MiMo's are non-causal).

Where two fields disagree, the precedence above decides and `conflicts` says so (both fields and the winner: a warning
in the eval's log and results.json's `notes`). No field is ignored in silence. A key is either interpreted (above, the
model's sizes), honoured only at its neutral value (`NEUTRAL`: e.g. `hidden_act` silu, `attention_bias` false; any
other value is refused), on the short list of bookkeeping keys that change no number (`HARMLESS`), transformers'
generic attributes at their base-class defaults (`TRANSFORMERS_DEFAULTS`: what `PretrainedConfig.to_dict()` writes),
or refused: a ConfigError naming it, unless the user allowed it by name (`--allow-unknown-config KEY`, recorded in
results.json). Harmless and allowed keys are kept in `extra` so that `to_dict()` writes back what was read.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from remote_payload.contract.errors import ConfigError, FeatureMismatchError, PayloadError
from remote_payload.contract.hfdefaults import TRANSFORMERS_DEFAULTS, same_as_default

LAYER_TYPES = ("full_attention", "sliding_attention")
SLIDING = "sliding_attention"
# Published variants whose extra modules / logit transforms this drafter does not implement.
_UNSUPPORTED_ARCHS = ("DFlash2DraftModel",)

# Bookkeeping keys that change no number of the drafter (HF/transformers housekeeping, training-only settings,
# and Qwen3's own sliding-window switches, which DFlash loaders do not read: layer_types decides).
HARMLESS = frozenset({
    "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "_name_or_path", "name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "attention_dropout", "tie_word_embeddings", "use_sliding_window", "max_window_layers", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "pruned_heads", "id2label", "label2id",
    "problem_type", "tokenizer_class", "chunk_size_feed_forward", "is_encoder_decoder", "quantization_config",
    "_attn_implementation_autoset",  # whether transformers picked the attention implementation itself
})
HARMLESS_DFLASH = frozenset({"t2d"})  # vLLM skips a shipped `t2d` tensor's key name too; nothing reads it

# Keys honoured at their neutral value only: (neutral values, what a different value would mean). Another value
# is refused (exit 3) rather than evaluated as something else. None (JSON null) reads as absent everywhere.
_NEUTRAL_TOP = {
    "hidden_act": (("silu",), "another MLP activation"),
    "attention_bias": ((False,), "q/k/v/o projection biases"),
    "mlp_bias": ((False,), "MLP biases"),
    "is_neox_style": ((True,), "interleaved (non-neox) RoPE"),
    "partial_rotary_factor": ((1, 1.0), "RoPE on part of each head"),
    "logit_scale": ((1, 1.0), "a scaled draft logit (vLLM LogitsProcessor scale)"),
    "use_aux_hidden_state": ((True,), "no fc over the target's hidden states"),
    "add_swa_attention_sink_bias": ((False,), "a per-head attention-sink logit in the softmax"),
    "projector_type": ((), "another context projector (e.g. domino's prefix GRU)"),
    "input_embedding_scale": ((1, 1.0), "scaled input embeddings"),
    "output_multiplier": ((1, 1.0), "scaled outputs"),
    "final_logit_softcapping": ((), "soft-capped draft logits"),
}
_NEUTRAL_DFLASH = {
    "attention_sink_bias": ((False,), "a per-head attention-sink logit in the softmax"),
    "use_aux_hidden_state": ((True,), "no fc over the target's hidden states"),
    "projector_type": ((), "another context projector (e.g. domino's prefix GRU)"),
    "input_embedding_scale": ((1, 1.0), "scaled input embeddings"),
    "output_multiplier": ((1, 1.0), "scaled outputs"),
    "final_logit_softcapping": ((), "soft-capped draft logits"),
}
_DFLASH_READ = ("mask_token_id", "target_layer_ids", "block_size", "use_swa", "swa_window_size", "causal")
ALLOW_HINT = "--allow-unknown-config"


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    fc_layer_ids: list[int]
    layer_types: list[str] | None  # as written (None: absent); the resolved type of layer i is `layer_type(i)`
    rope_theta: float
    num_target_layers: int | None = None
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    sliding_window: int | None = None  # top-level; dflash_config.swa_window_size wins (`layer_window`)
    is_causal: bool | None = None  # top-level, all layers (z-lab rule); wins over dflash_config.causal
    use_swa: bool = False  # dflash_config.use_swa
    swa_window_size: int | None = None  # dflash_config.swa_window_size
    causal: bool | None = None  # dflash_config.causal: all layers, unless is_causal is set
    extra: dict = field(default_factory=dict)
    allowed_unknown: list[str] = field(default_factory=list, compare=False)  # keys the user allowed by name
    conflicts: list[str] = field(default_factory=list, compare=False)  # fields that disagree, and which won

    @property
    def fc_in_features(self) -> int:
        return len(self.fc_layer_ids) * self.hidden_size

    def _types_from_list(self) -> bool:
        return self.layer_types is not None and (not self.use_swa or SLIDING in self.layer_types)

    def layer_type(self, i: int) -> str:
        """Rule 1 of the module doc."""
        if self._types_from_list():
            return self.layer_types[i]
        return SLIDING if self.use_swa else "full_attention"

    def layer_window(self, i: int) -> int | None:
        """Rule 2: keys a query of a sliding layer sees (itself included); None for full layers."""
        if self.layer_type(i) != SLIDING:
            return None
        return self.swa_window_size if self.swa_window_size is not None else self.sliding_window

    def layer_is_causal(self, i: int) -> bool:
        """Rule 3 of the module doc."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        if self.causal is not None:
            return bool(self.causal)
        return self.layer_types is not None and self.layer_types[i] == SLIDING

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json", allow_unknown=()) -> DrafterConfig:
        return _parse(d, source, tuple(allow_unknown))

    def to_dict(self) -> dict:
        """z-lab layout (plus our `fc_layer_ids`); `from_dict(to_dict(c)) == c`."""
        out = dict(self.extra)
        dflash = dict(out.get("dflash_config") or {})
        for f in dataclasses.fields(self):
            if f.name in ("extra", "allowed_unknown", "conflicts", "mask_token_id", "target_layer_ids", "use_swa",
                          "swa_window_size", "causal"):
                continue
            out[f.name] = getattr(self, f.name)
        if self.num_target_layers is None:
            out.pop("num_target_layers")
        for k in ("layer_types", "is_causal"):
            if out[k] is None:
                out.pop(k)
        dflash.update(mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids))
        if self.use_swa:
            dflash["use_swa"] = True
        for k in ("swa_window_size", "causal"):
            if getattr(self, k) is not None:
                dflash[k] = getattr(self, k)
        out["dflash_config"] = dflash
        out.pop("rope_parameters", None)  # rope_theta/rope_scaling are authoritative once parsed
        return out


def parse_layer_ids(text: str) -> list[int]:
    """'1,16,31' -> [1, 16, 31]; PayloadError on anything else."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PayloadError(f"--layers {text!r}: expected comma-separated layer ids, e.g. --layers 1,16,31,46,61")
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise PayloadError(f"--layers {text!r}: need distinct non-negative layer ids, e.g. --layers 1,16,31,46,61")
    return ids


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return [round(1 + i * step) for i in range(num_draft_layers)]


_READ_TOP = {f.name for f in dataclasses.fields(DrafterConfig)} - {"extra", "allowed_unknown", "conflicts",
                                                                     "use_swa", "swa_window_size", "causal"}
_READ_TOP |= {"dflash_config", "rope_parameters", "draft_vocab_size", "target_hidden_size"}


def _parse(d: Any, source: str, allow: tuple[str, ...]) -> DrafterConfig:
    def fail(msg: str) -> ConfigError:
        return ConfigError(f"{source}: {msg}")

    if not isinstance(d, dict):
        raise fail(f"expected a JSON object, got {type(d).__name__}")
    dflash = d.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise fail("'dflash_config' must be an object {mask_token_id, target_layer_ids}")
    _refuse_unimplemented(d, dflash, fail)
    allowed = _check_unknown(d, dflash, allow, fail)
    f = _Fields(d, fail)
    H, n_heads, n_layers, n_kv, head_dim, n_target, vocab_size = _sizes(f)
    tli, fc_ids = _layer_ids(f, d, dflash, n_target, n_layers)
    layer_types, window, swa_window, use_swa = _attention_fields(f, dflash, n_layers)
    rope_theta, rope_scaling = _rope(f, d)

    block_size = f.get("block_size", int, 16, where=(d, dflash))
    if block_size < 2:
        raise fail(f"block_size={block_size} must be >= 2")
    mask_id = f.get("mask_token_id", int, where=(dflash, d))
    if not 0 <= mask_id < vocab_size:
        raise fail(f"mask_token_id={mask_id} is outside the vocabulary (vocab_size={vocab_size})")

    cfg = DrafterConfig(
        hidden_size=H,
        intermediate_size=f.get("intermediate_size", int),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        num_hidden_layers=n_layers,
        vocab_size=vocab_size,
        mask_token_id=mask_id,
        target_layer_ids=tli,
        fc_layer_ids=fc_ids,
        layer_types=None if layer_types is None else list(layer_types),
        rope_theta=rope_theta,
        num_target_layers=n_target,
        block_size=block_size,
        rms_norm_eps=f.get("rms_norm_eps", float, 1e-6),
        rope_scaling=rope_scaling,
        max_position_embeddings=f.get("max_position_embeddings", int, 40960),
        sliding_window=window,
        is_causal=f.flag("is_causal", d),
        use_swa=use_swa,
        swa_window_size=swa_window,
        causal=f.flag("causal", dflash, "dflash_config."),
        extra=_extra(d, dflash),
        allowed_unknown=allowed,
    )
    sliding = [i for i in range(n_layers) if cfg.layer_type(i) == SLIDING]
    if sliding and cfg.layer_window(sliding[0]) is None:
        why = "dflash_config.use_swa is true" if not cfg._types_from_list() else "layer_types has sliding layers"
        raise fail(f"{why} but no window is given: set dflash_config.swa_window_size or 'sliding_window' "
                   f"('sliding_window' is missing)")
    cfg.conflicts = _conflicts(d, cfg, bool(sliding))
    return cfg


def _conflicts(d: dict, cfg: DrafterConfig, sliding: bool) -> list[str]:
    """Fields that say different things, resolved by the precedence of the module doc: one sentence each,
    naming both fields and the one that won (the eval prints them as warnings and keeps them in results.json)."""
    chains = [["dflash_config.mask_token_id", "mask_token_id"],
              ["dflash_config.target_layer_ids", "target_layer_ids"],
              ["block_size", "dflash_config.block_size"],
              ["rope_theta", "rope_parameters.rope_theta", "rope_scaling.rope_theta"],
              ["is_causal", "dflash_config.causal"]]
    if sliding:
        chains.append(["dflash_config.swa_window_size", "sliding_window"])
    out = []
    for chain in chains:
        given = [(path, v) for path in chain if (v := _at(d, path)) is not None]
        out += [f"{given[0][0]}={given[0][1]!r} and {path}={v!r} differ: {given[0][0]} wins"
                for path, v in given[1:] if v != given[0][1]]
    if cfg.use_swa and cfg.layer_types is not None and set(cfg.layer_types) != {SLIDING}:
        won = "layer_types" if SLIDING in cfg.layer_types else "dflash_config.use_swa (every layer slides)"
        out.append(f"dflash_config.use_swa=True and layer_types={cfg.layer_types} differ: {won} wins")
    return out


def _at(d: dict, path: str):
    """d["a"]["b"] for "a.b" (None where a level is missing or not an object)."""
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _refuse_unimplemented(d: dict, dflash: dict, fail) -> None:
    """Refuses unsupported architectures and keys away from their neutral value (`_NEUTRAL_TOP`,
    `_NEUTRAL_DFLASH`)."""
    archs = d.get("architectures") or []
    for arch in archs if isinstance(archs, list) else [archs]:
        if arch in _UNSUPPORTED_ARCHS:
            raise fail(f"architecture {arch!r} is not supported (plain DFlashDraftModel only)")
    for table, where, prefix in ((_NEUTRAL_TOP, d, ""), (_NEUTRAL_DFLASH, dflash, "dflash_config.")):
        for k, (neutral, meaning) in table.items():
            v = where.get(k)
            if v is None or (v in neutral and type(v) is type(neutral[0]) or
                             (isinstance(v, (int, float)) and not isinstance(v, bool) and v in neutral)):
                continue
            want = " or ".join(repr(x) for x in neutral) if neutral else "absent or null"
            raise fail(f"{prefix}{k}={v!r} ({meaning}) is not implemented by reval's drafter; refusing rather "
                       f"than evaluate another model (it evaluates {prefix}{k} = {want})")


class _Fields:
    """Typed reads of a config dict's fields; `fail(msg)` makes the error that names the file."""

    def __init__(self, d: dict, fail):
        self.d, self.fail = d, fail

    def get(self, name: str, typ, default=..., where=None):
        """The first non-null `name` among `where` (default: the top level) as `typ`; `default` when absent
        (none given: a missing field, with the closest names found)."""
        where = (self.d,) if where is None else where
        for src in where:
            if name in src and src[name] is not None:
                v = src[name]
                break
        else:
            if default is ...:
                close = difflib.get_close_matches(name, [k for s in where for k in s], n=2)
                hint = f" (found {', '.join(map(repr, close))})" if close else ""
                raise self.fail(f"missing field {name!r}{hint}")
            return default
        ok = (isinstance(v, typ) and not isinstance(v, bool)) if typ in (int, float) else isinstance(v, typ)
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v, ok = float(v), True
        if not ok:
            raise self.fail(f"field {name!r} must be {typ.__name__}, got {type(v).__name__} {v!r}")
        return v

    def int_list(self, name: str, v) -> list[int]:
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise self.fail(f"field {name!r} must be a list of integers, got {v!r}")
        return list(v)

    def flag(self, name: str, src: dict, prefix: str = "") -> bool | None:
        v = src.get(name)
        if v is not None and not isinstance(v, bool):
            raise self.fail(f"field '{prefix}{name}' must be true, false or absent, got {v!r}")
        return v


def _sizes(f: _Fields) -> tuple[int, int, int, int, int, int | None, int]:
    """(hidden_size, heads, layers, kv heads, head_dim, num_target_layers, vocab_size), checked."""
    H = f.get("hidden_size", int)
    n_heads = f.get("num_attention_heads", int)
    n_layers = f.get("num_hidden_layers", int)
    n_kv = f.get("num_key_value_heads", int, n_heads)
    head_dim = f.get("head_dim", int, H // n_heads if n_heads else 0)
    if min(H, n_heads, n_layers, n_kv, head_dim) <= 0:
        raise f.fail("hidden_size, num_attention_heads, num_key_value_heads, head_dim, num_hidden_layers "
                     "must be > 0")
    if n_heads % n_kv:
        raise f.fail(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    if head_dim % 2:
        raise f.fail(f"head_dim={head_dim} must be even (RoPE rotates pairs)")
    n_target = f.get("num_target_layers", int, None)
    vocab_size = f.get("vocab_size", int)
    for k, same, what in (("draft_vocab_size", vocab_size, "vocab_size"), ("target_hidden_size", H, "hidden_size")):
        v = f.get(k, int, None)
        if v is not None and v != same:
            meaning = ("a reduced draft vocabulary (own lm_head + d2t offsets)" if k == "draft_vocab_size" else
                       "a target whose hidden size differs from the drafter's (own embed_tokens/lm_head)")
            raise f.fail(f"{k}={v} != {what}={same} ({meaning}) is not implemented by reval's drafter; "
                         f"refusing rather than evaluate another model")
    return H, n_heads, n_layers, n_kv, head_dim, n_target, vocab_size


def _layer_ids(f: _Fields, d: dict, dflash: dict, n_target: int | None,
               n_layers: int) -> tuple[list[int], list[int]]:
    """(target_layer_ids, fc_layer_ids), checked; target_layer_ids derived when absent (module doc)."""
    tli = f.get("target_layer_ids", list, None, where=(dflash, d))
    if tli is None:
        if n_target is None:
            raise f.fail("missing field 'dflash_config.target_layer_ids' (and no 'num_target_layers' to "
                         "derive it)")
        tli = default_target_layer_ids(n_target, n_layers)
    tli = f.int_list("target_layer_ids", tli)
    if not tli or len(set(tli)) != len(tli) or min(tli) < 0 or (n_target is not None and max(tli) >= n_target):
        raise f.fail(f"target_layer_ids {tli} must be distinct layer indices in "
                     f"[0, num_target_layers={n_target})")
    fc_ids = f.int_list("fc_layer_ids", f.get("fc_layer_ids", list, tli))
    if not fc_ids or any(i not in tli for i in fc_ids) or len(set(fc_ids)) != len(fc_ids):
        raise f.fail(f"fc_layer_ids {fc_ids} must be distinct members of target_layer_ids {tli}")
    return tli, fc_ids


def _attention_fields(f: _Fields, dflash: dict,
                      n_layers: int) -> tuple[list | None, int | None, int | None, bool]:
    """(layer_types as written, sliding_window, dflash_config.swa_window_size, dflash_config.use_swa),
    checked."""
    layer_types = f.get("layer_types", list, None)
    if layer_types is not None:
        if len(layer_types) != n_layers:
            raise f.fail(f"layer_types has {len(layer_types)} entries but num_hidden_layers={n_layers}")
        for t in layer_types:
            if t not in LAYER_TYPES:
                close = difflib.get_close_matches(str(t), LAYER_TYPES, n=1)
                raise f.fail(f"unknown layer type {t!r} in layer_types" + (
                    f"; did you mean {close[0]!r}?" if close else f"; expected one of {list(LAYER_TYPES)}"))
    window = f.get("sliding_window", int, None)
    swa_window = f.get("swa_window_size", int, None, where=(dflash,))
    use_swa = bool(f.flag("use_swa", dflash, "dflash_config."))
    for name, w in (("sliding_window", window), ("dflash_config.swa_window_size", swa_window)):
        if w is not None and w <= 0:
            raise f.fail(f"{name}={w} must be a positive number of positions")
    return layer_types, window, swa_window, use_swa


def _rope(f: _Fields, d: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling): plain RoPE only (module doc: where rope_theta may live)."""
    rope_params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    rope_scaling = d.get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise f.fail(f"field 'rope_scaling' must be an object or null, got {rope_scaling!r}")
    rope_theta = f.get("rope_theta", float, None, where=(d, rope_params, rope_scaling or {}))
    if rope_theta is None:
        raise f.fail("missing field 'rope_theta' (also looked in rope_parameters and rope_scaling)")
    for spec in (rope_scaling, rope_params):
        rtype = (spec or {}).get("rope_type", (spec or {}).get("type", "default"))
        if rtype not in ("default", None):
            raise f.fail(f"rope type {rtype!r} is not implemented (only plain RoPE, rope_type 'default' or "
                         f"null)")
        prf = (spec or {}).get("partial_rotary_factor")
        if prf not in (None, 1, 1.0):
            raise f.fail(f"partial_rotary_factor={prf!r} (RoPE on part of each head) is not implemented by "
                         f"reval's drafter; refusing rather than evaluate another model")
    return rope_theta, rope_scaling


def add_allow_unknown(p) -> None:
    """`--allow-unknown-config KEY` of `eval` and `preflight` (argparse)."""
    p.add_argument("--allow-unknown-config", action="append", default=[], metavar="KEY",
                   help="evaluate although the drafter's config.json has KEY, which reval does not interpret "
                        "(dflash_config.KEY for a nested one; repeatable). Without it such a key is refused "
                        "(exit 3); allowed keys are recorded in results.json")


def _check_unknown(d: dict, dflash: dict, allow: tuple[str, ...], fail) -> list[str]:
    """Keys reval neither reads, nor holds to a neutral value, nor knows to be harmless: refused by name unless
    the user allowed them (`--allow-unknown-config KEY`, `dflash_config.KEY` for the nested ones)."""
    at_default = {k for k, v in d.items()
                  if k in TRANSFORMERS_DEFAULTS and same_as_default(v, TRANSFORMERS_DEFAULTS[k])}
    known_top = _READ_TOP | HARMLESS | set(_NEUTRAL_TOP) | at_default
    known_dflash = set(_DFLASH_READ) | set(_NEUTRAL_DFLASH) | HARMLESS_DFLASH
    found = [k for k in d if k not in known_top] + [f"dflash_config.{k}" for k in dflash if k not in known_dflash]
    allowed = [k for k in found if k in allow]
    refused = [k for k in found if k not in allow]
    if refused:
        more = f" (and {len(refused) - 1} more: {', '.join(refused[1:4])})" if len(refused) > 1 else ""
        close = difflib.get_close_matches(refused[0].split(".")[-1], sorted(known_top | known_dflash), n=1)
        near = f"; did you mean {close[0]!r}?" if close else ""
        k = refused[0]
        what = (f"key {k!r}={d[k]!r}{more}: transformers' generic attribute away from its default "
                f"{TRANSFORMERS_DEFAULTS[k]!r}, which no DFlash loader reads: reval would evaluate the drafter "
                f"without it." if k in TRANSFORMERS_DEFAULTS else
                f"unknown key {k!r}{more}: reval does not interpret it and would evaluate the drafter without "
                f"it{near}")
        raise fail(f"{what} If it changes no number, pass {ALLOW_HINT} {k} (recorded in results.json)")
    return allowed


def _extra(d: dict, dflash: dict) -> dict:
    """What we do not interpret but keep for `to_dict()`: harmless, neutral and allowed keys (incl. nested)."""
    extra = {k: v for k, v in d.items() if k not in _READ_TOP}
    rest = {k: v for k, v in dflash.items() if k not in _DFLASH_READ}
    if rest:
        extra["dflash_config"] = rest
    return extra


def check_features(cfg: DrafterConfig, cache_layer_ids: list[int], cache_hidden_size: int) -> list[int]:
    """Indices into the cache's layer list, in fc's input order; FeatureMismatchError if it cannot serve."""
    need, have, H = list(cfg.fc_layer_ids), list(cache_layer_ids), cfg.hidden_size
    want = f"drafter fc expects {len(need) * H} input features ({len(need)} layers x {H}: {need})"
    held = f"the cache holds {len(have) * cache_hidden_size} ({len(have)} layers x {cache_hidden_size}: {have})"
    if cache_hidden_size != H:
        raise FeatureMismatchError(f"{want}; {held}: hidden sizes differ, so the cache comes from another target "
                                   f"model. Extract a cache with this drafter's target.")
    missing = [layer for layer in need if layer not in have]
    if missing:
        layers = ",".join(str(x) for x in sorted(set(have) | set(need)))
        raise FeatureMismatchError(f"{want}; {held}, without layers {missing}. Re-extract with --layers {layers}, "
                                   f"or evaluate a {len(have)}-layer drafter.")
    return [have.index(layer) for layer in need]
