"""Hidden-state caches built on a host through reval: `reval extract`, `reval caches`, `run --prompts`.

A host keeps a cache store (`<workdir>/caches/`, remote_payload/extract/store.py): each cache under the key of
its recipe (the target's content, the prompts, the layers, the template, the options that change the data),
built once however many ask. From here:

    sync_prompts(backend, refs)     the prompt files copied to <workdir>/prompts/<sha256><suffix>: named by their
                                    content, so only a file not there yet travels (one round trip to look)
    plan(prepared, spec, remote)    what each suite resolves to in the store (`extract --store --plan`: key,
                                    ready|missing|building|damaged, the estimated size); bad input: ConfigError
    submit_extract(prepared, spec)  one extract run for the suites asked (the lifecycle's: detached under the
                                    wrapper, followed, killed, pulled like any run; pulled: caches.json only)
    list_caches / remove_caches     `python -m remote_payload caches` on the host (JSON)

The payload re-derives each key itself (the same recipe function both ways), so nothing here decides what a
cache is: this side only names the files and the options.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from remote_payload.contract import protocol
from remote_payload.contract import spec as _spec

from .. import __version__
from ..backends.base import Submission
from ..errors import ConfigError, EvalFailed, RemoteCommandError, RevalError
from ..hosts.gpuspec import normalize_gpus
from ..hosts.transport import q
from .lifecycle import Prepared, check_prompt_file, failure_exit_code, submit_submission

CHAT_TEMPLATES = ("auto", "on", "off")
DTYPES = ("auto", "bf16", "fp32", "fp16")


@dataclass(frozen=True)
class ExtractSpec:
    """What to extract: the target (a path on the host), the suites' prompt files (here: NAME=FILE), the tapped
    layers (`layers`, or `for_drafter`: a drafter on the host whose target_layer_ids they are), and the options
    that change the data. Checked when made (ConfigError)."""
    target: str
    prompts: tuple[_spec.PromptRef, ...]
    layers: str | None = None
    for_drafter: str | None = None
    max_new_tokens: int | None = None
    num_prompts: int | None = None
    chat_template: str = "auto"
    enable_thinking: bool = False
    dtype: str = "auto"
    gpus: str | None = None  # where, not what: auto | none | 0,1 (None: the host's)

    def __post_init__(self):
        try:
            object.__setattr__(self, "prompts", _spec.parse_prompts(self.prompts))
        except _spec.SpecError as e:
            raise ConfigError(str(e), hint=e.hint) from None
        if not self.prompts:
            raise ConfigError("extract: give the prompt files, --prompts NAME=FILE once per suite",
                              hint="e.g. --prompts gsm8k=prompts/gsm8k.jsonl")
        if not isinstance(self.target, str) or not self.target:
            raise ConfigError("extract: give --target PATH (the target model's folder on the host)")
        if bool(self.layers) == bool(self.for_drafter):
            raise ConfigError("extract: give the tapped layers: --layers 1,16,31 or --for-drafter PATH (its "
                              "target_layer_ids), one of them")
        for k in ("max_new_tokens", "num_prompts"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"--{k.replace('_', '-')} must be a whole number of at least 1, got {v!r}")
        if self.chat_template not in CHAT_TEMPLATES or self.dtype not in DTYPES:
            raise ConfigError(f"--chat-template {self.chat_template} / --dtype {self.dtype}: use "
                              f"{'|'.join(CHAT_TEMPLATES)} / {'|'.join(DTYPES)}")
        for ref in self.prompts:
            check_prompt_file(ref)

    def options_argv(self) -> list[str]:
        """The payload's options that change the data (the sampling flags join here), then --layers."""
        argv = ["--layers", self.layers] if self.layers else ["--for-drafter", str(self.for_drafter)]
        argv += ["--max-new-tokens", str(self.max_new_tokens)] if self.max_new_tokens else []
        argv += ["--num-prompts", str(self.num_prompts)] if self.num_prompts else []
        argv += ["--chat-template", self.chat_template] if self.chat_template != "auto" else []
        argv += ["--enable-thinking"] if self.enable_thinking else []
        return argv + (["--dtype", self.dtype] if self.dtype != "auto" else [])

    def with_paths(self, fix) -> ExtractSpec:
        """The spec with its host paths passed through fix(option, path) (made absolute)."""
        return dataclasses.replace(self, target=fix("target", self.target),
                                   for_drafter=fix("for-drafter", self.for_drafter) if self.for_drafter else None)


def store_dir(workdir: str) -> str:
    return f"{workdir}/caches"


def prompt_name(path: str | os.PathLike) -> str:
    """The host's name of a prompt file: its sha256 and its suffix (.jsonl or .txt decides how it is read)."""
    if not Path(path).is_file():  # never a read that blocks (a FIFO); the specs refuse these with the suite's name
        raise ConfigError(f"prompt file {path}: not a regular file here", hint="give a .jsonl or .txt file")
    data = Path(path).read_bytes()
    suffix = Path(path).suffix if Path(path).suffix in (".jsonl", ".txt") else ".txt"
    return hashlib.sha256(data).hexdigest() + suffix


@dataclass
class SyncedPrompts:
    """The suites' prompt files on the host: `remote` [(suite, path there)]; `sent`: the files copied now (the
    others were there already)."""
    remote: list[tuple[str, str]]
    sent: list[str] = field(default_factory=list)


def sync_prompts(prepared: Prepared, refs) -> SyncedPrompts:
    """Copy the prompt files the host lacks to <workdir>/prompts/ (content-addressed; written under a temporary
    name and renamed): one round trip to look, one more only when something is missing."""
    t, d = prepared.backend.transport, f"{prepared.workdir}/prompts"
    names = {r.name: prompt_name(r.path) for r in refs}
    look = "; ".join(f"[ -f {q(d + '/' + n)} ] && echo {q(n)}" for n in sorted(set(names.values())))
    have = set(t.run(f"{look}; true").stdout.split())
    missing = sorted({n for n in names.values() if n not in have})
    if missing:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for n in missing:
                ref = next(r for r in refs if names[r.name] == n)
                data = Path(ref.path).read_bytes()
                info = tarfile.TarInfo(n)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        t.run(f"mkdir -p {q(d)} && tmp=$(mktemp -d {q(d + '/.in.XXXXXX')}) && tar xf - -C \"$tmp\" && "
              f"for f in \"$tmp\"/*; do mv -f \"$f\" {q(d)}/; done && rmdir \"$tmp\"", input=buf.getvalue())
    return SyncedPrompts([(r.name, f"{d}/{names[r.name]}") for r in refs], missing)


def extract_argv(prepared: Prepared, spec: ExtractSpec, remote: list[tuple[str, str]]) -> list[str]:
    """`python -m remote_payload extract --store ...` arguments, without --run-dir (the launcher adds it). The
    plan must key the cache as the run will (the dtype is in the recipe): --gpus none is --device cpu (the
    plan runs outside the wrapper, CUDA visible); where the plan runs on another machine than the job (a
    scheduler's login node: Backend.job_device), --dtype auto is named for the job's device (cuda: bf16, cpu:
    fp32), as extract resolves auto there, so the login node's lack of a GPU keys nothing."""
    gpus = normalize_gpus(spec.gpus or prepared.backend.host.gpus)
    argv = ["extract", "--store", store_dir(prepared.workdir), "--target", spec.target,
            *[a for name, path in remote for a in ("--prompts", f"{name}={path}")], *spec.options_argv(),
            *(["--device", "cpu"] if gpus == "none" else [])]
    device = prepared.backend.job_device(gpus) if spec.dtype == "auto" and gpus != "none" else None
    return argv + (["--dtype", "bf16" if device == "cuda" else "fp32"] if device else [])


def _payload_cmd(prepared: Prepared, argv: list[str]) -> str:
    env = " ".join(q(f"{k}={v}") for k, v in prepared.backend.host.env.items())
    return (f"cd {q(prepared.workdir + '/payload')} && {'env ' + env + ' ' if env else ''}"
            f"{q(prepared.python)} -m remote_payload {' '.join(q(a) for a in argv)}")


def _payload(prepared: Prepared, argv: list[str], *, timeout_s: float = 600):
    """Run `python -m remote_payload ARGV` in the host's payload folder: (rc, stdout, stderr)."""
    p = prepared.backend.transport.run(_payload_cmd(prepared, argv), check=False, timeout_s=timeout_s)
    return p.returncode, p.stdout, p.stderr


def _refusal(host: str, rc: int, out: str, err: str, what: str) -> RevalError:
    lines = [ln for ln in (err.strip() + "\n" + out.strip()).splitlines() if ln.strip()]
    why = next((ln.removeprefix("error: ") for ln in lines if ln.startswith("error: ")), None)
    if rc == protocol.EXIT_BAD_INPUT and why:
        return ConfigError(f"{host}: {why}", hint="nothing was started")
    return RemoteCommandError(host, what, rc, err, out)


def plan(prepared: Prepared, spec: ExtractSpec, remote: list[tuple[str, str]]) -> dict:
    """What each suite resolves to in the host's store (no torch unless the dtype must ask CUDA): the payload's
    `extract --store --plan` JSON; its refusal (bad input, a damaged entry, too little disk) as ConfigError."""
    argv = [*extract_argv(prepared, spec, remote), "--plan"]
    rc, out, err = _payload(prepared, argv)
    return _plan_of(prepared, rc, out, err)


MISSING = "__reval_prompts_missing__"


def synced_plan(prepared: Prepared, spec: ExtractSpec) -> tuple[list[tuple[str, str]], dict]:
    """The prompt files' copy and the plan in one round trip when the host has every file already (the reuse
    path: the look and the plan are one shell command); else the copy (one more, with what is missing), then
    the plan. Returns ([(suite, path there)], the plan)."""
    d = f"{prepared.workdir}/prompts"
    remote = [(r.name, f"{d}/{prompt_name(r.path)}") for r in spec.prompts]
    look = " && ".join(f"[ -f {q(p)} ]" for p in sorted({p for _, p in remote}))
    cmd = f"if {look}; then {_payload_cmd(prepared, [*extract_argv(prepared, spec, remote), '--plan'])}; " \
          f"else echo {MISSING}; fi"
    p = prepared.backend.transport.run(cmd, check=False, timeout_s=600)
    if p.returncode == 0 and p.stdout.strip() == MISSING:
        remote = sync_prompts(prepared, spec.prompts).remote
        return remote, plan(prepared, spec, remote)
    return remote, _plan_of(prepared, p.returncode, p.stdout, p.stderr)


def _plan_of(prepared: Prepared, rc: int, out: str, err: str) -> dict:
    if rc != 0:
        raise _refusal(prepared.host, rc, out, err, "extract --plan")
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RemoteCommandError(prepared.host, "extract --plan", rc, err, out) from None


def submission(prepared: Prepared, spec: ExtractSpec, remote: list[tuple[str, str]], *, name: str,
               argv: list[str] | None = None, run_json: dict | None = None) -> Submission:
    """The extract run's Submission: pre-flight = the plan (exit 3: nothing is created); several GPUs asked:
    one extract process a GPU (--gpus all: every GPU the wrapper gave it)."""
    gpus = normalize_gpus(spec.gpus or prepared.backend.host.gpus)
    payload = extract_argv(prepared, spec, remote)
    if "," in gpus:
        payload += ["--gpus", "all"]
    info = {"kind": "extract", "argv": argv if argv is not None else [], "payload_argv": payload,
            "target": spec.target, "prompts": {n: p for n, p in remote}, "gpus_requested": gpus,
            "created_at": protocol.now_iso(), "controller_version": __version__, **(run_json or {})}
    return Submission(name, payload, prepared.python, gpus=gpus, run_json=info, preflight=[*payload, "--plan"])


def prompts_identity(spec) -> str:
    """What a spec's --prompts suites ask, as one fingerprint (a sweep's ledger key and its hosts' agreement):
    each suite's name and prompt file content, and the completion cap; the target, the layers (the drafter's)
    and the dtype are the host's to resolve, and results.json records each suite's cache key and recipe."""
    cap = spec.max_new_tokens or "default"
    return _spec.joined_fingerprint([(r.name, f"prompts:{prompt_name(r.path)}:max_new_tokens={cap}")
                                     for r in spec.prompts])


def with_caches(spec, caches: tuple[_spec.CacheRef, ...]):
    """The spec with its prompt suites' caches as --cache NAME=PATH, and no prompts left."""
    return dataclasses.replace(spec, cache=spec.cache + caches, prompts=(), max_new_tokens=None)


def resolve_prompts(prepared: Prepared, spec, *, sink=None, name: str | None = None, give_up_s: float = 120.0,
                    synced: list[tuple[str, str]] | None = None, build: bool = True, run_json: dict | None = None):
    """An EvalSpec's --prompts suites -> their caches in the host's store: the files copied (only what the host
    lacks; `synced`: the [(suite, path there)] of a copy made before), the plan asked (the layers: the
    drafter's), the missing caches built by one extract run (followed into `sink`; a failure raises EvalFailed
    naming it), then the spec with those caches as --cache NAME=PATH and no prompts. Returns (spec, {suite:
    {"key", "built", "file", "recipe"}}); nothing is launched when every cache is there (one round trip: the
    look and the plan in one command, synced_plan). build=False: None when a cache is missing (nothing launched)."""
    es = ExtractSpec(target=spec.target, prompts=spec.prompts, for_drafter=spec.drafter, gpus=spec.gpus,
                     max_new_tokens=spec.max_new_tokens)
    if synced is not None:
        remote, planned = synced, plan(prepared, es, synced)
    else:
        remote, planned = synced_plan(prepared, es)
    rows = {c["suite"]: c for c in planned["caches"]}
    paths = {s: c["path"] for s, c in rows.items() if c["state"] == "ready"}
    todo = [r for r in es.prompts if r.name not in paths]
    if todo and not build:
        return None
    built: set[str] = set()
    if todo:
        names = {r.name for r in todo}
        sub = submission(prepared, dataclasses.replace(es, prompts=tuple(todo)),
                         [(n, p) for n, p in remote if n in names], name=name or protocol.default_run_name("extract"),
                         run_json=run_json or {"for": "reval run --prompts"})
        fin = submit_submission(prepared.backend, sub).finish(sink, give_up_s=give_up_s)
        try:
            made = json.loads((fin.path / protocol.CACHES_JSON).read_text(encoding="utf-8"))["caches"]
        except (OSError, ValueError, KeyError):
            made = []
        if not fin.ok or {c["suite"] for c in made} != names:
            raise EvalFailed(f"{prepared.host}/{fin.name}: building the caches of {', '.join(sorted(names))} "
                             f"{fin.state}; nothing was evaluated", hint=f"see {fin.path}/eval.log",
                             exit_code=failure_exit_code(fin.state, fin.status) if not fin.ok else 1)
        paths.update({c["suite"]: c["path"] for c in made})
        built = {c["suite"] for c in made if c.get("built")}
    caches = tuple(_spec.CacheRef(path=paths[r.name], name=r.name) for r in es.prompts)
    info = {r.name: {"key": Path(paths[r.name]).name, "built": r.name in built, "file": Path(f).name,
                     **({"recipe": rows[r.name]["recipe"]} if rows[r.name]["key"] == Path(paths[r.name]).name
                        and rows[r.name].get("recipe") else {})}
            for r, (_, f) in zip(es.prompts, remote)}
    return with_caches(spec, caches), info


def list_caches(prepared: Prepared) -> dict:
    """The host's store as `python -m remote_payload caches --json` lists it."""
    rc, out, err = _payload(prepared, ["caches", "--store", store_dir(prepared.workdir), "--json"])
    if rc != 0:
        raise _refusal(prepared.host, rc, out, err, "caches --json")
    return json.loads(out.strip().splitlines()[-1])


def remove_caches(prepared: Prepared, keys: list[str]) -> list[str]:
    """Remove store entries (a key or its first 8+ characters): refused (ConfigError) while a running run reads
    one or it is being built; the removed keys."""
    rc, out, err = _payload(prepared, ["caches", "--store", store_dir(prepared.workdir), "--json", "--rm", *keys])
    removed = [json.loads(ln)["removed"] for ln in out.splitlines() if ln.startswith('{"removed"')]
    if rc != 0:
        raise _refusal(prepared.host, rc, out, err, "caches --rm")
    return removed
