"""transformers' generic config attributes at their base-class defaults: what `PretrainedConfig.to_dict()` writes
into every config, which the drafter config parser (drafterconfig.py) accepts at these values only. Stdlib, a
literal table (the payload's stdlib tiers read it without transformers)."""
from __future__ import annotations

from typing import Any

# transformers' generic PretrainedConfig attributes, which `to_dict()` writes into every config (36 of them in 4.57
# beside the HARMLESS ones; 5.x writes only HARMLESS ones) and no DFlash loader reads: honoured at the base
# class's default value (4.x; the generation parameters also 5.x's GenerationConfig defaults, which 5.x pops
# from a config on load), refused naming the key at any other value. tests/test_layouts.py checks this table
# against a config written by transformers 4.57's to_dict() and against the installed transformers.
TRANSFORMERS_DEFAULTS: dict[str, Any] = {
    "is_decoder": False, "add_cross_attention": False, "cross_attention_hidden_size": None,
    "tie_encoder_decoder": False, "use_bfloat16": False, "tf_legacy_loss": False, "finetuning_task": None,
    "prefix": None, "sep_token_id": None, "decoder_start_token_id": None, "task_specific_params": None,
    # generation parameters
    "max_length": 20, "min_length": 0, "do_sample": False, "early_stopping": False, "num_beams": 1,
    "num_beam_groups": 1, "diversity_penalty": 0.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
    "typical_p": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "num_return_sequences": 1, "output_scores": False,
    "return_dict_in_generate": False, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "remove_invalid_values": False, "exponential_decay_length_penalty": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0,
    "num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4,
    "assistant_lookbehind": 10, "target_lookbehind": 10,
}


def same_as_default(v: Any, default: Any) -> bool:
    """`v` is transformers' default value `default` (1 == 1.0, but True is no 1 and 0 no False)."""
    if default is None or isinstance(default, bool):
        return v is default
    if isinstance(default, (int, float)):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == default
    return v == default
