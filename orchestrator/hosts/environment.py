"""The payload's Python on a host.

`venv: {mode: managed}`: a venv at `<workdir>/venvs/<key>/`, key = sha256(requirements + the base python's
version + the system_site_packages flag). A venv whose marker `.reval-ready` exists (written LAST, after a
successful install) is reused, so an unchanged host costs one round trip. Built with `uv` when the host has
it, else `python -m venv` + pip; `system_site_packages` reuses the server's own CUDA torch; `wheelhouse`
pushes a local folder of wheels and installs from it with --no-index (servers without a registry).

`venv: {mode: python}`: the interpreter is used as is; one round trip checks that it can import the
payload's requirements.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, RemoteCommandError
from .inventory import Host
from .sync import SyncResult, payload_requirements, push_tree, requirements_text, sync_payload
from .transport import Transport, q, resolve_workdir

READY = ".reval-ready"
WHEELHOUSE = "wheelhouse"


@dataclass
class EnvInfo:
    python: str        # the interpreter runs use on the host
    key: str           # venv key (managed) or python-<version> (mode python)
    reused: bool
    method: str = ""   # uv | venv (built now) | existing


def venv_key(requirements: list[str], python_version: str, system_site_packages: bool) -> str:
    blob = f"{requirements_text(requirements)}\0python={python_version}\0ssp={int(system_site_packages)}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def module_names(requirements: list[str]) -> list[str]:
    """Top-level import names of requirement specs (the payload's deps import under their dist name)."""
    return [re.split(r"[\s<>=!~\[;]", r.strip(), maxsplit=1)[0].replace("-", "_").lower()
            for r in requirements if r.strip()]


_FIND_PY = ("import importlib.util as u, json, platform, sys; print(json.dumps({'version': platform.python_version(),"
            " 'missing': [m for m in sys.argv[1:] if u.find_spec(m) is None]}))")


def ensure_env(transport: Transport, host: Host, *, requirements: list[str] | None = None,
               probe: tuple[int, str] | None = None) -> EnvInfo:
    """The interpreter runs use on `host`, building the managed venv when its key has no ready venv.
    `probe`: (exit code, stdout) of `probe_command(host, ...)` when the caller already ran it (provision)."""
    reqs = payload_requirements() if requirements is None else requirements
    if probe is None:
        p = transport.run(f"W={q(resolve_workdir(transport))}; " + probe_command(host, reqs), check=False,
                          timeout_s=120)
        probe = (p.returncode, p.stdout)
        stderr = p.stderr
    else:
        stderr = ""
    rc, out = probe
    if rc == 127:
        raise _no_python(host, host.python)
    if rc != 0:
        raise RemoteCommandError(host.name, f"{host.python}: environment probe", rc, stderr or out)
    if host.venv.mode == "python":
        info = json.loads(out.strip().splitlines()[-1])
        if info["missing"]:
            raise ConfigError(f"{host.name}: {host.python} cannot import {', '.join(info['missing'])}",
                              hint=f"install them into that interpreter, or use `venv: {{mode: managed}}` "
                                   f"for {host.name}")
        return EnvInfo(host.python, f"python-{info['version']}", True, "existing")
    return _ensure_venv(transport, host, reqs, out)


def provision(transport: Transport, host: Host, *, venv: bool = True, method: str | None = None,
              requirements: list[str] | None = None, source: Path | None = None
              ) -> tuple[SyncResult, EnvInfo | None]:
    """sync_payload + ensure_env with their probes in ONE round trip: an unchanged host costs just that."""
    reqs = payload_requirements() if requirements is None else requirements
    synced = sync_payload(transport, host, method=method, requirements=reqs, source=source,
                          also=probe_command(host, reqs) if venv else "")
    return synced, (ensure_env(transport, host, requirements=reqs, probe=synced.also) if venv else None)


def _no_python(host: Host, python: str) -> ConfigError:
    return ConfigError(f"{host.name}: python interpreter {python!r} not found on the host",
                       hint=f"set `python:` for host {host.name} in hosts.yaml to an interpreter that exists there")


def _venvs_dir_sh(host: Host) -> str:
    """The venvs dir as a shell expression (uses $W, the workdir, set by the caller)."""
    return q(host.venv.path) if host.venv.path else '"$W"/venvs'


def probe_command(host: Host, reqs: list[str]) -> str:
    """Shell snippet (needs $W): mode python -> JSON {version, missing modules}; managed -> the base python's
    `-V`, uv's path (or an empty line), then the keys of the ready venvs. Exit 127: no such python."""
    if host.venv.mode == "python":
        return f"{q(host.python)} -c {q(_FIND_PY)} {' '.join(q(m) for m in module_names(reqs))}"
    # `python -V` (no site import) is several times cheaper than `python -c`: this is the hot no-change path.
    return (f"{q(host.python)} -V 2>&1 || exit 127; command -v uv || echo; "
            f"for m in {_venvs_dir_sh(host)}/*/{READY}; do [ -f \"$m\" ] && basename \"$(dirname \"$m\")\"; "
            "done; true")


def _ensure_venv(transport: Transport, host: Host, reqs: list[str], probe_out: str) -> EnvInfo:
    workdir = resolve_workdir(transport)
    vdir = host.venv.path or f"{workdir}/venvs"
    version, uv, *ready = probe_out.split("\n")
    key = venv_key(reqs, version.split()[-1], host.venv.system_site_packages)  # "Python 3.11.7"
    vpy = f"{vdir}/{key}/bin/python"
    if key in ready:
        return EnvInfo(vpy, key, True, "existing")
    find_links = None
    if host.venv.wheelhouse:
        find_links = f"{workdir}/{WHEELHOUSE}"
        _push_wheelhouse(transport, host)
    method = "uv" if uv.strip() else "venv"
    script = build_venv_script(host.python, f"{vdir}/{key}", f"{workdir}/locks/venv-{key}.lock",
                               uv=uv.strip() or None, system_site_packages=host.venv.system_site_packages,
                               find_links=find_links, install=bool(reqs))
    p = transport.run(script, input=requirements_text(reqs), check=False)
    if p.returncode != 0:
        raise RemoteCommandError(host.name, f"build venv {key} ({method})", p.returncode, p.stderr)
    return EnvInfo(vpy, key, False, method)


def build_venv_script(python: str, venv: str, lock: str, *, uv: str | None, system_site_packages: bool,
                      find_links: str | None, install: bool) -> str:
    """The remote shell script that builds one venv (pure). Requirements arrive on stdin. Under a lock so
    that two syncs of one host build it once; the ready marker is the last thing written."""
    ssp = " --system-site-packages" if system_site_packages else ""
    offline = f" --no-index --find-links {q(find_links)}" if find_links else ""
    req = q(f"{venv}.requirements.txt")
    if uv:
        create = f"{q(uv)} venv -q{ssp} --python {q(python)} {q(venv)}"
        pip = f"{q(uv)} pip install -q --python {q(venv + '/bin/python')}{offline} -r {req}"
    else:
        create = f"{q(python)} -m venv{ssp} {q(venv)}"
        pip = f"{q(venv + '/bin/python')} -m pip install -q --disable-pip-version-check{offline} -r {req}"
    lines = [
        "set -e",
        f"mkdir -p {q(str(Path(venv).parent))} {q(str(Path(lock).parent))}",
        f"cat > {req}",
        f"if command -v flock >/dev/null 2>&1; then exec 9>{q(lock)}; flock 9; fi",
        f"[ -f {q(venv + '/' + READY)} ] && exit 0",  # built meanwhile by another sync
        f"rm -rf {q(venv)}",
        create,
        pip if install else ":",
        f"cp {req} {q(venv + '/requirements.txt')}",
        f"printf '%s\\n' ready > {q(venv + '/' + READY)}",
    ]
    return "\n".join(lines) + "\n"


def _push_wheelhouse(transport: Transport, host: Host) -> None:
    src = Path(host.venv.wheelhouse)
    if not src.is_dir():
        raise ConfigError(f"{host.name}: wheelhouse {src} is not a directory",
                          hint="build one with: pip wheel -w DIR -r requirements.txt")
    files = {p.name: p for p in sorted(src.iterdir()) if p.is_file() and p.suffix in (".whl", ".gz", ".zip")}
    dest = q(f"{resolve_workdir(transport)}/{WHEELHOUSE}")
    out = transport.run(f"mkdir -p {dest} && (command -v rsync >/dev/null && echo rsync || echo none) && "
                        f"cat {dest}/MANIFEST.json 2>/dev/null; true", timeout_s=120).stdout
    rsync, _, text = out.partition("\n")
    try:
        remote = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        remote = None
    push_tree(transport, files, WHEELHOUSE, remote, remote_rsync=rsync == "rsync")
