"""The CLI's display of a followed run (follow sinks, see orchestrator/rundir/follow.py and events.py): plain
lines when stdout is not a terminal, a rich progress bar with the log lines above it on a terminal. Only the
CLI prints. What a host sent (log lines, the events' labels, notes) is shown with its control characters
escaped (reval.printable), on a terminal and in a pipe alike."""
from __future__ import annotations

import json
import math
import sys

from rich.markup import escape

from reval import Progress, printable

from . import output


def json_line(offset: int, text: str) -> str:
    """One eval.log line as `reval logs --json` prints it: {"offset": its byte offset, "line": its text}
    (pure). JSON escapes the C0 controls itself; the others a terminal obeys (DEL, C1, the bidi overrides:
    printable's) are written as \\u escapes too, the text otherwise as it is (UTF-8, not \\u-escaped)."""
    line = json.dumps({"offset": offset, "line": text}, ensure_ascii=False)
    if printable(line) != line:
        line = "".join(c if printable(c) == c else f"\\u{ord(c):04x}" for c in line)
    return line + "\n"


class PlainSink:
    """Non-TTY output: the log lines as they are, notes on stderr."""

    def __init__(self, out=None, err=None):
        self.out, self.err = out or sys.stdout, err or sys.stderr

    def line(self, text: str) -> None:
        # a closed pipe (| head) silences it; the follow goes on
        output.write(self.out, printable(text, "\t") + "\n")

    def line_at(self, offset: int, text: str) -> None:
        """A log line with its byte offset in eval.log (follow calls this; JsonLinesSink shows the offset)."""
        self.line(text)

    def event(self, ev: dict) -> None:
        pass

    def status(self, st: dict) -> None:
        pass

    def note(self, text: str) -> None:
        output.write(self.err, printable(text, "\t\n") + "\n")

    def close(self) -> None:
        pass


class JsonLinesSink(PlainSink):
    """`logs -f --json`: each log line as {"offset", "line"} on stdout; notes stay plain on stderr."""

    def line_at(self, offset: int, text: str) -> None:
        output.write(self.out, json_line(offset, text))


def rate_eta(samples: list[tuple[float, int]], n: int) -> tuple[float | None, float | None]:
    """(items per second, seconds left) from (event time "t", i) samples of one counting stage, by the
    events' own clock: a replayed log (`logs -f` on a run that is half done) shows the run's real rate,
    not the speed of the replay (pure)."""
    if len(samples) < 2:
        return None, None
    (t0, i0), (t1, i1) = samples[0], samples[-1]
    if not (math.isfinite(t0) and math.isfinite(t1)) or t1 <= t0 or i1 <= i0:
        return None, None  # absurd times (a damaged events.jsonl: 1e308, Infinity, NaN) give no rate
    rate = (i1 - i0) / (t1 - t0)
    if not 1e-9 < rate < 1e9:  # 1e308 apart (or 1e-300): no rate worth a number
        return None, None
    eta = max(0.0, (n - i1) / rate)
    return rate, eta if eta <= MAX_ETA_S else None


MAX_ETA_S = 100 * 365 * 86400.0  # an ETA past a century is no ETA (absurd event times)


def rate_text(rate: float | None, eta_s: float | None) -> str:
    """`2.4/s · ETA 0:00:41` (pure)."""
    if rate is None or not math.isfinite(rate):
        return ""
    if eta_s is not None and not (math.isfinite(eta_s) and 0 <= eta_s <= MAX_ETA_S):
        eta_s = None
    r = f"{rate:.1f}/s" if rate >= 0.1 else f"{rate * 60:.1f}/min"
    if eta_s is None:
        return r
    m, s = divmod(round(eta_s), 60)
    return f"{r} · ETA {m // 60}:{m % 60:02d}:{s:02d}"


class RichSink(PlainSink):
    """TTY output: a progress bar from events.jsonl, the log lines printed above it. The label is the
    payload's current step (`[3/5] Loading cached hidden states`, from events with step/steps), else the
    stage; the bar is i/n of the latest event that has them, with the rate and ETA by the events' times; a step
    that does not count (the weight load) is a bar without a count, never the last step's. The wrapper's own
    `[reval] ...` lines are one line each here (their whole text is in eval.log)."""

    WINDOW = 20  # events of the current count the rate is measured over

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Column
        from rich.text import Text

        class Count(MofNCompleteColumn):  # `3/10`; nothing for a step that does not count
            def render(self, task):
                return Text("") if task.total is None else super().render(task)

        self.console = console
        label = Column(no_wrap=True, overflow="ellipsis", max_width=max(24, console.width * 2 // 5))  # the bar stays
        self.progress = Progress(TextColumn("{task.description}", table_column=label), BarColumn(), Count(),
                                 TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console,
                                 transient=True)
        self.task = None
        self.shown_on_terminal = 0  # log lines printed above the bar (the final line does not repeat them)
        self.label = ""
        self.step = None
        self.samples: list[tuple[float, int]] = []
        self.count = None
        self.progress.start()

    @property
    def width(self) -> int:
        """The terminal's columns (the final summary is fitted to them)."""
        return self.console.width

    def line(self, text: str) -> None:
        from rich.text import Text
        one = text.startswith("[reval] ")  # `[reval] NAME started ... · CMD`: one line, not five
        self.progress.console.print(Text(printable(text, "\t")), highlight=False, no_wrap=one or None,
                                    overflow="ellipsis" if one else None)
        self.shown_on_terminal += 1

    def event(self, ev: dict) -> None:
        p = Progress.from_event(ev)  # the typed event the API's Run.events() yields too
        if p.step is not None and p.steps is not None and p.message and p.i is None and p.step != self.step:
            self.step, self.label = p.step, f"[{p.step}/{p.steps}] {p.message}"
            self._show(p, total=None)  # a new step: no count until it counts (not the last step's 10/10)
            return
        if p.n is None or p.i is None:
            return
        count = (self.label, p.n)  # one count, whichever events of the step carry it (eval and eval_prompt)
        if count != self.count or (self.samples and p.i < self.samples[-1][1]):
            self.count, self.samples = count, []  # a new count: its own rate
        t = ev.get("t")
        t = float(t) if isinstance(t, float) or isinstance(t, int) and not isinstance(t, bool) and abs(t) < 1e300 \
            else None  # an int past float's range (10**400 in events.jsonl) is no time either
        if (t is not None and math.isfinite(t)
                and (not self.samples or p.i > self.samples[-1][1])):  # the time each i was first reached
            self.samples = (self.samples + [(t, p.i)])[-self.WINDOW:]
        self._show(p, total=max(p.n, 1), completed=p.i, rate=rate_text(*rate_eta(self.samples, p.n)))

    def _show(self, p: Progress, *, total: int | None, completed: int = 0, rate: str = "") -> None:
        description = escape(printable(self.label or p.stage or ""))
        if self.task is not None and total is None:  # rich keeps a total once set: a new task has none
            self.progress.remove_task(self.task)
            self.task = None
        if self.task is None:
            self.task = self.progress.add_task(description, total=total, completed=completed, rate=rate)
        else:
            self.progress.update(self.task, description=description, total=total, completed=completed, rate=rate)

    def note(self, text: str) -> None:
        shown = escape(printable(text, "\t\n"))
        self.progress.console.print(f"[dim]{shown}[/dim]")

    def close(self) -> None:
        self.progress.stop()
