"""The user's words, read one way by the core and the CLI alike (pure): the closest known word to a
mistyped one (every "did you mean"), a duration like 90m, 36h, 7d or 2w (`--since`, `--older-than`), and any
name or line shown with its control characters escaped (`printable`)."""
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


# What a terminal acts on instead of showing: the C0 controls (ESC opens every escape sequence: OSC 0 sets
# the window title, OSC 52 writes the clipboard; BEL ends an OSC; CR rewrites the line), DEL, the C1 controls
# (U+009B is a CSI by itself), the line and paragraph separators, and the bidirectional overrides and
# isolates (which show a name in another order than it is written).
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")

_CONTROLS = [chr(c) for c in range(0x2070) if CONTROL.match(chr(c))]
_ESCAPES = {ord(c): ascii(c)[1:-1] for c in _CONTROLS}  # \x1b, \n, \x9b, \u202e: as Python writes them
# keep -> (the runs of the other control characters, the ASCII bytes that are not one of them)
_UNKEPT: dict[str, tuple[re.Pattern, bytes]] = {}


def _escaped(m: re.Match) -> str:
    run = m[0]
    if run.count(run[0]) == len(run):  # one character repeated (a log's hole of NULs): C speed
        return _ESCAPES[ord(run[0])] * len(run)
    return run.translate(_ESCAPES)


def printable(text, keep: str = "") -> str:
    """`text` as it may reach a terminal, a CSV cell or a page: each control character (CONTROL) written as
    its escape as Python writes it (ESC -> `\\x1b`, a newline -> `\\n`, U+202E -> `\\u202e`), except those
    in `keep` (a log line's tabs, the newlines of a multi-line text). A prompt, suite, run or host name, or a
    line a host sent, is shown, never obeyed (pure)."""
    text = str(text)
    if keep not in _UNKEPT:
        unkept = [c for c in _CONTROLS if c not in keep]
        _UNKEPT[keep] = (re.compile("[" + "".join(map(re.escape, unkept)) + "]+"),
                         bytes(sorted(set(range(128)) - {ord(c) for c in unkept})))
    runs, plain = _UNKEPT[keep]
    if text.isascii():  # the usual case, checked at C speed (a log of 1.5 GB)
        if not text.encode("ascii").translate(None, plain):
            return text
    elif not runs.search(text):
        return text
    return runs.sub(_escaped, text)


def online_agreement(on) -> str:
    """The online check's agreement in a few words, from results.json's online section (a dict or its record):
    '6/6 agree' for a greedy cache (prompts whose every round equals the offline walk's); at T > 0, where rounds
    are not compared (the online draws are its own), 'tau 3.82 online vs 3.85 offline'; '' when neither is there."""
    get = on.get if isinstance(on, dict) else lambda k: getattr(on, k, None)
    if get("prompts_agreeing") is not None:
        return f"{get('prompts_agreeing')}/{get('prompts')} agree"
    t_on, t_off = get("tau_online"), get("tau_offline")
    if t_on is None or t_off is None:
        return ""
    return f"tau {t_on:.2f} online vs {t_off:.2f} offline"
