"""The target's chat template (`--chat-template auto|on|off`; auto = when the target has one).

Each prompt is rendered by transformers' `apply_chat_template(messages, tokenize=False,
add_generation_prompt=True, enable_thinking=...)` as the DFlash/DDTree benchmark scripts do, then tokenized
with the target's tokenizer.json without adding special tokens again. Turn k of a conversation is rendered
with the user turns 1..k and the target's own greedy replies to the earlier turns (decoded, special tokens
skipped) as the assistant messages (`extract` generates turn by turn). cache.json records it in
"prompt_format".
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular


def chat_template_source(target: Path) -> str | None:
    """Where the target's chat template is: "tokenizer_config.json" (its chat_template), "chat_template.jinja",
    or None when it has none."""
    cfg = target / "tokenizer_config.json"
    if cfg.is_file():
        try:
            d = json.loads(read_regular(cfg))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PayloadError(f"--target {target}: tokenizer_config.json is not valid JSON ({e}); fix it, or pass "
                               "--chat-template off for raw text") from None
        if isinstance(d, dict) and d.get("chat_template"):
            return "tokenizer_config.json"
    return "chat_template.jinja" if (target / "chat_template.jinja").is_file() else None


def add_template_hint(target: Path) -> str:
    """The one fix for a missing template, whatever the mode: the file transformers reads."""
    return (f"add a chat template to {target} (a chat_template.jinja file, or \"chat_template\" in its "
            "tokenizer_config.json)")


class ChatTemplate:
    """The target's chat template, rendered by transformers' tokenizer (local files only). `raw_ok`: whether raw
    text (--chat-template off) would do instead (not for multi-turn prompts), so that no error advises it there."""

    def __init__(self, target: Path, enable_thinking: bool, raw_ok: bool = True):
        off = "; or pass --chat-template off for raw text" if raw_ok else ""
        try:
            from transformers import AutoTokenizer
            self.hf = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
        except Exception as e:  # whatever a broken tokenizer_config makes transformers raise
            raise PayloadError(f"--target {target}: transformers cannot load its tokenizer to render the chat "
                               f"template ({type(e).__name__}: {_first_line(e)}); fix its tokenizer files{off}") from e
        t = getattr(self.hf, "chat_template", None)
        if not t:
            raise PayloadError(f"--target {target}: transformers' tokenizer has no chat template; "
                               f"{add_template_hint(target)}{off}")
        text = t if isinstance(t, str) else json.dumps(t, sort_keys=True)
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        self.enable_thinking, self.raw_ok = enable_thinking, raw_ok

    def render(self, messages: list[dict], name: str) -> str:
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               enable_thinking=self.enable_thinking)
        except Exception as e:  # jinja errors, the template's raise_exception
            fix = "fix the template, or try --chat-template off" if self.raw_ok else "fix the template"
            raise PayloadError(f"prompt {name!r}: the target's chat template fails on it ({type(e).__name__}: "
                               f"{_first_line(e)}); {fix}") from e


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def resolve_chat_template(target: Path, mode: str, enable_thinking: bool,
                          records: list[tuple[str, list[str]]], prompts_file) -> ChatTemplate | None:
    """--chat-template auto|on|off and --enable-thinking -> the template to apply, or None (raw text); checks
    that a multi-turn file or --enable-thinking has a template to go with. Every refusal advises one path that
    works, never a --chat-template value that the next run refuses: without a template, add one to the target;
    with one and --chat-template off, leave the option out."""
    source = template_applies(target, mode, enable_thinking, records, prompts_file)
    multi = any(len(turns) > 1 for _, turns in records)
    return ChatTemplate(target, enable_thinking, raw_ok=not multi) if source else None


def template_applies(target: Path, mode: str, enable_thinking: bool, records: list[tuple[str, list[str]]],
                     prompts_file) -> str | None:
    """resolve_chat_template's decision without loading the tokenizer: the template's source file when one is
    applied, None for raw text; the same refusals."""
    if mode not in ("auto", "on", "off"):
        raise PayloadError(f"--chat-template {mode}: expected auto, on or off")
    has = chat_template_source(target)
    source = None if mode == "off" else has
    multi = next(((n, len(t)) for n, t in records if len(t) > 1), None)
    # what to do, the same in every message: leave `off` out where the target has a template, else add one
    fix = ("leave --chat-template off out (auto applies the target's template)" if has
           else add_template_hint(target))
    if source is None and multi:
        why = "--chat-template off applies none" if has else f"--target {target} has none"
        raise PayloadError(f"--prompts {prompts_file}: {multi[0]!r} has {multi[1]} turns, and multi-turn prompts "
                           f"need a chat template ({why}); {fix}")
    if mode == "on" and source is None:
        raise PayloadError(f"--chat-template on: --target {target} has no chat template (no chat_template in "
                           f"tokenizer_config.json, no chat_template.jinja); {fix}, or pass --chat-template off "
                           "for raw text")
    if source is None and enable_thinking:
        why = "--chat-template off" if has else f"--target {target} has no chat template"
        raise PayloadError(f"--enable-thinking: no chat template is applied ({why}) and only a chat template reads "
                           f"enable_thinking; leave --enable-thinking out, or {fix}")
    return source
