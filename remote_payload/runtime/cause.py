"""Why a run failed, in one line (stdlib only): what the wrapper records as status.json's `error` when its
payload exits non-zero without one, so that `reval status`, `ls`, `--json` and the final line of `run` say
the cause instead of only `exit 1`.

Where it comes from, first found wins:
  1. the payload's last `error` event in events.jsonl (`{"stage": "error", "message": ...}`: the eval writes
     one for every failure it catches);
  2. the exception line that ends the last Python traceback at the end of eval.log (`RuntimeError: CUDA out of
     memory ...`), the first line of it;
  3. the last `error: ...` line near the end of eval.log (a payload that says what went wrong and exits).
"""
from __future__ import annotations

import json
import os

from remote_payload.contract import protocol

MAX_CAUSE_CHARS = 300  # one line on a screen, whole enough for `torch.OutOfMemoryError: CUDA out of memory...`
TAIL_BYTES = 64 << 10  # what is read from the end of events.jsonl and eval.log
TRACEBACK = "Traceback (most recent call last):"


def one_line(text: str, limit: int = MAX_CAUSE_CHARS) -> str:
    """The first non-empty line of `text`, stripped, at most `limit` characters (pure)."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[:limit - 1] + "…"


def from_events(text: str) -> str | None:
    """The message of the last `error` event in events.jsonl text (pure)."""
    for raw in reversed(text.splitlines()):
        try:
            ev = json.loads(raw)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("stage") == "error" and isinstance(ev.get("message"), str):
            msg = one_line(ev["message"])
            if msg and msg != "interrupted":
                return msg
    return None


def from_log(text: str) -> str | None:
    """The exception line of the last traceback in eval.log text, else its last `error: ...` line (pure).
    The wrapper's own `[reval] ...` lines are not the payload's words and are skipped."""
    lines = [ln for ln in text.splitlines() if not ln.startswith("[reval] ")]
    starts = [i for i, ln in enumerate(lines) if ln.strip() == TRACEBACK]
    if starts:
        for ln in lines[starts[-1] + 1:]:  # the frames are indented; the exception is the first line that is not
            if ln.strip() and not ln[:1].isspace():
                return one_line(ln)
    for ln in reversed(lines[-50:]):
        if ln.strip().lower().startswith("error:"):
            return one_line(ln.strip()[len("error:"):]) or None
    return None


def failure_cause(run_dir) -> str | None:
    """The one-line cause of a failed run from its events.jsonl and eval.log, or None when neither says."""
    return (from_events(protocol.tail_text(os.path.join(run_dir, protocol.EVENTS_JSONL), TAIL_BYTES))
            or from_log(protocol.tail_text(os.path.join(run_dir, protocol.EVAL_LOG), TAIL_BYTES)))
