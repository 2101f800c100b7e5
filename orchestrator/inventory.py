"""hosts.yaml: hosts and groups, validated on load (file:line, did-you-mean). Owned by the inventory module."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def is_local(self) -> bool:
        return self.local
