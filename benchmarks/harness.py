"""What the orchestrator's benchmarks share (bench.py, bench_run.py): a Row of the speed table, the
BenchContext every benchmark takes (a scratch dir and a factory for sshd hosts), the median of cold runs, and
the table as text."""
from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.hosts import transport as transport_mod


@dataclass
class Row:
    name: str
    ours_s: float
    baseline_s: float
    baseline: str
    target_ratio: float

    @property
    def ratio(self) -> float:
        return self.ours_s / self.baseline_s if self.baseline_s else float("inf")


@dataclass
class BenchContext:
    root: Path
    repeat: int = 7
    _clusters: list = field(default_factory=list)
    _next_addr: int = 2

    def ssh_hosts(self, n: int, **kw):
        from tests.sshd import make_ssh_hosts  # dev-only harness
        c = make_ssh_hosts(Path(tempfile.mkdtemp(dir=self.root)), n, first_address=self._next_addr, **kw)
        self._next_addr += n
        self._clusters.append(c)
        return c

    def close(self):
        transport_mod.close_all()
        for c in self._clusters:
            c.close()


def median_s(fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if setup:
            setup()
        transport_mod.close_all()  # every sample starts from a cold connection
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def format_table(rows: list[Row]) -> str:
    """Plain-text table (pure)."""
    head = f"{'benchmark':40} {'ours':>9} {'baseline':>9} {'ratio':>6} {'target':>7}  ok   baseline is"
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = "yes" if r.ratio <= r.target_ratio else "NO"
        lines.append(f"{r.name:40} {r.ours_s * 1000:7.0f}ms {r.baseline_s * 1000:7.0f}ms {r.ratio:5.2f}x "
                     f"{'<=' + format(r.target_ratio, 'g') + 'x':>7}  {ok:4} {r.baseline}")
    return "\n".join(lines)
