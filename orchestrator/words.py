"""The user's words, read one way by the core and the CLI alike (pure): the closest known word to a
mistyped one (every "did you mean"), and a duration like 90m, 36h, 7d or 2w (`--since`, `--older-than`)."""
from __future__ import annotations

import difflib
import re


def did_you_mean(word: str, options) -> str | None:
    """The closest of `options` to `word`, or None (pure)."""
    close = difflib.get_close_matches(word, sorted(set(options)), n=1, cutoff=0.6)
    return close[0] if close else None


def duration_s(text: str) -> float | None:
    """A duration like 90m, 36h, 7d or 2w -> seconds; None when it is not one (pure)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    return float(m.group(1)) * unit[m.group(2)] if m else None
