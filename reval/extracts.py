"""Hidden-state caches through the API: extract(host, ExtractSpec) -> ExtractRun (its finish() ->
ExtractFinished, with the caches each suite resolved to), caches(host) -> CacheListing, remove_caches(host, keys).
The store and its keys: orchestrator/runs/extracts.py and remote_payload/extract/store.py."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from orchestrator.errors import ConfigError, EvalFailed
from orchestrator.hosts.gpuspec import normalize_gpus
from orchestrator.hosts.inventory import Host, Inventory
from orchestrator.rundir import registry as _runs
from orchestrator.rundir.events import Event
from orchestrator.runs import extracts as _extracts
from orchestrator.runs import lifecycle as _lifecycle
from orchestrator.runs.extracts import ExtractSpec
from orchestrator.runs.lifecycle import Finished
from remote_payload.contract import protocol

from .hosts import Prepared, as_host, as_inventory, hosts_of, per_host, prepare
from .runs import Run, host_path


@dataclass
class CacheInfo:
    """One cache of a host's store: its key (the recipe's), suite (the name it was first asked under), target
    (content hash) and target_path, layers, prompts (records) and entries, tokens, template (applied) and
    thinking, sampling, max_new_tokens, dtype, bytes, created_at, agreement (the target's argmax agreement with
    the cached tokens), readers (running runs that read it), building, damaged (why, when it does not hold up:
    never used); `built`: made by this extract (False: it was there and reused)."""
    key: str
    path: str
    suite: str | None = None
    target: str | None = None
    target_path: str | None = None
    layers: list | None = None
    prompts: int | None = None
    entries: int | None = None
    tokens: int | None = None
    template: bool | None = None
    thinking: bool | None = None
    sampling: object = None
    max_new_tokens: int | None = None
    dtype: str | None = None
    bytes: int | None = None
    created_at: str | None = None
    agreement: float | None = None
    readers: list = field(default_factory=list)
    building: bool = False
    damaged: str | None = None
    built: bool | None = None
    host: str = ""

    @classmethod
    def from_json(cls, d: dict, host: str = "") -> CacheInfo:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known and k != "host"}, host=host)

    @classmethod
    def from_built(cls, d: dict, host: str) -> CacheInfo:
        """A caches.json entry (suite, key, path, built, cache: its cache.json)."""
        meta, rec = d.get("cache") or {}, (d.get("cache") or {}).get("recipe") or {}
        prompts, agree, opts = meta.get("prompts") or [], meta.get("argmax_agreement"), rec.get("options") or {}
        return cls(key=d["key"], path=d["path"], suite=d.get("suite"), target=rec.get("target"),
                   target_path=(meta.get("target") or {}).get("path"), layers=opts.get("layers"),
                   prompts=(rec.get("prompts") or {}).get("count"), entries=len(prompts),
                   tokens=sum(int(p.get("seq_len", 0)) for p in prompts),
                   template=(rec.get("template") or {}).get("applied"),
                   thinking=(rec.get("template") or {}).get("enable_thinking"),
                   sampling=meta.get("sampling", opts.get("sampling", "greedy")),
                   max_new_tokens=opts.get("max_new_tokens"), dtype=opts.get("dtype"),
                   created_at=meta.get("created_at"),
                   agreement=agree.get("fraction") if isinstance(agree, dict) else None,
                   built=bool(d.get("built")), host=host)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(repr=False)
class ExtractFinished:
    """How an extract run ended: `finished` (the lifecycle's Finished: state, status, path of the pulled copy)
    and `caches` (from its caches.json: each suite's cache, `built` or reused); exit_code 0 when it succeeded
    and said what each suite resolved to."""
    finished: Finished
    caches: list[CacheInfo] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.finished.ok and bool(self.caches)

    @property
    def exit_code(self) -> int:
        if self.ok:
            return 0
        return _lifecycle.failure_exit_code(self.finished.state, self.finished.status)

    def __getattr__(self, name):  # state, status, path, last_lines, discarded: the Finished's
        return getattr(self.finished, name)

    def __repr__(self) -> str:
        return f"reval.ExtractFinished({self.finished.host}/{self.finished.name}: {self.finished.state}, " \
               f"{len(self.caches)} caches)"


def pulled_caches(path: Path, host: str) -> list[CacheInfo]:
    """The caches an extract run's pulled copy names (its caches.json); [] when it has none."""
    try:
        data = json.loads((path / protocol.CACHES_JSON).read_text(encoding="utf-8"))
        return [CacheInfo.from_built(d, host) for d in data["caches"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def extract_finished(fin: Finished) -> ExtractFinished | None:
    """The Finished of an extract run (its run.json says kind extract: `reval logs NAME -f` on one) as an
    ExtractFinished; None for any other run."""
    info = getattr(fin.result, "run_info", None) or {}
    if info.get("kind") != "extract":
        return None
    return ExtractFinished(fin, pulled_caches(fin.path, fin.host))


class ExtractRun(Run):
    """An extract run: a Run (state, events, log, kill, pull) whose finish() says which caches it made;
    `prompts_sent`: the prompt files copied to the host by this call (the others were there)."""

    def __init__(self, handle, *, prompts_sent: list[str] | None = None, **kw):
        super().__init__(handle, **kw)
        self.prompts_sent = list(prompts_sent or [])

    def finish(self, *, on_event: Callable[[Event], None] | None = None, log_offset: int | None = None,
               tail: int | None = None, give_up_s: float = 120.0) -> ExtractFinished:
        fin = super().finish(on_event=on_event, log_offset=log_offset, tail=tail, give_up_s=give_up_s)
        return ExtractFinished(fin, pulled_caches(fin.path, self.host))

    def wait(self, *, give_up_s: float = 120.0, on_event: Callable[[Event], None] | None = None):
        """Follow to the end; the caches (list[CacheInfo]); reval.Error when it did not succeed."""
        fin = self.finish(on_event=on_event, give_up_s=give_up_s)
        if fin.ok:
            return fin.caches
        why = fin.status.get("error") or f"exit {fin.status.get('exit_code')}"
        err = EvalFailed(f"{self.ref}: {fin.state} ({why})", hint=f"see {fin.path}/eval.log",
                         exit_code=fin.exit_code)
        err.finished = fin
        raise err


def check_extract(host: Host, spec: ExtractSpec, *, name: str | None = None) -> ExtractSpec:
    """What extract refuses before anything happens anywhere (exit 3): a relative host path on a remote host,
    the GPUs, the run name, a runs/ here that cannot be written."""
    spec = spec.with_paths(lambda k, v: host_path(k, v, host))
    normalize_gpus(spec.gpus or host.gpus)
    if name is not None:
        _runs.check_run_name(name)
    _runs.check_local_runs_root(host.name)
    return spec


def extract(host: Host | str, spec: ExtractSpec, *, name: str | None = None,
            inventory: Inventory | str | Path | None = None, prepared: Prepared | None = None,
            argv: list[str] | None = None) -> ExtractRun:
    """Build the caches `spec` asks for on `host` (`reval extract`): the spec checked, the payload synced
    (unless `prepared`), the prompt files copied (only those the host lacks), the plan checked there (exit 3:
    nothing started), then one extract run, detached: the suites already in the store are reused, the others
    built (once, whoever else asks)."""
    h = as_host(host, inventory)
    spec = check_extract(h, spec, name=name)
    if prepared is not None and prepared.host != h.name:
        raise ConfigError(f"prepared for {prepared.host}, not {h.name}", hint=f"reval.prepare({h.name!r})")
    prep = prepared or prepare(h)
    synced = _extracts.sync_prompts(prep, spec.prompts)
    run_name = name or protocol.default_run_name("extract")
    sub = _extracts.submission(prep, spec, synced.remote, name=run_name, argv=argv,
                               run_json={"payload_hash": prep.synced.manifest_hash, "venv_key": prep.env.key,
                                         **({"via": "reval API"} if argv is None else {})})
    return ExtractRun(_lifecycle.submit_submission(prep.backend, sub), prompts_sent=synced.sent)


@dataclass
class CacheListing:
    """caches(): every host's store entries; `unreachable`: {host: why}."""
    caches: list[CacheInfo] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> list[dict]:
        return ([c.to_json() for c in self.caches]
                + [{"host": h, "state": "unreachable", "error": why} for h, why in self.unreachable.items()])


def caches(target: str | None = None, *, inventory: Inventory | str | Path | None = None) -> CacheListing:
    """The cache stores of a host or group (default: every inventory host) (`reval caches`)."""
    hosts = hosts_of(as_inventory(inventory), target)

    def one(be):
        prep = prepare(be.host)
        return [CacheInfo.from_json(d, be.host.name) for d in _extracts.list_caches(prep)["caches"]]
    found, unreachable = per_host(hosts, one)
    return CacheListing([c for h in hosts for c in found.get(h.name, [])], unreachable)


def remove_caches(host: Host | str, keys: list[str], *,
                  inventory: Inventory | str | Path | None = None) -> list[str]:
    """Remove caches from a host's store (`reval caches rm HOST KEY...`): refused while a running run reads one
    (exit_code 3); the removed keys."""
    return _extracts.remove_caches(prepare(as_host(host, inventory)), list(keys))
