"""Where a test process's network components go when the suite runs in parallel workers (pytest-xdist: `make
test` runs two). The real sshd and Slurm daemons have fixed places in the one private namespace (sshd on
127.0.0.2.. port 2222, slurmctld/slurmd on ports 6817/6818, a second loopback address for Slurm), so each
worker takes its own: worker k's sshd from 127.0.0.(2 + 40(k+1)), its Slurm ports 10(k+1) higher and its extra
loopback address k lower. Run by one process (no xdist), the places are the usual ones."""
from __future__ import annotations

import os
import re

MAX_WORKERS = 5  # 2 + 40 * 5 + a test's hosts stays below 250, the Slurm extra addresses' range


def worker_index() -> int | None:
    """0 for xdist's gw0, 1 for gw1, ...; None when the suite runs in one process."""
    m = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    if m is None:
        return None
    k = int(m.group(1))
    if k >= MAX_WORKERS:
        raise RuntimeError(f"at most {MAX_WORKERS} test workers have network places (got gw{k}): run fewer (-n)")
    return k


def first_sshd_address() -> int:
    """The last byte of this process's first sshd address (127.0.0.N)."""
    k = worker_index()
    return 2 if k is None else 2 + 40 * (k + 1)


def port_offset() -> int:
    k = worker_index()
    return 0 if k is None else 10 * (k + 1)


def extra_lo_byte() -> int:
    k = worker_index()
    return 250 if k is None else 250 - k
