"""The CLI's display of a followed run (follow sinks, see follow.py / events.py): plain lines when stdout is
not a terminal, a rich progress bar with the log lines above it on a terminal. Only the CLI prints."""
from __future__ import annotations

import sys

from rich.markup import escape

from .. import output
from ..events import Progress


class PlainSink:
    """Non-TTY output: the log lines as they are, notes on stderr."""

    def __init__(self, out=None, err=None):
        self.out, self.err = out or sys.stdout, err or sys.stderr

    def line(self, text: str) -> None:
        output.write(self.out, text + "\n")  # a closed pipe (| head) silences it; the follow goes on

    def event(self, ev: dict) -> None:
        pass

    def status(self, st: dict) -> None:
        pass

    def note(self, text: str) -> None:
        output.write(self.err, text + "\n")

    def close(self) -> None:
        pass


class RichSink(PlainSink):
    """TTY output: a progress bar from events.jsonl, the log lines printed above it. The label is the
    payload's current step (`[3/5] Loading cached hidden states`, from events with step/steps), else the
    stage; the bar is i/n of the latest event that has them."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True)
        self.task = None
        self.label = ""
        self.progress.start()

    def line(self, text: str) -> None:
        from rich.text import Text
        self.progress.console.print(Text(text), highlight=False)

    def event(self, ev: dict) -> None:
        p = Progress.from_event(ev)  # the typed event the API's Run.events() yields too
        fields = {}
        if p.step is not None and p.steps is not None and p.message and p.i is None:
            self.label = f"[{p.step}/{p.steps}] {p.message}"
            fields = {"completed": 0, "total": None}  # a new step: indeterminate until it counts
        if p.n is not None and p.i is not None:
            fields = {"completed": p.i, "total": max(p.n, 1)}
        if not fields:
            return
        fields["description"] = escape(self.label or p.stage)
        if self.task is None:
            self.task = self.progress.add_task(**fields)
        else:
            self.progress.update(self.task, **fields)

    def note(self, text: str) -> None:
        self.progress.console.print(f"[dim]{escape(text)}[/dim]")

    def close(self) -> None:
        self.progress.stop()
