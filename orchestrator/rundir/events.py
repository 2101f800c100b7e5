"""Typed progress events of one run: what the CLI's progress bar draws, what `reval.Run.events()` yields.

The payload writes events.jsonl (one JSON object a line) and eval.log; following a run turns them into
    LogLine(text, offset)         a whole line of eval.log and its byte offset there
    Progress(stage, ...)          an events.jsonl entry: step/steps (the payload's 5 steps), i/n (prompts)
    StatusChange(state, status)   status.json changed (state in the one vocabulary: runs.reported_state)
    Note(text)                    the follower's own notes (a dropped connection, a reconnect, no progress)
`EventSink` is a follow sink (follow.py) that hands these to a callback instead of printing them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .registry import reported_state


@dataclass(frozen=True)
class LogLine:
    text: str
    offset: int | None = None  # of the line in eval.log (where `logs -f` resumes; None: not known)


@dataclass(frozen=True)
class Progress:
    stage: str = ""
    message: str = ""
    step: int | None = None
    steps: int | None = None
    i: int | None = None
    n: int | None = None
    metrics: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_event(cls, ev: dict) -> Progress:
        def num(k):
            v = ev.get(k)
            return v if isinstance(v, int) and not isinstance(v, bool) else None
        m = ev.get("metrics")
        return cls(stage=str(ev.get("stage") or ""), message=str(ev.get("message") or ""), step=num("step"),
                   steps=num("steps"), i=num("i"), n=num("n"), metrics=m if isinstance(m, dict) else {}, raw=ev)


@dataclass(frozen=True)
class StatusChange:
    state: str
    status: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Note:
    text: str


Event = LogLine | Progress | StatusChange | Note


class EventSink:
    """A follow sink that emits typed events to `emit` (nothing is printed)."""

    def __init__(self, emit: Callable[[Event], None]):
        self.emit = emit

    def line(self, text: str) -> None:
        self.emit(LogLine(text))

    def line_at(self, offset: int, text: str) -> None:
        """A log line with its byte offset in eval.log (what follow hands every sink)."""
        self.emit(LogLine(text, offset))

    def event(self, ev: dict) -> None:
        if isinstance(ev, dict):
            self.emit(Progress.from_event(ev))

    def status(self, st: dict) -> None:
        self.emit(StatusChange(reported_state(st, bool(st.get("alive"))),
                               {k: v for k, v in st.items() if k != "alive"}))

    def note(self, text: str) -> None:
        self.emit(Note(text))

    def close(self) -> None:
        pass
