"""Hostile files (issue 19, items 5-11): alias bombs, huge and deeply nested hosts.yaml / JSON, NaN and
Infinity in results.json, 20,000 prompts, a 1.5 GB eval.log, a 20 MB line, absurd event times. Each command
runs as the user runs it, in its own process under an address-space limit and a timeout, so that a
regression fails here instead of eating the machine: one line, a documented exit code, bounded time and memory."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCUMENTED = {0, 1, 2, 3, 4, 101, 102, 103}
MiB = 1 << 20


def bounded(cwd: Path, *argv, mem_mb: int = 512, timeout: float = 30, env: dict | None = None,
            module: str = "orchestrator") -> subprocess.CompletedProcess:
    """`python -m orchestrator ARGV` in its own process, its address space capped at mem_mb (a MemoryError
    or a timeout here is the regression, not a stuck machine)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (mem_mb * MiB, mem_mb * MiB))
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    for k in ("REVAL_HOSTS", "REVAL_RUNS_DIR"):
        if env is None or k not in env:
            full_env.pop(k, None)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=full_env, capture_output=True,
                       text=True, errors="replace", timeout=timeout, preexec_fn=limit, check=False)
    p.elapsed = time.monotonic() - t0
    return p


def assert_one_line(p: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    """Exit `code`, no traceback, stderr's first line names the problem (every needle in it)."""
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr and "MemoryError" not in p.stderr, p.stderr[-3000:]
    first = p.stderr.strip().splitlines()[0] if p.stderr.strip() else ""
    for n in needles:
        assert n in first, (n, p.stderr[:2000])


# --- 5. hosts.yaml: alias bombs, huge files ----------------------------------------------------------------
def alias_bomb() -> str:
    """A few hundred bytes whose nine levels of aliases expand to 9**9 strings (through `tags:`)."""
    rows = ["&a0 [" + ", ".join(["x"] * 9) + "]"]
    rows += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "hosts:\n  h1:\n    ssh: h\n    tags:\n" + "".join(f"      - {r}\n" for r in rows)


def test_an_alias_bomb_in_hosts_yaml_is_one_line_at_once(tmp_path):
    bomb = tmp_path / "hosts.yaml"
    bomb.write_text(alias_bomb())
    assert bomb.stat().st_size < 1024
    p = bounded(tmp_path, "-i", str(bomb), "hosts", mem_mb=400, timeout=15)
    assert_one_line(p, 3, str(bomb), "expands through yaml aliases")
    assert p.elapsed < 10
    # an alias to itself; a chain of 3,000 aliases each nesting the last (construct would recurse 3,000 deep)
    bomb.write_text("hosts:\n  h1: {ssh: h, tags: &t [a, *t]}\n")
    assert_one_line(bounded(tmp_path, "-i", str(bomb), "hosts", mem_mb=400), 3, "line 2", "refers to the value")
    chain = ["&a0 [x]"] + [f"&a{i} [*a{i - 1}]" for i in range(1, 3000)]
    bomb.write_text("hosts:\n  h1:\n    ssh: h\n    tags:\n" + "".join(f"      - {r}\n" for r in chain))
    assert_one_line(bounded(tmp_path, "-i", str(bomb), "hosts", mem_mb=400), 3, "nested more than 64 levels")


def test_plain_aliases_as_yaml_safe_dump_writes_them_still_load(tmp_path):
    import yaml
    shared = {"env": {"A": "1"}, "tags": ["gpu"]}
    text = yaml.safe_dump({"hosts": {"a": {"ssh": "x", **shared}, "b": {"ssh": "y", **shared}}})
    assert "*id" in text
    (tmp_path / "hosts.yaml").write_text(text)
    p = bounded(tmp_path, "-i", str(tmp_path / "hosts.yaml"), "hosts", mem_mb=400, env={"COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("gpu") >= 2


def test_nesting_100000_deep_in_hosts_yaml_is_one_line(tmp_path):
    deep = tmp_path / "hosts.yaml"
    deep.write_text("hosts:\n  h: {ssh: a, tags: " + "[" * 100_000 + "]" * 100_000 + "}\n")  # 200 KB
    p = bounded(tmp_path, "-i", str(deep), "hosts", mem_mb=400, timeout=15)
    assert_one_line(p, 3, str(deep), "line 2", "nested more than 64 levels deep")


def test_a_huge_hosts_yaml_is_refused_by_size_without_parsing_it(tmp_path):
    big = tmp_path / "hosts.yaml"
    row = "  h{}: {{ssh: host{}, workdir: /w/r, tags: [a, b]}}\n"
    big.write_text("hosts:\n" + "".join(row.format(i, i) for i in range(20_000)))  # ~1 MB: 15 s to parse
    assert big.stat().st_size > MiB
    p = bounded(tmp_path, "-i", str(big), "hosts", mem_mb=400, timeout=10)
    assert_one_line(p, 3, str(big), "larger than 256 KiB")
    assert p.elapsed < 5
    # 50 MB (sparse): only the first 256 KiB are ever read, under an address space well below it
    with open(big, "r+b") as f:
        f.truncate(50 * MiB)
    p = bounded(tmp_path, "-i", str(big), "hosts", mem_mb=300, timeout=10)
    assert_one_line(p, 3, "larger than 256 KiB")


def test_a_hosts_yaml_of_a_thousand_hosts_still_loads(tmp_path):
    ok = tmp_path / "hosts.yaml"
    ok.write_text("hosts:\n" + "".join(f"  h{i}: {{ssh: host{i}, tags: [a, b]}}\n" for i in range(1000)))
    p = bounded(tmp_path, "-i", str(ok), "hosts", mem_mb=400, timeout=30)
    assert p.returncode == 0 and "h999" in p.stdout, p.stderr
