"""reval as a library: run DFlash drafter evals on GPU hosts, follow them, load and compare results.

    import reval
    inv = reval.Inventory.load("hosts.yaml")             # the CLI's validation and one-line errors
    run = reval.submit(inv["gpu1"], reval.EvalSpec(drafter="/m/step4000", target="/m/Qwen3.6-27B",
                       cache="/eval/cache", num_prompts=10, max_blocks=30), name="step4000")
    for ev in run.events():                              # typed progress (what the CLI's bar draws):
        ...                                              #   reval.LogLine / Progress / StatusChange / Note
    res = run.wait()                                     # follows, pulls, returns a reval.Result
    res.metrics.tau, res.per_prompt[0].acceptance_lengths, res.health.suspect, res.path
    base = reval.load("runs/gpu1/zlab_full")             # any pulled run directory
    cmp = reval.compare([res, base], baseline=base)      # what `reval compare` prints, as data
    cmp.best, cmp.rows                                   # the top-tau rankable run; one plain dict per run

One entry point per verb; nothing here prints. Errors are `reval.Error` (a RevalError: `str(e)` is the
one line, `e.hint` the fix, `e.exit_code` the CLI's code). `reval run/sweep/demo` are thin layers over the
same lifecycle (orchestrator/lifecycle.py) through a backend (orchestrator/backends/: SSH or the local
folder; a scheduler next). `Result` is the pulled run directory as read from disk: its typed results.json
(`res.result`, remote_payload/contract/results.py; `res.metrics`, `res.per_prompt`, `res.health`... forward to it),
status.json, run.json, `res.state`, `res.suspect`, `res.path`.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import compare as _compare
from orchestrator import lifecycle as _lifecycle
from orchestrator import tables as _tables
from orchestrator.backends import get_backend
from orchestrator.errors import EvalFailed, RevalError
from orchestrator.events import Event, LogLine, Note, Progress, StatusChange
from orchestrator.inventory import Host, Inventory, load_inventory
from orchestrator.lifecycle import EvalSpec, Finished

Error = RevalError
Result = _compare.RunRecord  # a pulled run directory: .result (typed results.json), .metrics..., .state, .path

__all__ = ["Comparison", "Error", "EvalSpec", "Event", "Finished", "Host", "Inventory", "LogLine", "Note",
           "Progress", "Result", "Run", "StatusChange", "attach", "compare", "load", "submit"]


class Run:
    """A run on a host: `events()`, `wait()`, `kill()`, `state` (see the module doc)."""

    def __init__(self, handle: _lifecycle.Run):
        self._run = handle

    def __repr__(self) -> str:
        return f"reval.Run({self.ref})"

    @property
    def name(self) -> str:
        return self._run.name

    @property
    def host(self) -> str:
        return self._run.host

    @property
    def ref(self) -> str:
        """`host/name`, as the CLI takes it."""
        return self._run.ref

    @property
    def handle(self) -> _lifecycle.Run:
        """The lifecycle handle under it (orchestrator/lifecycle.py): what the CLI follows with its display."""
        return self._run

    @property
    def state(self) -> str:
        """queued | running | succeeded | failed | cancelled | lost — asked from the host now."""
        return self._run.state

    def events(self, *, log_offset: int = 0, give_up_s: float = 120.0) -> Iterator[Event]:
        """Typed events until the run is over (from byte `log_offset` of its eval.log)."""
        return self._run.events(log_offset=log_offset, give_up_s=give_up_s)

    def wait(self, *, give_up_s: float = 120.0, on_event=None) -> Result:
        """Follow to the end, pull, and load the result. A run that did not succeed raises reval.Error
        (exit_code 1, or 3 for bad input, 103 cancelled) with `.finished` (how it ended) and `.result`."""
        from orchestrator.events import EventSink
        fin = self._run.wait(EventSink(on_event) if on_event else None, give_up_s=give_up_s)
        res = load(fin.path)
        if _lifecycle.bad_input(fin):
            self._run.discard()  # exit 3 leaves nothing on either side (the name is free again)
        if not fin.ok or res.result is None:
            why = fin.status.get("error") or f"exit {fin.status.get('exit_code')}"
            err = EvalFailed(f"{self.ref}: {fin.state} ({why})", hint=f"see {fin.path}/eval.log",
                             exit_code=_lifecycle.failure_exit_code(fin.state, fin.status))
            err.finished, err.result = fin, res
            raise err
        return res

    def kill(self, *, grace_s: float = 10.0) -> str:
        """Cancel it (TERM, wait, KILL; confirmed); returns the state after (`cancelled`, or how it ended)."""
        return self._run.kill(grace_s=grace_s).state


def _host(host: Host | str, inventory: Inventory | None) -> Host:
    if isinstance(host, Host):
        return host
    return (inventory or load_inventory()).get(host)


def submit(host: Host | str, spec: EvalSpec, *, name: str | None = None, inventory: Inventory | None = None) -> Run:
    """Sync the payload (and venv) to `host`, check the spec's paths there, and start the eval detached.
    `host`: an inventory Host (`inv["gpu1"]`) or its name (looked up in `inventory`, else the default)."""
    h = _host(host, inventory)
    backend = get_backend(h)
    prep = _lifecycle.prepare(backend)
    return Run(_lifecycle.submit(backend, spec, python=prep.python, name=name,
                                 run_json={"payload_hash": prep.synced.manifest_hash, "venv_key": prep.env.key,
                                           "via": "reval API"}))


def attach(host: Host | str, name: str, *, inventory: Inventory | None = None) -> Run:
    """A handle on a run that already exists on `host` (started by the CLI, the API or a sweep)."""
    return Run(_lifecycle.attach(get_backend(_host(host, inventory)), name))


def load(run_dir: str | Path) -> Result:
    """A pulled run directory (runs/<host>/<name>/, or any folder holding its results.json/status.json)."""
    return _compare.load_run(run_dir)


@dataclass
class Comparison:
    """The comparison `reval compare` prints: `rows` (one plain dict per run: metrics, marks, ratio/delta
    vs the baseline), `best` (label of the highest-tau rankable run), `comparable`, `differences`."""
    model: _compare.Comparison
    rows: list[dict] = field(default_factory=list)
    best: str | None = None
    comparable: bool = True
    differences: list[dict] = field(default_factory=list)
    note: str = ""


def compare(results: list[Result | str | Path], *, baseline: Result | str | Path | None = None) -> Comparison:
    """Compare results (or run directories); runs that are not comparable are marked, never ranked."""
    model = _compare.compare(results, baseline, allow_incomparable=True)  # what `reval compare` builds
    data = _tables.comparison_json(model)
    ranked = [r for r in data["runs"] if r["rankable"] and r["metrics"].get("tau") is not None]
    best = max(ranked, key=lambda r: r["metrics"]["tau"])["label"] if ranked else None
    return Comparison(model, data["runs"], best, data["comparable"], data["differences"], data["note"])
