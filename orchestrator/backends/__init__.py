"""Backends: how runs are started, observed and cancelled on a host (base.py: the interface and its optional
abilities; ssh.py: a host over SSH or the local folder; slurm.py: a Slurm cluster through its login node).
`get_backend(host)` is the one place that picks one: everything else asks the backend it was given."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..hosts.inventory import Host
    from ..hosts.transport import Transport
    from .base import Backend


def get_backend(host: Host, transport: Transport | None = None) -> Backend:
    """The backend of an inventory host: `slurm` for a host with a `slurm:` entry (a cluster through its login
    node), else `ssh` (over SSH, or the local folder). `transport`: reuse an open one (its ControlMaster, its
    resolved workdir)."""
    from ..hosts.transport import get_transport
    if host.slurm is not None:
        from .slurm import SlurmBackend
        return SlurmBackend(host, transport or get_transport(host))
    from .ssh import SSHBackend
    return SSHBackend(host, transport or get_transport(host))
