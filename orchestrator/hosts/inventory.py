"""hosts.yaml: hosts and groups, validated on load. Every problem is ONE line naming the file, the line
and the fix ("did you mean"), raised as ConfigError (exit 3); all of a file's problems are reported at once
(the first as the error, the others in its `more`).

    hosts:
      local: {local: true, workdir: .reval/local, python: current, venv: {mode: python}}
      ct129: {ssh: ct129, workdir: ~/reval, venv: {system_site_packages: true}}   # an ~/.ssh/config alias
      hpc: {ssh: hpc-login, workdir: /shared/me/reval, slurm: {partition: gpu, gpus: 1, time: "2:00:00"}}
    groups:
      gpu-boxes: [ct129]

Default file: `-i FILE` > $REVAL_HOSTS > ./hosts.yaml > the built-in `local` host only.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import ConfigError
from .inventory_slurm import SlurmSpec, parse_slurm
from .yamlcheck import Checker, did_you_mean_text

VENV_MODES = ("managed", "python")
MAX_INVENTORY_BYTES = 256 * 1024  # thousands of hosts; parsing it stays around a second
HOST_KEY_POLICIES = ("strict", "accept-new")


@dataclass
class VenvSpec:
    mode: str = "managed"          # managed: a venv keyed by the requirements hash | python: use `python` as is
    system_site_packages: bool = False  # reuse the server's own CUDA torch
    wheelhouse: str | None = None  # local folder of wheels pushed to servers without a registry
    path: str | None = None        # where venvs live (default <workdir>/venvs)


@dataclass
class Host:
    name: str
    address: str = ""              # hostname/IP or ~/.ssh/config alias; "" for local
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    proxy_jump: str | None = None
    known_hosts_file: str | None = None
    ssh_config_file: str | None = None
    host_key_policy: str = "strict"  # strict | accept-new
    connect_timeout_s: float = 10
    workdir: str = "~/.reval"
    python: str = "python3"
    venv: VenvSpec = field(default_factory=VenvSpec)
    gpus: str = "auto"             # auto | none | "0,1"
    env: dict = field(default_factory=dict)
    tags: list = field(default_factory=list)
    local: bool = False
    slurm: SlurmSpec | None = None  # set: a Slurm cluster reached through this (login) host

    @property
    def is_local(self) -> bool:
        return self.local

    def describe_address(self) -> str:
        """`(local)`, or where SSH reaches it: `user@address:port` (pure)."""
        if self.is_local:
            return "(local)"
        s = f"{self.user}@{self.address}" if self.user else self.address
        return f"{s}:{self.port}" if self.port else s


def builtin_local_host() -> Host:
    """The embedded default: a folder under the current directory, the controller's own interpreter."""
    return Host(name="local", local=True, workdir=".reval/local", python=sys.executable,
                venv=VenvSpec(mode="python"))


@dataclass
class Inventory:
    path: str | None               # None: the built-in inventory
    hosts: dict[str, Host]
    groups: dict[str, list[str]]

    def get(self, name: str) -> Host:
        if name in self.hosts:
            return self.hosts[name]
        raise ConfigError(f"unknown host {name!r} in {self.path or 'the built-in inventory'}"
                          + did_you_mean_text(name, self.hosts), hint=f"known hosts: {', '.join(self.hosts)}")

    def __getitem__(self, name: str) -> Host:
        return self.get(name)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> Inventory:
        """load_inventory(path): validated, one-line errors (None: the default lookup order)."""
        return load_inventory(path)

    def resolve(self, name: str) -> list[Host]:
        """A host name or a group name -> its hosts, in inventory order."""
        if name in self.hosts:
            return [self.hosts[name]]
        if name in self.groups:
            return [self.hosts[h] for h in self.groups[name]]
        known = list(self.hosts) + list(self.groups)
        raise ConfigError(f"unknown host or group {name!r} in {self.path or 'the built-in inventory'}"
                          + did_you_mean_text(name, known),
                          hint=f"hosts: {', '.join(self.hosts)}" + (f"; groups: {', '.join(self.groups)}"
                                                                     if self.groups else ""))


def default_inventory_path(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit
    if os.environ.get("REVAL_HOSTS"):
        return os.environ["REVAL_HOSTS"]
    return "hosts.yaml" if os.path.exists("hosts.yaml") else None


def load_inventory(path: str | os.PathLike | None = None) -> Inventory:
    """Load and validate an inventory (path None: the default lookup order)."""
    path = default_inventory_path(str(path) if path else None)
    if path is None:
        local = builtin_local_host()
        return Inventory(None, {"local": local}, {})
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_INVENTORY_BYTES + 1)  # never the whole of a huge file (pure-python yaml: ~6 s/MB)
        if len(raw) > MAX_INVENTORY_BYTES:
            raise ConfigError(f"inventory {path} is larger than {MAX_INVENTORY_BYTES // 1024} KiB",
                              hint="a hosts.yaml is a few KB: check that -i / $REVAL_HOSTS names the right file")
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path} line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x})",
                          hint="save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    except FileNotFoundError:
        raise ConfigError(f"inventory {path} not found",
                          hint="create it (see the shipped hosts.yaml) or pass -i FILE / set REVAL_HOSTS") from None
    except OSError as e:
        raise ConfigError(f"cannot read inventory {path}: {e.strerror}") from None
    return parse_inventory(text, str(path))


# --- validation ------------------------------------------------------------------------------------------
# yaml key -> (Host field, accepted python types, a word for the error)
_HOST_KEYS = {
    "local": ("local", (bool,), "true or false"),
    "ssh": ("address", (str,), "an ~/.ssh/config alias"),
    "address": ("address", (str,), "a hostname or IP"),
    "user": ("user", (str,), "a user name"),
    "port": ("port", (int,), "a port number"),
    "identity_file": ("identity_file", (str,), "a key file path"),
    "proxy_jump": ("proxy_jump", (str,), "[user@]host[:port]"),
    "known_hosts_file": ("known_hosts_file", (str,), "a file path"),
    "ssh_config_file": ("ssh_config_file", (str,), "a file path"),
    "host_key": ("host_key_policy", (str,), "strict or accept-new"),
    "connect_timeout_s": ("connect_timeout_s", (int, float), "seconds"),
    "workdir": ("workdir", (str,), "a directory path"),
    "python": ("python", (str,), "an interpreter path or name"),
    "venv": ("venv", (dict,), "a mapping (mode, system_site_packages, wheelhouse, path)"),
    "gpus": ("gpus", (str, int, list), "auto, none, or a list of GPU indices"),
    "env": ("env", (dict,), "a mapping of NAME: value"),
    "tags": ("tags", (list,), "a list of words"),
    "slurm": ("slurm", (dict,), "a mapping (partition, account, qos, time, gpus, cpus, mem, sbatch, ...)"),
}
_NAME = re.compile(r"^(?![.-])[A-Za-z0-9._-]{1,64}$")  # not '-...': a host name is a command argument
_VENV_KEYS = {
    "mode": ((str,), "managed or python"),
    "system_site_packages": ((bool,), "true or false"),
    "wheelhouse": ((str,), "a local folder of wheels"),
    "path": ((str,), "a directory on the host"),
}
_TOP_KEYS = ("hosts", "groups")


def parse_inventory(text: str, path: str = "hosts.yaml") -> Inventory:
    c = Checker(text, path)
    try:
        root = c.loader.get_single_node()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if root is None:
        raise ConfigError(f"{path}: empty inventory", hint="add a `hosts:` mapping (see the shipped hosts.yaml)")
    inv = c.collect(_parse_root, c, root, path)
    c.raise_problems()
    return inv


def _parse_root(c: Checker, root, path: str) -> Inventory:
    top = {}
    for key, knode, vnode in c.mapping(root, "top-level"):
        if key not in _TOP_KEYS:
            c.collect(c.fail, knode, f"unknown top-level key {key!r}{did_you_mean_text(key, _TOP_KEYS)}",
                      "top-level keys: hosts, groups")
        top[key] = (knode, vnode)
    if "hosts" not in top:
        c.fail(root, "missing `hosts:` mapping")
    hosts: dict[str, Host] = {}
    named = c.mapping(top["hosts"][1], "hosts")
    for name, knode, vnode in named:
        # Host names become local folders (runs/<host>/<run>/) and appear in commands: same alphabet as runs.
        if not isinstance(name, str) or not _NAME.match(name):
            c.collect(c.fail, knode, f"host name {name!r} is not allowed: use 1-64 characters from A-Z a-z 0-9 . _ - "
                      "(not starting with '.' or '-')", "the address goes in `address:`, e.g. my-box: {address: ...}")
        host = c.collect(_parse_host, c, name, knode, vnode, Path(path).parent)
        if host is not None:
            hosts[name] = host
    groups: dict[str, list[str]] = {}
    if "groups" in top:
        names = [n for n, _, _ in named]  # a host with errors of its own is still a known name here
        for gname, knode, vnode in c.mapping(top["groups"][1], "groups"):
            members = c.collect(_parse_group, c, gname, knode, vnode, names)
            if members is not None:
                groups[gname] = members
    if "local" not in hosts:
        hosts["local"] = builtin_local_host()
    return Inventory(path, hosts, groups)


def _parse_group(c: Checker, gname: str, knode, vnode, names: list[str]) -> list[str]:
    if not isinstance(gname, str) or not _NAME.match(gname):  # a group name is a command argument too
        c.collect(c.fail, knode, f"group name {gname!r} is not allowed: use 1-64 characters from A-Z a-z 0-9 . _ - "
                  "(not starting with '.' or '-')", "rename the group")
    if gname in names:
        c.fail(knode, f"group {gname!r} has the name of a host", hint="rename the group or the host")
    if not isinstance(vnode, yaml.SequenceNode):
        c.fail(vnode, f"group {gname!r} must be a list of host names")
    members = []
    for item in vnode.value:
        member = c.collect(c.value, item)
        if member not in names:
            c.collect(c.fail, item, f"group {gname!r} names unknown host {member!r}"
                      f"{did_you_mean_text(str(member), names)}",
                      f"known hosts: {', '.join(map(str, names))}")
        members.append(member)
    return members


def _parse_host(c: Checker, name: str, knode, vnode, base_dir: Path) -> Host:
    if vnode is None or isinstance(vnode, yaml.ScalarNode) and c.value(vnode) is None:
        c.fail(knode, f"host {name!r} has no settings", hint="give it `ssh: ALIAS` or `address: HOST` (or local: true)")
    host = Host(name=name)
    given: dict[str, yaml.Node] = {}
    for key, kn, vn in c.mapping(vnode, f"host {name!r}"):
        c.collect(_host_key, c, host, given, key, kn, vn, base_dir)
    _check_host(c, host, knode, given)
    return host


def _host_key(c: Checker, host: Host, given: dict, key: str, kn, vn, base_dir: Path) -> None:
    """One `key: value` of a host, checked and set on `host`."""
    name = host.name
    if key not in _HOST_KEYS:
        c.fail(kn, f"unknown key {key!r} in host {name!r}{did_you_mean_text(key, _HOST_KEYS)}",
               hint=f"host keys: {', '.join(_HOST_KEYS)}")
    given[key] = vn  # given, even when its value is refused below: no second error for a missing key
    attr, types, expect = _HOST_KEYS[key]
    val = c.typed(vn, types, f"host {name!r}: {key}", expect)
    if key == "venv":
        val = _parse_venv(c, name, vn, base_dir)
    elif key == "host_key" and val not in HOST_KEY_POLICIES:
        c.fail(vn, f"host {name!r}: host_key {val!r} is not one of {', '.join(HOST_KEY_POLICIES)}"
               + did_you_mean_text(val, HOST_KEY_POLICIES))
    elif key == "port" and not 0 < val < 65536:
        c.fail(vn, f"host {name!r}: port {val} is out of range 1-65535")
    elif key == "gpus":
        val = _parse_gpus(c, name, vn, val)
    elif key == "env":
        for ek, ev in val.items():
            if not isinstance(ek, str) or not ek.replace("_", "a").isalnum() or ek[0].isdigit():
                c.fail(vn, f"host {name!r}: env name {ek!r} is not a valid variable name")
            if isinstance(ev, (dict, list)) or ev is None:
                c.fail(vn, f"host {name!r}: env {ek} must be a plain value, got {ev!r}")
        val = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in val.items()}
    elif key == "tags":
        val = [str(t) for t in val]
    elif key == "slurm":
        val = parse_slurm(c, name, vn)
    setattr(host, attr, val)


def _check_host(c: Checker, host: Host, knode, given: dict) -> None:
    """What a host's keys must be together."""
    name = host.name
    if "ssh" in given and "address" in given:
        c.fail(given["address"], f"host {name!r}: give either `ssh:` (an ~/.ssh/config alias) or `address:`, not both")
    if host.local and host.address:
        c.fail(given.get("ssh") or given["address"], f"host {name!r}: a local host has no ssh/address")
    if not host.local and not host.address and not ("ssh" in given or "address" in given):
        c.fail(knode, f"host {name!r}: missing `ssh:` (an ~/.ssh/config alias) or `address:`",
               hint="or set `local: true` for a folder on this machine")
    if host.slurm is not None and "gpus" in given:
        c.fail(given["gpus"], f"host {name!r}: Slurm assigns a cluster's GPUs; reval never picks them there",
               hint="ask for them per job instead: slurm: {gpus: 1} (or slurm: {gres: 'gpu:1'})")
    if host.python == "current":
        if not host.local:
            c.fail(given["python"], f"host {name!r}: python: current means this controller's interpreter; "
                   "only a local host can use it", hint="give the server's interpreter, e.g. python3")
        host.python = sys.executable


def _parse_venv(c: Checker, name: str, node, base_dir: Path) -> VenvSpec:
    spec = VenvSpec()
    for key, vn, val in c.section(node, name, "venv", _VENV_KEYS):
        c.collect(_venv_key, c, spec, name, key, vn, val, base_dir)
    return spec


def _venv_key(c: Checker, spec: VenvSpec, name: str, key: str, vn, val, base_dir: Path) -> None:
    if key == "mode" and val not in VENV_MODES:
        c.fail(vn, f"host {name!r}: venv.mode {val!r} is not one of {', '.join(VENV_MODES)}"
               + did_you_mean_text(val, VENV_MODES))
    if key == "wheelhouse":
        val = str((base_dir / os.path.expanduser(val)).resolve())  # relative to the inventory file
    if key == "path" and not val.startswith("/"):
        # it is used on the host after `cd <workdir>/payload`: a relative or ~ path would point elsewhere
        c.fail(vn, f"host {name!r}: venv.path {val!r} must be an absolute path on the host",
               hint="e.g. venv: {path: /opt/reval/venvs}, or leave it out for <workdir>/venvs")
    setattr(spec, key, val)


def _parse_gpus(c: Checker, name: str, node, val) -> str:
    if isinstance(val, str):
        if val in ("auto", "none"):
            return val
        parts = val.split(",")
    elif isinstance(val, int):  # 5 GPUs, or GPU 5? Neither silently.
        c.fail(node, f"host {name!r}: gpus {val} is not a list",
               hint=f"for GPU {val} write gpus: [{val}]; for any free GPU: gpus: auto; CPU only: gpus: none")
    else:
        parts = [str(v) for v in val]
    if not parts or not all(p.strip().isdigit() for p in parts):
        c.fail(node, f"host {name!r}: gpus {val!r} must be auto, none, or GPU indices like [0, 1]")
    return ",".join(p.strip() for p in parts)


