"""`DrafterConfig`: the DFlash drafter's architecture, read from a z-lab style `config.json`.

Where each field may live (the published configs are not uniform):
- `mask_token_id`, `target_layer_ids`: `dflash_config` first, then the top level.
- `block_size`: top level first, then `dflash_config`; default 16.
- `rope_theta`: top level, else `rope_parameters.rope_theta` (transformers 5), else `rope_scaling.rope_theta`.
- `target_layer_ids` absent: evenly spaced from 1 to N-3, `round(1 + i*(N-4)/(L-1))` (N = num_target_layers,
  L = num_hidden_layers), as the reference code does.
- `fc_layer_ids` (ours): the tapped layers fc consumes, in fc's input order; default = target_layer_ids.
Fields we do not use are kept in `extra` so that `to_dict()` writes back what was read.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from remote_payload.errors import ConfigError, FeatureMismatchError

LAYER_TYPES = ("full_attention", "sliding_attention")
# Published variants whose extra modules / logit transforms this drafter does not implement.
_UNSUPPORTED_ARCHS = ("DFlash2DraftModel",)
_UNSUPPORTED_DFLASH_KEYS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


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
    layer_types: list[str]
    rope_theta: float
    num_target_layers: int | None = None
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: causal inside the block for sliding layers only (reference rule)
    extra: dict = field(default_factory=dict)

    @property
    def fc_in_features(self) -> int:
        return len(self.fc_layer_ids) * self.hidden_size

    def layer_is_causal(self, i: int) -> bool:
        """Reference rule (z-lab model.py): `is_causal` unset => causal iff the layer is sliding."""
        if self.is_causal is None:
            return self.layer_types[i] == "sliding_attention"
        return bool(self.is_causal)

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> DrafterConfig:
        return _parse(d, source)

    def to_dict(self) -> dict:
        """z-lab layout (plus our `fc_layer_ids`); `from_dict(to_dict(c)) == c`."""
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name in ("extra", "mask_token_id", "target_layer_ids"):
                continue
            out[f.name] = getattr(self, f.name)
        if self.num_target_layers is None:
            out.pop("num_target_layers")
        dflash = dict(out.get("dflash_config") or {})
        dflash.update(mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids))
        out["dflash_config"] = dflash
        out.pop("rope_parameters", None)  # rope_theta/rope_scaling are authoritative once parsed
        return out


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return [round(1 + i * step) for i in range(num_draft_layers)]


_KNOWN = {f.name for f in dataclasses.fields(DrafterConfig)} | {"dflash_config", "rope_parameters"}


def _parse(d: Any, source: str) -> DrafterConfig:
    def fail(msg: str) -> ConfigError:
        return ConfigError(f"{source}: {msg}")

    if not isinstance(d, dict):
        raise fail(f"expected a JSON object, got {type(d).__name__}")
    dflash = d.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise fail("'dflash_config' must be an object {mask_token_id, target_layer_ids}")
    for arch in d.get("architectures") or []:
        if arch in _UNSUPPORTED_ARCHS:
            raise fail(f"architecture {arch!r} is not supported (plain DFlashDraftModel only)")
    for k, neutral in _UNSUPPORTED_DFLASH_KEYS.items():
        v = dflash.get(k, d.get(k, neutral))
        if v != neutral:
            raise fail(f"{k}={v!r} is not supported by this drafter implementation (expected {neutral!r})")

    def get(name: str, typ, default=..., where=(d,)):
        for src in where:
            if name in src and src[name] is not None:
                v = src[name]
                break
        else:
            if default is ...:
                close = difflib.get_close_matches(name, [k for s in where for k in s], n=2)
                hint = f" (found {', '.join(map(repr, close))})" if close else ""
                raise fail(f"missing field {name!r}{hint}")
            return default
        ok = (isinstance(v, typ) and not isinstance(v, bool)) if typ in (int, float) else isinstance(v, typ)
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v, ok = float(v), True
        if not ok:
            raise fail(f"field {name!r} must be {typ.__name__}, got {type(v).__name__} {v!r}")
        return v

    def int_list(name: str, v) -> list[int]:
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise fail(f"field {name!r} must be a list of integers, got {v!r}")
        return list(v)

    H = get("hidden_size", int)
    n_heads = get("num_attention_heads", int)
    n_layers = get("num_hidden_layers", int)
    n_kv = get("num_key_value_heads", int, n_heads)
    head_dim = get("head_dim", int, H // n_heads if n_heads else 0)
    if min(H, n_heads, n_layers, n_kv, head_dim) <= 0:
        raise fail("hidden_size, num_attention_heads, num_key_value_heads, head_dim, num_hidden_layers must be > 0")
    if n_heads % n_kv:
        raise fail(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    if head_dim % 2:
        raise fail(f"head_dim={head_dim} must be even (RoPE rotates pairs)")
    n_target = get("num_target_layers", int, None)

    tli = get("target_layer_ids", list, None, where=(dflash, d))
    if tli is None:
        if n_target is None:
            raise fail("missing field 'dflash_config.target_layer_ids' (and no 'num_target_layers' to derive it)")
        tli = default_target_layer_ids(n_target, n_layers)
    tli = int_list("target_layer_ids", tli)
    if not tli or len(set(tli)) != len(tli) or min(tli) < 0 or (n_target is not None and max(tli) >= n_target):
        raise fail(f"target_layer_ids {tli} must be distinct layer indices in [0, num_target_layers={n_target})")
    fc_ids = int_list("fc_layer_ids", get("fc_layer_ids", list, tli))
    if not fc_ids or any(i not in tli for i in fc_ids) or len(set(fc_ids)) != len(fc_ids):
        raise fail(f"fc_layer_ids {fc_ids} must be distinct members of target_layer_ids {tli}")

    layer_types = get("layer_types", list, ["full_attention"] * n_layers)
    if len(layer_types) != n_layers:
        raise fail(f"layer_types has {len(layer_types)} entries but num_hidden_layers={n_layers}")
    for t in layer_types:
        if t not in LAYER_TYPES:
            close = difflib.get_close_matches(str(t), LAYER_TYPES, n=1)
            raise fail(f"unknown layer type {t!r} in layer_types" + (f"; did you mean {close[0]!r}?" if close else
                                                                      f"; expected one of {list(LAYER_TYPES)}"))
    window = get("sliding_window", int, None)
    if "sliding_attention" in layer_types and (window is None or window <= 0):
        raise fail("layer_types has sliding_attention layers but 'sliding_window' is missing or not positive")

    rope_params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    rope_scaling = d.get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise fail(f"field 'rope_scaling' must be an object or null, got {rope_scaling!r}")
    rope_theta = get("rope_theta", float, None, where=(d, rope_params, rope_scaling or {}))
    if rope_theta is None:
        raise fail("missing field 'rope_theta' (also looked in rope_parameters and rope_scaling)")
    for spec in (rope_scaling, rope_params):
        rtype = (spec or {}).get("rope_type", (spec or {}).get("type", "default"))
        if rtype not in ("default", None):
            raise fail(f"rope type {rtype!r} is not implemented (only plain RoPE, rope_type 'default' or null)")

    is_causal = d.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise fail(f"field 'is_causal' must be true, false or absent, got {is_causal!r}")
    block_size = get("block_size", int, 16, where=(d, dflash))
    if block_size < 2:
        raise fail(f"block_size={block_size} must be >= 2")

    vocab_size, mask_id = get("vocab_size", int), get("mask_token_id", int, where=(dflash, d))
    if not 0 <= mask_id < vocab_size:
        raise fail(f"mask_token_id={mask_id} is outside the vocabulary (vocab_size={vocab_size})")

    return DrafterConfig(
        hidden_size=H,
        intermediate_size=get("intermediate_size", int),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        num_hidden_layers=n_layers,
        vocab_size=vocab_size,
        mask_token_id=mask_id,
        target_layer_ids=tli,
        fc_layer_ids=fc_ids,
        layer_types=list(layer_types),
        rope_theta=rope_theta,
        num_target_layers=n_target,
        block_size=block_size,
        rms_norm_eps=get("rms_norm_eps", float, 1e-6),
        rope_scaling=rope_scaling,
        max_position_embeddings=get("max_position_embeddings", int, 40960),
        sliding_window=window,
        is_causal=is_causal,
        extra=_extra(d, dflash),
    )


def _extra(d: dict, dflash: dict) -> dict:
    """What we do not interpret, kept for `to_dict()` (incl. unknown `dflash_config` entries)."""
    extra = {k: v for k, v in d.items() if k not in _KNOWN}
    rest = {k: v for k, v in dflash.items() if k not in ("mask_token_id", "target_layer_ids", "block_size")}
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
