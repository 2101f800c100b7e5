"""A second process that draws one of a report's figures while this one draws the others: matplotlib draws
on one core, and a sweep's report is six figures (plots.png, ~0.8 s, and report.html's five SVGs, ~0.8 s
together), so two processes halve the wait at the end of a sweep.

The worker is started early (`warm()`: the sweep calls it while its first run goes on), so its own imports
(matplotlib, ~0.5 s) are paid while the evals run, not at the end. It reads requests on stdin and answers on
stdout, each a length-prefixed pickle: (function name in plots.py, args) -> ("ok", value) | ("error", text).
It ends at the end of its stdin: when this process closes the pipe (`close()`, at exit) or dies. Anything
the worker cannot do (it failed to start, died, answered an error) is done here instead (`start` or
`result()` says None and the caller draws it itself): a second process only saves time, never changes a file.
"""
from __future__ import annotations

import atexit
import pickle
import struct
import subprocess
import sys
import threading
from pathlib import Path

_HEADER = struct.Struct(">Q")
_ROOT = str(Path(__file__).resolve().parents[2])  # where the orchestrator package is, for the worker's import
_SERVE = "from orchestrator.render.plotworker import serve; serve()"
# the worker only draws what plots.py names here (a request is never an arbitrary call)
ALLOWED = frozenset({"save_comparison_plot", "panel_svg", "tau_vs_step_svg"})


def _send(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def _recv(f):
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the pipe closed")
    n = _HEADER.unpack(head)[0]
    data = f.read(n)
    if len(data) < n:
        raise EOFError("the pipe closed mid-message")
    return pickle.loads(data)  # our own process's pipe, never a file or a host's output


class PlotWorker:
    """One worker process (see the module doc), serving one request at a time: a second `start` before the
    first one's `result()` gets None (its caller draws itself)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"import sys; sys.path.insert(0, {_ROOT!r}); {_SERVE}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, name: str, *args) -> Pending | None:
        """Ask for plots.<name>(*args) and return at once (the worker draws while the caller goes on), or None
        when the worker cannot take it (the caller then draws it itself). The answer: `Pending.result()`."""
        if name not in ALLOWED or not self.alive() or not self.lock.acquire(blocking=False):
            return None
        try:
            _send(self.proc.stdin, (name, args))
        except (OSError, ValueError, pickle.PickleError, AttributeError, TypeError):
            self.lock.release()
            self.close()  # a worker that cannot be written to is not asked again
            return None
        return Pending(self)

    def _answer(self):
        try:
            status, value = _recv(self.proc.stdout)
            return value if status == "ok" else None
        except (OSError, EOFError, ValueError, pickle.PickleError, AttributeError, TypeError):
            self.close()  # a worker that broke its protocol is not asked again
            return None
        finally:
            self.lock.release()

    def close(self) -> None:
        """End the worker (the end of its stdin) and reap it."""
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            p.stdin.close()
            p.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()  # our own child, started above
            p.wait()
        finally:
            p.stdout.close()


class Pending:
    """A request the worker took: `result()` waits for its answer (None: the worker failed; draw it here)."""

    def __init__(self, worker: PlotWorker):
        self.worker, self.done, self.value = worker, False, None

    def result(self):
        if not self.done:
            self.done, self.value = True, self.worker._answer()
        return self.value


_worker: PlotWorker | None = None
_worker_lock = threading.Lock()


def warm() -> None:
    """Start the shared worker now (it imports matplotlib while the caller goes on); a second call keeps it."""
    global _worker
    with _worker_lock:
        if _worker is None or not _worker.alive():
            _worker = PlotWorker()


def shared() -> PlotWorker | None:
    """The worker `warm()` started, if it is still there."""
    with _worker_lock:
        return _worker if _worker is not None and _worker.alive() else None


@atexit.register
def close() -> None:
    global _worker
    with _worker_lock:
        w, _worker = _worker, None
    if w is not None:
        w.close()


def serve() -> None:
    """The worker's loop: requests on stdin, answers on stdout, until stdin ends."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing printed by a library may land in the answers
    from . import plots
    while True:
        try:
            name, args = _recv(inp)
        except EOFError:
            return
        try:
            if name not in ALLOWED:
                raise ValueError(f"not a plot: {name!r}")
            _send(out, ("ok", getattr(plots, name)(*args)))
        except BrokenPipeError:
            return
        except Exception as e:  # noqa: BLE001 - said to the caller, which draws it itself
            _send(out, ("error", f"{type(e).__name__}: {e}"))
