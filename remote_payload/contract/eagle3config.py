"""`Eagle3Config`: an EAGLE-3 draft head's architecture, read from its `config.json` (stdlib only).

The SafeAILab/EAGLE layout (`LlamaForCausalLMEagle3`): standard Llama fields plus `draft_vocab_size` and, when
the draft's width differs from the target's, `target_hidden_size`; one decoder layer (`num_hidden_layers` 1).
What each key does here (no key is ignored in silence, as for DFlash in contract/drafterconfig.py):
- read: the sizes, `rms_norm_eps`, `rope_theta` (plain RoPE only), `draft_vocab_size` (default `vocab_size`),
  `target_hidden_size` (default `hidden_size`), `head_dim` (default hidden_size / heads, as SafeAILab),
  `eagle_config.eagle_aux_hidden_state_layer_ids` (the tapped target states; see `tap_ids`);
- the variants that change the math, each implemented (eagle3/model.py): `fc_norm` (SpecForge / speculators:
  RMSNorms on the three chunks), `norm_before_fc` (speculators: one RMSNorm on the concatenation),
  `norm_before_residual` (speculators / vLLM: residual = hidden_norm(u)), SGLang's `bias` (an fc bias);
- honoured at a neutral value only (`_NEUTRAL`; any other value is refused, exit 3): `hidden_act` silu, no
  attention / MLP biases, no sliding window, untied lm_head;
- `norm_output` means opposite things: SpecForge "norm before lm_head" (default true; false = lm_head reads the
  pre-norm hidden), speculators "feed the post-norm hidden back" (Eagle 3.1). It is read by the layout that says
  whose it is: a speculators config (`speculators_model_type`), or a flat config with `fc_norm` (SpecForge's: the
  SafeAILab layout has no such key); in a flat config without `fc_norm` it is refused;
- bookkeeping keys that change no number (drafterconfig.HARMLESS, `pretraining_tp`: a split of the same GEMMs);
- anything else is refused by name unless allowed (`--allow-unknown-config KEY`, recorded in results.json).

Layouts (`layout`): `eagle` (SafeAILab's flat LlamaForCausalLMEagle3 config), `specforge` (the same, with SpecForge's
`fc_norm` key), `speculators` (vllm-project/speculators: `speculators_model_type: eagle3`, the Llama layer's fields in
`transformer_layer_config`, `draft_vocab_size` / `target_hidden_size` / `eagle_aux_hidden_state_layer_ids` / the
variants at the top level, `speculators_config` bookkeeping; a non-Llama layer is refused).

Tapped states (spec eagle3.md §2), in HF `output_hidden_states` indexing (entry 0 = the embeddings, entry k =
the INPUT of decoder layer k): default {2, L//2, L-3} for an L-layer target (SafeAILab, vLLM, SGLang agree).
Explicit `eagle_aux_hidden_state_layer_ids` are read in vLLM's convention (id k = HF k: vLLM passes config ids
through); `tap_ids(..., convention="sglang")` reads them as SGLang does (id k = HF k+1, before SGLang's 2026-05
change); the eval uses vLLM's and records it. A reval cache stores decoder block l's OUTPUT as layer l, which is HF
entry l+1: `cache_layer_ids` maps one to the other.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from remote_payload.contract.drafterconfig import ALLOW_HINT, HARMLESS
from remote_payload.contract.errors import ConfigError, FeatureMismatchError

FAMILY = "eagle3"
CONVENTIONS = ("vllm", "sglang")  # explicit layer ids: HF k (vLLM) or HF k+1 (SGLang before 2026-05)
_ARCH_MARKERS = ("eagle3",)  # LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM, LlamaForCausalLM_Eagle3 ...

_NEUTRAL: dict[str, tuple[tuple, str]] = {
    "hidden_act": (("silu",), "another MLP activation"),
    "attention_bias": ((False,), "q/k/v/o projection biases"),
    "mlp_bias": ((False,), "MLP biases"),
    "sliding_window": ((), "a sliding attention window"),
    "use_sliding_window": ((False,), "a sliding attention window"),
    "tie_word_embeddings": ((False,), "an lm_head tied to the embedding"),
    "use_aux_hidden_state": ((True,), "no fc over the target's tapped states"),
    "logit_scale": ((1, 1.0), "scaled draft logits"),
    "partial_rotary_factor": ((1, 1.0), "RoPE on part of each head"),
}
_VARIANTS = ("fc_norm", "norm_before_fc", "norm_before_residual", "bias")  # read: booleans that change the math
_READ = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
         "num_hidden_layers", "vocab_size", "draft_vocab_size", "target_hidden_size", "rms_norm_eps", "rope_theta",
         "rope_scaling", "rope_parameters", "max_position_embeddings", "eagle_config", "layer_types", "norm_output",
         *_VARIANTS}
_HARMLESS = HARMLESS | {"pretraining_tp"}
_EAGLE_READ = {"eagle_aux_hidden_state_layer_ids"}
_EAGLE_NEUTRAL = {"use_aux_hidden_state": ((True,), "no fc over the target's tapped states")}


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    aux_layer_ids: list[int] | None = None  # as written in eagle_config (None: the default taps)
    fc_norm: bool = False  # SpecForge / speculators: RMSNorms fc_norm.{0,1,2} on the three tapped chunks before fc
    norm_before_fc: bool = False  # speculators: one RMSNorm input_norm on the concatenated taps before fc
    norm_before_residual: bool = False  # speculators / vLLM: the attention residual is hidden_norm(u), not u
    fc_bias: bool = False  # SGLang's `bias`: fc.bias
    lm_head_norm: bool = True  # SpecForge's norm_output (false: lm_head reads the pre-norm hidden)
    feed_normed: bool = False  # speculators' norm_output (Eagle 3.1: the post-norm hidden is fed back)
    layout: str = field(default="eagle", compare=False)  # eagle (SafeAILab) | specforge | speculators (module doc)
    extra: dict = field(default_factory=dict)
    allowed_unknown: list[str] = field(default_factory=list, compare=False)

    @property
    def fc_in_features(self) -> int:
        return 3 * self.target_hidden_size

    def tap_ids(self, num_target_layers: int, convention: str = "vllm") -> list[int]:
        """The three tapped states as HF hidden_states indices, low -> mid -> high (module doc)."""
        L = num_target_layers
        if self.aux_layer_ids is None:
            ids = [2, L // 2, L - 3]
        else:
            if convention not in CONVENTIONS:
                raise ConfigError(f"layer-id convention {convention!r}: expected one of {', '.join(CONVENTIONS)}")
            ids = [k + (1 if convention == "sglang" else 0) for k in self.aux_layer_ids]
        if len(set(ids)) != 3 or min(ids) < 1 or max(ids) > L:
            raise ConfigError(f"EAGLE-3 taps HF hidden_states {ids} of a {L}-layer target: need 3 distinct states in "
                              f"1..{L} (a target of >= 7 layers for the default {{2, L//2, L-3}})")
        return ids

    def cache_layer_ids(self, num_target_layers: int, convention: str = "vllm") -> list[int]:
        """The reval-cache layer ids holding those states (cache layer l = HF hidden_states[l+1])."""
        return [k - 1 for k in self.tap_ids(num_target_layers, convention)]

    @classmethod
    def from_dict(cls, d: Any, source: str = "config.json", allow_unknown=()) -> Eagle3Config:
        return _parse(d, source, tuple(allow_unknown))

    def to_dict(self) -> dict:
        """The flat (SafeAILab / SpecForge) layout; `from_dict(to_dict(c)) == c` (a speculators config's layout is
        not kept; its post-norm feedback has no flat form: ValueError)."""
        out = dict(self.extra)
        skip = ("extra", "allowed_unknown", "aux_layer_ids", "layout", "lm_head_norm", "feed_normed", "fc_bias",
                *_VARIANTS)
        for f in dataclasses.fields(self):
            if f.name not in skip:
                out[f.name] = getattr(self, f.name)
        if self.feed_normed:
            raise ValueError("a head that feeds the post-norm hidden back has no flat (SafeAILab) config")
        out.update({k: True for k in ("fc_norm", "norm_before_fc", "norm_before_residual") if getattr(self, k)})
        if self.fc_bias:
            out["bias"] = True
        if not self.lm_head_norm:  # SpecForge's norm_output=false, said by its fc_norm key
            out.update(norm_output=False, fc_norm=self.fc_norm)
        out["num_hidden_layers"] = 1
        if self.aux_layer_ids is not None:
            out["eagle_config"] = {**(out.get("eagle_config") or {}),
                                   "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return out


def target_layers(target_config: dict) -> int:
    """The decoder layer count of a target's config.json dict (plain, or multimodal with text_config)."""
    text = target_config.get("text_config") if isinstance(target_config.get("text_config"), dict) else {}
    n = target_config.get("num_hidden_layers") or text.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError("the target's config.json has no num_hidden_layers (nor text_config.num_hidden_layers): "
                          "the EAGLE-3 taps depend on it")
    return n


def check_taps(cfg: Eagle3Config, num_target_layers: int, cache_layer_ids: list[int], cache_hidden_size: int,
               convention: str = "vllm") -> tuple[list[int], list[int]]:
    """(HF hidden_states indices, cache layer ids) of the head's taps on this target; FeatureMismatchError when a
    cache does not hold them, naming both and the fix (the eval and `preflight` both ask this)."""
    taps = cfg.tap_ids(num_target_layers, convention)
    need, have = [k - 1 for k in taps], list(cache_layer_ids)
    if cache_hidden_size != cfg.target_hidden_size:
        raise FeatureMismatchError(f"the EAGLE-3 head's fc expects 3 x {cfg.target_hidden_size} features; the cache "
                                   f"holds layers of {cache_hidden_size}: it comes from another target")
    missing = [layer for layer in need if layer not in have]
    if missing:
        raise FeatureMismatchError(
            f"the EAGLE-3 head taps HF hidden_states {taps} of this {num_target_layers}-layer target = cache layers "
            f"{need} (layer l = decoder block l's output); the cache holds {have}, without {missing}. Re-extract "
            f"with --for-drafter {{this head}} (or --layers {','.join(map(str, sorted(set(have) | set(need))))})")
    return taps, need


def looks_like_eagle3(d: Any) -> bool:
    """Whether a config.json dict describes an EAGLE-3 head (not a DFlash drafter)."""
    if not isinstance(d, dict) or "dflash_config" in d:
        return False
    if "speculators_model_type" in d:
        return d["speculators_model_type"] == "eagle3"
    archs = d.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    dflash_keys = ("block_size", "mask_token_id", "target_layer_ids")  # a DFlash config's, at its top level
    return (any(m in str(a).lower() for a in archs for m in _ARCH_MARKERS) or "eagle_config" in d
            or ("draft_vocab_size" in d and d.get("num_hidden_layers") == 1 and not any(k in d for k in dflash_keys)))


def _parse(d: Any, source: str, allow: tuple[str, ...]) -> Eagle3Config:
    def fail(msg: str) -> ConfigError:
        return ConfigError(f"{source}: {msg}")

    if not isinstance(d, dict):
        raise fail(f"expected a JSON object, got {type(d).__name__}")
    layout = "eagle"
    if "speculators_model_type" in d:
        d, layout = _from_speculators(d, fail), "speculators"
    eagle = d.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise fail("'eagle_config' must be an object {eagle_aux_hidden_state_layer_ids: [...]}")
    flags = {k: _flag(d, k, fail) for k in (*_VARIANTS, "norm_output")}
    norm_output = d.get("norm_output")
    if layout == "eagle" and "fc_norm" in d:
        layout = "specforge"  # fc_norm in a flat config: SpecForge's (SafeAILab has none; speculators nests)
    if norm_output is not None and layout == "eagle":
        raise fail(f"norm_output={norm_output!r} is refused: SpecForge reads it as 'norm before lm_head', speculators "
                   "as 'feed the post-norm hidden back' (Eagle 3.1), and this config does not say whose it is (a "
                   "SpecForge config has fc_norm, a speculators config speculators_model_type); remove it if the "
                   "head is SafeAILab's plain form")
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise fail("norm_before_fc and fc_norm are both true: one norm before fc (speculators refuses both too)")
    _neutral(d, _NEUTRAL, "", fail)
    _neutral(eagle, _EAGLE_NEUTRAL, "eagle_config.", fail)
    allowed = _unknown(d, eagle, allow, fail)

    def get(name: str, typ, default=...):
        v = d.get(name)
        if v is None:
            if default is ...:
                close = difflib.get_close_matches(name, list(d), n=2)
                raise fail(f"missing field {name!r}" + (f" (found {', '.join(map(repr, close))})" if close else ""))
            return default
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise fail(f"field {name!r} must be {typ.__name__}, got {type(v).__name__} {v!r}")
        return v

    H, nh = get("hidden_size", int), get("num_attention_heads", int)
    n_layers = get("num_hidden_layers", int, 1)
    if n_layers != 1:
        raise fail(f"num_hidden_layers={n_layers}: an EAGLE-3 head has one decoder layer (midlayer); refusing "
                   "rather than evaluate another model")
    nkv = get("num_key_value_heads", int, nh)
    hd = get("head_dim", int, H // nh if nh else 0)
    V = get("vocab_size", int)
    cfg = Eagle3Config(hidden_size=H, intermediate_size=get("intermediate_size", int), num_attention_heads=nh,
                       num_key_value_heads=nkv, head_dim=hd, vocab_size=V,
                       draft_vocab_size=get("draft_vocab_size", int, V),
                       target_hidden_size=get("target_hidden_size", int, H),
                       rms_norm_eps=get("rms_norm_eps", float, 1e-6), rope_theta=_rope_theta(d, fail),
                       aux_layer_ids=_aux_ids(eagle, fail), fc_norm=flags["fc_norm"],
                       norm_before_fc=flags["norm_before_fc"], norm_before_residual=flags["norm_before_residual"],
                       fc_bias=flags["bias"],
                       lm_head_norm=not (layout == "specforge" and norm_output is False),
                       feed_normed=layout == "speculators" and bool(norm_output), layout=layout,
                       extra={k: v for k, v in d.items() if k not in _READ or k == "eagle_config"},
                       allowed_unknown=allowed)
    cfg.extra.pop("eagle_config", None)
    if min(H, nh, nkv, hd, V, cfg.draft_vocab_size, cfg.target_hidden_size, cfg.intermediate_size) <= 0:
        raise fail("sizes (hidden_size, heads, head_dim, vocab sizes, intermediate_size) must be > 0")
    if nh % nkv:
        raise fail(f"num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}")
    if hd % 2:
        raise fail(f"head_dim={hd} must be even (RoPE rotates pairs)")
    if cfg.draft_vocab_size > V:
        raise fail(f"draft_vocab_size={cfg.draft_vocab_size} > vocab_size={V}: the draft vocabulary is a subset")
    types = d.get("layer_types")
    if types is not None and types != ["full_attention"]:
        raise fail(f"layer_types={types!r}: the EAGLE-3 layer is one full causal attention layer")
    return cfg


def _flag(d: dict, k: str, fail) -> bool:
    v = d.get(k)
    if v is not None and not isinstance(v, bool):
        raise fail(f"field {k!r} must be true or false, got {v!r}")
    return bool(v)


_SPECULATORS_TOP = {"draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm",
                    "norm_output"}  # read from the top level of a speculators config, beside its layer config
_SPECULATORS_BOOKKEEPING = {"speculators_model_type", "speculators_version", "speculators_config", "architectures",
                            "embed_requires_grad", "torch_dtype", "dtype", "transformers_version", "model_type",
                            "has_no_defaults_at_init"}  # change no number the eval computes


def _from_speculators(d: dict, fail) -> dict:
    """A vllm-project/speculators config (speculators_model_type eagle3; the decoder layer's fields in
    transformer_layer_config, the EAGLE-3 fields at the top level) -> the flat form `_parse` reads."""
    if d["speculators_model_type"] != "eagle3":
        raise fail(f"speculators_model_type={d['speculators_model_type']!r}: only eagle3 speculators are EAGLE-3 heads")
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise fail("a speculators config needs 'transformer_layer_config' (the decoder layer's config) as an object")
    if layer.get("model_type", "llama") != "llama":
        raise fail(f"transformer_layer_config.model_type={layer.get('model_type')!r}: reval's EAGLE-3 layer is "
                   "Llama's (a qwen3 layer has q_norm/k_norm); refusing rather than evaluate another model")
    known = _SPECULATORS_TOP | _SPECULATORS_BOOKKEEPING | {"transformer_layer_config",
                                                           "eagle_aux_hidden_state_layer_ids"}
    flat = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
    clash = sorted(k for k in _SPECULATORS_TOP if k in flat and k in d and flat[k] != d[k])
    if clash:
        raise fail(f"{clash[0]} differs between the top level and transformer_layer_config")
    flat.update({k: v for k, v in d.items() if k not in known or k in _SPECULATORS_TOP})
    if d.get("eagle_aux_hidden_state_layer_ids") is not None:
        flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": d["eagle_aux_hidden_state_layer_ids"]}
    return flat


def _neutral(src: dict, table: dict, prefix: str, fail) -> None:
    for k, (neutral, meaning) in table.items():
        v = src.get(k)
        if v is None or any(v == n and type(v) is type(n) for n in neutral) or (
                isinstance(v, (int, float)) and not isinstance(v, bool) and v in neutral):
            continue
        want = " or ".join(repr(x) for x in neutral) if neutral else "absent or null"
        raise fail(f"{prefix}{k}={v!r} ({meaning}) is not implemented by reval's EAGLE-3 head; refusing rather "
                   f"than evaluate another model (it evaluates {prefix}{k} = {want})")


def _unknown(d: dict, eagle: dict, allow: tuple[str, ...], fail) -> list[str]:
    known = _READ | _HARMLESS | set(_NEUTRAL)
    known_eagle = _EAGLE_READ | set(_EAGLE_NEUTRAL)
    found = [k for k in d if k not in known] + [f"eagle_config.{k}" for k in eagle if k not in known_eagle]
    refused = [k for k in found if k not in allow]
    if refused:
        close = difflib.get_close_matches(refused[0].split(".")[-1], sorted(known | known_eagle), n=1)
        near = f"; did you mean {close[0]!r}?" if close else ""
        more = f" (and {len(refused) - 1} more: {', '.join(refused[1:4])})" if len(refused) > 1 else ""
        raise fail(f"unknown key {refused[0]!r}{more}: reval does not interpret it and would evaluate the head "
                   f"without it{near} If it changes no number, pass {ALLOW_HINT} {refused[0]} (recorded in "
                   "results.json)")
    return [k for k in found if k in allow]


def _aux_ids(eagle: dict, fail) -> list[int] | None:
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if (not isinstance(ids, list) or len(ids) != 3 or len(set(ids)) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids)):
        raise fail(f"eagle_config.eagle_aux_hidden_state_layer_ids={ids!r}: expected 3 distinct layer ids")
    return list(ids)


def _rope_theta(d: dict, fail) -> float:
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    scaling = d.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise fail(f"field 'rope_scaling' must be an object or null, got {scaling!r}")
    for spec in (scaling or {}, params):
        rtype = spec.get("rope_type", spec.get("type", "default"))
        if rtype not in ("default", None):
            raise fail(f"rope type {rtype!r} is not implemented (plain RoPE only: rope_scaling null)")
    theta = d.get("rope_theta", params.get("rope_theta", (scaling or {}).get("rope_theta")))
    if theta is None:
        return 10000.0  # SafeAILab / LlamaConfig's default
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise fail(f"rope_theta={theta!r} must be a positive number")
    return float(theta)
