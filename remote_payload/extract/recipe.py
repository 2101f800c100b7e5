"""An extract's recipe: everything that decides a cache's content, and its key (stdlib only: a store lookup
never loads torch or transformers).

    target      the target's content hash (contract.contenthash: config.json + the weights the loader reads)
    tokenizer   sha256 over the target's tokenizer files (tokenizer.json, its config, the chat template file,
                special tokens, generation_config.json's eos): the prompts' ids and their rendering
    prompts     sha256 of the records used (after --num-prompts: names and turns) and the file's shape;
                `count` records, `entries` cache entries (a multi-turn record is one entry a turn)
    template    whether the chat template is applied (--chat-template auto|on|off resolved), and
                enable_thinking
    options     the extract options that change the data (`data_options`: layers, max new tokens, the resolved
                dtype; the sampling regime joins there)
    generator   GENERATOR_VERSION: bumped when extract writes other data for the same inputs

`Recipe.key` is sha256 over the canonical JSON of all of it: the name of the cache in a store
(extract/store.py) and the key an interrupted extract resumes on (`differences` says which field differs).
What does not change the data stays out (batch sizes, the number of GPUs, the prompt file's name and path);
cache.json records the recipe beside the key.

The target's hash reads every weight file; `target_hash(..., memo=DIR)` keeps it under a stat signature of the
files it covers (path, device, inode, size, mtime and ctime in ns: a copy with `cp -p`, a file rewritten in
place with its mtime put back, another folder with matching names and sizes all change it, since a ctime
cannot be set back), so that a store lookup reads the weights once.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from remote_payload.contract.contenthash import content_files, content_hash
from remote_payload.contract.runstate import read_regular
from remote_payload.prompts.chat import template_applies
from remote_payload.prompts.files import read_prompts

GENERATOR_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "bf16": "bf16", "fp32": "fp32",
               "fp16": "fp16"}


def data_options(*, layer_ids, max_new_tokens: int, dtype: str, **more) -> dict:
    """The extract options that change the data, as one dict (the recipe's `options`): the tapped layers, the
    completion cap, the dtype the target runs in (resolved: bf16, fp32 or fp16, never auto), and any option
    added later (`more`: e.g. sampling=...), each a JSON value; an option left None is left out, so a cache
    made before it existed keeps its key."""
    name = DTYPE_NAMES.get(str(dtype).removeprefix("torch."))
    if name is None:
        raise ValueError(f"dtype {dtype!r}: the recipe takes the resolved dtype (bf16, fp32 or fp16)")
    opts = {"layers": [int(x) for x in layer_ids], "max_new_tokens": int(max_new_tokens), "dtype": name}
    opts.update({k: v for k, v in more.items() if v is not None})
    json.dumps(opts)  # JSON values only
    return opts


def prompts_digest(shape: str, records: list[tuple[str, list[str]]]) -> dict:
    """The recipe's `prompts`: a digest of the records used (as prompts/files.read_prompts returns them)."""
    blob = json.dumps({"shape": shape, "records": [[n, list(t)] for n, t in records]}, ensure_ascii=False)
    return {"sha256": hashlib.sha256(blob.encode()).hexdigest(), "shape": shape, "count": len(records),
            "entries": sum(len(t) for _, t in records)}


def tokenizer_digest(target: str | os.PathLike) -> str:
    """sha256 over the target's tokenizer files that exist (name, NUL, size, NUL, bytes each, by name)."""
    h = hashlib.sha256()
    for name in sorted(TOKENIZER_FILES):
        f = Path(target) / name
        if f.is_file():
            data = read_regular(f)
            h.update(f"{name}\0{len(data)}\0".encode() + data)
    return h.hexdigest()


def stat_signature(files: list[Path]) -> str:
    """A stat per file (no read): resolved path, device, inode, size, mtime and ctime in ns."""
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(f"{Path(f).resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0"
                 f"{st.st_ctime_ns}\n".encode())
    return h.hexdigest()


def target_hash(target: str | os.PathLike, memo: str | os.PathLike | None = None) -> str:
    """The target's content hash; with `memo` (a folder), kept there under the stat signature of the files it
    covers and read back while that signature holds (see the module doc)."""
    if memo is None:
        return content_hash(target)
    sig = stat_signature(content_files(target))
    f = Path(memo) / f"{sig}.hash"
    try:
        known = read_regular(f).decode().strip()
        if known.startswith("sha256-"):
            return known
    except (OSError, UnicodeDecodeError):
        pass
    h = content_hash(target)
    if stat_signature(content_files(target)) == sig:  # unchanged while it was read: worth keeping
        Path(memo).mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f"{f.name}.{os.getpid()}.part")
        tmp.write_text(h + "\n")
        os.replace(tmp, f)
    return h


@dataclass(frozen=True)
class Recipe:
    """What a cache is made of (the module doc); `key` names it."""
    target: str
    tokenizer: str
    prompts: dict
    template: dict
    options: dict
    generator: int = GENERATOR_VERSION
    extra: dict = field(default_factory=dict)  # fields a later payload added (kept, keyed)

    def as_dict(self) -> dict:
        d = asdict(self)
        return {**{k: v for k, v in d.items() if k != "extra"}, **self.extra}

    @property
    def key(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict) -> Recipe:
        """A recipe read back (cache.json, partial.json); KeyError/TypeError when it is not one."""
        own = ("target", "tokenizer", "prompts", "template", "options", "generator")
        if not isinstance(d, dict) or not all(k in d for k in own):
            raise KeyError("not a recipe")
        extra = {k: v for k, v in d.items() if k not in own and k != "key"}
        return cls(**{k: d[k] for k in own}, extra=extra)


def make_recipe(target: str | os.PathLike, shape: str, records: list[tuple[str, list[str]]], *,
                template_applied: bool, enable_thinking: bool, options: dict,
                memo: str | os.PathLike | None = None) -> Recipe:
    """The recipe of an extract of `records` (read_prompts' result) from `target`; `template_applied`: the
    resolved --chat-template; `options`: `data_options(...)`."""
    return Recipe(target=target_hash(target, memo), tokenizer=tokenizer_digest(target),
                  prompts=prompts_digest(shape, records),
                  template={"applied": bool(template_applied),
                            "enable_thinking": bool(enable_thinking) if template_applied else None},
                  options=dict(options))


def recipe_of(target: str | os.PathLike, prompts_file: str | os.PathLike, *, layer_ids, max_new_tokens: int,
              dtype: str, chat_template: str = "auto", enable_thinking: bool = False,
              num_prompts: int | None = None, memo: str | os.PathLike | None = None, regime=None,
              **more) -> Recipe:
    """The recipe of `extract(target, prompts_file, ..., **the same options)`, decided without torch: the
    prompts read and the chat template resolved as extract does (its refusals too); `dtype` resolved
    (bf16, fp32, fp16); `regime`: the sampling regime (eval/regime.py; None: greedy, left out of the recipe so a
    greedy cache keeps its key), as `options["sampling"]`; `more`: the data options added later (data_options)."""
    if regime is not None:
        more["sampling"] = regime.to_json()
    shape, records = read_prompts(prompts_file, num_prompts)
    source = template_applies(Path(target), chat_template, enable_thinking, records, prompts_file)
    applied = source is not None
    options = data_options(layer_ids=layer_ids, max_new_tokens=max_new_tokens, dtype=dtype, **more)
    return make_recipe(target, shape, records, template_applied=applied, enable_thinking=enable_thinking,
                       options=options, memo=memo)


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The fields two recipes (dicts) differ in, each as 'field: OLD -> NEW' (nested ones dotted; long
    values cut), for a message that says which one changed."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}: {_short(a)} -> {_short(b)}")
    return out


def _short(v) -> str:
    s = json.dumps(v, ensure_ascii=True) if not isinstance(v, str) else v
    return s if len(s) <= 28 else f"{s[:14]}...{s[-8:]}"
