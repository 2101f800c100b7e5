"""Prompt files (`read_prompts`): z-lab's `{"turns": [...]}` jsonl (multi-turn, e.g. MT-Bench),
`{"prompt": ...}` jsonl, or a .txt with one prompt a line; one shape per file. Turn k of a conversation is one
cache entry `<name>/t<k>` (`entry_names`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular

_NAME_KEYS = ("name", "question_id", "id")
PROMPT_SHAPES = ('{"turns": ["...", ...]} (z-lab, multi-turn; optional "question_id"/"id"/"name"), '
                 '{"prompt": "..."} (optional "name"); or a .txt with one prompt a line')


class _BadLine(ValueError):
    """What is wrong with a prompt file's line (read_prompts adds the file and line)."""


def _parse_prompt_line(line: str) -> tuple[str | None, list[str], str]:
    """One jsonl line -> (name or None, turns, shape); _BadLine saying what is wrong."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise _BadLine(f"not JSON ({e})") from None
    if not isinstance(d, dict):
        raise _BadLine(f"a JSON {type(d).__name__}, not an object")
    if "turns" in d and "prompt" in d:
        raise _BadLine('both "turns" and "prompt"')
    if "turns" in d:
        turns = d["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise _BadLine('"turns" is not a non-empty list of non-empty strings')
        shape = "turns"
    elif "prompt" in d:
        if not isinstance(d["prompt"], str) or not d["prompt"].strip():
            raise _BadLine('"prompt" is not a non-empty string')
        turns, shape = [d["prompt"]], "prompt"
    else:
        keys = sorted(" ".join(str(k).split())[:40] for k in d)  # one line, whatever the keys hold
        raise _BadLine(f'no "turns" or "prompt" (keys: {", ".join(keys[:6])}{", ..." if len(keys) > 6 else ""})')
    name = next((d[k] for k in _NAME_KEYS if d.get(k) is not None), None)
    return (None if name is None else str(name)), list(turns), shape


def _lines(text: str) -> list[str]:
    """A file's lines, split at \\n (a \\r\\n ending loses its \\r) and nowhere else: str.splitlines() also splits at
    U+2028, NEL, form feed, \\v, ..., which cut a .txt prompt in two and a valid jsonl line's string in half."""
    return [ln.removesuffix("\r") for ln in text.split("\n")]


def entry_names(records: list[tuple[str, list[str]]]) -> list[list[str]]:
    """Cache entry names per record: a single-turn prompt keeps its name, turn k of a longer one is <name>/t<k>."""
    return [[name] if len(turns) == 1 else [f"{name}/t{k}" for k in range(1, len(turns) + 1)]
            for name, turns in records]


def read_prompts(path: str | os.PathLike, num_prompts: int | None = None) -> tuple[str, list[tuple[str, list[str]]]]:
    """A prompt file -> (shape, [(name, turns)]) for its first num_prompts records (conversations).

    shape "turns": z-lab's {"turns": [...]} jsonl (name: "name", "question_id" or "id"); "prompt": {"prompt": ...}
    jsonl (also today's {name, prompt}); "txt": any other file, one prompt a line. A record without a name is
    prompt-NNN (its place in the file). One shape per file; a bad line is one line naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise PayloadError(f"--prompts {path}: no such file; pass a .jsonl of {PROMPT_SHAPES}")
    try:
        lines = _lines(read_regular(path).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PayloadError(f"--prompts {path}: not UTF-8 text ({e}); pass a .jsonl or .txt of prompts") from None
    records: list[tuple[str, list[str]]] = []
    if path.suffix == ".jsonl":
        shape = None
        for n, ln in enumerate(lines, 1):
            if not ln.strip():
                continue
            try:
                name, turns, line_shape = _parse_prompt_line(ln)
            except _BadLine as e:
                raise PayloadError(f"--prompts {path} line {n}: {e}; expected one of {PROMPT_SHAPES}") from None
            if shape is not None and line_shape != shape:
                raise PayloadError(f"--prompts {path} line {n}: a {line_shape!r} line after {shape!r} lines; "
                                   "use one shape per file")
            shape = line_shape
            records.append((name if name is not None else f"prompt-{len(records):03d}", turns))
    else:
        shape = "txt"
        records = [(f"prompt-{i:03d}", [ln]) for i, ln in enumerate(ln for ln in lines if ln.strip())]
    if not records:
        raise PayloadError(f"--prompts {path} holds no prompts; add one prompt per line")
    names = [n for ns in entry_names(records) for n in ns]
    seen: set[str] = set()
    dup = sorted({n for n in names if n in seen or seen.add(n)})
    if dup:
        raise PayloadError(f"--prompts {path}: duplicate names {dup[:5]}; give every prompt its own name")
    return shape, (records[:num_prompts] if num_prompts else records)
